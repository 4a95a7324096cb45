"""The operator in a background thread of this process, with its own event loop.

    operator = EmbeddedOperator(settings, kubeconfig="/path/kubeconfig")   # or in-cluster/KUBECONFIG
    operator.start()        # returns once kopf is ready (watches started)
    ...
    operator.stop()         # stops kopf; raises what the operator died of, if anything

A thread and not a task in the caller's loop: on exit kopf cancels every task
spawned while it ran, which would include the caller's own. Used by the test
tiers (in-memory API and the real control plane) and for notebooks.
"""

from __future__ import annotations

import asyncio
import threading

import kopf

from mtp_operator.handlers import build_registry
from mtp_operator.settings import OperatorSettings


class EmbeddedOperator:
    def __init__(self, settings: OperatorSettings, kubeconfig: str | None = None):
        self.settings = settings
        self.kubeconfig = kubeconfig
        self.thread: threading.Thread | None = None
        self.stop_flag = threading.Event()
        self.error: BaseException | None = None

    def _main(self, ready: threading.Event) -> None:
        try:
            asyncio.run(kopf.operator(
                registry=build_registry(self.settings, kubeconfig=self.kubeconfig),
                clusterwide=self.settings.all_namespaces, namespaces=list(self.settings.namespace),
                standalone=True, stop_flag=self.stop_flag, ready_flag=ready))
        except BaseException as exc:  # surfaced by stop()
            self.error = exc

    def start(self, timeout: float = 20.0) -> None:
        if self.thread is not None:
            raise RuntimeError("the embedded operator is running already")
        self.error = None
        self.stop_flag, ready = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._main, args=(ready,), name="kopf-operator", daemon=True)
        self.thread.start()
        if not ready.wait(timeout):
            raise TimeoutError(f"the operator did not become ready within {timeout:.0f}s")

    def stop(self, timeout: float = 20.0) -> None:
        if self.thread is not None:
            self.stop_flag.set()
            self.thread.join(timeout)
            if self.thread.is_alive():
                raise TimeoutError(f"the operator did not stop within {timeout:.0f}s")
            self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    @property
    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()
