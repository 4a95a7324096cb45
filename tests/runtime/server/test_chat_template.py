"""Chat templates from tokenizer_config.json, rendered with Hugging Face's conventions."""

import json

import pytest

from mtp_runtime.server.chat_template import ChatTemplateError, load_chat_template

TEMPLATE = ("{{ bos_token }}{% for m in messages %}"
            "{% if m['role'] == 'bot' %}{{ raise_exception('no bots') }}{% endif %}"
            "<|{{ m['role'] }}|>{{ m['content'] }}\n"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def write_config(path, **config):
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def test_renders_with_special_tokens(tmp_path):
    write_config(tmp_path, chat_template=TEMPLATE, bos_token={"content": "<s>", "lstrip": False})
    tpl = load_chat_template(str(tmp_path))
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert tpl.render(msgs) == "<s><|system|>be brief\n<|user|>hi\n<|assistant|>"
    assert tpl.render(msgs, add_generation_prompt=False).endswith("hi\n")


def test_raise_exception_and_bad_templates(tmp_path):
    write_config(tmp_path, chat_template=TEMPLATE, bos_token="<s>")
    with pytest.raises(ChatTemplateError, match="no bots"):
        load_chat_template(str(tmp_path)).render([{"role": "bot", "content": "x"}])
    write_config(tmp_path, chat_template="{% for %}")
    with pytest.raises(ChatTemplateError, match="tokenizer_config.json"):
        load_chat_template(str(tmp_path))


def test_named_templates_jinja_file_and_missing(tmp_path):
    write_config(tmp_path, chat_template=[{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}])
    assert load_chat_template(str(tmp_path)).render([]) == "D"
    write_config(tmp_path, bos_token="<s>")
    assert load_chat_template(str(tmp_path)) is None
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert load_chat_template(str(tmp_path)).render([{"role": "user", "content": "j"}]) == "j"
