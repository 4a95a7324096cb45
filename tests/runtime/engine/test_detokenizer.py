"""Incremental detokenisation (engine/detokenizer.py): the text streamed piece by piece is the text of
the whole output, for our byte-level tokenizers and for a decoder that drops a first token's space."""

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from mtp_runtime.checkpoint.tokenizer import build_tokenizer
from mtp_runtime.engine.detokenizer import REPLACEMENT, IncrementalText


@pytest.fixture(scope="module", params=["deepseek", "glm"])
def tokenizer(request):
    return Tokenizer.from_file(str(build_tokenizer(512, request.param) / "tokenizer.json"))


def stream(tokenizer, ids, chunks, final_at_end=True):
    """The deltas of feeding `ids` in pieces of the given sizes (the last update is final)."""
    text, deltas, end = IncrementalText(tokenizer), [], 0
    for size in chunks:
        end = min(len(ids), end + size)
        deltas.append(text.update(ids[:end], final=final_at_end and end == len(ids)))
        if end == len(ids):
            break
    return deltas, text


def test_streamed_text_is_the_whole_text_on_random_outputs(tokenizer):
    rng = random.Random(0)
    vocab = tokenizer.get_vocab_size()
    for trial in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        chunks = [rng.randrange(1, 5) for _ in range(len(ids))]
        deltas, text = stream(tokenizer, ids, chunks)
        assert "".join(deltas) == text.text == tokenizer.decode(ids, skip_special_tokens=True), (trial, ids)


def test_a_character_split_across_tokens_waits_for_its_last_byte(tokenizer):
    sentence = "naïve café: 世界 🙂 done"
    ids = tokenizer.encode(sentence).ids
    assert len(ids) > len(sentence.split()), "the text should span several tokens"
    deltas, text = stream(tokenizer, ids, [1] * len(ids))
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert not any(REPLACEMENT in d for d in deltas), deltas  # never half a character mid-stream
    # cut inside the emoji's bytes: an unfinished update holds them back, a final one emits U+FFFD
    cut = next(n for n in range(1, len(ids)) if tokenizer.decode(ids[:n]).endswith(REPLACEMENT))
    held = IncrementalText(tokenizer)
    held.update(ids[:cut])
    assert REPLACEMENT not in held.text
    assert held.update(ids[:cut], final=True).endswith(REPLACEMENT)


def test_special_tokens_are_skipped_and_nothing_is_repeated(tokenizer):
    vocab = tokenizer.get_vocab()
    special = [i for t, i in vocab.items() if t.startswith("<") and t.endswith(">")]
    assert special, "the tiny tokenizer has special tokens"
    words = tokenizer.encode("def add(a, b):\n    return a + b").ids
    ids = words[:4] + special[:1] + words[4:] + special[:1]
    deltas, _ = stream(tokenizer, ids, [2] * len(ids))
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    text = IncrementalText(tokenizer)
    text.update(ids)
    assert text.update(ids) == "" and text.update(ids, final=True) == ""  # no new tokens, no new text
    with pytest.raises(ValueError, match="shrank"):
        text.update(ids[:-2])


def test_a_decoder_that_drops_the_first_space_keeps_the_spaces_between_pieces():
    vocab = {"[UNK]": 0, "\u2581hello": 1, "\u2581world": 2, "\u2581again": 3, "!": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    ids = [1, 2, 4, 3, 2]
    assert tok.decode([2]) == "world"  # decoded alone, the leading space goes
    deltas, text = stream(tok, ids, [1] * len(ids))
    assert "".join(deltas) == tok.decode(ids) == "hello world! again world"
