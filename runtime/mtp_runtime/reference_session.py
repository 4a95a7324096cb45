"""Models + tokenizer of one checkpoint directory, ready for the reference generation loop."""

from __future__ import annotations

import json
from pathlib import Path

from mtp_runtime.models.loader import load_draft, load_model
from mtp_runtime.reference_generate import GenerationResult, generate


class ReferenceSession:
    def __init__(self, model_dir: str | Path, draft_dir: str | Path | None = None, dtype: str = "float32",
                 device: str = "cpu"):
        from tokenizers import Tokenizer

        self.model = load_model(model_dir, dtype, device)
        self.draft = load_draft(draft_dir, self.model, dtype, device) if draft_dir else None
        tokenizer_file = Path(model_dir) / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{tokenizer_file}: not found; the model directory needs its tokenizer")
        self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        self.eos_ids = eos_token_ids(Path(model_dir))

    def encode(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt).ids

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def generate(self, prompt: str | list[int], max_tokens: int, num_speculative_tokens: int = 0,
                 temperature: float = 0.0, seed: int = 0) -> GenerationResult:
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return generate(self.model, ids, max_tokens, self.draft, num_speculative_tokens, temperature,
                        self.eos_ids, seed)


def eos_token_ids(model_dir: Path) -> tuple[int, ...]:
    """End-of-sequence ids from generation_config.json, else config.json."""
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.is_file():
            value = json.loads(path.read_text()).get("eos_token_id")
            if value is not None:
                return tuple(value) if isinstance(value, list) else (int(value),)
    return ()
