"""A real byte-level BPE tokenizer for tiny checkpoints, trained offline and cached.

Trained with the `tokenizers` library on the standard-library corpus, with the
special tokens and a chat template in the style of the model family
(DeepSeek or GLM). Training is deterministic; the result is cached on disk by
its arguments ($MTP_CACHE_DIR, else ~/.cache/mtp-operator) so repeated
`mtp make-tiny` calls take milliseconds.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import tempfile
from pathlib import Path

from .corpus import corpus_texts

# Bump when the training recipe changes, so stale cache entries are not reused.
RECIPE_VERSION = 2
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# Files a model directory may carry that describe tokenisation/generation; export copies these.
AUX_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja",
)

SPECIAL_TOKENS = {
    "deepseek": ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<｜User｜>", "<｜Assistant｜>"],
    "glm": ["[gMASK]", "<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>", "<|observation|>", "<sop>"],
}

CHAT_TEMPLATES = {
    "deepseek": (
        "{{ bos_token }}"
        "{% for message in messages %}"
        "{% if message['role'] == 'system' %}{{ message['content'] }}"
        "{% elif message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
        "{% elif message['role'] == 'assistant' %}{{ '<｜Assistant｜>' + message['content'] + eos_token }}"
        "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
    ),
    "glm": (
        "[gMASK]<sop>"
        "{% for message in messages %}"
        "{{ '<|' + message['role'] + '|>' + '\n' + message['content'] }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
    ),
}


def style_for_arch(arch: str) -> str:
    return "glm" if arch.startswith("glm") else "deepseek"


def cache_root() -> Path:
    return Path(os.environ.get("MTP_CACHE_DIR") or Path.home() / ".cache" / "mtp-operator")


def build_tokenizer(vocab_size: int, style: str = "deepseek", corpus_bytes: int = 2 * 1024 * 1024) -> Path:
    """Directory holding tokenizer.json + tokenizer_config.json; trained once, then cached."""
    if style not in SPECIAL_TOKENS:
        raise ValueError(f"tokenizer style must be one of {sorted(SPECIAL_TOKENS)}, got {style!r}")
    if vocab_size < 256 + len(SPECIAL_TOKENS[style]) + 1:
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level BPE (need >= 263)")
    import tokenizers

    key = (
        f"tokenizer-{style}-v{vocab_size}-c{corpus_bytes}-r{RECIPE_VERSION}"
        f"-py{platform.python_version()}-tk{tokenizers.__version__}"
    )
    target = cache_root() / key
    if all((target / f).exists() for f in TOKENIZER_FILES):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=target.parent))
    try:
        tok = train_bpe(vocab_size, style, corpus_bytes)
        tok.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(style), indent=2, ensure_ascii=False))
        try:
            tmp.rename(target)
        except OSError:
            if not target.exists():  # a concurrent build that won the race is fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def train_bpe(vocab_size: int, style: str, corpus_bytes: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials = SPECIAL_TOKENS[style]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_texts("train", max_bytes=corpus_bytes), trainer=trainer)
    if style == "deepseek":  # DeepSeek's tokenizer prepends BOS on encode
        bos = specials[0]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, 0)]
        )
    return tok


def tokenizer_config(style: str) -> dict:
    specials = SPECIAL_TOKENS[style]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 131072,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATES[style],
        "additional_special_tokens": specials[2:],
    }
    if style == "deepseek":
        config.update(bos_token=specials[0], eos_token=specials[1], pad_token=specials[2], add_bos_token=True)
    else:
        config.update(eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    return config


def copy_aux_files(src_dir: Path, dst_dir: Path) -> list[str]:
    """Copy the tokenizer/generation files that exist in `src_dir`; returns their names."""
    copied = []
    for name in AUX_FILES:
        src = Path(src_dir) / name
        if src.is_file():
            shutil.copyfile(src, Path(dst_dir) / name)
            copied.append(name)
    return copied
