"""LocalDeployment with several groups: real child processes (stand-in ranks
that serve /health, the OpenAI API and /metrics on loopback) started,
watched, restarted group by group and reported the way the operator would."""

from __future__ import annotations

import os
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import yaml

from mtp_operator.local.launch import LocalGroup, choose_ports, plan_groups, plan_local
from mtp_operator.local.paths import LocalPaths
from mtp_operator.local.processes import LocalProcess
from mtp_operator.local.runner import EXIT_FAILED, EXIT_OK, LocalDeployment, UpOptions
from mtp_operator.spec import parse_spec

SAMPLE = Path(__file__).resolve().parents[3] / "crds" / "samples" / "tiny-cpu.yaml"

# A stand-in rank 0: /health (200 once HEALTH_AFTER seconds passed), /v1/models,
# /v1/completions (answers with its own port), /metrics (the builtin engine's
# counters DRAFT and ACCEPTED). Exits with code 3 after EXIT_AFTER seconds, or
# as soon as the file CRASH_WHEN appears (removing it: its restart stays up).
RANK_SCRIPT = textwrap.dedent(
    """
    import http.server, json, os, sys, threading, time
    port = int(sys.argv[1])
    started = time.monotonic()
    env = os.environ
    class Rank(http.server.BaseHTTPRequestHandler):
        def answer(self, code, body, kind="application/json"):
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        def do_GET(self):
            if self.path == "/health":
                up = time.monotonic() - started >= float(env.get("HEALTH_AFTER", "0"))
                self.answer(200 if up else 503, {"state": "ready" if up else "loading"})
            elif self.path == "/v1/models":
                self.answer(200, {"data": [{"id": "stand-in"}]})
            elif self.path == "/metrics":
                self.answer(200, "mtp_spec_decode_draft_tokens_total %s\\n"
                                 "mtp_spec_decode_accepted_tokens_total %s\\n" % (env["DRAFT"], env["ACCEPTED"]),
                            "text/plain")
            else:
                self.answer(404, {})
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.answer(200, {"choices": [{"text": "port %d" % port}], "usage": {"completion_tokens": 2}})
        def log_message(self, *args):
            'No access log in the test output.'
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Rank)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    trigger = env.get("CRASH_WHEN")
    deadline = started + float(env.get("EXIT_AFTER", "inf"))
    while time.monotonic() < deadline:
        if trigger and os.path.exists(trigger):
            os.remove(trigger)
            break
        time.sleep(0.05)
    print("stand-in rank giving up", flush=True)
    sys.exit(3)
    """
)


def fleet_spec(replicas: int):
    data = yaml.safe_load(SAMPLE.read_text())["spec"]
    data.pop("export")
    data.update(replicas=replicas, draftModel={"path": "/models/ready-mtp"})
    return parse_spec(data)


def stand_in_fleet(tmp_path: Path, envs: list[dict[str, str]], lines: list[str], **options) -> LocalDeployment:
    """A LocalDeployment of len(envs) one-rank groups on the ports `mtp up` would choose, each rank a
    stand-in with its env."""
    spec = fleet_spec(len(envs))
    planned = plan_groups("fleet", spec, LocalPaths.for_spec(spec, tmp_path), choose_ports(spec, None, None, len(envs)))
    groups = []
    for group, env in zip(planned, envs):
        port = group.plan.http_port
        stand_in = LocalProcess(group.ranks[0].name, [sys.executable, "-c", RANK_SCRIPT, str(port)],
                                {"DRAFT": "0", "ACCEPTED": "0", **env}, port)
        groups.append(LocalGroup(group.index, group.plan, [stand_in]))
    opts = UpOptions(log_dir=tmp_path / "logs", poll_interval=0.1, metrics_interval=0.2, restart_backoff=0.01,
                     grace_seconds=2, status_file=tmp_path / "status.json", **options)
    return LocalDeployment("fleet", spec, groups[0].plan, None, groups, opts, out=lines.append)


def run_in_thread(deployment: LocalDeployment) -> tuple[threading.Event, threading.Thread, list[int]]:
    stop, code = threading.Event(), []
    thread = threading.Thread(target=lambda: code.append(deployment.run(stop)), daemon=True)
    thread.start()
    return stop, thread, code


def wait_for(deployment: LocalDeployment, done, lines: list[str], seconds: float = 20) -> dict:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        status = deployment.status
        if status and done(status):
            return status
        time.sleep(0.05)
    pytest.fail(f"never reached the expected status; last: {deployment.status}\n" + "\n".join(lines))


def member_pid(status: dict, group: int) -> int:
    return int(status["groups"][group]["gang"]["members"]["0"].split("/")[0])


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def test_once_waits_for_every_group_and_asks_each_groups_rank_0(tmp_path):
    # Group 1 becomes healthy a second after group 0: --once must wait for it. Each group's
    # completion comes from its own rank 0; the fleet's acceptance is weighted by drafted tokens.
    lines: list[str] = []
    deployment = stand_in_fleet(tmp_path, [{"DRAFT": "30", "ACCEPTED": "24"},
                                           {"DRAFT": "10", "ACCEPTED": "2", "HEALTH_AFTER": "1"}],
                                lines, once=True, requests=1)
    code = deployment.run(threading.Event())
    out = "\n".join(lines)
    assert code == EXIT_OK, out
    ports = [group.plan.http_port for group in deployment.groups]
    assert ports[0] != ports[1]
    for g, port in enumerate(ports):
        assert f"group {g}: endpoint http://127.0.0.1:{port} (OpenAI API" in out
        assert f"group {g}: completion 'def main(' -> 'port {port}' (2 tokens)" in out
    status = deployment.status
    assert status["phase"] == "Running" and status["nodes"] == "2/2"
    assert (status["replicas"], status["readyReplicas"], status["ready"]) == (2, 2, "2/2")
    first, second = status["groups"]
    assert (first["index"], first["endpoint"], first["acceptanceRate"]) == (0, f"http://127.0.0.1:{ports[0]}", 0.8)
    assert (second["index"], second["endpoint"], second["acceptanceRate"]) == (1, f"http://127.0.0.1:{ports[1]}", 0.2)
    assert first["masterAddress"] != second["masterAddress"]
    assert status["speculative"]["acceptanceRate"] == pytest.approx(26 / 40)
    assert status["speculative"]["draftTokens"] == 40
    assert "groups 2/2" in out  # the status line of a fleet counts groups
    summaries = deployment.group_summaries()
    assert summaries[1].startswith(f"group 1: Running, 1 rank(s) ready, http://127.0.0.1:{ports[1]}, "
                                   "acceptance rate 0.200 over 10 drafted tokens")
    assert "stopped rank-0 (-15), g1-rank-0 (-15)" in out


def test_a_crash_restarts_only_its_own_group(tmp_path):
    lines: list[str] = []
    trigger = tmp_path / "crash-now"
    deployment = stand_in_fleet(tmp_path, [{}, {"CRASH_WHEN": str(trigger)}], lines, restart_budget=2)
    stop, thread, code = run_in_thread(deployment)
    try:
        status = wait_for(deployment, lambda s: s["readyReplicas"] == 2 and s["groups"][0]["gang"]["members"]
                          and s["groups"][1]["gang"]["members"], lines)
        before = [member_pid(status, 0), member_pid(status, 1)]
        trigger.touch()
        status = wait_for(deployment, lambda s: s["groups"][1]["restarts"] == 1 and s["readyReplicas"] == 2
                          and s["groups"][1]["gang"]["members"], lines)
        after = [member_pid(status, 0), member_pid(status, 1)]
        running = [run.processes.pids()[run.group.ranks[0].name] for run in deployment.runs]
        assert running == after and alive(before[0])  # group 0's rank is the one it started with
    finally:
        stop.set()
        thread.join(30)
    out = "\n".join(lines)
    assert code == [EXIT_OK], out
    assert after[0] == before[0]  # group 0 kept its rank
    assert after[1] != before[1] and not alive(before[1])
    assert status["groups"][0]["restarts"] == 0 and status["groups"][1]["gang"]["reason"] == "RankRestarted"
    assert "gang" not in status  # no group speaks for the fleet: each has its own record
    assert "group 1: g1-rank-0 exited with code 3" in out and "stand-in rank giving up" in out
    assert "group 1: restarting the whole group in 0s (1/2)" in out
    assert "group 0: rank-0 exited" not in out
    assert not any(alive(pid) for pid in after)
    assert "stand-in rank giving up" in (tmp_path / "logs" / "g1-rank-0.log").read_text()


def test_a_group_out_of_budget_stays_stopped_while_the_others_serve(tmp_path):
    lines: list[str] = []
    crashing = {"EXIT_AFTER": "0.2"}
    deployment = stand_in_fleet(tmp_path, [{}, crashing], lines, restart_budget=1)
    stop, thread, code = run_in_thread(deployment)
    try:
        status = wait_for(deployment, lambda s: s["groups"][1]["phase"] == "Failed", lines)
        time.sleep(0.5)  # a few more rounds: group 0 keeps serving, group 1 stays down
        status = deployment.status
        serving = member_pid(status, 0)
        assert alive(serving) and thread.is_alive()
    finally:
        stop.set()
        thread.join(30)
    out = "\n".join(lines)
    assert code == [EXIT_OK], out
    assert status["phase"] == "Failed" and status["readyReplicas"] == 1
    assert [g["phase"] for g in status["groups"]] == ["Running", "Failed"]
    assert status["groups"][1]["gang"]["reason"] == "GangRestartBudgetExhausted"
    assert status["gang"]["reason"] == "GangRestartBudgetExhausted"  # the worst group speaks for the fleet
    assert {c["type"]: c["reason"] for c in status["conditions"]}["Ready"] == "GangRestartBudgetExhausted"
    assert out.count("g1-rank-0 exited with code 3") == 2  # first start + 1 restart
    assert "group 1: whole-group restarts exhausted the budget (1 used); it stays stopped" in out
    # With --once every group must come up: one out of budget before it was ever Ready ends the run.
    lines.clear()
    never_ready = {**crashing, "HEALTH_AFTER": "30"}
    once = stand_in_fleet(tmp_path, [{}, never_ready], lines, restart_budget=0, once=True, timeout=30)
    assert once.run(threading.Event()) == EXIT_FAILED, "\n".join(lines)
    assert once.status["phase"] == "Failed" and once.status["groups"][0]["phase"] == "Running"


def test_replicas_zero_starts_no_rank_and_says_so(tmp_path):
    spec = fleet_spec(0)
    lines: list[str] = []
    plan = plan_local("fleet", spec, spec.ports.http, spec.ports.master)
    deployment = LocalDeployment("fleet", spec, plan, None, [], UpOptions(log_dir=tmp_path / "logs", once=True),
                                 out=lines.append)
    assert deployment.run(threading.Event()) == EXIT_OK
    status = deployment.status
    assert status["phase"] == "Pending" and (status["replicas"], status["readyReplicas"]) == (0, 0)
    assert status["groups"] == [] and status["nodes"] == "0/0" and status["endpoint"] == ""
    assert {c["type"]: c["reason"] for c in status["conditions"]}["Ready"] == "ScaledToZero"
    assert any("spec.replicas is 0: no group started" in line for line in lines)
    assert not (tmp_path / "logs").exists() or not list((tmp_path / "logs").glob("*rank-*.log"))
