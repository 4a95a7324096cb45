"""Tokenising and detokenising run beside the event loop, not on it: while one request's text
work is held up, /health still answers (the app in process, a scripted engine, a real tokenizer)."""

import asyncio
import threading
import time
from types import SimpleNamespace

import httpx
from tokenizers import Tokenizer

from mtp_runtime.checkpoint.tokenizer import build_tokenizer
from mtp_runtime.server.app import create_app
from mtp_runtime.server.async_engine import AsyncEngine
from mtp_runtime.server.request_builder import RequestBuilder

HELD_S = 5.0  # how long a held tokenizer call waits at most
ANSWER_WITHIN_S = 2.0  # /health must answer well before that


class Gate:
    def __init__(self) -> None:
        self.entered, self.opened = threading.Event(), threading.Event()

    def hold(self) -> None:
        self.entered.set()
        self.opened.wait(HELD_S)


class GatedTokenizer:
    """The make-tiny tokenizer, whose encode waits at the gate (a prompt that takes long to tokenise)."""

    def __init__(self, inner: Tokenizer, gate: Gate | None) -> None:
        self.inner, self.gate = inner, gate

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def encode(self, *args, **kwargs):
        if self.gate is not None:
            self.gate.hold()
        return self.inner.encode(*args, **kwargs)


class SlowOutput:
    """A finished request whose text takes long to decode (when it has a gate)."""

    def __init__(self, request_id: str, gate: Gate | None) -> None:
        self.request_id, self.gate = request_id, gate
        self.prompt_token_ids, self.token_ids, self.new_token_ids = [1, 2], [3], [3]
        self.finished, self.finish_reason = True, "length"

    @property
    def text(self) -> str:
        if self.gate is not None:
            self.gate.hold()
        return "decoded"


class OneStepEngine:
    def __init__(self, decode_gate: Gate | None) -> None:
        self.decode_gate, self.pending, self.lock = decode_gate, [], threading.Lock()

    def add_request(self, request_id, prompt_ids, params) -> None:
        with self.lock:
            self.pending.append(request_id)

    def abort_request(self, request_id) -> None:
        pass

    def has_unfinished_requests(self) -> bool:
        with self.lock:
            return bool(self.pending)

    def step(self):
        with self.lock:
            done, self.pending = self.pending, []
        return [SlowOutput(r, self.decode_gate) for r in done]

    def stats(self):
        return SimpleNamespace(num_running=0, num_waiting=0, kv_cache_usage=0.0, num_kv_blocks=8)


class QuietMetrics:
    def observe_output(self, out) -> None:
        pass

    def forget(self, request_id) -> None:
        pass

    def set_engine_state(self, running, waiting, kv_cache_usage) -> None:
        pass


def serve_app(encode_gate: Gate | None, decode_gate: Gate | None):
    tokenizer = Tokenizer.from_file(str(build_tokenizer(1024, "deepseek") / "tokenizer.json"))
    engine = AsyncEngine(lambda: OneStepEngine(decode_gate), QuietMetrics(), max_in_flight=4)
    engine.start()
    deadline = time.monotonic() + 10
    while not engine.ready:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    builder = RequestBuilder(GatedTokenizer(tokenizer, encode_gate), None, max_model_len=64, vocab_size=1024)
    return engine, create_app(engine, builder, "tiny", "/models/tiny", None)


async def health_while_held(app, gate: Gate) -> tuple[int, int]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
        completion = asyncio.create_task(client.post("/v1/completions", json={"prompt": "def f(", "max_tokens": 2}))
        assert await asyncio.to_thread(gate.entered.wait, HELD_S), "the request never reached the held step"
        try:
            health = await asyncio.wait_for(client.get("/health"), ANSWER_WITHIN_S)
        finally:
            gate.opened.set()
        return health.status_code, (await completion).status_code


def test_health_answers_while_a_prompt_is_being_tokenised():
    gate = Gate()
    engine, app = serve_app(encode_gate=gate, decode_gate=None)
    try:
        assert asyncio.run(health_while_held(app, gate)) == (200, 200)
    finally:
        engine.shutdown()


def test_health_answers_while_an_answer_is_being_detokenised():
    gate = Gate()
    engine, app = serve_app(encode_gate=None, decode_gate=gate)
    try:
        assert asyncio.run(health_while_held(app, gate)) == (200, 200)
    finally:
        engine.shutdown()
