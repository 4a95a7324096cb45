"""Rollout decisions (mtp_operator.rollout), pure: no cluster, no operator."""

from __future__ import annotations

import json

import pytest

from mtp_operator.rollout import Counters, Figures, GroupView, RolloutPolicy, decide_rollout

OLD, NEW, NEWER = "old1234567", "new1234567", "newer12345"


class Fleet:
    """Groups that take the revision they are told on the next step and are Ready one step later;
    rank 0 of each drafts `rate` tokens a step at its revision's acceptance and TPOT."""

    def __init__(self, replicas: int, revision: str = OLD, acceptance=None, tpot=None, rate: float = 100.0):
        self.revision = {i: revision for i in range(replicas)}
        self.ready = {i: True for i in range(replicas)}
        self.counters = {i: Counters(f"pod-{i}-{revision}") for i in range(replicas)}
        self.acceptance = acceptance or {OLD: 0.85, NEW: 0.84, NEWER: 0.8}
        self.tpot = tpot or {OLD: 0.010, NEW: 0.010, NEWER: 0.010}
        self.rate = rate
        self.state: dict | None = None
        self.current = revision
        self.history: list[dict[int, str]] = []

    def views(self) -> list[GroupView]:
        return [GroupView(i, self.revision[i], self.ready[i], self.counters[i]) for i in sorted(self.revision)]

    def step(self, update: str, policy: RolloutPolicy, replicas: int, now: float, baseline=None,
             persist: bool = True):
        decision = decide_rollout(self.views(), replicas=replicas, policy=policy, current=self.current,
                                  update=update, state=self.state, baseline=baseline, now=now)
        # The state goes through status (JSON), as it would across an operator restart.
        self.state = json.loads(json.dumps(decision.state)) if persist else decision.state
        self.current = decision.current
        for i in list(self.revision):
            if i not in decision.targets:
                del self.revision[i], self.ready[i], self.counters[i]
        for i, rev in decision.targets.items():
            if self.revision.get(i) != rev:  # replaced: not ready until the next step, a new rank-0 pod
                self.revision[i], self.ready[i], self.counters[i] = rev, False, Counters(f"pod-{i}-{rev}")
            else:
                self.ready[i] = True
                c = self.counters[i]
                self.counters[i] = Counters(c.uid, c.draft + self.rate, c.accepted + self.rate * self.acceptance[rev],
                                            c.tpot_sum + self.tpot[rev] * self.rate, c.tpot_count + self.rate)
        self.history.append(dict(decision.targets))
        return decision


def policy(**kw) -> RolloutPolicy:
    values = dict(max_unavailable=1, max_surge=0, canary_groups=1, analysis_seconds=10, min_acceptance_ratio=0.9,
                  max_tpot_ratio=1.2, min_draft_tokens=200)
    values.update(kw)
    return RolloutPolicy(**values)


def run(fleet: Fleet, update: str, pol: RolloutPolicy, replicas: int, steps: int = 40, start: float = 0.0,
        dt: float = 5.0, baseline=None):
    decisions = []
    for n in range(steps):
        decisions.append(fleet.step(update, pol, replicas, start + n * dt, baseline))
        if fleet.current == update and all(fleet.revision[i] == update and fleet.ready[i] for i in range(replicas)):
            break
    return decisions


def updating(history: list[dict[int, str]], before: dict[int, str]) -> list[set[int]]:
    """Per step: which groups were newly moved to another revision."""
    moves, last = [], before
    for targets in history:
        moves.append({i for i, rev in targets.items() if last.get(i) != rev})
        last = targets
    return moves


def test_no_change_and_scaling_are_not_rollouts():
    fleet = Fleet(2)
    decision = fleet.step(OLD, policy(), 2, 0.0)
    assert decision.targets == {0: OLD, 1: OLD} and not decision.progressing[0] and decision.events == []
    decision = fleet.step(OLD, policy(), 4, 5.0)  # scale up: new groups on the current revision at once
    assert decision.targets == {0: OLD, 1: OLD, 2: OLD, 3: OLD} and fleet.state == {}
    assert decision.progressing[:2] == (True, "GroupsStarting")
    decision = fleet.step(OLD, policy(), 1, 10.0)  # scale down: the highest groups go
    assert decision.targets == {0: OLD}


def test_new_resource_takes_its_revision_at_once():
    decision = decide_rollout([], replicas=3, policy=policy(), current=None, update=NEW, state=None, baseline=None,
                              now=0.0)
    assert decision.targets == {0: NEW, 1: NEW, 2: NEW} and decision.current == NEW


@pytest.mark.parametrize("max_unavailable", [1, 2])
def test_canary_first_then_the_rest_max_unavailable_at_a_time(max_unavailable):
    fleet = Fleet(4)
    decisions = run(fleet, NEW, policy(max_unavailable=max_unavailable), 4)
    assert fleet.current == NEW and all(rev == NEW for rev in fleet.revision.values())
    moves = [m for m in updating(fleet.history, {i: OLD for i in range(4)}) if m]
    assert moves[0] == {3}, "the canary is the highest group, alone"
    assert all(len(m) <= max_unavailable for m in moves[1:]) and max(len(m) for m in moves[1:]) == max_unavailable
    reasons = [d.progressing[1] for d in decisions]
    assert reasons.index("CanaryAnalysis") < reasons.index("RollingGroups") and reasons[-1] == "GroupsReady"
    assert any(e[1] == "CanaryPassed" for d in decisions for e in d.events)
    assert any(e[1] == "RolloutComplete" for d in decisions for e in d.events)
    # Never more than maxUnavailable groups down.
    for targets in fleet.history:
        assert len(targets) == 4


def test_surge_canary_adds_a_group_and_keeps_capacity():
    fleet = Fleet(3)
    pol = policy(max_unavailable=0, max_surge=1)
    first = fleet.step(NEW, pol, 3, 0.0)
    assert first.targets == {0: OLD, 1: OLD, 2: OLD, 3: NEW}, "the canary is an extra group"
    run(fleet, NEW, pol, 3, start=5.0)
    assert fleet.current == NEW and sorted(fleet.revision) == [0, 1, 2], "the surge group goes at the end"
    for targets in fleet.history[:-1]:
        old_ready = len(targets)
        assert old_ready >= 3


def test_canary_fails_on_acceptance_and_rolls_back():
    fleet = Fleet(4, acceptance={OLD: 0.85, NEW: 0.30})
    decisions = run(fleet, NEW, policy(), 4, steps=12)
    failed = next(d for d in decisions if d.progressing[1] == "CanaryFailed")
    assert not failed.progressing[0] and "acceptance 0.300" in failed.progressing[2]
    assert "acceptance 0.850" in failed.progressing[2] and "acceptance ratio 0.353" in failed.progressing[2]
    assert ("Warning", "CanaryFailed") == next((e[0], e[1]) for e in failed.events if e[1] == "CanaryFailed")
    assert fleet.current == OLD and set(fleet.revision.values()) == {OLD}, "the canary went back"
    # Nothing more is rolled until the spec changes again.
    for n in range(5):
        later = fleet.step(NEW, policy(), 4, 1000.0 + n)
        assert set(later.targets.values()) == {OLD} and later.events == []
    # A new spec starts a new rollout; going back to the serving revision clears the failure.
    assert fleet.step(NEWER, policy(), 4, 2000.0).state["phase"] == "Canary"
    back = fleet.step(OLD, policy(), 4, 2005.0)
    assert back.targets == {i: OLD for i in range(4)} and "phase" not in back.state


def test_canary_fails_on_tpot():
    fleet = Fleet(2, tpot={OLD: 0.010, NEW: 0.015})
    decisions = run(fleet, NEW, policy(), 2, steps=12)
    failed = next(d for d in decisions if d.progressing[1] == "CanaryFailed")
    assert "TPOT ratio 1.500 > maxTpotRatio 1.2" in failed.progressing[2]
    assert fleet.current == OLD


def test_canary_passes_at_084_against_085():
    fleet = Fleet(4, acceptance={OLD: 0.85, NEW: 0.84})
    run(fleet, NEW, policy(), 4)
    assert fleet.current == NEW


def test_not_enough_draft_tokens_waits():
    fleet = Fleet(2, rate=1.0)  # 1 drafted token a step: the canary never has the evidence
    decisions = run(fleet, NEW, policy(min_draft_tokens=500), 2, steps=20)
    assert decisions[-1].progressing[1] == "CanaryAnalysis" and "needs 500 drafted tokens" in decisions[-1].progressing[2]
    assert fleet.current == OLD and fleet.revision[1] == NEW and fleet.revision[0] == OLD


def test_analysis_lasts_at_least_analysis_seconds():
    fleet = Fleet(2, rate=10_000.0)
    decisions = run(fleet, NEW, policy(analysis_seconds=60), 2, dt=5.0)
    analysing = [d for d in decisions if d.progressing[1] == "CanaryAnalysis"]
    assert len(analysing) >= 60 / 5


def test_single_group_is_judged_against_the_recorded_baseline():
    fleet = Fleet(1, acceptance={OLD: 0.85, NEW: 0.30})
    baseline = Figures(500.0, 0.85, 0.010)
    decisions = run(fleet, NEW, policy(), 1, steps=12, baseline=baseline)
    failed = next(d for d in decisions if d.progressing[1] == "CanaryFailed")
    assert "recorded figures" in failed.progressing[2] and fleet.revision[0] == OLD


def test_paused_freezes_every_group():
    fleet = Fleet(4)
    fleet.step(NEW, policy(), 4, 0.0)  # the canary moved
    snapshot = dict(fleet.revision)
    for n in range(5):
        decision = fleet.step(NEW, policy(paused=True), 4, 5.0 + n)
        assert decision.progressing[1] == "RolloutPaused" and dict(fleet.revision) == snapshot
    run(fleet, NEW, policy(), 4, start=100.0)
    assert fleet.current == NEW


def test_operator_restart_mid_rollout_resumes_where_it_was():
    """Two operators: one dies mid-rollout; the other starts from the persisted status alone."""
    fleet = Fleet(4)
    for n in range(6):
        fleet.step(NEW, policy(), 4, n * 5.0)
    mid = json.loads(json.dumps(fleet.state))
    assert mid["phase"] in ("Analyzing", "Rolling")
    twin = Fleet(4)
    twin.revision, twin.ready, twin.counters = dict(fleet.revision), dict(fleet.ready), dict(fleet.counters)
    twin.state, twin.current = mid, fleet.current
    a = fleet.step(NEW, policy(), 4, 30.0)
    b = twin.step(NEW, policy(), 4, 30.0)
    assert a.targets == b.targets and a.state == b.state and a.progressing == b.progressing
    run(twin, NEW, policy(), 4, start=35.0)
    assert twin.current == NEW


def test_spec_changed_again_mid_rollout_restarts_with_the_newest():
    fleet = Fleet(4)
    fleet.step(NEW, policy(), 4, 0.0)
    fleet.step(NEW, policy(), 4, 5.0)
    assert fleet.revision[3] == NEW
    decision = fleet.step(NEWER, policy(), 4, 10.0)
    assert decision.state["revision"] == NEWER and decision.state["canaryGroups"] == [3], \
        "the group already off the current revision is the new canary"
    assert set(decision.targets.values()) == {OLD, NEWER} and decision.targets[3] == NEWER
    run(fleet, NEWER, policy(), 4, start=15.0)
    assert fleet.current == NEWER and set(fleet.revision.values()) == {NEWER}


def test_canary_restarting_resets_the_analysis():
    fleet = Fleet(2)
    for n in range(3):
        fleet.step(NEW, policy(), 2, n * 5.0)
    assert fleet.state["phase"] == "Analyzing"
    fleet.ready[1] = False  # the canary group went down (a gang restart)
    decision = fleet.step(NEW, policy(), 2, 15.0)
    assert decision.state["phase"] == "Canary" and "analysisStart" not in decision.state


def test_counters_that_went_back_start_the_window_afresh():
    start = Counters("pod/0", draft=1400, accepted=1190, tpot_sum=14, tpot_count=1400)
    assert Counters("pod/0", 1600, 1250, 16, 1600).since(start) == Counters("pod/0", 200, 60, 2, 200)
    reset = Counters("pod/0", 1600, 480, 16, 1600)  # accepted went back: another life of the server
    assert reset.since(start) == reset
    assert Counters("pod/1", 10, 9, 0.1, 10).since(start) == Counters("pod/1", 10, 9, 0.1, 10)
