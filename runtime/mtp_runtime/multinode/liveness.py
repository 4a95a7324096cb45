"""Failing together: a heartbeat through rank 0's TCPStore.

Every rank bumps its own counter in the store every `interval_s` and watches
the others'. A counter that has not moved for `timeout_s` (dead or hung
rank), or a store that stops answering (rank 0 dead or hung), means the
group is broken: this rank logs which rank was lost, runs its failure hooks
(rank 0 fails in-flight requests) and exits non-zero, so Kubernetes restarts
the whole group instead of leaving half of it hanging in a collective.

Counters, not timestamps: each rank judges staleness on its own monotonic
clock, so clock skew between nodes does not matter.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from mtp_runtime.multinode.node_state import NodeState

log = logging.getLogger("mtp_runtime.multinode")

HEARTBEAT_KEY = "mtp/heartbeat"
SHUTDOWN_KEY = "mtp/shutdown"
LEFT_KEY = "mtp/left"
VERDICT_KEY = "mtp/lost"
VERDICT_ACK_KEY = "mtp/lost-seen"
# Exit status of a rank that left because another rank was lost.
RANK_LOST_EXIT_CODE = 4  # 2: bad flags, 3: model failed to load (mtp serve)
DEFAULT_TIMEOUT_S = 30.0

FailureHook = Callable[[str], None]


class Heartbeat:
    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        interval_s: float | None = None,
        state: NodeState | None = None,
        hook_grace_s: float = 5.0,
        exit_fn: Callable[[int], None] = os._exit,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"heartbeat timeout_s={timeout_s}: must be > 0")
        # A separate client connection whose own timeout bounds a hung master.
        self.store = store.clone()
        self.store.set_timeout(timedelta(seconds=timeout_s))
        self.rank, self.world_size = rank, world_size
        self.timeout_s = timeout_s
        self.interval_s = interval_s if interval_s is not None else max(0.05, timeout_s / 10)
        self.state = state
        self.hook_grace_s = hook_grace_s
        self.exit_fn = exit_fn
        self._hooks: list[FailureHook] = []
        self._stop = threading.Event()
        self._failing = threading.Lock()
        self._thread: threading.Thread | None = None
        self._others = [r for r in range(world_size) if r != rank]
        self._last_value: dict[int, bytes | None] = {r: None for r in self._others}
        self._last_change: dict[int, float] = {}
        self._beats = 0

    def add_failure_hook(self, hook: FailureHook) -> None:
        """hook(reason) runs once, before exit, with at most hook_grace_s to finish."""
        self._hooks.append(hook)

    def start(self) -> "Heartbeat":
        self._beat()
        now = time.monotonic()
        self._last_change = {r: now for r in self._others}
        self._thread = threading.Thread(target=self._run, name="mtp-heartbeat", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (a clean shutdown of this rank)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval_s + self.timeout_s)

    def announce_shutdown(self) -> None:
        """Rank 0 stops the group on purpose: the others exit 0 instead of
        failing. Waits (bounded) until they left, since they need its store."""
        self.stop()
        self.store.set(SHUTDOWN_KEY, str(self.rank))
        deadline = time.monotonic() + self.timeout_s
        pending = [f"{LEFT_KEY}/{r}" for r in self._others]
        while pending and time.monotonic() < deadline:
            pending = [k for k in pending if not self.store.check([k])]
            time.sleep(0.05)

    def leave(self) -> None:
        """A worker that rank 0 stopped: say so, since rank 0 waits for it in announce_shutdown."""
        self.stop()
        self.store.set(f"{LEFT_KEY}/{self.rank}", "1")

    def on_collective_error(self, exc: BaseException) -> None:
        """A collective raised (usually a peer closed its socket): let the
        heartbeat name the lost rank, else fail with the collective's error."""
        log.error("rank %d: collective failed (%s); checking which rank was lost", self.rank, exc)
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=self.timeout_s + 2 * self.interval_s)
        self.fail(f"collective failed: {exc}")

    def fail(self, reason: str, lost_rank: int | None = None) -> None:
        """Log, run failure hooks, exit non-zero. Only the first caller acts."""
        if not self._failing.acquire(blocking=False):
            return
        self._stop.set()
        who = f"rank {lost_rank} lost" if lost_rank is not None else "group failed"
        message = f"rank {self.rank}: {who}: {reason}; exiting so the whole group restarts"
        log.error(message)
        if lost_rank is not None:
            self._publish_verdict(lost_rank, reason)
        if self.state is not None:
            self.state.failed(message)
        self._run_hooks(message)
        if self.rank == 0 and lost_rank is not None:
            self._wait_for_survivors(lost_rank)
        self.exit_fn(RANK_LOST_EXIT_CODE)

    def _publish_verdict(self, lost_rank: int, reason: str) -> None:
        """Best effort: the store may be the thing that is gone."""
        try:
            # compare_set: the first verdict stays, a later one does not overwrite it.
            self.store.compare_set(VERDICT_KEY, "", f"{lost_rank}|{self.rank}|{reason}")
            self.store.set(f"{VERDICT_ACK_KEY}/{self.rank}", "1")
        except Exception as exc:
            log.warning("rank %d: could not share the verdict through the store (%s)", self.rank, exc)

    def _wait_for_survivors(self, lost_rank: int) -> None:
        """Rank 0 holds the store: keep it up until the survivors read the verdict."""
        pending = [f"{VERDICT_ACK_KEY}/{r}" for r in self._others if r != lost_rank]
        deadline = time.monotonic() + self.timeout_s
        try:
            while pending and time.monotonic() < deadline:
                pending = [k for k in pending if not self.store.check([k])]
                if pending:
                    time.sleep(self.interval_s / 2)
        except Exception as exc:
            log.warning("rank 0: stopped waiting for the survivors (%s)", exc)

    def _read_verdict(self) -> tuple[int, str] | None:
        if not self.store.check([VERDICT_KEY]):
            return None
        lost, reporter, reason = self.store.get(VERDICT_KEY).decode().split("|", 2)
        return int(lost), f"{reason} (noticed by rank {reporter})"

    def _run_hooks(self, reason: str) -> None:
        def run_all() -> None:
            for hook in self._hooks:
                try:
                    hook(reason)
                except Exception:  # a broken hook must not stop the exit
                    log.exception("failure hook %r raised", hook)

        runner = threading.Thread(target=run_all, name="mtp-failure-hooks", daemon=True)
        runner.start()
        runner.join(timeout=self.hook_grace_s)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
                if self.store.check([SHUTDOWN_KEY]):
                    self._leave_cleanly()
                    return
                verdict = self._read_verdict()
                if verdict is not None:
                    self.fail(verdict[1], lost_rank=verdict[0])
                    return
                self._watch_others()
            except Exception as exc:  # the store lives on rank 0
                if self._stop.is_set():
                    return
                self.fail(f"rank 0's store stopped answering ({exc})", lost_rank=0 if self.rank else None)
                return

    def _beat(self) -> None:
        self._beats += 1
        self.store.set(f"{HEARTBEAT_KEY}/{self.rank}", str(self._beats))

    def _watch_others(self) -> None:
        now = time.monotonic()
        for r in self._others:
            key = f"{HEARTBEAT_KEY}/{r}"
            value = self.store.get(key) if self.store.check([key]) else None
            if value != self._last_value[r]:
                self._last_value[r], self._last_change[r] = value, now
            elif now - self._last_change[r] > self.timeout_s:
                seen = "never beat" if value is None else f"last beat #{value.decode()}"
                silent = now - self._last_change[r]
                self.fail(f"no heartbeat for {silent:.1f}s (timeout {self.timeout_s:g}s, {seen})", lost_rank=r)
                return

    def _leave_cleanly(self) -> None:
        log.info("rank %d: master announced shutdown; leaving", self.rank)
        self._stop.set()
        if self.rank != 0:
            self.store.set(f"{LEFT_KEY}/{self.rank}", "1")
            self.exit_fn(0)
