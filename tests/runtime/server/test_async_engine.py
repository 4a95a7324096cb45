"""AsyncEngine's thread hand-off, with a scripted engine in place of the model."""

import asyncio
import threading
import time
from types import SimpleNamespace

from mtp_runtime.server.async_engine import AsyncEngine


class OneStepEngine:
    """Finishes every request in one step; stats() is slow once the step is done (a busy host)."""

    def __init__(self) -> None:
        self.running: list[str] = []
        self.lock = threading.Lock()
        self.stepped = False

    def add_request(self, request_id, prompt_ids, params) -> None:
        with self.lock:
            self.running.append(request_id)

    def abort_request(self, request_id) -> None:
        with self.lock:
            if request_id in self.running:
                self.running.remove(request_id)

    def has_unfinished_requests(self) -> bool:
        with self.lock:
            return bool(self.running)

    def step(self):
        with self.lock:
            finished, self.running = self.running, []
        self.stepped = True
        return [SimpleNamespace(request_id=r, finished=True) for r in finished]

    def stats(self):
        if self.stepped:
            time.sleep(0.3)
        with self.lock:
            return SimpleNamespace(num_running=len(self.running), num_waiting=0, kv_cache_usage=0.0,
                                   num_kv_blocks=8)


class GaugeRecorder:
    """The part of ServerMetrics AsyncEngine uses: the running-requests gauge."""

    def __init__(self) -> None:
        self.running = 0

    def observe_output(self, out) -> None:
        pass

    def forget(self, request_id) -> None:
        pass

    def set_engine_state(self, running, waiting, kv_cache_usage) -> None:
        self.running = running


def test_a_finished_request_is_not_counted_as_running_once_its_client_has_it():
    # `mtp up --once` scrapes /metrics right after its last answer; it reported 1 request running.
    metrics = GaugeRecorder()
    engine = AsyncEngine(OneStepEngine, metrics, max_in_flight=4)
    engine.start()
    try:
        deadline = time.monotonic() + 10
        while not engine.ready:
            assert time.monotonic() < deadline, "the scripted engine never became ready"
            time.sleep(0.01)

        async def one_request():
            outputs = engine.add_request("r1", [1, 2, 3], None)
            metrics.running = 1  # what the gauge said while the request ran
            out = await asyncio.wait_for(outputs.get(), 10)
            return out, metrics.running

        out, running_when_answered = asyncio.run(one_request())
        assert out.finished
        assert running_when_answered == 0
    finally:
        engine.shutdown()
