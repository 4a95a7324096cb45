"""What this rank is doing, for `GET /health` on every rank.

A rank moves waiting_for_master -> loading -> ready; any step may end in
failed. /health answers 200 only in `ready`, which a rank enters after its
own weights are loaded AND the whole group has passed the ready barrier.
"""

from __future__ import annotations

import threading
import time
from typing import Any

WAITING_FOR_MASTER = "waiting_for_master"
LOADING = "loading"
READY = "ready"
FAILED = "failed"

STATES = (WAITING_FOR_MASTER, LOADING, READY, FAILED)

# Allowed moves; failed is terminal so a late "ready" cannot hide a failure.
# loading -> waiting_for_master: the server marks "loading" when its engine
# thread starts, and that thread then joins the group before reading weights.
_NEXT = {
    WAITING_FOR_MASTER: {WAITING_FOR_MASTER, LOADING, FAILED},
    LOADING: {LOADING, WAITING_FOR_MASTER, READY, FAILED},
    READY: {READY, FAILED},
    FAILED: {FAILED},
}


class NodeState:
    """Thread-safe state of one rank; the server reads it, rendezvous writes it."""

    def __init__(self, rank: int | None = None, nnodes: int = 1) -> None:
        self._lock = threading.Lock()
        self._state = WAITING_FOR_MASTER
        self._detail = "starting"
        self._since = time.time()
        self.rank = rank
        self.nnodes = nnodes

    @property
    def state(self) -> str:
        with self._lock:
            return self._state

    def set(self, state: str, detail: str = "") -> None:
        if state not in STATES:
            raise ValueError(f"unknown node state {state!r}; expected one of {STATES}")
        with self._lock:
            if state not in _NEXT[self._state]:
                raise ValueError(f"node state cannot move from {self._state!r} to {state!r}")
            if state != self._state:
                self._since = time.time()
            self._state = state
            self._detail = detail

    def waiting_for_master(self, detail: str) -> None:
        self.set(WAITING_FOR_MASTER, detail)

    def loading(self, detail: str = "loading weights") -> None:
        self.set(LOADING, detail)

    def ready(self) -> None:
        self.set(READY, "group ready")

    def failed(self, reason: str) -> None:
        self.set(FAILED, reason)

    def health(self) -> tuple[int, dict[str, Any]]:
        """(HTTP status, JSON body) for GET /health."""
        with self._lock:
            body = {
                "state": self._state,
                "detail": self._detail,
                "rank": self.rank,
                "nnodes": self.nnodes,
                "since": self._since,
            }
            return (200 if self._state == READY else 503), body
