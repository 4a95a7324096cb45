"""Fixtures: node ranks as real processes on loopback, with their output."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

RANK_SCRIPT = Path(__file__).with_name("rank_process.py")


def free_tcp_port() -> int:
    """A free port below the ephemeral range, so the OS does not hand it to another
    process's outgoing connection before our rank 0 binds it."""
    rng = random.Random()
    while True:
        port = rng.randrange(20000, 32000)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


class RankProcess:
    """A rank's process plus a reader thread, so waiting never blocks on a pipe."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        env = dict(os.environ, GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"), OMP_NUM_THREADS="1",
                   **(env or {}))
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for_line(self, needle: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(needle in line for line in self.lines):
                return
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.05)
        raise AssertionError(f"no line with {needle!r} within {timeout_s}s; output:\n{self.output}")

    def wait(self, timeout_s: float) -> int | None:
        """Exit code, or None if still running at the deadline."""
        try:
            code = self.proc.wait(timeout=max(0.1, timeout_s))
        except subprocess.TimeoutExpired:
            return None
        self._reader.join(timeout=5)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def free_port() -> int:
    return free_tcp_port()


@pytest.fixture
def free_ports():
    """free_ports(n) -> n distinct free ports."""
    def take(n: int) -> list[int]:
        ports: list[int] = []
        while len(ports) < n:
            port = free_tcp_port()
            if port not in ports:
                ports.append(port)
        return ports
    return take


@pytest.fixture
def start_rank():
    """start_rank(*args) -> RankProcess running rank_process.py (or `script`); all killed at teardown.
    start_rank(*args, module="mtp_runtime") runs `python -m mtp_runtime *args` instead."""
    started: list[RankProcess] = []

    def start(*args: object, script: Path = RANK_SCRIPT, module: str | None = None,
              env: dict[str, str] | None = None) -> RankProcess:
        head = ["-m", module] if module else [str(script)]
        started.append(RankProcess([sys.executable, *head, *map(str, args)], env))
        return started[-1]

    yield start
    for rank in started:
        rank.kill()


@pytest.fixture(scope="session")
def tiny_dsv3(tmp_path_factory) -> Path:
    """A tiny DeepSeek-V3 checkpoint with its MTP layer, from `mtp make-tiny`."""
    out = tmp_path_factory.mktemp("multinode") / "tiny-dsv3"
    subprocess.run([sys.executable, "-m", "mtp_runtime", "make-tiny", "--arch", "deepseek_v3", "--out", str(out)],
                   check=True, capture_output=True)
    return out


# The arguments of tests/runtime/server/test_serve_api.py, so make-tiny's training cache (keyed by them)
# serves both; a cold run trains for about 10 s on 2 cores, and gives the same weights every time.
TRAINING = ("--train-steps", "120", "--train-batch", "8", "--train-seq-len", "64")


@pytest.fixture(scope="session")
def trained_dsv3(tmp_path_factory) -> Path:
    """The tiny DeepSeek-V3, briefly trained, so its MTP draft agrees with the main model often
    (the random `tiny_dsv3` accepts no drafts and cannot reach the accept path)."""
    out = tmp_path_factory.mktemp("multinode") / "trained-dsv3"
    subprocess.run([sys.executable, "-m", "mtp_runtime", "make-tiny", "--arch", "deepseek_v3", "--out", str(out),
                    *TRAINING], check=True, capture_output=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    return out
