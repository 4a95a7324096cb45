import json

import pytest
from jinja2 import Template

from mtp_runtime.checkpoint import tokenizer as tk


def test_training_is_deterministic_with_specials_first():
    a = tk.train_bpe(400, "deepseek", corpus_bytes=60_000)
    b = tk.train_bpe(400, "deepseek", corpus_bytes=60_000)
    assert a.to_str() == b.to_str()
    assert a.get_vocab_size() == 400
    assert [a.token_to_id(t) for t in tk.SPECIAL_TOKENS["deepseek"]] == [0, 1, 2, 3, 4]
    ids = a.encode("def f(x):\n    return x  # café").ids
    assert ids[0] == 0  # BOS prepended like DeepSeek's tokenizer
    assert a.decode(ids) == "def f(x):\n    return x  # café"


def test_cached_build(tmp_path, monkeypatch):
    monkeypatch.setenv("MTP_CACHE_DIR", str(tmp_path))
    first = tk.build_tokenizer(300, "glm", corpus_bytes=30_000)
    mtime = (first / "tokenizer.json").stat().st_mtime_ns
    assert tk.build_tokenizer(300, "glm", corpus_bytes=30_000) == first
    assert (first / "tokenizer.json").stat().st_mtime_ns == mtime
    assert first.parent == tmp_path
    config = json.loads((first / "tokenizer_config.json").read_text())
    text = Template(config["chat_template"]).render(
        messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert text == "[gMASK]<sop><|user|>\nhi<|assistant|>\n"
    with pytest.raises(ValueError, match="too small"):
        tk.build_tokenizer(100, "glm")


def test_deepseek_chat_template():
    config = tk.tokenizer_config("deepseek")
    text = Template(config["chat_template"]).render(
        messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
        bos_token=config["bos_token"], eos_token=config["eos_token"], add_generation_prompt=False)
    assert text == "<｜begin▁of▁sentence｜><｜User｜>a<｜Assistant｜>b<｜end▁of▁sentence｜>"
