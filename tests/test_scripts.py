"""The developer scripts in hack/: syntax (bash -n), shellcheck, and the
behaviour that can be exercised without Docker or a network."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((REPO / "hack").glob("*.sh"))


def tool(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    assert found, f"{name} is not installed; run hack/setup-env.sh (shellcheck comes from the dev extra)"
    return found


def test_scripts_found():
    names = {p.name for p in SCRIPTS}
    assert {"install-helm.sh", "kind-e2e.sh", "setup-env.sh", "test.sh"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_syntax(script):
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_shellcheck_clean():
    done = subprocess.run(
        [tool("shellcheck"), "--shell=bash", "--severity=style", *map(str, SCRIPTS)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_shellcheck_finds_problems(tmp_path):
    # The check above can fail: an unquoted expansion is reported.
    bad = tmp_path / "bad.sh"
    bad.write_text('#!/usr/bin/env bash\nrm -rf $1/out\n')
    done = subprocess.run([tool("shellcheck"), str(bad)], capture_output=True, text=True)
    assert done.returncode != 0 and "SC2086" in done.stdout


@pytest.mark.parametrize("name", ["install-helm.sh", "kind-e2e.sh"])
def test_scripts_are_strict(name):
    text = (REPO / "hack" / name).read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in text


def path_with_only(tmp_path: Path, *tools: str) -> str:
    """A PATH holding just these tools, so missing ones are really missing."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in tools:
        (bin_dir / name).symlink_to(tool(name))
    return str(bin_dir)


def test_kind_e2e_fails_fast_without_docker(tmp_path):
    env = {"PATH": path_with_only(tmp_path, "dirname"), "HOME": str(tmp_path)}
    done = subprocess.run(
        ["/bin/bash", str(REPO / "hack" / "kind-e2e.sh")], capture_output=True, text=True, env=env, timeout=30
    )
    assert done.returncode == 1
    assert "'docker' is not installed" in done.stderr
    assert done.stdout == ""


def test_kind_e2e_fails_fast_without_kind(tmp_path):
    # A docker on PATH, but no kind: it must stop before creating anything.
    bin_dir = Path(path_with_only(tmp_path, "dirname"))
    (bin_dir / "docker").write_text("#!/bin/sh\necho docker-called >> \"$HOME/calls\"\n")
    (bin_dir / "docker").chmod(0o755)
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path)}
    done = subprocess.run(
        ["/bin/bash", str(REPO / "hack" / "kind-e2e.sh")], capture_output=True, text=True, env=env, timeout=30
    )
    assert done.returncode == 1
    assert "'kind' is not installed" in done.stderr
    assert not (tmp_path / "calls").exists()


def test_install_helm_usage_error():
    done = subprocess.run(["bash", str(REPO / "hack" / "install-helm.sh")], capture_output=True, text=True)
    assert done.returncode == 2
    assert "usage:" in done.stderr and "DEST_BIN" in done.stderr


def test_install_helm_is_idempotent(tmp_path):
    # With helm 4 already in DEST_BIN it must do nothing (no download).
    dest = tmp_path / "bin"
    dest.mkdir()
    (dest / "helm").symlink_to(tool("helm"))
    env = {**os.environ, "PIP_INDEX_URL": "http://127.0.0.1:9/unreachable", "PIP_NO_INDEX": "1"}
    done = subprocess.run(
        ["bash", str(REPO / "hack" / "install-helm.sh"), str(dest)], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr
    assert (dest / "helm").is_symlink()
    assert "fetching" not in done.stderr
