"""Small builders for MtpDeployment test objects (LWS style: tests build what they need)."""

from __future__ import annotations

import copy
import http.server
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import pytest

BASE_SPEC: dict[str, Any] = {
    "model": {"path": "/models/ds", "modelType": "deepseek_v3", "volume": {"claimName": "models"}},
    "export": {"outputPath": "/models/ds-mtp"},
    "nnodes": 2,
    "image": "example.com/mtp/runtime:1",
}


def merge(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """Recursive merge; a None value removes the key (like a JSON merge patch)."""
    out = copy.deepcopy(base)
    for key, value in changes.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


@pytest.fixture
def make_spec() -> Callable[..., dict[str, Any]]:
    def build(changes: dict[str, Any] | None = None) -> dict[str, Any]:
        return merge(BASE_SPEC, changes or {})

    return build


@pytest.fixture
def make_cr(make_spec: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    def build(name: str = "ds", namespace: str = "default", changes: dict[str, Any] | None = None,
              uid: str = "uid-1", generation: int = 1) -> dict[str, Any]:
        return {
            "apiVersion": "mtp.inference.dev/v1alpha1",
            "kind": "MtpDeployment",
            "metadata": {"name": name, "namespace": namespace, "uid": uid, "generation": generation},
            "spec": make_spec(changes),
        }

    return build


@contextmanager
def _serving(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[int]:
    handler.log_message = lambda self, *args: None  # keep the test output quiet
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()


@pytest.fixture(scope="session")
def serve_http():
    """serve_http(HandlerClass) -> a context manager yielding the port of a loopback HTTP server
    that answers with the handler (a stand-in API server, rank 0, ...), stopped on exit."""
    return _serving

