"""Request validation: strict types, unsupported fields by name, OpenAI error shape."""

import json

import pytest
from pydantic import ValidationError

from mtp_runtime.server.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    lone_surrogate_error,
    may_hold_lone_surrogate,
    validation_error_to_api_error,
)


def error_of(model, body):
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    err = validation_error_to_api_error(info.value)
    assert err.status == 400
    return err


def test_completion_defaults_and_prompt_forms():
    req = CompletionRequest.model_validate({"model": "m", "prompt": "hi", "extra_field": 1})
    assert req.max_tokens == 16 and req.temperature == 1.0 and req.top_k == -1 and not req.stream
    assert CompletionRequest.model_validate({"model": "m", "prompt": ["one"]}).prompt == "one"
    assert CompletionRequest.model_validate({"model": "m", "prompt": [1, 2]}).prompt == [1, 2]
    assert CompletionRequest.model_validate({"model": "m", "prompt": "x", "temperature": 0}).temperature == 0.0
    req = CompletionRequest.model_validate({"model": "m", "prompt": "x", "stop": "\n"})
    assert req.stop_list() == ["\n"]


@pytest.mark.parametrize("body, param", [
    ({"model": "m"}, "prompt"),
    ({"model": 5, "prompt": "x"}, "model"),
    ({"model": "m", "prompt": 5}, "prompt"),
    ({"model": "m", "prompt": ""}, "prompt"),
    ({"model": "m", "prompt": ["a", "b"]}, "prompt"),
    ({"model": "m", "prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": "m", "prompt": "x", "temperature": -0.5}, "temperature"),
    ({"model": "m", "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": "m", "prompt": "x", "top_k": 0}, "top_k"),
    ({"model": "m", "prompt": "x", "n": 2}, "n"),
    ({"model": "m", "prompt": "x", "stream": "yes"}, "stream"),
    ({"model": "m", "prompt": "x", "stop": [1]}, "stop"),
    ({"model": "m", "prompt": "x", "logprobs": 3}, "logprobs"),
    ({"model": "m", "prompt": "x", "seed": 2**64}, "seed"),
])
def test_completion_errors_name_the_field(body, param):
    err = error_of(CompletionRequest, body)
    assert err.param == param and err.message.startswith(param)
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}


def test_chat_messages():
    req = ChatCompletionRequest.model_validate({
        "model": "m", "max_completion_tokens": 7,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert req.messages[0].text() == "ab" and req.requested_max_tokens() == 7
    assert ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}]}).requested_max_tokens() is None
    assert error_of(ChatCompletionRequest, {"model": "m", "messages": []}).param == "messages"
    assert error_of(ChatCompletionRequest, {"model": "m", "messages": [{"role": "bot", "content": "x"}]}).param \
        == "messages.0.role"
    assert error_of(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": 3}]}).param \
        == "messages.0.content"


def test_model_may_be_left_out():
    # vLLM and SGLang serve a request without `model` with their one model; so do we.
    assert CompletionRequest.model_validate({"prompt": "x"}).model is None
    assert ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]}).model is None


@pytest.mark.parametrize("field", ["temperature", "top_p"])
def test_nan_and_infinity_are_not_numbers(field):
    nan = error_of(CompletionRequest, {"prompt": "x", field: float("nan")})
    assert nan.param == field and nan.message == f"{field}: NaN is not a number; send a finite number"
    inf = error_of(CompletionRequest, {"prompt": "x", field: float("inf")})
    assert inf.param == field and "inf is not a finite number" in inf.message


@pytest.mark.parametrize("raw, param", [
    (rb'{"prompt": "a\ud800b"}', "prompt"),
    (rb'{"messages": [{"role": "user", "content": "\udfff"}]}', "messages.0.content"),
    (rb'{"prompt": "x", "stop": ["ok", "\uDBFF!"]}', "stop.1"),
    (rb'{"prompt": "x", "\ud800": 1}', "request body"),  # a key
])
def test_a_lone_surrogate_is_named_by_its_field(raw, param):
    assert may_hold_lone_surrogate(raw)
    err = lone_surrogate_error(json.loads(raw))
    assert err is not None and err.status == 400 and err.param == param
    assert err.message.startswith(f"{param}: holds a lone surrogate") and err.code == "invalid_unicode"
    err.message.encode("ascii")  # the answer itself can always be encoded


@pytest.mark.parametrize("raw", [
    rb'{"prompt": "\ud83d\ude00"}',  # a pair: json.loads joins it into one character
    rb'{"prompt": "\\ud800"}',  # an escaped backslash, then the letters "ud800"
])
def test_surrogate_pairs_and_escaped_backslashes_are_text(raw):
    assert may_hold_lone_surrogate(raw)  # the cheap scan cannot tell; the walk can
    assert lone_surrogate_error(json.loads(raw)) is None
    assert not may_hold_lone_surrogate(b'{"prompt": "caf\xc3\xa9 \\u00e9"}')  # no walk for ordinary text
