"""Request validation: strict types, unsupported fields by name, OpenAI error shape."""

import pytest
from pydantic import ValidationError

from mtp_runtime.server.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
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
    ({"prompt": "x"}, "model"),
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
