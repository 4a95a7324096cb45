"""Benchmark prompts of an exact token length, cut from held-out corpus text.

Prompts are sent as token ids, so every request really has `input_len` prompt
tokens on the server (text would re-tokenise to a slightly different length).
The text is the corpus's held-out split, which tokenizer and model training
never saw, so acceptance is measured on unseen text.
"""

from __future__ import annotations

import os
import random

from mtp_runtime.checkpoint.corpus import corpus_texts


def load_tokenizer(model_dir: str):
    from tokenizers import Tokenizer

    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: pass --tokenizer with a model directory holding tokenizer.json")
    return Tokenizer.from_file(path)


def heldout_token_stream(tokenizer, min_tokens: int, max_bytes: int = 1024 * 1024) -> list[int]:
    ids: list[int] = []
    for text in corpus_texts("heldout", max_bytes=max_bytes):
        ids.extend(tokenizer.encode(text, add_special_tokens=False).ids)
        if len(ids) >= min_tokens:
            break
    if len(ids) < min_tokens:
        raise ValueError(f"the held-out corpus has only {len(ids)} tokens; ask for fewer or shorter prompts")
    return ids


def build_prompts(tokenizer, num_prompts: int, input_len: int, seed: int = 0) -> list[list[int]]:
    """`num_prompts` distinct windows of `input_len` tokens at seeded random offsets."""
    if input_len < 1 or num_prompts < 1:
        raise ValueError(f"input_len ({input_len}) and num_prompts ({num_prompts}) must be >= 1")
    stream = heldout_token_stream(tokenizer, min_tokens=max(input_len * 4, 4096))
    rng = random.Random(seed)
    starts = [rng.randrange(0, len(stream) - input_len + 1) for _ in range(num_prompts)]
    return [stream[s:s + input_len] for s in starts]
