"""ProcessGroup: real child processes started, watched, restarted and stopped
together (the local twin of a gang restart)."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import time

import pytest

from mtp_operator.local.ports import free_ports
from mtp_operator.local.probe import probe_health
from mtp_operator.local.processes import LocalProcess, ProcessGroup

# A stand-in rank: serves GET /health on its port; exits with EXIT_CODE after
# EXIT_AFTER seconds when set; ignores SIGTERM when STUBBORN is set.
RANK_SCRIPT = textwrap.dedent(
    """
    import http.server, os, signal, sys, threading, time
    port = int(sys.argv[1])
    if os.environ.get("STUBBORN"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
            self.wfile.write(b'{"state": "ready"}')
        def log_message(self, *args):
            'No access log in the test output.'
    server = http.server.HTTPServer(("127.0.0.1", port), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print("rank up on", port, flush=True)
    if os.environ.get("EXIT_AFTER"):
        time.sleep(float(os.environ["EXIT_AFTER"]))
        print("rank giving up", flush=True)
        sys.exit(int(os.environ.get("EXIT_CODE", "3")))
    while True:
        time.sleep(1)
    """
)


def rank(name: str, port: int, **env: str) -> LocalProcess:
    return LocalProcess(name, [sys.executable, "-c", RANK_SCRIPT, str(port)], dict(env), http_port=port)


def wait_healthy(port: int, deadline: float = 10.0) -> None:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if probe_health("127.0.0.1", port, timeout=0.5).ok:
            return
        time.sleep(0.05)
    pytest.fail(f"stand-in rank on {port} never became healthy")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie counts as gone: it has exited and only awaits its parent.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def test_group_starts_probes_and_stops(tmp_path):
    ports = free_ports(2)
    group = ProcessGroup([rank("rank-0", ports[0]), rank("rank-1", ports[1])], tmp_path)
    group.start()
    try:
        for port in ports:
            wait_healthy(port)
        assert group.first_exit() is None
        pids = group.pids()
    finally:
        codes = group.stop()
    assert codes == {"rank-0": -signal.SIGTERM, "rank-1": -signal.SIGTERM}
    assert not any(alive(pid) for pid in pids.values())
    assert "rank up on" in (tmp_path / "rank-0.log").read_text()
    assert not probe_health("127.0.0.1", ports[0], timeout=0.5).ok


def test_one_rank_exiting_restarts_the_whole_group(tmp_path):
    ports = free_ports(2)
    # rank-0 ignores SIGTERM: a restart must not wait out the grace period.
    members = [rank("rank-0", ports[0], STUBBORN="1"), rank("rank-1", ports[1], EXIT_AFTER="0.3", EXIT_CODE="7")]
    group = ProcessGroup(members, tmp_path, restart_budget=1, restart_backoff=0.01, grace_seconds=5)
    group.start()
    try:
        wait_healthy(ports[0])
        end = time.monotonic() + 10
        while (crash := group.first_exit()) is None and time.monotonic() < end:
            time.sleep(0.05)
        assert crash is not None and crash.name == "rank-1" and crash.returncode == 7
        assert "rank giving up" in crash.log_tail
        before = group.pids()
        slept = []
        restart_started = time.monotonic()
        group.restart(sleep=slept.append)
        assert slept == [0.01] and group.restarts == 1
        # Killed at once (grace 0), not given the 5 s grace of a shutdown.
        assert time.monotonic() - restart_started < 4
        after = group.pids()
        # The healthy rank was restarted too: a group never loses one member.
        assert set(before.values()).isdisjoint(after.values())
        assert not alive(before["rank-0"])
        wait_healthy(ports[0])
        assert not group.can_restart()
        with pytest.raises(RuntimeError, match="budget of 1"):
            group.restart(sleep=slept.append)
    finally:
        group.stop(grace_seconds=0)


def test_restart_interrupted_during_backoff_leaves_the_group_stopped(tmp_path):
    # `sleep` is an Event's wait in `mtp up`: True means Ctrl-C came meanwhile.
    (port,) = free_ports(1)
    group = ProcessGroup([rank("rank-0", port)], tmp_path, restart_budget=3, restart_backoff=60)
    group.start()
    try:
        wait_healthy(port)
        before = group.pids()
        slept = []
        assert group.restart(sleep=lambda seconds: slept.append(seconds) or True) is False
        assert slept == [60] and group.restarts == 0
        assert group.pids() == {} and not alive(before["rank-0"])
    finally:
        group.stop(grace_seconds=0)


def test_backoff_doubles(tmp_path):
    group = ProcessGroup([rank("rank-0", 1)], tmp_path, restart_budget=5, restart_backoff=2.0)
    delays = []
    for restarts in range(3):
        group.restarts = restarts
        delays.append(group.next_backoff())
    assert delays == [2.0, 4.0, 8.0]


def test_stop_kills_a_rank_that_ignores_sigterm(tmp_path):
    (port,) = free_ports(1)
    group = ProcessGroup([rank("rank-0", port, STUBBORN="1")], tmp_path, grace_seconds=0.5)
    group.start()
    wait_healthy(port)
    started = time.monotonic()
    codes = group.stop()
    assert codes == {"rank-0": -signal.SIGKILL}
    assert time.monotonic() - started < 5


def test_stop_reaches_processes_a_rank_spawned(tmp_path):
    pid_file = tmp_path / "child.pid"
    spawner = (
        "import subprocess, sys, time;"
        f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid));"
        "time.sleep(60)"
    )
    group = ProcessGroup([LocalProcess("rank-0", [sys.executable, "-c", spawner])], tmp_path, grace_seconds=2)
    group.start()
    end = time.monotonic() + 10
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < end, "spawner never wrote its child's pid"
        time.sleep(0.05)
    child = int(pid_file.read_text())
    group.stop()
    end = time.monotonic() + 5
    while alive(child) and time.monotonic() < end:
        time.sleep(0.05)
    assert not alive(child)


def test_empty_group_is_refused(tmp_path):
    with pytest.raises(ValueError, match="at least one"):
        ProcessGroup([], tmp_path)


def test_free_ports_are_distinct_and_bindable():
    import socket

    ports = free_ports(4)
    assert len(set(ports)) == 4
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_each_run_starts_its_logs_fresh_and_keeps_the_last_one(tmp_path):
    # A crash report must show this run's lines, not another run's.
    (port,) = free_ports(1)
    (tmp_path / "rank-0.log").write_text("a line of the run before last\n")
    for run in (1, 2):
        group = ProcessGroup([rank("rank-0", port, EXIT_AFTER="0.1", EXIT_CODE=str(run))], tmp_path,
                             restart_budget=1, restart_backoff=0.01)
        group.start()
        end = time.monotonic() + 10
        while (crash := group.first_exit()) is None and time.monotonic() < end:
            time.sleep(0.05)
        assert crash is not None and crash.returncode == run
        group.restart(sleep=lambda _: None)  # a restart within the run appends
        while group.first_exit() is None and time.monotonic() < end:
            time.sleep(0.05)
        group.stop(grace_seconds=0)
        log = (tmp_path / "rank-0.log").read_text()
        assert log.count("rank up on") == 2 and "run before last" not in log
    previous = (tmp_path / "rank-0.log.1").read_text()
    assert previous.count("rank up on") == 2 and "run before last" not in previous
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank-0.log", "rank-0.log.1"]


def test_a_restart_in_two_halves_leaves_the_wait_to_the_caller(tmp_path):
    # `mtp up` watches the other groups while one waits out its backoff.
    (port,) = free_ports(1)
    group = ProcessGroup([rank("rank-0", port)], tmp_path, restart_budget=1, restart_backoff=30)
    group.start()
    try:
        wait_healthy(port)
        before = group.pids()
        started = time.monotonic()
        assert group.begin_restart() == 30
        assert time.monotonic() - started < 4  # killed at once, no waiting here
        assert group.pids() == {} and not alive(before["rank-0"]) and group.restarts == 0
        group.finish_restart()
        assert group.restarts == 1 and set(group.pids().values()).isdisjoint(before.values())
        wait_healthy(port)
        with pytest.raises(RuntimeError, match="budget of 1"):
            group.begin_restart()
    finally:
        group.stop(grace_seconds=0)
