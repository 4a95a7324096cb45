"""The local backend's control loop: export, start the group, observe, report.

    deployment = LocalDeployment(name, spec, plan, export, ranks, options)
    code = deployment.run(stop_event)

Each round observes the processes (alive, /health of every rank, /metrics of
rank 0 every metrics interval) into `Observations` and passes them to the
operator's `compute_status`, so phases, conditions and acceptance figures
mean exactly what they mean on a cluster. A rank that exits restarts the
whole group, within a budget, as the operator's gang restart does.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from mtp_operator.gang import REASON_BUDGET_EXHAUSTED, REASON_MEMBER_RESTARTED
from mtp_operator.local import report
from mtp_operator.local.client import smoke_requests
from mtp_operator.local.probe import probe_health, scrape_metrics
from mtp_operator.local.processes import LocalProcess, ProcessGroup, log_tail, rotate_log, terminate
from mtp_operator.metrics import (
    MetricsFormatError,
    SpecDecodeCounters,
    SpecDecodeStats,
    interval_stats,
    read_counters,
)
from mtp_operator.observations import ExportObservation, Observations, RankObservation
from mtp_operator.plan import DeploymentPlan
from mtp_operator.spec import MtpDeploymentSpec
from mtp_operator.status import compute_status, utc_now

EXIT_OK = 0
EXIT_FAILED = 1


@dataclass
class UpOptions:
    log_dir: Path
    once: bool = False  # exit 0 as soon as the group is Ready (after --requests)
    timeout: float | None = None  # seconds to reach Ready, else exit 1
    requests: int = 0  # smoke completions sent once Ready
    max_tokens: int = 32  # per smoke completion
    poll_interval: float = 1.0
    metrics_interval: float = 10.0
    restart_budget: int = 3
    restart_backoff: float = 2.0
    grace_seconds: float = 15.0
    status_file: Path | None = None
    generation: int = 1


@dataclass
class Scrape:
    """Rank 0's last counters, and the figures of the last interval that drafted tokens."""

    previous: SpecDecodeCounters | None = None
    last_time: float = 0.0
    stats: SpecDecodeStats | None = None
    stats_time: str | None = None


@dataclass
class LocalDeployment:
    name: str
    spec: MtpDeploymentSpec
    plan: DeploymentPlan
    export: LocalProcess | None
    ranks: list[LocalProcess]
    options: UpOptions
    out: Callable[[str], None] = print
    status: dict[str, Any] = field(default_factory=dict)
    gang: dict[str, Any] = field(default_factory=lambda: {"members": {}, "restarts": 0})

    def __post_init__(self) -> None:
        self.group = ProcessGroup(self.ranks, self.options.log_dir, self.options.restart_budget,
                                  self.options.restart_backoff, self.options.grace_seconds)
        self.scrape = Scrape()
        self._last_key: tuple | None = None
        self.export_summary = ""  # the export's last line: what it did
        self._last_acceptance: str | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.plan.http_port}"

    # ---- status

    def observations(self, export: ExportObservation | None, ranks: list[RankObservation]) -> Observations:
        return Observations(
            generation=self.options.generation, nnodes=self.plan.nnodes,
            draft_model_path=self.plan.draft_model_path, master_address=self.plan.master_address,
            endpoint=self.endpoint, template_hash=self.plan.template_hash, export=export, ranks=ranks,
            stats=self.scrape.stats, stats_time=self.scrape.stats_time, gang=dict(self.gang),
        )

    def update_status(self, obs: Observations) -> dict[str, Any]:
        self.status = compute_status(self.status, obs, min_acceptance_rate=self.spec.speculative.min_acceptance_rate)
        key = report.change_key(self.status)
        if key != self._last_key:
            self.out(report.status_line(self.status))
            self._last_key = key
        acceptance = report.acceptance_summary(self.status)
        if acceptance and acceptance != self._last_acceptance:
            self.out(f"           {acceptance}")
            self._last_acceptance = acceptance
        if self.options.status_file is not None:
            report.write_status_file(self.options.status_file, self.name, self.status)
        return self.status

    # ---- export step

    def export_observation(self, state: str, message: str = "") -> ExportObservation | None:
        if self.export is None:
            return None
        return ExportObservation(self.plan.export.job_name, state, message)  # type: ignore[union-attr]

    def run_export(self, stop: threading.Event) -> bool:
        """Run the export step to its end; `mtp export` itself skips an up-to-date draft."""
        if self.export is None:
            return True
        self.update_status(self.observations(self.export_observation("running"), []))
        self.options.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.options.log_dir / "export.log"
        rotate_log(log_path)
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(self.export.argv, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    env={**os.environ, **self.export.env})
        while proc.poll() is None:
            if stop.wait(0.2):
                terminate(proc, self.options.grace_seconds)
                return False
        tail = log_tail(log_path, 5)
        if proc.returncode != 0:
            message = f"exit code {proc.returncode}: {tail}"
            self.update_status(self.observations(self.export_observation("failed", message), []))
            return False
        if tail:
            self.export_summary = tail.splitlines()[-1]
            self.out(f"           export: {self.export_summary}")
        return True

    # ---- ranks

    def rank_observations(self) -> list[RankObservation]:
        observed = []
        pids = self.group.pids()
        for rank, member in enumerate(self.ranks):
            pid = pids.get(member.name)
            if pid is None:
                continue
            healthy, detail = None, ""
            if member.http_port is not None:
                probe = probe_health("127.0.0.1", member.http_port)
                healthy = probe.ok
                if not probe.ok:
                    detail = probe.error or str((probe.body or {}).get("state", probe.status_code))
            observed.append(RankObservation(rank=rank, uid=str(pid), restart_count=0,
                                            ready=healthy is not False, healthy=healthy, health_detail=detail))
        return observed

    def scrape_rank0(self, now: float, force: bool = False) -> None:
        """Counters of rank 0 every metrics interval; figures of intervals that drafted tokens."""
        if not force and now - self.scrape.last_time < self.options.metrics_interval:
            return
        port = self.plan.ranks[0].http_port
        text = scrape_metrics("127.0.0.1", port) if port is not None else None
        if text is None:
            return
        try:
            counters = read_counters(self.plan.engine, text, now)
        except MetricsFormatError as exc:
            self.out(f"           metrics: {exc}")
            return
        stats = interval_stats(self.scrape.previous, counters, self.spec.speculative.num_speculative_tokens)
        self.scrape.previous, self.scrape.last_time = counters, now
        # An idle interval has nothing to say about acceptance: keep the last figures.
        if stats.draft_tokens > 0:
            self.scrape.stats, self.scrape.stats_time = stats, utc_now()

    def record_members(self, ranks: list[RankObservation]) -> None:
        if not self.gang["members"] and len(ranks) == self.plan.nnodes and all(r.healthy is not False for r in ranks):
            self.gang["members"] = {str(r.rank): f"{r.uid}/{r.restart_count}" for r in ranks}

    def handle_exit(self, stop: threading.Event) -> bool:
        """A rank exited: restart the whole group if the budget allows; False when spent.

        Ctrl-C during the backoff (up to minutes after a few restarts) ends it
        at once: the group then stays stopped and `run` sees `stop` set.
        """
        crash = self.group.first_exit()
        if crash is None:
            return True
        self.out(f"           {crash.name} exited with code {crash.returncode}; last log lines:\n{crash.log_tail}")
        if not self.group.can_restart():
            self.gang = {**self.gang, "reason": REASON_BUDGET_EXHAUSTED}
            return False
        self.out(f"           restarting the whole group in {self.group.next_backoff():.0f}s "
                 f"({self.group.restarts + 1}/{self.group.restart_budget})")
        if not self.group.restart(sleep=stop.wait):
            return True
        self.gang = {"members": {}, "restarts": self.group.restarts, "lastRestartTime": utc_now(),
                     "reason": REASON_MEMBER_RESTARTED}
        return True

    # ---- the loop

    def send_smoke_requests(self) -> None:
        for done in smoke_requests(self.endpoint, self.options.requests, self.options.max_tokens):
            self.out(f"           completion {done.prompt!r} -> {done.text!r} ({done.completion_tokens} tokens)")
        self.scrape_rank0(time.monotonic(), force=True)

    def run(self, stop: threading.Event) -> int:
        started = time.monotonic()
        if not self.run_export(stop):
            return EXIT_OK if stop.is_set() and self.status.get("phase") != "Failed" else EXIT_FAILED
        export = self.export_observation("succeeded", self.export_summary)  # "... up to date" or "... exported"
        self.group.start()
        was_ready = False
        try:
            while True:
                if not self.handle_exit(stop):
                    self.update_status(self.observations(export, self.rank_observations()))
                    return EXIT_FAILED
                ranks = self.rank_observations()
                self.record_members(ranks)
                ready = self.status.get("phase") in ("Running", "Degraded")
                if ready:
                    self.scrape_rank0(time.monotonic())
                status = self.update_status(self.observations(export, ranks))
                ready = status["phase"] in ("Running", "Degraded")
                if ready and not was_ready:
                    self.out(f"           endpoint {self.endpoint} (OpenAI API: /v1/completions, "
                             "/v1/chat/completions; /health, /metrics)")
                    if self.options.requests:
                        try:
                            self.send_smoke_requests()
                        except (OSError, ValueError, KeyError) as exc:
                            self.out(f"           completion request to {self.endpoint} failed: {exc}")
                            return EXIT_FAILED
                        status = self.update_status(self.observations(export, self.rank_observations()))
                    if self.options.once:
                        return EXIT_OK
                was_ready = was_ready or ready
                timeout = self.options.timeout
                if not was_ready and timeout is not None and time.monotonic() - started > timeout:
                    self.out(f"           not Ready after {timeout:.0f}s; giving up")
                    return EXIT_FAILED
                if stop.wait(self.options.poll_interval):
                    return EXIT_OK
        finally:
            codes = self.group.stop()
            if codes:
                self.out(f"           stopped {', '.join(f'{n} ({c})' for n, c in sorted(codes.items()))}")
