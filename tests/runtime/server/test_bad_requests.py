"""Hostile and broken requests against a real `mtp serve`: each gets a 4xx in the
OpenAI error shape, no internal exception text, and the server stays healthy.

One server (an untrained `mtp make-tiny` model, no draft: only the HTTP layer
is under test) with a small --max_request_bytes, so oversized bodies are cheap
to send.
"""

import json
import os
import subprocess
import sys

import httpx
import pytest

from mtp_runtime.bench.local_server import LocalServer

pytestmark = pytest.mark.slow  # starts a real server process

API_KEY = "bad-request-key"
SERVED_NAME = "tiny"
MAX_MODEL_LEN = 256
MAX_REQUEST_BYTES = 64 * 1024
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
# What must never reach a client: exception names and texts from inside the server.
INTERNALS = ("Traceback", "RecursionError", "TextInputSequence", "UnicodeEncodeError", "internal error:",
             "Exception", "File \"")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = tmp_path_factory.mktemp("bad-requests") / "tiny"
    done = subprocess.run([sys.executable, "-m", "mtp_runtime", "make-tiny", "--arch", "deepseek_v3",
                           "--out", str(model), "--num-hidden-layers", "1", "--shards", "1"],
                          capture_output=True, text=True, env={**os.environ, **ONE_THREAD})
    assert done.returncode == 0, done.stderr
    flags = ["--model", str(model), "--served_model_name", SERVED_NAME, "--api_key", API_KEY,
             "--max_model_len", str(MAX_MODEL_LEN), "--max_request_bytes", str(MAX_REQUEST_BYTES),
             "--max_seqs_per_batch", "2"]
    with LocalServer(flags, startup_timeout_s=180.0, env=ONE_THREAD) as running:
        yield running
        assert running.stop() == 0, running.log_tail()


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.base_url, timeout=60.0,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


def openai_error(resp: httpx.Response, status: int) -> dict:
    """The error object of an OpenAI-shaped error answer with `status`; the server still healthy."""
    assert resp.status_code == status, resp.text[:500]
    assert resp.headers["content-type"].startswith("application/json")
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert not any(word in error["message"] for word in INTERNALS), error["message"]
    return error


def assert_healthy(client: httpx.Client) -> None:
    assert client.get("/health").status_code == 200


def post_raw(client: httpx.Client, path: str, raw: bytes) -> httpx.Response:
    return client.post(path, content=raw, headers={"Content-Type": "application/json"})


COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"

# (name, path, raw body, status, param, code): every one a client mistake, none a 5xx.
BAD_BODIES = [
    ("lone surrogate in prompt", COMPLETIONS, rb'{"prompt": "a\ud800b", "max_tokens": 2}', 400, "prompt",
     "invalid_unicode"),
    ("lone surrogate in a prompt list", COMPLETIONS, rb'{"prompt": ["\udc00"]}', 400, "prompt.0",
     "invalid_unicode"),
    ("lone surrogate in chat content", CHAT, rb'{"messages": [{"role": "user", "content": "a\ud800b"}]}', 400,
     "messages.0.content", "invalid_unicode"),
    ("lone surrogate in a content part", CHAT,
     rb'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\udbff"}]}]}', 400,
     "messages.0.content.0.text", "invalid_unicode"),
    ("lone surrogate in a stop string", COMPLETIONS, rb'{"prompt": "x", "stop": "\ud800"}', 400, "stop",
     "invalid_unicode"),
    ("lone surrogate in the model name", COMPLETIONS, rb'{"model": "\ud800", "prompt": "x"}', 400, "model",
     "invalid_unicode"),
    ("deeply nested JSON", COMPLETIONS, b'{"prompt": "x", "extra": ' + b"[" * 20_000 + b"]" * 20_000 + b"}",
     400, None, "invalid_json"),
    ("deeply nested object", CHAT, b'{"messages": ' + b'{"a":' * 5_000 + b"1" + b"}" * 5_000 + b"}",
     400, None, "invalid_json"),
    ("nested lists in a known field", COMPLETIONS, b'{"prompt": "x", "stop": ' + b"[" * 500 + b"]" * 500 + b"}",
     400, "stop", None),
    ("NaN temperature", COMPLETIONS, b'{"prompt": "x", "temperature": NaN}', 400, "temperature", "finite_number"),
    ("infinite top_p", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "top_p": Infinity}', 400,
     "top_p", "finite_number"),
    ("an integer of 5000 digits", COMPLETIONS, b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", 400, None,
     "invalid_json"),
    ("max_tokens far beyond the context", COMPLETIONS, b'{"prompt": "x", "max_tokens": ' + b"9" * 30 + b"}", 400,
     "max_tokens", "context_length_exceeded"),
    ("not UTF-8", COMPLETIONS, b'{"prompt": "\xff\xfe"}', 400, None, "invalid_json"),
    ("not JSON", COMPLETIONS, b"{prompt", 400, None, "invalid_json"),
    ("empty body", COMPLETIONS, b"", 400, None, "invalid_json"),
    ("a JSON array", CHAT, b"[1, 2]", 400, None, "invalid_json"),
    ("a JSON string", COMPLETIONS, b'"prompt"', 400, None, "invalid_json"),
    ("no messages", CHAT, b'{"messages": []}', 400, "messages", None),
    ("a message that is not an object", CHAT, b'{"messages": ["hi"]}', 400, "messages.0", None),
    ("an unknown role", CHAT, b'{"messages": [{"role": "wizard", "content": "x"}]}', 400, "messages.0.role",
     None),
    ("a token id outside the vocabulary", COMPLETIONS, b'{"prompt": [1, 99999999]}', 400, "prompt",
     "invalid_token_id"),
    ("a negative token id", COMPLETIONS, b'{"prompt": [-1]}', 400, "prompt", "invalid_token_id"),
    ("more token ids than the context", COMPLETIONS,
     json.dumps({"prompt": [5] * MAX_MODEL_LEN}).encode(), 400, "prompt", "context_length_exceeded"),
    ("a text far longer than the context", COMPLETIONS,
     json.dumps({"prompt": "z" * 60_000}).encode(), 400, "prompt", "context_length_exceeded"),
    ("a chat far longer than the context", CHAT,
     json.dumps({"messages": [{"role": "user", "content": "z" * 60_000}]}).encode(), 400, "messages",
     "context_length_exceeded"),
    ("an unknown model", COMPLETIONS, b'{"model": "gpt-4", "prompt": "x"}', 404, "model", "model_not_found"),
    ("stream with a bad field", COMPLETIONS, b'{"prompt": "x", "stream": true, "temperature": -1}', 400,
     "temperature", None),
]


@pytest.mark.parametrize("name, path, raw, status, param, code", BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_bad_body_gets_a_4xx_in_the_openai_shape(client, name, path, raw, status, param, code):
    error = openai_error(post_raw(client, path, raw), status)
    if param is not None:
        assert error["param"] == param and error["message"].startswith(f"{param}:"), error
    if code is not None:
        assert error["code"] == code, error
    assert_healthy(client)


def test_nan_temperature_is_called_not_a_number(client):
    error = openai_error(post_raw(client, COMPLETIONS, b'{"prompt": "x", "temperature": NaN}'), 400)
    assert error["message"] == "temperature: NaN is not a number; send a finite number"


def test_a_text_too_long_for_any_tokenisation_is_refused_by_its_length(client):
    error = openai_error(client.post(COMPLETIONS, json={"prompt": "z" * 60_000}), 400)
    assert "60000 characters are at least" in error["message"] and f"context of {MAX_MODEL_LEN}" in error["message"]


def test_huge_top_k_is_served(client):
    # top_k beyond the vocabulary keeps the whole vocabulary; it must not break the engine step.
    for top_k in (5000, 10**30):
        resp = client.post(COMPLETIONS, json={"prompt": "def f(", "max_tokens": 3, "top_k": top_k, "seed": 1})
        assert resp.status_code == 200, resp.text
    assert_healthy(client)


def test_body_over_the_limit_is_refused_with_413(client):
    body = json.dumps({"prompt": "x" * (MAX_REQUEST_BYTES + 10)}).encode()
    error = openai_error(post_raw(client, COMPLETIONS, body), 413)
    assert error["code"] == "request_too_large" and str(MAX_REQUEST_BYTES) in error["message"]
    assert "--max_request_bytes" in error["message"]
    assert_healthy(client)


def test_chunked_body_over_the_limit_is_refused_with_413(client):
    # No Content-Length: the server counts the chunks as they come.
    def chunks():
        yield b'{"prompt": "'
        for _ in range(2 * MAX_REQUEST_BYTES // 4096):
            yield b"x" * 4096
        yield b'"}'

    resp = client.post(COMPLETIONS, content=chunks(), headers={"Content-Type": "application/json"})
    assert "content-length" not in resp.request.headers
    error = openai_error(resp, 413)
    assert error["code"] == "request_too_large"
    assert_healthy(client)


def test_a_connection_keeps_serving_after_a_413(client):
    # The refused body is read and dropped, not left to be parsed as the next request.
    big = json.dumps({"prompt": "x" * (MAX_REQUEST_BYTES * 2)}).encode()
    for _ in range(2):
        openai_error(post_raw(client, COMPLETIONS, big), 413)
        ok = client.post(COMPLETIONS, json={"prompt": "def f(", "max_tokens": 2})
        assert ok.status_code == 200, ok.text


def test_request_without_model_is_served_by_the_only_model(client):
    completion = client.post(COMPLETIONS, json={"prompt": "def f(", "max_tokens": 3, "temperature": 0})
    assert completion.status_code == 200, completion.text
    assert completion.json()["model"] == SERVED_NAME
    chat = client.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert chat.status_code == 200, chat.text
    assert chat.json()["model"] == SERVED_NAME


def test_401_names_the_bearer_scheme(server):
    with httpx.Client(base_url=server.base_url, timeout=30.0) as anonymous:
        for resp in (anonymous.post(COMPLETIONS, json={"prompt": "x"}), anonymous.get("/v1/models"),
                     anonymous.post(CHAT, json={}, headers={"Authorization": "Bearer wrong"})):
            error = openai_error(resp, 401)
            assert error["type"] == "authentication_error"
            assert resp.headers["www-authenticate"] == "Bearer"
        assert anonymous.get("/health").status_code == 200


def test_unknown_route_and_method(client):
    assert openai_error(client.get("/v1/nothing"), 404)["type"] == "invalid_request_error"
    openai_error(client.get(COMPLETIONS), 405)


def test_still_serving_after_everything(client):
    resp = client.post(COMPLETIONS, json={"model": SERVED_NAME, "prompt": "import os\n", "max_tokens": 4})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] >= 1
    health = client.get("/health").json()
    assert health["state"] == "ready" and health["requests_in_flight"] == 0


def test_a_byte_order_mark_is_ignored(client):
    resp = post_raw(client, COMPLETIONS, b'\xef\xbb\xbf{"prompt": "def f(", "max_tokens": 2}')
    assert resp.status_code == 200, resp.text
