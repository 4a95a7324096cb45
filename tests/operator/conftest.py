"""Small builders for MtpDeployment test objects (LWS style: tests build what they need)."""

from __future__ import annotations

import copy
from typing import Any, Callable

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
