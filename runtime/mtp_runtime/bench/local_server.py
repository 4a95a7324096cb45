"""Start an `mtp serve` process on a free loopback port and wait until /health says ready.

Used by `mtp bench --model` (baseline and MTP servers, one after the other, so
they never compete for the same cores) and by the server's own tests.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    def __init__(self, serve_flags: list[str], startup_timeout_s: float = 300.0, env: dict | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="mtp-serve-", suffix=".log", delete=False)
        argv = [sys.executable, "-m", "mtp_runtime", "serve", "--host", "127.0.0.1",
                "--port", str(self.port), *serve_flags]
        self.process = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT,
                                        env={**os.environ, **(env or {})})
        try:
            self._wait_ready(startup_timeout_s)
        except BaseException:
            self.__exit__()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"mtp serve exited with {self.process.returncode} while starting:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"mtp serve was not ready within {timeout_s:.0f}s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()[-chars:]

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, as Kubernetes does; SIGKILL only if it overstays."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def __enter__(self) -> "LocalServer":
        return self

    def __exit__(self, *_exc) -> None:
        self.stop()
        self.log.close()
        os.unlink(self.log.name)
