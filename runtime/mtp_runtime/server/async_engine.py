"""The engine stepping in a background thread, feeding per-request asyncio queues.

LLMEngine.add_request/abort_request are safe from any thread (they validate
in the caller and post to the engine's inbox), so HTTP handlers call them
directly and a bad request fails in its own handler. Only the engine thread
steps; it hands each RequestOutput to its request's asyncio.Queue with
call_soon_threadsafe. The thread also loads the model, so /health can answer
503 "loading" while weights are read.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from mtp_runtime.multinode.node_state import FAILED, READY, NodeState

from .metrics import ServerMetrics

log = logging.getLogger("mtp.serve")


class QueueFullError(RuntimeError):
    """More requests in flight than the server admits; answered with 429."""


class EngineNotReadyError(RuntimeError):
    """The model is still loading, failed to load, or the server is draining; answered with 503."""


@dataclass
class EngineFailure:
    """Put on a request's queue when the engine itself broke under it."""

    message: str


@dataclass
class RequestAborted:
    """Put on a request's queue when the server cut it short (shutdown deadline)."""

    message: str


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue


class AsyncEngine:
    def __init__(self, build_engine: Callable[[], Any], metrics: ServerMetrics, max_in_flight: int,
                 node_state: NodeState | None = None) -> None:
        self._build_engine = build_engine
        self.metrics = metrics
        self.max_in_flight = max_in_flight
        self.node_state = node_state or NodeState(rank=0, nnodes=1)
        self.engine: Any = None
        self.last_stats: Any = None
        self.load_error: str | None = None
        self.on_load_failure: Callable[[], None] | None = None
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # guards _streams and _accepting
        self._accepting = True
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mtp-engine", daemon=True)

    # ---- event-loop side ---------------------------------------------------------

    def start(self) -> None:
        self.node_state.loading()
        self._thread.start()

    @property
    def ready(self) -> bool:
        return self.node_state.state == READY

    def in_flight(self) -> int:
        with self._lock:
            return len(self._streams)

    def health_stats(self) -> dict:
        """Engine figures for /health: load, and free KV blocks (tests check nothing leaks)."""
        body: dict = {"requests_in_flight": self.in_flight()}
        runner = getattr(self.engine, "runner", None)
        if runner is not None and hasattr(runner, "graph"):  # loaded: how its steps run, and why
            body["graph_mode"] = runner.graph.reason
            body["aot_step"] = runner.aot_reason
        stats = self.last_stats
        if stats is not None:
            free = round((1.0 - stats.kv_cache_usage) * stats.num_kv_blocks)
            body.update(requests_running=stats.num_running, requests_waiting=stats.num_waiting,
                        kv_cache_usage=stats.kv_cache_usage, free_blocks=free, total_blocks=stats.num_kv_blocks)
        return body

    def add_request(self, request_id: str, prompt_ids: list[int], params) -> asyncio.Queue:
        """Queue of this request's outputs; raises ValueError for a request the engine refuses."""
        if not self.ready:
            raise EngineNotReadyError(f"the model is not ready (state {self.node_state.state})")
        outputs: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if not self._accepting:
                raise EngineNotReadyError("the server is shutting down")
            if len(self._streams) >= self.max_in_flight:
                raise QueueFullError(f"{len(self._streams)} requests in flight, the limit is {self.max_in_flight}; "
                                     "retry later")
            self._streams[request_id] = _Stream(asyncio.get_running_loop(), outputs)
        try:
            self.engine.add_request(request_id, prompt_ids, params)
        except Exception:
            with self._lock:
                self._streams.pop(request_id, None)
            raise
        self._wake.set()
        return outputs

    def abort_request(self, request_id: str) -> None:
        with self._lock:
            known = self._streams.pop(request_id, None) is not None
        if known:
            self.engine.abort_request(request_id)
            self._wake.set()

    def stop_accepting(self) -> None:
        with self._lock:
            self._accepting = False

    def abort_all(self, message: str) -> None:
        """Cut every in-flight request short; each handler then ends its response cleanly."""
        with self._lock:
            streams = dict(self._streams)
            self._streams.clear()
        for request_id, stream in streams.items():
            log.warning("aborting request %s: %s", request_id, message)
            self.engine.abort_request(request_id)
            stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, RequestAborted(message))
        self._wake.set()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    # ---- the engine thread -----------------------------------------------------------

    def _run(self) -> None:
        try:
            self.engine = self._build_engine()
        except BaseException as exc:  # noqa: BLE001 - report any load failure, then exit the process
            self.load_error = f"{type(exc).__name__}: {exc}"
            log.error("loading the model failed: %s\n%s", self.load_error, traceback.format_exc())
            self.node_state.set(FAILED, self.load_error)
            if self.on_load_failure:
                self.on_load_failure()
            return
        self._publish_state()
        self.node_state.ready()
        log.info("model loaded; serving")
        while not self._stop.is_set():
            if not self.engine.has_unfinished_requests():
                self._publish_state()
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - one bad step must not kill the server
                log.error("engine step failed\n%s", traceback.format_exc())
                self._fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
                continue
            step = getattr(self.engine, "last_step", None)  # (engines without step records: no step metrics)
            if step is not None:
                self.metrics.observe_step(step)
            # Gauges first: a client that has its answer must find it no longer counted as running.
            self._publish_state()
            for out in outputs:
                self._deliver(out)

    def _deliver(self, out) -> None:
        self.metrics.observe_output(out)
        with self._lock:
            stream = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, out)

    def _fail_all(self, message: str) -> None:
        with self._lock:
            streams = dict(self._streams)
            self._streams.clear()
        for request_id, stream in streams.items():
            self.engine.abort_request(request_id)
            self.metrics.forget(request_id)
            stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, EngineFailure(message))

    def _publish_state(self) -> None:
        stats = self.engine.stats()
        self.metrics.set_engine_state(stats.num_running, stats.num_waiting, stats.kv_cache_usage)
        self.last_stats = stats
