"""Whole-group restart decisions."""

from __future__ import annotations

from mtp_operator.gang import REASON_BUDGET_EXHAUSTED, evaluate_gang
from mtp_operator.observations import RankObservation


def ranks(*members, ready=True):
    return [RankObservation(rank=i, uid=uid, restart_count=restarts, ready=ready)
            for i, (uid, restarts) in enumerate(members)]


def decide(record, observed, now=1000.0, budget=3, backoff=10.0, nnodes=2):
    return evaluate_gang(record, observed, nnodes=nnodes, now=now, budget=budget, backoff=backoff)


def test_first_complete_group_becomes_the_baseline():
    d = decide(None, ranks(("a", 0), ("b", 0)))
    assert not d.restart and d.record["members"] == {"0": "a/0", "1": "b/0"}


def test_incomplete_group_waits():
    d = decide({"members": {"0": "a/0", "1": "b/0"}, "restarts": 0}, ranks(("a", 0)))
    assert not d.restart and d.record["members"] == {"0": "a/0", "1": "b/0"}


def test_one_rank_restarting_restarts_the_group():
    base = decide(None, ranks(("a", 0), ("b", 0))).record
    d = decide(base, ranks(("a", 0), ("b", 1)))
    assert d.restart and d.record["restarts"] == 1 and d.record["members"] == {}
    assert "rank(s) 1 restarted" in d.message


def test_replaced_pod_restarts_the_group():
    base = decide(None, ranks(("a", 0), ("b", 0))).record
    assert decide(base, ranks(("a", 0), ("c", 0))).restart


def test_whole_group_replaced_together_is_a_new_baseline():
    base = decide(None, ranks(("a", 0), ("b", 0))).record
    d = decide(base, ranks(("x", 0), ("y", 0)))
    assert not d.restart and d.record["members"] == {"0": "x/0", "1": "y/0"}


def test_backoff_doubles_and_budget_is_enforced():
    record = decide(None, ranks(("a", 0), ("b", 0))).record
    record = decide(record, ranks(("a", 0), ("b", 1)), now=1000).record  # restart 1, immediate
    record = decide(record, ranks(("c", 0), ("d", 0)), now=1001).record  # new baseline
    early = decide(record, ranks(("c", 0), ("d", 1)), now=1005)  # backoff 10s after restart 1
    assert not early.restart and early.reason == "GangRestartBackoff"
    second = decide(record, ranks(("c", 0), ("d", 1)), now=1011)
    assert second.restart and second.record["restarts"] == 2
    record = decide(second.record, ranks(("e", 0), ("f", 0)), now=1012).record
    assert not decide(record, ranks(("e", 1), ("f", 0)), now=1025).restart  # 20s backoff now
    third = decide(record, ranks(("e", 1), ("f", 0)), now=1032)
    assert third.restart and third.record["restarts"] == 3
    record = decide(third.record, ranks(("g", 0), ("h", 0)), now=1033).record
    out = decide(record, ranks(("g", 2), ("h", 0)), now=5000)
    assert not out.restart and out.exhausted and out.reason == REASON_BUDGET_EXHAUSTED


def test_single_node_never_gang_restarts():
    base = decide(None, ranks(("a", 0)), nnodes=1).record
    d = decide(base, ranks(("a", 1)), nnodes=1)
    assert not d.restart and d.record["members"] == {"0": "a/1"}


def test_terminating_and_stale_pods_do_not_count():
    base = decide(None, ranks(("a", 0), ("b", 0))).record
    observed = [RankObservation(0, "a", 0, True), RankObservation(1, "b2", 0, True, terminating=True)]
    assert not decide(base, observed).restart
    observed = [RankObservation(0, "a", 0, True), RankObservation(1, "b2", 0, True, current=False)]
    assert not decide(base, observed).restart


def test_deleted_members_never_become_the_next_baseline():
    base = decide(None, ranks(("a", 0), ("b", 0))).record
    restarted = decide(base, ranks(("a", 0), ("b", 1)))
    assert restarted.restart and restarted.record["retired"] == ["a", "b"]
    lagging = decide(restarted.record, ranks(("a", 0), ("b", 1)))  # the watch still shows the old pods
    assert not lagging.restart and lagging.record["members"] == {}
    fresh = decide(lagging.record, ranks(("c", 0), ("d", 0)))
    assert fresh.record["members"] == {"0": "c/0", "1": "d/0"} and "retired" not in fresh.record
