"""Observations -> the MtpDeployment status dict (pure; both backends call it).

    new_status = compute_status(old_status, observations, min_acceptance_rate=0.6, now="2026-...Z")

Phase: Failed (spec cannot run, export failed, gang budget exhausted) >
Exporting (draft not ready) > Starting (ranks not all ready/healthy) >
Degraded (running, but acceptance below spec.speculative.minAcceptanceRate or
a whole-group restart is pending) > Running.
Conditions keep their lastTransitionTime while their status is unchanged.
Speculative, throughput and latency figures keep their last values when this
call has no fresh scrape (`observations.stats is None`).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from mtp_operator import constants as c
from mtp_operator.metrics import SpecDecodeStats
from mtp_operator.observations import Observations


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _condition(old: dict[str, dict], ctype: str, status: bool, reason: str, message: str, now: str,
               generation: int) -> dict[str, Any]:
    text = "True" if status else "False"
    previous = old.get(ctype)
    changed = previous is None or previous.get("status") != text
    return {"type": ctype, "status": text, "reason": reason, "message": message,
            "lastTransitionTime": now if changed else previous.get("lastTransitionTime", now),
            "observedGeneration": generation}


def _draft(obs: Observations) -> tuple[bool, str, str, bool]:
    """(ready, reason, message, failed)."""
    if obs.failure and obs.export is None and not obs.draft_model_path:
        return False, obs.failure[0], obs.failure[1], False
    if obs.export is None:
        return True, "DraftProvided", f"using draft model {obs.draft_model_path}", False
    state = obs.export.state
    if state == "succeeded":
        # `mtp export` says "up to date" when it found the draft already written.
        did = "found {} up to date" if "up to date" in obs.export.message else "wrote {}"
        return True, "ExportSucceeded", f"export job {obs.export.name} {did.format(obs.draft_model_path)}", False
    if state == "failed":
        detail = obs.export.message.strip() or "no termination message; see the job's pod logs"
        return False, "ExportFailed", f"export job {obs.export.name} failed: {detail}", True
    if state == "running":
        return False, "Exporting", f"export job {obs.export.name} is running", False
    return False, "ExportPending", f"creating export job {obs.export.name}", False


def _ready_ranks(obs: Observations) -> tuple[int, list[str]]:
    waiting = []
    ready = 0
    by_rank = {r.rank: r for r in obs.ranks if not r.terminating}
    for rank in range(obs.nnodes):
        r = by_rank.get(rank)
        if r is None:
            waiting.append(f"rank {rank}: no pod")
        elif not r.current:
            waiting.append(f"rank {rank}: old template, rolling")
        elif not r.ready:
            waiting.append(f"rank {rank}: not ready")
        elif r.healthy is False:
            waiting.append(f"rank {rank}: /health {r.health_detail or 'failed'}")
        else:
            ready += 1
    return ready, waiting


def group_ready_ranks(nnodes: int, ranks: list) -> tuple[int, list[str]]:
    """(ready ranks, why the others are not) of one group."""
    return _ready_ranks(Observations(generation=0, nnodes=nnodes, draft_model_path="", master_address="",
                                     endpoint="", template_hash="", export=None, ranks=ranks))


def _fleet_ready(obs: Observations) -> tuple[int, list[str], bool]:
    """(ready ranks over every group, waiting messages, every group ready)."""
    total, waiting, all_ready = 0, [], bool(obs.groups)
    for group in obs.groups or []:
        ready, why = group_ready_ranks(group.nnodes, group.ranks)
        total += ready
        if ready < group.nnodes:
            all_ready = False
            waiting += [f"group {group.index} {text}" for text in why]
    return total, waiting, all_ready


def _figures(stats: SpecDecodeStats, stats_time: str | None) -> dict[str, Any]:
    def clean(values: dict[str, Any]) -> dict[str, Any]:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in values.items() if v is not None}

    return {
        "speculative": clean({"acceptanceRate": stats.acceptance_rate,
                              "meanAcceptedTokensPerStep": stats.mean_accepted_tokens_per_step,
                              "perPositionAcceptance": stats.per_position_acceptance,
                              "meanSpeculativeTokens": stats.mean_speculative_tokens,
                              "draftTokens": int(stats.draft_tokens), "observedTime": stats_time}),
        "throughput": clean({"generationTokensPerSecond": stats.generation_tokens_per_second,
                             "promptTokensPerSecond": stats.prompt_tokens_per_second,
                             "requestsRunning": stats.requests_running, "requestsWaiting": stats.requests_waiting,
                             "kvCacheUsageRatio": stats.kv_cache_usage_ratio}),
        "latency": clean({"timeToFirstTokenSeconds": stats.time_to_first_token_seconds,
                          "timePerOutputTokenSeconds": stats.time_per_output_token_seconds}),
    }


def compute_status(old: dict[str, Any] | None, obs: Observations, *, min_acceptance_rate: float | None,
                   now: str | None = None) -> dict[str, Any]:
    old = dict(old or {})
    now = now or utc_now()
    old_conditions = {cond["type"]: cond for cond in old.get("conditions", []) if "type" in cond}
    gen = obs.generation
    draft_ready, draft_reason, draft_message, export_failed = _draft(obs)
    if obs.groups is not None:
        ready_count, waiting, every_group = _fleet_ready(obs) if draft_ready else (0, [], False)
        total_nodes = sum(group.nnodes for group in obs.groups)
        group_ready = draft_ready and every_group and not obs.failure
    else:
        ready_count, waiting = _ready_ranks(obs) if draft_ready else (0, [])
        total_nodes = obs.nnodes
        group_ready = draft_ready and ready_count == obs.nnodes and not obs.failure

    figures = _figures(obs.stats, obs.stats_time) if obs.stats is not None else \
        {k: old[k] for k in ("speculative", "throughput", "latency") if k in old}
    acceptance = figures.get("speculative", {}).get("acceptanceRate")
    low_acceptance = (group_ready and min_acceptance_rate is not None and acceptance is not None
                      and acceptance < min_acceptance_rate)
    gang = obs.gang or old.get("gang")
    gang_reason = (gang or {}).get("reason")
    gang_exhausted = gang_reason == "GangRestartBudgetExhausted"

    failure = obs.failure
    if failure is None and export_failed:
        failure = (draft_reason, draft_message)
    if failure is None and gang_exhausted:
        failure = (gang_reason, f"whole-group restarts exhausted the budget ({gang.get('restarts')} used)")

    if failure:
        phase = "Failed"
        progressing = (False, failure[0], failure[1])
        ready = (False, failure[0], failure[1])
    elif not draft_ready:
        phase = "Exporting"
        progressing = (True, draft_reason, draft_message)
        ready = (False, "DraftNotReady", draft_message)
    elif obs.groups is not None and not obs.groups:
        phase = "Pending"
        progressing = (False, "ScaledToZero", "spec.replicas is 0: no group runs; the export and Services stay")
        ready = (False, "ScaledToZero", "spec.replicas is 0")
    elif not group_ready:
        phase = "Starting"
        message = f"{ready_count}/{total_nodes} ranks ready; " + "; ".join(waiting)
        progressing = (True, "RanksStarting", message)
        ready = (False, "RanksNotReady", message)
    else:
        phase = "Running"
        what = f"{len(obs.groups)} group(s) of {obs.nnodes} ranks" if obs.groups is not None else \
            f"{obs.nnodes} ranks"
        progressing = (False, "GroupReady", f"all {what} ready")
        ready = (True, "GroupReady", f"all {what} ready and healthy")

    if low_acceptance:
        degraded = (True, "LowAcceptance",
                    f"acceptance rate {acceptance:.3f} is below minAcceptanceRate {min_acceptance_rate}")
    elif gang_reason in ("GangRestartBackoff",) or (phase == "Failed" and gang_exhausted):
        degraded = (True, gang_reason, "whole-group restarts are failing to bring the group up")
    else:
        degraded = (False, "AsExpected", "")
    if phase == "Running" and degraded[0]:
        phase = "Degraded"

    conditions = [
        _condition(old_conditions, c.CONDITION_DRAFT_READY, draft_ready, draft_reason, draft_message, now, gen),
        _condition(old_conditions, c.CONDITION_READY, *ready, now, gen),
        _condition(old_conditions, c.CONDITION_PROGRESSING, *progressing, now, gen),
        _condition(old_conditions, c.CONDITION_DEGRADED, *degraded, now, gen),
    ] + foreign_conditions(old)
    status: dict[str, Any] = {
        "phase": phase, "observedGeneration": gen, "conditions": conditions,
        "readyNodes": ready_count, "nnodes": obs.nnodes, "nodes": f"{ready_count}/{total_nodes}",
        "masterAddress": obs.master_address, "endpoint": obs.endpoint, "draftModelPath": obs.draft_model_path,
        "templateHash": obs.template_hash, **figures,
    }
    if obs.export is not None:
        status["exportJob"] = obs.export.name
    if gang:
        status["gang"] = gang
    return status


OWN_CONDITIONS = (c.CONDITION_DRAFT_READY, c.CONDITION_READY, c.CONDITION_PROGRESSING, c.CONDITION_DEGRADED)


def foreign_conditions(status: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Conditions other writers keep in our status (a policy engine, an admin): never ours to drop."""
    return [cond for cond in (status or {}).get("conditions", []) if cond.get("type") not in OWN_CONDITIONS]


def with_conditions_of(status: dict[str, Any], observed: dict[str, Any] | None) -> dict[str, Any]:
    """`status` with its foreign conditions replaced by those of `observed` (the object as last read)."""
    own = [cond for cond in status.get("conditions", []) if cond.get("type") in OWN_CONDITIONS]
    return {**status, "conditions": own + foreign_conditions(observed)}


class StatusUpdate:
    """Our whole status as a kopf patch transformation (`patch.fns`), applied to the newest copy of the
    object kopf has: every field ours, other writers' conditions kept exactly as that copy has them.

    Used whenever our conditions change. A merge patch replaces a list whole, so merge-patching
    `conditions` from the copy a handler was given would put back another writer's older conditions
    if it wrote in between. kopf sends this transformation as one JSON patch led by a test of that
    copy's resourceVersion: all of it is written or, if the object changed since, none of it, and kopf
    applies it again to the next copy it sees."""

    def __init__(self, status: dict[str, Any]):
        self.status = status

    def __call__(self, body: dict[str, Any]) -> None:
        current = body.get("status") or {}
        new = {key: value for key, value in current.items() if key in STATUS_KEPT}
        new.update(self.status)
        own = [cond for cond in self.status.get("conditions", []) if cond.get("type") in OWN_CONDITIONS]
        new["conditions"] = own + foreign_conditions(current)
        body["status"] = new

    def __repr__(self) -> str:
        return f"StatusUpdate(phase={self.status.get('phase')!r})"


STATUS_KEPT = ("kopf",)  # status keys that are not ours: never deleted by our writes


def _merge_diff(old: dict[str, Any], new: dict[str, Any], keep: tuple[str, ...] = ()) -> dict[str, Any]:
    patch: dict[str, Any] = {}
    for key, value in new.items():
        before = old.get(key)
        if before == value:
            continue
        if isinstance(before, dict) and isinstance(value, dict):
            patch[key] = _merge_diff(before, value)  # a key the new dict lacks must be deleted too
        else:
            patch[key] = value
    patch.update({k: None for k in old if k not in new and k not in keep})
    return patch


def status_changes(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """A merge patch turning `old` into `new` (None deletes, at any depth: a merge patch keeps the keys
    of a nested object it does not mention); empty when nothing changed."""
    return _merge_diff(old or {}, new, keep=STATUS_KEPT)
