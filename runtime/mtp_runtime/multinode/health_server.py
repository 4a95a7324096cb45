"""/health and /metrics on a worker rank (rank 0 serves them from its API server).

A worker has no OpenAI API, but Kubernetes probes every pod and the operator
reads every rank's /health, so each worker answers on --port from a small
stdlib HTTP server in a daemon thread.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from mtp_runtime.multinode.node_state import STATES, NodeState

log = logging.getLogger("mtp_runtime.multinode")


class WorkerHealthServer:
    def __init__(self, host: str, port: int, state: NodeState, model_calls=lambda: 0, steps_by_k=dict) -> None:
        self.state = state
        self.registry = CollectorRegistry()
        node_state = Gauge("mtp_node_state", "1 for this rank's current state", ["state"], registry=self.registry)
        for name in STATES:
            node_state.labels(name).set_function(lambda name=name: float(self.state.state == name))
        calls = Gauge("mtp_worker_model_calls", "model calls this worker made for rank 0's plans",
                      registry=self.registry)
        calls.set_function(lambda: float(model_calls()))
        self.registry.register(_StepsByK(steps_by_k))
        self._server = ThreadingHTTPServer((host, port), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="mtp-worker-health", daemon=True)

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def start(self) -> "WorkerHealthServer":
        self._thread.start()
        log.info("worker /health and /metrics on port %d", self.port)
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                path = self.path.split("?")[0]
                if path == "/health":
                    code, body = owner.state.health()
                    self._send(code, json.dumps(body).encode(), "application/json")
                elif path == "/metrics":
                    self._send(200, generate_latest(owner.registry), CONTENT_TYPE_LATEST)
                else:
                    self._not_here(path)

            def do_POST(self) -> None:  # noqa: N802
                self._not_here(self.path.split("?")[0])

            def _not_here(self, path: str) -> None:
                message = {"error": f"{path}: a worker rank serves only /health and /metrics; "
                                    f"send API requests to rank 0"}
                self._send(404, json.dumps(message).encode(), "application/json")

            def _send(self, code: int, body: bytes, content_type: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args) -> None:  # probes every few seconds: keep quiet
                pass

        return Handler


class _StepsByK:
    """mtp_worker_steps{k}: the steps this worker followed, by the k rank 0 chose for each (adaptive
    depth puts it in every step's main-forward plan); rank 0 counts the same steps in
    mtp_spec_decode_num_speculative_tokens."""

    def __init__(self, steps_by_k) -> None:
        self._steps_by_k = steps_by_k

    def collect(self):
        family = GaugeMetricFamily("mtp_worker_steps", "steps followed, by the k rank 0 chose for each", labels=["k"])
        for k, count in sorted(dict(self._steps_by_k()).items()):
            family.add_metric([str(k)], float(count))
        yield family
