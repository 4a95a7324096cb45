"""The local backend's control loop: export, start every group, observe, report.

    deployment = LocalDeployment(name, spec, plan, export, groups, options)
    code = deployment.run(stop_event)

spec.replicas groups run side by side, each its own processes (ports, master,
devices: see launch.py). Each round observes them (alive, /health of every
rank, /metrics of each group's rank 0 every metrics interval) into
`Observations` with one `GroupObservation` per group and passes them to the
operator's `compute_status`, so phases, conditions and acceptance figures mean
exactly what they mean on a cluster; `status.groups` has each group's own
figures, the top-level ones are the fleet's, weighted by drafted tokens. A
rank that exits restarts its own group only, within that group's budget, as
the operator's gang restart does.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from mtp_operator.local import report
from mtp_operator.local.client import smoke_requests
from mtp_operator.local.group import GroupRun
from mtp_operator.local.launch import LocalGroup
from mtp_operator.local.processes import LocalProcess, log_tail, rotate_log, terminate
from mtp_operator.metrics import combine_stats
from mtp_operator.observations import ExportObservation, GroupObservation, Observations, RankObservation
from mtp_operator.plan import DeploymentPlan
from mtp_operator.revisions import group_template, revision_hash
from mtp_operator.spec import MtpDeploymentSpec
from mtp_operator.status import compute_status

EXIT_OK = 0
EXIT_FAILED = 1


class Stop(Protocol):
    """What asks the loop to stop: a threading.Event, or mtp up's SignalStop (safe in a signal handler)."""

    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool: ...


@dataclass
class UpOptions:
    log_dir: Path
    once: bool = False  # exit 0 as soon as every group has been Ready (after --requests)
    timeout: float | None = None  # seconds for every group to reach Ready, else exit 1
    requests: int = 0  # smoke completions sent to each group's rank 0 once it is Ready
    max_tokens: int = 32  # per smoke completion
    poll_interval: float = 1.0
    metrics_interval: float = 10.0
    restart_budget: int = 3
    restart_backoff: float = 2.0
    grace_seconds: float = 15.0
    status_file: Path | None = None
    generation: int = 1


@dataclass
class LocalDeployment:
    name: str
    spec: MtpDeploymentSpec
    plan: DeploymentPlan  # the export step and the facts shared by every group (group 0's ports)
    export: LocalProcess | None
    groups: list[LocalGroup]  # spec.replicas of them; none with replicas: 0
    options: UpOptions
    out: Callable[[str], None] = print
    status: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        o = self.options
        self.runs = [GroupRun(group, o.log_dir, o.restart_budget, o.restart_backoff, o.grace_seconds)
                     for group in self.groups]
        self.revision = revision_hash(group_template(self.spec))
        self._last_key: tuple | None = None
        self.export_summary = ""  # the export's last line: what it did
        self._last_acceptance: str | None = None

    @property
    def fleet(self) -> bool:
        """Several groups (or none): lines say which group they are about."""
        return len(self.groups) != 1

    @property
    def endpoint(self) -> str:
        """Group 0's endpoint (there is no Service in front of the groups here); "" with no group."""
        return self.groups[0].endpoint if self.groups else ""

    def say(self, run: GroupRun, text: str) -> None:
        self.out(f"           group {run.index}: {text}" if self.fleet else f"           {text}")

    # ---- status

    def update_status(self, export: ExportObservation | None,
                      ranks: dict[int, list[RankObservation]] | None = None) -> dict[str, Any]:
        ranks = ranks or {}
        runs = self.runs
        fresh = [run.scrape_state.stats for run in runs if run.scrape_state.stats is not None]
        times = [run.scrape_state.stats_time for run in runs if run.scrape_state.stats_time]
        # The group in the worst whole-group-restart state speaks for the fleet (Failed when its budget is spent).
        worst = next((run.gang for run in runs if run.spent), None)
        obs = Observations(
            generation=self.options.generation, nnodes=self.plan.nnodes,
            draft_model_path=self.plan.draft_model_path,
            master_address=self.groups[0].plan.master_address if self.groups else "",
            endpoint=self.endpoint, template_hash=self.plan.template_hash, export=export,
            stats=combine_stats(fresh), stats_time=max(times) if times else None,
            groups=[GroupObservation(run.index, self.revision, run.nnodes, ranks.get(run.index, [])) for run in runs],
            gang=worst or (dict(runs[0].gang) if len(runs) == 1 else None),
        )
        old = {k: v for k, v in self.status.items() if k != "gang"}
        status = compute_status(old, obs, min_acceptance_rate=self.spec.speculative.min_acceptance_rate)
        entries = [run.entry(ranks.get(run.index, []), self.revision) for run in runs]
        ready_groups = sum(1 for entry in entries if entry["phase"] == "Running")
        status.update({
            "replicas": len(entries), "readyReplicas": ready_groups, "updatedReplicas": len(entries),
            "ready": f"{ready_groups}/{len(entries)}", "currentRevision": self.revision,
            "updateRevision": self.revision, "groups": entries,
        })
        self.status = status
        key = report.change_key(status)
        if key != self._last_key:
            self.out(report.status_line(status))
            self._last_key = key
        acceptance = report.acceptance_summary(status)
        if acceptance and acceptance != self._last_acceptance:
            self.out(f"           {acceptance}")
            self._last_acceptance = acceptance
        if self.options.status_file is not None:
            report.write_status_file(self.options.status_file, self.name, status)
        return status

    # ---- export step

    def export_observation(self, state: str, message: str = "") -> ExportObservation | None:
        if self.export is None:
            return None
        return ExportObservation(self.plan.export.job_name, state, message)  # type: ignore[union-attr]

    def run_export(self, stop: Stop) -> bool:
        """Run the export step to its end; `mtp export` itself skips an up-to-date draft."""
        if self.export is None:
            return True
        self.update_status(self.export_observation("running"))
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
            self.update_status(self.export_observation("failed", message))
            return False
        if tail:
            self.export_summary = tail.splitlines()[-1]
            self.out(f"           export: {self.export_summary}")
        return True

    # ---- groups

    def handle_exit(self, run: GroupRun, now: float) -> None:
        """A rank of `run` exited: its whole group restarts after its backoff, or stops for good when its
        budget is spent. The other groups are not touched."""
        crash = run.crashed()
        if crash is None:
            return
        self.say(run, f"{crash.name} exited with code {crash.returncode}; last log lines:\n{crash.log_tail}")
        if not run.can_restart():
            run.give_up()
            if len(self.runs) > 1:
                self.say(run, f"whole-group restarts exhausted the budget ({run.processes.restarts} used); "
                              "it stays stopped, the other groups keep serving")
            return
        budget = run.processes.restart_budget
        delay = run.begin_restart(now)
        self.say(run, f"restarting the whole group in {delay:.0f}s ({run.processes.restarts + 1}/{budget})")

    def scrape(self, run: GroupRun, force: bool = False) -> None:
        problem = run.scrape(time.monotonic(), self.options.metrics_interval, self.plan.engine,
                             self.spec.speculative.num_speculative_tokens, force=force)
        if problem:
            self.say(run, f"metrics: {problem}")

    def send_smoke_requests(self, run: GroupRun) -> None:
        for done in smoke_requests(run.endpoint, self.options.requests, self.options.max_tokens):
            self.say(run, f"completion {done.prompt!r} -> {done.text!r} ({done.completion_tokens} tokens)")
        self.scrape(run, force=True)

    def observe(self) -> dict[int, list[RankObservation]]:
        ranks = {run.index: run.observe() for run in self.runs}
        for run in self.runs:
            run.record(ranks[run.index])
        return ranks

    # ---- the loop

    def run(self, stop: Stop) -> int:
        started = time.monotonic()
        if not self.run_export(stop):
            return EXIT_OK if stop.is_set() and self.status.get("phase") != "Failed" else EXIT_FAILED
        export = self.export_observation("succeeded", self.export_summary)  # "... up to date" or "... exported"
        if not self.runs:
            self.update_status(export)
            self.out("           spec.replicas is 0: no group started, nothing serves (the export ran); "
                     "set spec.replicas to run groups")
            return EXIT_OK
        for run in self.runs:
            run.start()
        try:
            while True:
                now = time.monotonic()
                for run in self.runs:
                    if not run.spent:
                        self.handle_exit(run, now)
                        run.restart_if_due(now)
                was_ready = {run.index: run.ready for run in self.runs}
                ranks = self.observe()
                for run in self.runs:
                    if run.ready and was_ready[run.index]:
                        self.scrape(run)
                self.update_status(export, ranks)
                newly_ready = [run for run in self.runs if run.ready and not run.was_ready]
                for run in newly_ready:
                    self.say(run, f"endpoint {run.endpoint} (OpenAI API: /v1/completions, "
                                  "/v1/chat/completions; /health, /metrics)")
                    if self.options.requests:
                        try:
                            self.send_smoke_requests(run)
                        except (OSError, ValueError, KeyError) as exc:
                            self.say(run, f"completion request to {run.endpoint} failed: {exc}")
                            return EXIT_FAILED
                    run.was_ready = True
                if newly_ready and self.options.requests:
                    self.update_status(export, self.observe())
                spent = [run for run in self.runs if run.spent]
                if spent and (self.options.once or len(spent) == len(self.runs)):
                    return EXIT_FAILED
                waiting = [run for run in self.runs if not run.was_ready and not run.spent]
                if self.options.once and not waiting:
                    return EXIT_OK
                timeout = self.options.timeout
                if waiting and timeout is not None and time.monotonic() - started > timeout:
                    which = "" if not self.fleet else \
                        f" (group {', '.join(str(run.index) for run in waiting)})"
                    self.out(f"           not Ready after {timeout:.0f}s{which}; giving up")
                    return EXIT_FAILED
                due = [run.restart_at - time.monotonic() for run in self.runs if run.restart_at is not None]
                if stop.wait(max(0.0, min([self.options.poll_interval, *due]))):
                    return EXIT_OK
        finally:
            stopped = [f"{n} ({c})" for run in self.runs for n, c in sorted(run.stop().items())]
            if stopped:
                self.out(f"           stopped {', '.join(stopped)}")

    def group_summaries(self) -> list[str]:
        """One line per group: its phase, ranks, endpoint and own figures."""
        return [report.group_line(entry) for entry in self.status.get("groups", [])]
