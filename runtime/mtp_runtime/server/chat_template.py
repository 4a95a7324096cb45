"""Chat prompts rendered from the model's own `chat_template` with jinja2.

The same sandboxed environment and variables as Hugging Face's
apply_chat_template (trim/lstrip blocks, raise_exception, bos/eos tokens), so
a published model's template renders here exactly as it does there.
"""

from __future__ import annotations

import json
import os
from datetime import datetime

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The model's chat template is missing, broken or rejects the messages."""


def _raise_exception(message: str):
    raise ChatTemplateError(message)


def _token_text(value) -> str | None:
    # tokenizer_config stores special tokens either as text or as AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value


class ChatTemplate:
    def __init__(self, template: str, special_tokens: dict[str, str | None], source: str) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = lambda obj, indent=None, ensure_ascii=False: json.dumps(
            obj, indent=indent, ensure_ascii=ensure_ascii)
        try:
            self._template = env.from_string(template)
        except TemplateError as exc:
            raise ChatTemplateError(f"{source}: chat_template does not parse: {exc}") from None
        self.special_tokens = special_tokens
        self.source = source

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens)
        except ChatTemplateError:
            raise
        except Exception as exc:  # a template bug must surface as a request error, not a crash
            raise ChatTemplateError(f"{self.source}: chat_template failed to render: {exc}") from None


def load_chat_template(model_dir: str) -> ChatTemplate | None:
    """The template of tokenizer_config.json (or chat_template.jinja); None if the model has none."""
    config_path = os.path.join(model_dir, "tokenizer_config.json")
    config: dict = {}
    if os.path.isfile(config_path):
        try:
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise ChatTemplateError(f"{config_path}: not readable JSON: {exc}") from None
    template, source = config.get("chat_template"), config_path
    if isinstance(template, list):  # named templates: use "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    jinja_path = os.path.join(model_dir, "chat_template.jinja")
    if template is None and os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            template, source = f.read(), jinja_path
    if template is None:
        return None
    if not isinstance(template, str):
        raise ChatTemplateError(f"{source}: chat_template must be a string")
    special = {name: _token_text(config.get(name))
               for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
    return ChatTemplate(template, special, source)
