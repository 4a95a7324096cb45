"""A stop request that a signal handler can make safely.

A Python signal handler runs in the main thread, between two bytecodes of
whatever the main thread was doing. `threading.Event.set` takes the Event's
lock; if the main thread was inside `Event.wait` on the same Event, holding
that lock between its own bytecodes, the handler waits for a lock its own
thread holds and the process hangs for good (a loop of `Event.wait(0)` hung on
about half of the SIGINTs sent to it). The same goes for any lock the
interrupted code may hold.

`SignalStop.set` takes no lock: it sets a flag and writes one byte to a pipe
(non-blocking). `wait` sleeps in `select` on that pipe, so a signal wakes it at
once. `call_when_set` runs a callback on a thread of its own once the stop is
asked for, for work that takes locks (a server's drain).

    stop = SignalStop()
    with stop.on_signals(signal.SIGINT, signal.SIGTERM):
        while not stop.wait(1.0):
            ...
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time
from typing import Callable, Iterator


class SignalStop:
    """Event-like (`set`, `is_set`, `wait`) and safe to set from a signal handler."""

    def __init__(self) -> None:
        self._flag = False
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)

    def set(self) -> None:
        self._flag = True
        with contextlib.suppress(OSError):  # the pipe is full (set many times over): it is readable already
            os.write(self._write, b"\0")

    def is_set(self) -> bool:
        return self._flag

    def wait(self, timeout: float | None = None) -> bool:
        """True once set; False after `timeout` seconds (None: wait for good)."""
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        while not self._flag:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            select.select([self._read], [], [], left)
        return self._flag

    def call_when_set(self, callback: Callable[[], None], name: str = "signal-stop") -> threading.Thread:
        """Run `callback` once, on a daemon thread, when the stop is asked for."""

        def watch() -> None:
            self.wait()
            callback()

        thread = threading.Thread(target=watch, name=name, daemon=True)
        thread.start()
        return thread

    @contextlib.contextmanager
    def on_signals(self, *signals: signal.Signals) -> Iterator[SignalStop]:
        """Each of `signals` sets this stop while the block runs; the previous handlers come back after it."""
        previous = {sig: signal.signal(sig, lambda *_: self.set()) for sig in signals}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def __del__(self) -> None:
        # Only here, never on request: a handler or watcher still holding this stop could otherwise write to a
        # descriptor number the process has since given to another file.
        for fd in (self._read, self._write):
            with contextlib.suppress(OSError):
                os.close(fd)
