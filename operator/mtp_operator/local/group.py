"""One running group of a local fleet: its processes, its gang record, its figures.

    run = GroupRun(LocalGroup(...), log_dir, restart_budget=3, restart_backoff=2.0, grace_seconds=15)
    run.start()
    crash = run.crashed()                  # a member exited: the whole group goes
    delay = run.begin_restart(now)          # stopped now, started by restart_if_due(now + delay)
    ranks = run.observe()                   # alive + /health of every rank
    run.scrape(now, interval)               # rank 0's /metrics, this group's own figures
    entry = run.entry(ranks)                # its item of status.groups

Each group restarts alone, within its own budget and with its own backoff, as
a group does on Kubernetes; the backoff is a deadline, not a sleep, so the
other groups are watched while one waits.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtp_operator.gang import REASON_BUDGET_EXHAUSTED, REASON_MEMBER_RESTARTED
from mtp_operator.local.launch import LOOPBACK, LocalGroup
from mtp_operator.local.probe import probe_health, scrape_metrics
from mtp_operator.local.processes import ProcessGroup, RankExit
from mtp_operator.metrics import MetricsFormatError, SpecDecodeCounters, SpecDecodeStats, interval_stats, read_counters
from mtp_operator.observations import RankObservation
from mtp_operator.status import group_ready_ranks, utc_now


@dataclass
class Scrape:
    """Rank 0's last counters, and the figures of the last interval that drafted tokens."""

    previous: SpecDecodeCounters | None = None
    last_time: float = 0.0
    stats: SpecDecodeStats | None = None
    stats_time: str | None = None


class GroupRun:
    def __init__(self, group: LocalGroup, log_dir: Path, restart_budget: int, restart_backoff: float,
                 grace_seconds: float):
        self.group = group
        self.processes = ProcessGroup(group.ranks, log_dir, restart_budget, restart_backoff, grace_seconds)
        self.scrape_state = Scrape()
        self.gang: dict[str, Any] = {"members": {}, "restarts": 0}
        self.restart_at: float | None = None  # in its backoff: started again at this monotonic time
        self.spent = False  # its restart budget is spent: stopped for good
        self.ready = False  # every rank ready and healthy at the last observation
        self.was_ready = False  # has been ready (and had its --requests) once

    @property
    def index(self) -> int:
        return self.group.index

    @property
    def endpoint(self) -> str:
        return self.group.endpoint

    @property
    def nnodes(self) -> int:
        return self.group.plan.nnodes

    def start(self) -> None:
        self.processes.start()

    def stop(self, grace_seconds: float | None = None) -> dict[str, int]:
        return self.processes.stop(grace_seconds)

    # ---- whole-group restarts

    def crashed(self) -> RankExit | None:
        """The member that exited, if any (ranks never exit on their own)."""
        return self.processes.first_exit()

    def can_restart(self) -> bool:
        return self.processes.can_restart()

    def begin_restart(self, now: float) -> float:
        """Stop every member at once; they start again when the backoff returned here is over."""
        delay = self.processes.begin_restart()
        self.restart_at = now + delay
        self.ready = False
        return delay

    def restart_if_due(self, now: float) -> bool:
        if self.restart_at is None or now < self.restart_at:
            return False
        self.restart_at = None
        self.processes.finish_restart()
        self.scrape_state.previous = None  # new processes count from zero
        self.gang = {"members": {}, "restarts": self.processes.restarts, "lastRestartTime": utc_now(),
                     "reason": REASON_MEMBER_RESTARTED}
        return True

    def give_up(self) -> None:
        """Budget spent: the rest of the group is stopped and stays stopped."""
        self.processes.stop(grace_seconds=0)
        self.spent, self.ready = True, False
        self.gang = {**self.gang, "reason": REASON_BUDGET_EXHAUSTED}

    # ---- observation

    def observe(self) -> list[RankObservation]:
        observed = []
        pids = self.processes.pids()
        for rank, member in enumerate(self.group.ranks):
            pid = pids.get(member.name)
            if pid is None:
                continue
            healthy, detail = None, ""
            if member.http_port is not None:
                probe = probe_health(LOOPBACK, member.http_port)
                healthy = probe.ok
                if not probe.ok:
                    detail = probe.error or str((probe.body or {}).get("state", probe.status_code))
            observed.append(RankObservation(rank=rank, uid=str(pid), restart_count=0,
                                            ready=healthy is not False, healthy=healthy, health_detail=detail))
        return observed

    def record(self, ranks: list[RankObservation]) -> bool:
        """Note who the members are once all are up; True when the group is ready."""
        ready_nodes, _ = group_ready_ranks(self.nnodes, ranks)
        self.ready = ready_nodes == self.nnodes and not self.spent and self.restart_at is None
        if self.ready and not self.gang["members"]:
            self.gang = {**self.gang, "members": {str(r.rank): f"{r.uid}/{r.restart_count}" for r in ranks}}
        return self.ready

    def scrape(self, now: float, interval: float, engine: str, num_speculative_tokens: int,
               force: bool = False) -> str | None:
        """Rank 0's counters every interval; figures of intervals that drafted tokens.

        Returns why the metrics could not be read, when they answered but made no sense.
        """
        if not force and now - self.scrape_state.last_time < interval:
            return None
        port = self.group.plan.ranks[0].http_port
        text = scrape_metrics(LOOPBACK, port) if port is not None else None
        if text is None:
            return None
        try:
            counters = read_counters(engine, text, now)
        except MetricsFormatError as exc:
            return str(exc)
        stats = interval_stats(self.scrape_state.previous, counters, num_speculative_tokens)
        self.scrape_state.previous, self.scrape_state.last_time = counters, now
        # An idle interval has nothing to say about acceptance: keep the last figures.
        if stats.draft_tokens > 0:
            self.scrape_state.stats, self.scrape_state.stats_time = stats, utc_now()
        return None

    # ---- status

    def phase(self) -> str:
        if self.spent:
            return "Failed"
        return "Running" if self.ready else "Starting"

    def entry(self, ranks: list[RankObservation], revision: str) -> dict[str, Any]:
        """This group's item of status.groups: the Kubernetes one's fields, plus where it listens."""
        ready_nodes, _ = group_ready_ranks(self.nnodes, ranks)
        plan = self.group.plan
        entry: dict[str, Any] = {
            "index": self.index, "revision": revision, "readyNodes": ready_nodes, "phase": self.phase(),
            "restarts": self.gang.get("restarts", 0), "templateHash": plan.template_hash, "gang": dict(self.gang),
            "endpoint": self.endpoint, "masterAddress": plan.master_address,
        }
        stats = self.scrape_state.stats
        if stats is not None:
            entry.update({k: v for k, v in (("acceptanceRate", stats.acceptance_rate),
                                             ("timePerOutputTokenSeconds", stats.time_per_output_token_seconds),
                                             ("draftTokens", int(stats.draft_tokens))) if v is not None})
        return entry
