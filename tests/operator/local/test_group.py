"""GroupRun: one group of a local fleet, its restart deadline, its budget and its status entry
(real child processes with no HTTP, so readiness is being alive)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import yaml

from mtp_operator.local.group import GroupRun
from mtp_operator.local.launch import LocalGroup, plan_local
from mtp_operator.local.processes import LocalProcess
from mtp_operator.spec import parse_spec

SAMPLE = Path(__file__).resolve().parents[3] / "crds" / "samples" / "tiny-cpu.yaml"


def one_rank_group(index: int, code: str) -> LocalGroup:
    plan = plan_local("fleet", parse_spec(yaml.safe_load(SAMPLE.read_text())["spec"]), 18700 + index, 18790 + index,
                      group=index)
    return LocalGroup(index, plan, [LocalProcess(f"g{index}-rank-0", [sys.executable, "-c", code])])


def wait_crash(run: GroupRun):
    end = time.monotonic() + 10
    while (crash := run.crashed()) is None:
        assert time.monotonic() < end, "the rank never exited"
        time.sleep(0.02)
    return crash


def test_restart_waits_for_its_deadline_and_records_the_restart(tmp_path):
    run = GroupRun(one_rank_group(1, "import sys; sys.exit(4)"), tmp_path, restart_budget=1, restart_backoff=5,
                   grace_seconds=1)
    run.start()
    try:
        assert wait_crash(run).returncode == 4
        assert run.begin_restart(now=100.0) == 5 and run.restart_at == 105.0
        assert run.observe() == [] and not run.record([])
        assert not run.restart_if_due(104.9) and run.processes.restarts == 0
        assert run.restart_if_due(105.0) and run.restart_at is None
        assert run.gang["restarts"] == 1 and run.gang["reason"] == "RankRestarted" and run.gang["members"] == {}
        assert wait_crash(run).returncode == 4 and not run.can_restart()
        run.give_up()
        entry = run.entry(run.observe(), "rev1")
        assert run.spent and entry["phase"] == "Failed" and entry["readyNodes"] == 0
        assert entry["gang"]["reason"] == "GangRestartBudgetExhausted" and entry["restarts"] == 1
    finally:
        run.stop(grace_seconds=0)


def test_a_live_group_records_its_members_and_reports_where_it_listens(tmp_path):
    run = GroupRun(one_rank_group(2, "import time; time.sleep(60)"), tmp_path, restart_budget=1,
                   restart_backoff=1, grace_seconds=1)
    run.start()
    try:
        ranks = run.observe()
        assert run.record(ranks) and run.ready
        pid = run.processes.pids()["g2-rank-0"]
        entry = run.entry(ranks, "rev1")
        assert entry == {"index": 2, "revision": "rev1", "readyNodes": 1, "phase": "Running", "restarts": 0,
                         "templateHash": run.group.plan.template_hash,
                         "gang": {"members": {"0": f"{pid}/0"}, "restarts": 0},
                         "endpoint": "http://127.0.0.1:18702", "masterAddress": "127.0.0.1:18792"}
    finally:
        run.stop(grace_seconds=0)
