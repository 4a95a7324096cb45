"""OpenAI request models, response bodies and error shapes.

Requests are validated strictly ("5" is not an int, NaN is not a number) so a
wrong-typed field gets a 400 naming it instead of a silent coercion. A
request without `model` is served by the server's one model. Unknown fields are
ignored, as OpenAI's own API does, so stock clients keep working; known
fields this build cannot honour (n > 1, logprobs) are rejected by name.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    model: str | None = None  # None: the one model this server serves (as vLLM and SGLang do)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)  # what torch.Generator accepts
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool | int | None = None
    ignore_eos: bool = False  # vLLM extension: fixed output lengths for benchmarks

    @model_validator(mode="after")
    def _supported(self):
        if self.n != 1:
            raise ValueError("n: only n=1 is supported")
        if self.logprobs not in (None, False):
            raise ValueError("logprobs: not supported by this server")
        if isinstance(self.stop, list) and (len(self.stop) > 4 or any(not s for s in self.stop)):
            raise ValueError("stop: at most 4 non-empty strings")
        if self.top_k == 0:
            raise ValueError("top_k: use -1 (or omit it) to disable top-k; 0 keeps no token")
        return self

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(SamplingFields):
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions
    prompt: str | list[int] | list[str]
    echo: bool = False

    @model_validator(mode="after")
    def _one_prompt(self):
        if isinstance(self.prompt, list):
            if not self.prompt:
                raise ValueError("prompt: must not be empty")
            if isinstance(self.prompt[0], str):
                if len(self.prompt) != 1:
                    raise ValueError("prompt: only one prompt per request is supported")
                self.prompt = self.prompt[0]
        if self.prompt == "":
            raise ValueError("prompt: must not be empty")
        if self.echo:
            raise ValueError("echo: not supported by this server")
        return self


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    add_generation_prompt: bool = True

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---- errors -------------------------------------------------------------------


class APIError(Exception):
    """An error answered as OpenAI-shaped JSON with an HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


_TYPE_TAGS = {"str", "int", "float", "bool", "none"}


def _field_path(loc: tuple) -> str:
    """`messages.0.content`, without pydantic's union-branch tags like `list[int]`."""
    parts = [str(p) for p in loc
             if not (isinstance(p, str) and ("[" in p or p in _TYPE_TAGS or p[:1].isupper()))]
    return ".".join(parts)


def validation_error_to_api_error(exc: ValidationError) -> APIError:
    """The first problem, named by the JSON path of the field that caused it."""
    err = exc.errors()[0]
    path = _field_path(err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "missing":
        message = f"{path}: field required"
    elif err["type"] == "finite_number":
        value = err["input"]
        what = "NaN is not a number" if value != value else f"{value} is not a finite number"
        message = f"{path}: {what}; send a finite number"
    elif not path:  # our own model validators already start with the field name
        message, path = msg, msg.split(":")[0]
    elif len(err["loc"]) > len(path.split(".")):  # a union: list what it accepts
        depth = len(path.split("."))
        accepted = dict.fromkeys(str(e["loc"][depth]) for e in exc.errors() if len(e["loc"]) > depth)
        message = f"{path}: wrong type {type(err['input']).__name__}; expected one of {', '.join(accepted)}"
    else:
        message = f"{path}: {msg}"
    return APIError(400, message, param=path, code=err["type"])


# JSON can only carry a lone surrogate as a \uD800-\uDFFF escape (raw surrogate bytes are not
# UTF-8), so a body without such an escape holds none, and only a body with one is walked.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\\ud800-\\udfff]")


def may_hold_lone_surrogate(raw: bytes | bytearray) -> bool:
    """False when the JSON text `raw` surely holds no lone surrogate (the usual case: no walk needed)."""
    return _SURROGATE_ESCAPE.search(raw) is not None


def lone_surrogate_error(body) -> APIError | None:
    """A 400 naming the first string of the parsed body that holds a lone UTF-16 surrogate.

    Such a string is not Unicode text: the tokenizer, the chat template and
    the JSON encoder of the answer would all fail on it.
    """
    stack: list[tuple[str, object]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            found = _SURROGATE.search(value)
            if found:
                name = path.encode("ascii", "backslashreplace").decode() or "request body"
                return APIError(400, f"{name}: holds a lone surrogate (\\u{ord(found.group()):04x} at character "
                                     f"{found.start()}), which is not Unicode text; send valid UTF-8 text",
                                param=name, code="invalid_unicode")
        elif isinstance(value, dict):
            items = [(f"{path}.{k}" if path else str(k), v) for k, v in value.items()]
            items += [(path or "request body", k) for k in value]  # the keys themselves
            stack.extend(reversed(items))
        elif isinstance(value, list):
            stack.extend(reversed([(f"{path}.{i}", v) for i, v in enumerate(value)]))
    return None


# ---- responses ----------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(request_id: str, model: str, text: str, finish_reason: str | None,
                    prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def completion_chunk(request_id: str, model: str, text: str, finish_reason: str | None) -> dict:
    return {
        "id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    }


def chat_body(request_id: str, model: str, text: str, finish_reason: str | None,
              prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                     "logprobs": None, "finish_reason": finish_reason}],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def chat_chunk(request_id: str, model: str, delta: dict, finish_reason: str | None) -> dict:
    return {
        "id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }


def usage_chunk(request_id: str, model: str, object_: str, prompt_tokens: int, completion_tokens: int) -> dict:
    return {"id": request_id, "object": object_, "created": int(time.time()), "model": model,
            "choices": [], "usage": usage(prompt_tokens, completion_tokens)}


def models_body(model: str, root: str) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": int(time.time()),
                                        "owned_by": "mtp", "root": root}]}
