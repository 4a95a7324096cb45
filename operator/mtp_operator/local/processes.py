"""A group of rank processes that lives and dies together, as on Kubernetes.

A multi-node group cannot lose one rank, so when any rank exits the whole
group is stopped and started again (within a restart budget, with a doubling
backoff) — the local twin of the operator's gang restart.

Each `mtp up` run starts every log fresh and keeps the previous run's as
NAME.log.1, so a crash report shows this run's lines only; the group's own
restarts within a run append to the same log.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class LocalProcess:
    """One process to run: a rank or the export step."""

    name: str  # "export", "rank-0", ...
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    http_port: int | None = None  # where /health and /metrics answer


@dataclass(frozen=True)
class RankExit:
    name: str
    returncode: int
    log_tail: str


def rotate_log(path: Path) -> None:
    """Keep the previous run's log as NAME.log.1 (replacing an older one); the next write starts fresh."""
    try:
        os.replace(path, path.with_name(path.name + ".1"))
    except FileNotFoundError:
        pass


def log_tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return ""


def terminate(proc: subprocess.Popen, grace_seconds: float) -> int:
    """SIGTERM the process's session, wait, then SIGKILL it; returns the exit code."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            return proc.wait(timeout=grace_seconds)
        except subprocess.TimeoutExpired:
            pass
    try:
        # Whatever is left of the session (the process or its children).
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return proc.wait()


class ProcessGroup:
    """Starts, watches, restarts and stops a fixed list of processes together."""

    def __init__(
        self,
        members: list[LocalProcess],
        log_dir: Path,
        restart_budget: int = 3,
        restart_backoff: float = 2.0,
        grace_seconds: float = 15.0,
    ):
        if not members:
            raise ValueError("a process group needs at least one process")
        self.members = members
        self.log_dir = log_dir
        self.restart_budget = restart_budget
        self.restart_backoff = restart_backoff
        self.grace_seconds = grace_seconds
        self.restarts = 0
        self._procs: dict[str, subprocess.Popen] = {}
        self._logs_rotated = False

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if not self._logs_rotated:  # the first start of this run; restarts append
            for member in self.members:
                rotate_log(self.log_path(member.name))
            self._logs_rotated = True
        for member in self.members:
            with open(self.log_path(member.name), "ab") as log:
                # Own session: stopping a rank also stops anything it spawned.
                self._procs[member.name] = subprocess.Popen(
                    member.argv,
                    env={**os.environ, **member.env},
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )

    def pids(self) -> dict[str, int]:
        return {name: proc.pid for name, proc in self._procs.items()}

    def first_exit(self) -> RankExit | None:
        """The first member found exited (ranks must never exit on their own)."""
        for name, proc in self._procs.items():
            code = proc.poll()
            if code is not None:
                return RankExit(name, code, log_tail(self.log_path(name)))
        return None

    def can_restart(self) -> bool:
        return self.restarts < self.restart_budget

    def next_backoff(self) -> float:
        return self.restart_backoff * (2**self.restarts)

    def restart(self, sleep=time.sleep) -> bool:
        """Whole-group restart: kill every member, back off, start them all.

        No grace period, like the operator's gang restart (pods deleted with
        grace 0): the survivors hold collective state that is already broken.
        `sleep` may be an Event's `wait`: when it returns True (a shutdown was
        asked for during the backoff) the group stays stopped and this returns
        False.
        """
        if sleep(self.begin_restart()) is True:
            return False
        self.finish_restart()
        return True

    def begin_restart(self) -> float:
        """The first half of `restart`, for a caller that waits out the backoff
        itself (while it watches other groups): kill every member at once and
        return the seconds to wait before `finish_restart`."""
        if not self.can_restart():
            raise RuntimeError(f"restart budget of {self.restart_budget} spent")
        self.stop(grace_seconds=0)
        return self.next_backoff()

    def finish_restart(self) -> None:
        self.restarts += 1
        self.start()

    def stop(self, grace_seconds: float | None = None) -> dict[str, int]:
        """Stop every member (SIGTERM, then SIGKILL after the grace period)."""
        grace = self.grace_seconds if grace_seconds is None else grace_seconds
        for proc in self._procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        codes = {name: terminate(proc, grace) for name, proc in self._procs.items()}
        self._procs.clear()
        return codes
