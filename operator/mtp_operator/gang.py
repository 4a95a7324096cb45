"""Gang restart: a multi-node group cannot lose a single rank.

    decision = evaluate_gang(record, ranks, nnodes=..., now=..., budget=..., backoff=...)
    if decision.restart: delete every pod (or process) of the group, all at once
    status["gang"] = decision.record

`record` is the previous `status.gang` dict: `members` maps rank -> "uid/restarts"
of the group that last came up complete; `retired` lists the uids a restart
deleted, so a lagging view of them never becomes the next baseline. When some members changed (a container
restarted, a pod was replaced) while others kept running, the survivors hold
stale collective state, so the whole group restarts — after a backoff that
doubles with every restart, and at most `budget` times per spec generation;
then `exhausted` is set (the caller reports Failed, reason GangRestartBudgetExhausted).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone

from mtp_operator.observations import RankObservation

REASON_MEMBER_RESTARTED = "RankRestarted"
REASON_BUDGET_EXHAUSTED = "GangRestartBudgetExhausted"
REASON_BACKOFF = "GangRestartBackoff"


@dataclass(frozen=True)
class GangDecision:
    restart: bool
    record: dict
    reason: str = ""
    message: str = ""
    exhausted: bool = False


def _rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse(text: str | None) -> float | None:
    if not text:
        return None
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()


def _member(rank: RankObservation) -> str:
    return f"{rank.uid}/{rank.restart_count}"


def empty_record() -> dict:
    return {"members": {}, "restarts": 0}


def evaluate_gang(record: dict | None, ranks: list[RankObservation], *, nnodes: int, now: float,
                  budget: int, backoff: float) -> GangDecision:
    record = {**empty_record(), **(record or {})}
    retired = set(record.get("retired", []))  # pods we deleted; the watch may still list them
    live = {r.rank: r for r in ranks if not r.terminating and r.current and r.uid not in retired}
    if len(live) < nnodes or any(rank not in live for rank in range(nnodes)):
        return GangDecision(False, record)  # group incomplete: wait until every rank exists again
    current = {str(rank): _member(live[rank]) for rank in range(nnodes)}
    members = record["members"]
    changed = [rank for rank, member in current.items() if members.get(rank) != member]
    survivors = [rank for rank in current if rank not in changed]
    if not members or not changed or not survivors or nnodes == 1:
        # First complete group, nothing new, or the whole group was replaced together.
        return GangDecision(False, {**{k: v for k, v in record.items() if k != "retired"}, "members": current})
    message = f"rank(s) {', '.join(changed)} restarted or were replaced while {', '.join(survivors)} kept running"
    if record["restarts"] >= budget:
        return GangDecision(False, {**record, "reason": REASON_BUDGET_EXHAUSTED}, REASON_BUDGET_EXHAUSTED,
                            f"{message}; {record['restarts']} whole-group restarts used the budget of {budget}",
                            exhausted=True)
    last = _parse(record.get("lastRestartTime"))
    wait = backoff * (2 ** max(record["restarts"] - 1, 0)) if record["restarts"] else 0.0
    if last is not None and now < last + wait:
        return GangDecision(False, {**record, "reason": REASON_BACKOFF}, REASON_BACKOFF,
                            f"{message}; next group restart after {wait:.0f}s backoff")
    new_record = {"members": {}, "restarts": record["restarts"] + 1, "lastRestartTime": _rfc3339(now),
                  "reason": REASON_MEMBER_RESTARTED, "retired": sorted(r.uid for r in live.values())}
    return GangDecision(True, new_record, REASON_MEMBER_RESTARTED, f"{message}; restarting the whole group")
