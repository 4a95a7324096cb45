"""The token-count lower bound that refuses over-long prompts before tokenising them."""

import random

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from mtp_runtime.checkpoint.tokenizer import build_tokenizer
from mtp_runtime.server.openai_protocol import APIError, ChatCompletionRequest
from mtp_runtime.server.chat_template import load_chat_template
from mtp_runtime.server.prompt_bound import cannot_fit, max_bytes_per_token
from mtp_runtime.server.request_builder import RequestBuilder


@pytest.fixture(scope="module")
def tokenizer_dir():
    return build_tokenizer(1024, "deepseek")  # the tokenizer `mtp make-tiny` gives its models


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))


def sample_texts(seed: int = 0):
    rng = random.Random(seed)
    alphabet = ["a", "é", "ß", "漢", "😀", " ", "  ", "\n", "def ", "self.", "<｜begin▁of▁sentence｜>", "    "]
    for n in (1, 10, 200, 2000):
        yield "".join(rng.choice(alphabet) for _ in range(n))
    yield " " * 5000  # runs of spaces make the longest tokens
    yield "<｜begin▁of▁sentence｜>" * 50  # added tokens are the longest entries of all


def test_the_bound_never_exceeds_the_real_token_count(tokenizer):
    m = max_bytes_per_token(tokenizer)
    assert m is not None and m >= len("<｜begin▁of▁sentence｜>".encode())
    for text in sample_texts():
        tokens = len(tokenizer.encode(text, add_special_tokens=False).ids)
        assert tokens >= len(text.encode()) / m, (text[:40], tokens)
        assert tokens >= len(text) / m


def tokenizer_with(normalizer=None, pre_tokenizer=None) -> Tokenizer:
    tok = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "ab": 2}, merges=[("a", "b")]))
    if normalizer is not None:
        tok.normalizer = normalizer
    if pre_tokenizer is not None:
        tok.pre_tokenizer = pre_tokenizer
    return tok


def test_pipelines_that_can_drop_text_have_no_bound():
    assert max_bytes_per_token(tokenizer_with()) == 2
    assert max_bytes_per_token(tokenizer_with(normalizers.NFC())) == 8  # a character can shrink 4x
    assert max_bytes_per_token(tokenizer_with(pre_tokenizer=pre_tokenizers.Split("x", "isolated"))) == 2
    # Each of these turns a long text into few tokens, so no length says "too long".
    assert max_bytes_per_token(tokenizer_with(normalizers.Strip())) is None
    assert max_bytes_per_token(tokenizer_with(normalizers.StripAccents())) is None
    assert max_bytes_per_token(tokenizer_with(pre_tokenizer=pre_tokenizers.Whitespace())) is None
    assert max_bytes_per_token(tokenizer_with(pre_tokenizer=pre_tokenizers.Split("x", "removed"))) is None
    truncating = tokenizer_with()
    truncating.enable_truncation(8)
    assert max_bytes_per_token(truncating) is None
    fused = Tokenizer(models.BPE(vocab={"a": 0, "<unk>": 1}, merges=[], unk_token="<unk>", fuse_unk=True))
    assert max_bytes_per_token(fused) is None


def test_cannot_fit():
    assert cannot_fit(100, 10, 10) == 10  # at least 10 tokens: no room for one more in 10
    assert cannot_fit(91, 10, 10) == 10  # 9.1 tokens are 10
    assert cannot_fit(90, 10, 10) is None  # 9 tokens may leave room
    assert cannot_fit(10**9, 10, None) is None  # no bound known: tokenise and count


class CountingTokenizer:
    """A real tokenizer that records whether anything was tokenised."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner, self.encoded = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def encode(self, *args, **kwargs):
        self.encoded += 1
        return self.inner.encode(*args, **kwargs)


def test_builder_refuses_an_over_long_prompt_without_tokenising_it(tokenizer, tokenizer_dir):
    counting = CountingTokenizer(tokenizer)
    builder = RequestBuilder(counting, load_chat_template(str(tokenizer_dir)), max_model_len=64, vocab_size=1024)
    long_text = "x" * (64 * builder.bytes_per_token)
    with pytest.raises(APIError) as refused:
        builder.completion_prompt_ids(long_text)
    assert refused.value.param == "prompt" and refused.value.code == "context_length_exceeded"
    assert counting.encoded == 0
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": long_text}]})
    with pytest.raises(APIError) as refused:
        builder.chat_prompt_ids(chat)
    assert refused.value.param == "messages" and counting.encoded == 0
    with pytest.raises(APIError) as refused:
        builder.completion_prompt_ids([10**9] * 64)  # counted before its ids are looked at
    assert refused.value.code == "context_length_exceeded"
    # A prompt the bound cannot rule out is tokenised and counted as before.
    assert builder.completion_prompt_ids("def f(x):\n    return x") and counting.encoded == 1
