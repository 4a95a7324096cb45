"""Fleet rollouts: which revision each group runs, decided from observations alone (pure, like gang.py).

    decision = decide_rollout(groups, replicas=..., policy=spec.rollout, current=..., update=...,
                              state=status.get("rollout"), baseline=..., now=...)
    decision.targets        {group index: revision}; a group not in it is removed
    decision.state          the next status.rollout (persisted: an operator restart resumes from it)
    decision.current        the revision the fleet is on once this step is taken
    decision.events         [(type, reason, message)]
    decision.progressing    (status, reason, message) for the Progressing condition

A template change (a new `update` revision) updates whole groups, never ranks:
1. Canary: `canary.groups` groups take the new revision — in place (the highest indices), or as extra
   surge groups (indices >= replicas) when `maxSurge > 0`.
2. Analysis: once every canary group is Ready, their rank-0 counters are compared with the groups
   still on the old revision over the same window (with no old group left serving, with the old
   revision's figures recorded in `baseline` before the change), for at least `analysisSeconds` and
   until the canaries drafted `minDraftTokens`: acceptance ratio new/old >= `minAcceptanceRatio` and
   time-per-output-token ratio new/old <= `maxTpotRatio`.
3. Pass: the other groups follow, as many at a time as keeps `replicas - maxUnavailable` groups Ready
   (surge groups count); then surge groups go and `current` becomes `update`.
   Fail: the canaries go back to `current`, state phase Failed (reason CanaryFailed, both
   revisions' figures in the message), and nothing more is rolled until the spec changes again.
Scaling is not a rollout: new groups get `current` (or `update` once the canary passed), groups
above `replicas` are removed. `paused` freezes every group where it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

REASON_CANARY = "CanaryProgressing"
REASON_ANALYSIS = "CanaryAnalysis"
REASON_ROLLING = "RollingGroups"
REASON_FAILED = "CanaryFailed"
REASON_PAUSED = "RolloutPaused"
REASON_COMPLETE = "RolloutComplete"


@dataclass(frozen=True)
class Counters:
    """Rank 0's cumulative counters of one group, with the pod they came from (a new pod starts at 0)."""

    uid: str
    draft: float = 0.0
    accepted: float = 0.0
    tpot_sum: float = 0.0
    tpot_count: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"uid": self.uid, "draft": self.draft, "accepted": self.accepted, "tpotSum": self.tpot_sum,
                "tpotCount": self.tpot_count}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Counters":
        return cls(str(data.get("uid", "")), float(data.get("draft", 0)), float(data.get("accepted", 0)),
                   float(data.get("tpotSum", 0)), float(data.get("tpotCount", 0)))

    def since(self, start: "Counters | None") -> "Counters":
        if start is None or start.uid != self.uid or any(
                before > now for before, now in ((start.draft, self.draft), (start.accepted, self.accepted),
                                                 (start.tpot_sum, self.tpot_sum), (start.tpot_count, self.tpot_count))):
            return self  # another pod, or counters that went back (a restart): all they count is in the window
        return Counters(self.uid, self.draft - start.draft, self.accepted - start.accepted,
                        self.tpot_sum - start.tpot_sum, self.tpot_count - start.tpot_count)


@dataclass(frozen=True)
class GroupView:
    index: int
    revision: str | None  # what its StatefulSet runs; None: no StatefulSet yet
    ready: bool  # every rank ready (and healthy) on that revision
    counters: Counters | None = None


@dataclass(frozen=True)
class Figures:
    draft_tokens: float
    acceptance_rate: float | None
    time_per_output_token: float | None

    def text(self) -> str:
        acc = "n/a" if self.acceptance_rate is None else f"{self.acceptance_rate:.3f}"
        tpot = "n/a" if self.time_per_output_token is None else f"{self.time_per_output_token * 1000:.1f} ms"
        return f"acceptance {acc}, TPOT {tpot} over {self.draft_tokens:.0f} drafted tokens"


def window_figures(windows: list[Counters]) -> Figures:
    draft = sum(w.draft for w in windows)
    accepted = sum(w.accepted for w in windows)
    tpot_sum, tpot_count = sum(w.tpot_sum for w in windows), sum(w.tpot_count for w in windows)
    return Figures(draft, accepted / draft if draft > 0 else None, tpot_sum / tpot_count if tpot_count > 0 else None)


@dataclass(frozen=True)
class RolloutPolicy:
    max_unavailable: int = 1
    max_surge: int = 0
    paused: bool = False
    canary_groups: int = 1
    analysis_seconds: float = 60.0
    min_acceptance_ratio: float = 0.9
    max_tpot_ratio: float = 1.2
    min_draft_tokens: float = 100.0

    @classmethod
    def from_spec(cls, rollout: Any) -> "RolloutPolicy":
        canary = rollout.canary
        return cls(rollout.max_unavailable, rollout.max_surge, rollout.paused, canary.groups,
                   float(canary.analysis_seconds), canary.min_acceptance_ratio, canary.max_tpot_ratio,
                   float(canary.min_draft_tokens))


@dataclass
class RolloutDecision:
    targets: dict[int, str]
    state: dict[str, Any]
    current: str
    progressing: tuple[bool, str, str]
    events: list[tuple[str, str, str]] = field(default_factory=list)


def _steady(groups: dict[int, GroupView], replicas: int, current: str, state: dict[str, Any],
            events: list) -> RolloutDecision:
    targets = {i: current for i in range(replicas)}
    waiting = [i for i in targets if not (i in groups and groups[i].revision == current and groups[i].ready)]
    progressing = (True, "GroupsStarting", f"waiting for group(s) {_list(waiting)}") if waiting else \
        (False, "GroupsReady", f"all {replicas} group(s) ready on revision {current}")
    return RolloutDecision(targets, state, current, progressing, events)


def _list(indices) -> str:
    return ", ".join(str(i) for i in sorted(indices)) or "none"


def _choose_canaries(groups: dict[int, GroupView], replicas: int, policy: RolloutPolicy, current: str) -> list[int]:
    if policy.max_surge > 0:
        return list(range(replicas, replicas + min(policy.canary_groups, policy.max_surge)))
    count = min(policy.canary_groups, replicas)
    # Prefer groups already off the current revision (a rollout replaced mid-way), then the highest.
    order = sorted(range(replicas), key=lambda i: (groups.get(i) is None or groups[i].revision == current, -i))
    return sorted(order[:count])


def _judge(canary: Figures, old: Figures, policy: RolloutPolicy) -> tuple[bool, str]:
    reasons = []
    if canary.acceptance_rate is not None and old.acceptance_rate:
        ratio = canary.acceptance_rate / old.acceptance_rate
        if ratio < policy.min_acceptance_ratio:
            reasons.append(f"acceptance ratio {ratio:.3f} < minAcceptanceRatio {policy.min_acceptance_ratio}")
    # No canary drafts: no evidence either way (minDraftTokens is what asks for evidence).
    if canary.time_per_output_token is not None and old.time_per_output_token:
        ratio = canary.time_per_output_token / old.time_per_output_token
        if ratio > policy.max_tpot_ratio:
            reasons.append(f"TPOT ratio {ratio:.3f} > maxTpotRatio {policy.max_tpot_ratio}")
    return not reasons, "; ".join(reasons)


def decide_rollout(groups: list[GroupView], *, replicas: int, policy: RolloutPolicy, current: str | None,
                   update: str, state: Mapping[str, Any] | None, baseline: Figures | None,
                   now: float) -> RolloutDecision:
    by_index = {g.index: g for g in groups}
    state = dict(state or {})
    events: list[tuple[str, str, str]] = []
    if current is None or current == update:
        # Nothing to roll (a new resource, or the spec went back to the serving revision): every group on
        # `current`; a group still on another revision is moved back at once.
        kept = {k: v for k, v in state.items() if k == "lastResult"}
        return _steady(by_index, replicas, update, kept, events)

    if state.get("revision") != update:
        canaries = _choose_canaries(by_index, replicas, policy, current)
        state = {"revision": update, "phase": "Canary", "canaryGroups": canaries, "startTime": now,
                 **({"baseline": {"draftTokens": baseline.draft_tokens, "acceptanceRate": baseline.acceptance_rate,
                                  "timePerOutputTokenSeconds": baseline.time_per_output_token}}
                    if baseline is not None else {})}
        events.append(("Normal", "RolloutStarted", f"revision {update} replaces {current}: canary group(s) "
                       f"{_list(canaries)}"))
        if not canaries:  # no group runs: nothing to judge
            return _complete(by_index, replicas, update, state, events, "no group to update")

    phase = state["phase"]
    canaries = [int(i) for i in state.get("canaryGroups", [])]
    if phase == "Failed":
        message = state.get("message", "the canary failed")
        return RolloutDecision({i: current for i in range(replicas)}, state, current,
                               (False, REASON_FAILED, message), events)

    def group_on(index: int, revision: str) -> bool:
        g = by_index.get(index)
        return g is not None and g.revision == revision and g.ready

    if policy.paused:
        targets = {i: (by_index[i].revision if i in by_index and by_index[i].revision else current)
                   for i in sorted(set(range(replicas)) | {i for i in canaries if i in by_index})}
        return RolloutDecision(targets, state, current, (True, REASON_PAUSED, f"rollout of {update} is paused "
                               f"({phase})"), events)

    if phase in ("Canary", "Analyzing"):
        targets = {i: current for i in range(replicas)}
        targets.update({i: update for i in canaries})
        if not all(group_on(i, update) for i in canaries):
            state = {k: v for k, v in state.items() if k not in ("analysisStart", "startCounters")}
            state["phase"] = "Canary"
            return RolloutDecision(targets, state, current, (True, REASON_CANARY, f"canary group(s) "
                                   f"{_list(canaries)} starting on revision {update}"), events)
        old_groups = [i for i in range(replicas) if i not in canaries and group_on(i, current)]
        if phase == "Canary":
            state["phase"], state["analysisStart"] = "Analyzing", now
            state["startCounters"] = {str(i): by_index[i].counters.to_dict() for i in canaries + old_groups
                                      if by_index[i].counters is not None}
        starts = {int(k): Counters.from_dict(v) for k, v in state.get("startCounters", {}).items()}

        def figures(indices: list[int]) -> Figures:
            return window_figures([by_index[i].counters.since(starts.get(i)) for i in indices
                                   if by_index[i].counters is not None])

        canary_figures = figures(canaries)
        old_figures = figures([i for i in old_groups if i in starts])
        compare_with = "old groups"
        if not [i for i in old_groups if i in starts]:
            recorded = state.get("baseline") or {}
            old_figures = Figures(recorded.get("draftTokens") or 0.0, recorded.get("acceptanceRate"),
                                  recorded.get("timePerOutputTokenSeconds"))
            compare_with = "the old revision's recorded figures"
        elapsed = now - float(state["analysisStart"])
        if elapsed < policy.analysis_seconds or canary_figures.draft_tokens < policy.min_draft_tokens:
            return RolloutDecision(targets, state, current, (True, REASON_ANALYSIS, f"canary {update}: "
                                   f"{canary_figures.text()}; {compare_with} ({current}): {old_figures.text()}; "
                                   f"{elapsed:.0f}/{policy.analysis_seconds:.0f}s, needs "
                                   f"{policy.min_draft_tokens:.0f} drafted tokens"), events)
        passed, why = _judge(canary_figures, old_figures, policy)
        comparison = (f"canary revision {update}: {canary_figures.text()}; revision {current} ({compare_with}): "
                      f"{old_figures.text()}")
        if not passed:
            message = f"{comparison}: {why}; canary group(s) {_list(canaries)} rolled back to {current}"
            state = {"revision": update, "phase": "Failed", "canaryGroups": canaries, "message": message,
                     "lastResult": message}
            events.append(("Warning", REASON_FAILED, message))
            return RolloutDecision({i: current for i in range(replicas)}, state, current,
                                   (False, REASON_FAILED, message), events)
        state = {**{k: v for k, v in state.items() if k not in ("startCounters",)}, "phase": "Rolling",
                 "lastResult": f"{comparison}: passed"}
        events.append(("Normal", "CanaryPassed", f"{comparison}: passed"))
        phase = "Rolling"

    # Rolling: the remaining groups follow, as many at a time as availability allows.
    extra = [i for i in canaries if i >= replicas]  # surge groups keep serving until the end
    targets = {i: (update if (i in by_index and by_index[i].revision == update) or i in canaries else current)
               for i in range(replicas)}
    targets.update({i: update for i in extra})
    ready = sum(1 for i in targets if group_on(i, targets[i]))
    budget = ready - (replicas - policy.max_unavailable)
    for i in range(replicas):
        if budget <= 0:
            break
        if targets[i] != update:
            targets[i] = update  # one fewer group ready while it updates
            budget -= 1
    if all(group_on(i, update) for i in range(replicas)):
        return _complete(by_index, replicas, update, state, events, f"all {replicas} group(s) on {update}")
    pending = [i for i in range(replicas) if not group_on(i, update)]
    return RolloutDecision(targets, state, current, (True, REASON_ROLLING, f"revision {update}: group(s) "
                           f"{_list(pending)} still to update ({policy.max_unavailable} at a time)"), events)


def _complete(groups: dict[int, GroupView], replicas: int, update: str, state: dict[str, Any], events: list,
              why: str) -> RolloutDecision:
    events.append(("Normal", REASON_COMPLETE, f"revision {update} rolled out: {why}"))
    kept = {"lastResult": state.get("lastResult", why)}
    decision = _steady(groups, replicas, update, kept, events)
    return decision
