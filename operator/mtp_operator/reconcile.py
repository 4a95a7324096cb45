"""One level-based reconcile of an MtpDeployment (a fleet of groups) on Kubernetes.

    outcome = reconcile(body, Cluster(kube, settings, jobs, pods, statefulsets, revisions), stats, now,
                        group_stats=..., counters=...)
    the status changes into kopf's patch (handlers.py; a StatusUpdate
    transformation when conditions change); post outcome.events

Flow: validate -> the group template's revision (a ControllerRevision, created once) -> export Job
of the newest revision (create once; its name is derived from the export settings, so a restarted
operator finds it instead of making a second one) -> when its draft is ready, the rollout decision
(mtp_operator.rollout, pure) says which revision each of the `replicas` groups runs -> each group's
StatefulSet is built from the template of its revision, and applied only when what we want
differs from what we last applied; groups beyond the decision are deleted -> per group: roll the
whole group when its template hash changed, gang restart when one of its ranks restarted alone
(mtp_operator.gang; budget and backoff per group) -> probe /health -> status.

Group 0 keeps the one-group names (StatefulSet `<name>`, selector without the group label), so an
MtpDeployment made before fleets keeps its pods across the operator upgrade.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from mtp_operator import constants as c
from mtp_operator.engines import PlanError, serves_http
from mtp_operator.gang import empty_record, evaluate_gang
from mtp_operator.indexing import export_observation, rank_observations
from mtp_operator.kube import KubeApi
from mtp_operator.manifests import (build_client_service, build_export_job, build_headless_service,
                                    build_statefulset, group_pods_selector)
from mtp_operator.metrics import SpecDecodeStats
from mtp_operator.observations import GroupObservation, Observations, RankObservation
from mtp_operator.plan import (DeploymentPlan, client_service_name, kubernetes_master_host, plan_deployment,
                               statefulset_name)
from mtp_operator.probes import probe_health
from mtp_operator.revisions import (build_controller_revision, group_template, revision_hash, revision_name,
                                    stale_revisions)
from mtp_operator.rollout import Counters, Figures, GroupView, RolloutPolicy, decide_rollout
from mtp_operator.settings import OperatorSettings
from mtp_operator.spec import MtpDeploymentSpec, SpecError, parse_spec
from mtp_operator.status import compute_status, group_ready_ranks, utc_now

log = logging.getLogger(__name__)


@dataclass
class Cluster:
    """The operator's view of one MtpDeployment's children, plus the API to change them."""

    kube: KubeApi
    settings: OperatorSettings
    jobs: list[dict] = field(default_factory=list)
    pods: list[dict] = field(default_factory=list)
    statefulsets: list[dict] = field(default_factory=list)
    revisions: list[dict] = field(default_factory=list)  # ControllerRevision summaries (indexing.py)


@dataclass
class Outcome:
    status: dict[str, Any]
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)


def _digest(objects: list[dict]) -> str:
    return hashlib.sha256(json.dumps(objects, sort_keys=True).encode()).hexdigest()[:16]


def _failed(body: Mapping[str, Any], reason: str, message: str) -> Outcome:
    nnodes = (body.get("spec") or {}).get("nnodes")
    obs = Observations(generation=body["metadata"].get("generation", 0),
                       nnodes=nnodes if isinstance(nnodes, int) else 0, draft_model_path="", master_address="",
                       endpoint="", template_hash="", export=None, failure=(reason, message))
    return Outcome(compute_status(body.get("status"), obs, min_acceptance_rate=None))


def rank0_selector(name: str) -> str:
    """The scale subresource's selector: every group's rank 0 (the pods that serve the API)."""
    labels = {**c.selector_labels(name), c.LABEL_COMPONENT: c.COMPONENT_SERVER, c.LABEL_POD_INDEX: "0"}
    return ",".join(f"{k}={v}" for k, v in labels.items())


def _baseline(status: Mapping[str, Any]) -> Figures | None:
    """The fleet's last figures: what a rollout compares a lone canary with."""
    speculative, latency = status.get("speculative") or {}, status.get("latency") or {}
    if speculative.get("acceptanceRate") is None and latency.get("timePerOutputTokenSeconds") is None:
        return None
    return Figures(float(speculative.get("draftTokens") or 0), speculative.get("acceptanceRate"),
                   latency.get("timePerOutputTokenSeconds"))


class _Revisions:
    """Revision hash -> parsed spec (from the ControllerRevisions), with per-group plans."""

    def __init__(self, name: str, namespace: str, settings: OperatorSettings, summaries: list[dict]):
        self.name, self.namespace, self.settings = name, namespace, settings
        self.summaries = {r["hash"]: r for r in summaries if r.get("hash")}
        self.specs: dict[str, MtpDeploymentSpec] = {}

    def add(self, rev: str, spec: MtpDeploymentSpec, summary: dict) -> None:
        self.specs[rev] = spec
        self.summaries[rev] = summary

    def spec(self, rev: str) -> MtpDeploymentSpec | None:
        if rev not in self.specs:
            summary = self.summaries.get(rev)
            if summary is None or summary.get("spec") is None:
                return None
            try:
                self.specs[rev] = parse_spec(summary["spec"], settings=self.settings)
            except SpecError as exc:  # an older revision this operator no longer accepts
                log.warning("%s/%s: revision %s no longer validates: %s", self.namespace, self.name, rev, exc)
                return None
        return self.specs[rev]

    def plan(self, rev: str, group: int) -> DeploymentPlan | None:
        spec = self.spec(rev)
        if spec is None:
            return None
        return plan_deployment(self.name, self.namespace, spec, settings=self.settings,
                               master_host=kubernetes_master_host(self.name, self.namespace, group))


def reconcile(body: Mapping[str, Any], cluster: Cluster, stats: tuple[SpecDecodeStats, str] | None,
              now: float, group_stats: Mapping[int, SpecDecodeStats] | None = None,
              counters: Mapping[int, Counters] | None = None) -> Outcome:
    meta = body["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    old_status = dict(body.get("status") or {})
    kube, settings = cluster.kube, cluster.settings
    try:
        spec = parse_spec(body.get("spec"), settings=settings)
        plan = plan_deployment(name, namespace, spec, master_host=kubernetes_master_host(name, namespace),
                               settings=settings)
    except (SpecError, PlanError) as exc:
        return _failed(body, "InvalidSpec", str(exc))
    events: list[tuple[str, str, str]] = []

    # The group template's revision: a ControllerRevision holds it for every later rollback.
    template = group_template(spec)
    update = revision_hash(template)
    revisions = _Revisions(name, namespace, settings, cluster.revisions)
    if update not in revisions.summaries:
        number = max([r.get("revision", 0) for r in cluster.revisions] + [0]) + 1
        kube.create_controller_revision(namespace, build_controller_revision(body, update, template, number))
        revisions.add(update, spec, {"name": revision_name(name, update), "hash": update, "revision": number,
                                     "spec": template})
    else:
        revisions.specs[update] = spec

    export = None
    if plan.export is not None:
        export = export_observation(plan.export.job_name, cluster.jobs, cluster.pods)
        if export.state == "absent" and kube.create_job(namespace, build_export_job(plan, spec, body, settings)):
            events.append(("Normal", "ExportStarted", f"created export job {plan.export.job_name}"))
    draft_ready = export is None or export.state == "succeeded"

    server_pods = [p for p in cluster.pods if p.get("component") == c.COMPONENT_SERVER]
    sets = {s["group"]: s for s in cluster.statefulsets if s.get("group") is not None}
    old_groups = {g.get("index"): g for g in old_status.get("groups", [])}
    # New, or made before fleets (no currentRevision): the group(s) run the spec as it is now.
    current = old_status.get("currentRevision") or update
    group_revision = {g: (s.get("revision") or old_groups.get(g, {}).get("revision") or current)
                      for g, s in sets.items()}

    def observe(group: int, rev: str | None) -> tuple[DeploymentPlan | None, list[RankObservation]]:
        group_plan = revisions.plan(rev, group) if rev else None
        pods = [p for p in server_pods if p.get("group") == group]
        ranks = rank_observations(pods, group_plan.template_hash if group_plan else "")
        if settings.probe_pods and group_plan is not None:
            ips = {p["rank"]: p["podIP"] for p in pods if p["templateHash"] == group_plan.template_hash}
            probed = []
            for rank in ranks:
                if rank.ready and rank.current and not rank.terminating and serves_http(group_plan.engine, rank.rank) \
                        and ips.get(rank.rank):
                    result = probe_health(ips[rank.rank], group_plan.http_port, group_plan.health_path,
                                          settings.health_timeout)
                    rank = replace(rank, healthy=result.healthy, health_detail=result.detail)
                probed.append(rank)
            ranks = probed
        return group_plan, ranks

    observed = {g: observe(g, rev) for g, rev in group_revision.items()}
    views = []
    for g, (group_plan, ranks) in observed.items():
        ready_count, _ = group_ready_ranks(group_plan.nnodes if group_plan else 0, ranks)
        ready = group_plan is not None and ready_count == group_plan.nnodes
        views.append(GroupView(g, group_revision[g], ready, (counters or {}).get(g)))

    # A new revision waits for its draft: until the export finished, nothing rolls to it.
    target_update = update if draft_ready else current
    decision = decide_rollout(views, replicas=spec.replicas, policy=RolloutPolicy.from_spec(spec.rollout),
                              current=current, update=target_update, state=old_status.get("rollout"),
                              baseline=_baseline(old_status), now=now)
    events += decision.events

    applied = old_status.get("appliedHash")  # the Services as last applied; each group's in groups[]
    applied_groups: dict[int, str] = {}
    group_plans: dict[int, tuple[str, DeploymentPlan, MtpDeploymentSpec]] = {}
    if draft_ready or sets:
        services = [build_headless_service(plan, body), build_client_service(plan, spec, body)]
        missing = any(g not in sets for g in decision.targets)
        if _digest(services) != applied or missing:
            for service in services:
                kube.apply_service(namespace, service)
            applied = _digest(services)
        for g, rev in sorted(decision.targets.items()):
            group_plan, group_spec = revisions.plan(rev, g), revisions.spec(rev)
            if group_plan is None or group_spec is None:
                events.append(("Warning", "RevisionMissing", f"group {g}: revision {rev} is gone; keeping it as is"))
                continue
            group_plans[g] = (rev, group_plan, group_spec)
            statefulset = build_statefulset(group_plan, group_spec, body, settings, group=g, revision=rev)
            # Only the groups whose StatefulSet changed: a rollout step touches the groups it moves.
            applied_groups[g] = _digest([statefulset])
            if applied_groups[g] != old_groups.get(g, {}).get("appliedHash") or g not in sets:
                kube.apply_statefulset(namespace, statefulset)
        for g, s in sets.items():
            if g not in decision.targets:
                kube.delete_statefulset(namespace, s["name"])
                events.append(("Normal", "GroupRemoved", f"group {g} ({s['name']}) removed"))

    # Per group: a roll when its template changed, a gang restart when a rank restarted alone.
    group_entries, group_observations = [], []
    other_groups = sorted(set(sets) | set(group_plans))
    restarting: set[int] = set()
    for g in sorted(group_plans):
        rev, group_plan, _ = group_plans[g]
        pods = [p for p in server_pods if p.get("group") == g]
        if any(p["templateHash"] != group_plan.template_hash and not p["terminating"] for p in pods):
            # OnDelete StatefulSet: delete the whole old group at once; never rank by rank.
            kube.delete_pods(namespace, group_pods_selector(group_plan, g, other_groups,
                                                            {c.LABEL_TEMPLATE_HASH: group_plan.template_hash}))
            events.append(("Normal", "GroupRolling", f"group {g}: restarting all ranks on revision {rev} "
                           f"(template {group_plan.template_hash})"))
        seen_plan, ranks = observed.get(g, (None, []))
        if seen_plan is None or seen_plan.template_hash != group_plan.template_hash:
            ranks = rank_observations(pods, group_plan.template_hash)  # moving to another revision now
        old_entry = old_groups.get(g, {})
        legacy = g == 0 and not old_groups and old_status.get("templateHash") == group_plan.template_hash
        record = (old_entry.get("gang") if old_entry.get("templateHash") == group_plan.template_hash
                  else (old_status.get("gang") if legacy else None)) or empty_record()
        gang = evaluate_gang(record, ranks, nnodes=group_plan.nnodes, now=now,
                             budget=settings.gang_restart_budget, backoff=settings.gang_restart_backoff)
        if gang.restart:
            kube.delete_pods(namespace, group_pods_selector(group_plan, g, other_groups))
            events.append(("Warning", "GangRestart", f"group {g}: {gang.message}"))
            restarting.add(g)
        elif gang.exhausted and (old_entry.get("gang") or {}).get("reason") != gang.reason:
            events.append(("Warning", gang.reason, f"group {g}: {gang.message}"))
        ranks = [] if gang.restart else ranks
        ready_nodes, _ = group_ready_ranks(group_plan.nnodes, ranks)
        figures = (group_stats or {}).get(g)
        phase = "Running" if ready_nodes == group_plan.nnodes else ("Updating" if sets.get(g, {}).get("revision")
                                                                     not in (None, rev) else "Starting")
        entry = {"index": g, "revision": rev, "statefulSet": statefulset_name(name, g),
                 "readyNodes": ready_nodes, "phase": phase, "restarts": gang.record.get("restarts", 0),
                 "templateHash": group_plan.template_hash, "appliedHash": applied_groups[g], "gang": gang.record}
        if figures is not None:
            entry.update({k: v for k, v in (("acceptanceRate", figures.acceptance_rate),
                                             ("timePerOutputTokenSeconds", figures.time_per_output_token_seconds),
                                             ("draftTokens", int(figures.draft_tokens))) if v is not None})
        else:
            entry.update({k: old_entry[k] for k in ("acceptanceRate", "timePerOutputTokenSeconds", "draftTokens")
                          if k in old_entry and old_entry.get("revision") == rev})
        group_entries.append(entry)
        group_observations.append(GroupObservation(g, rev, group_plan.nnodes, ranks))

    # The group in the worst whole-group-restart state speaks for the fleet (Failed when its budget is spent).
    worst = next((e["gang"] for reason in ("GangRestartBudgetExhausted", "GangRestartBackoff")
                  for e in group_entries if (e.get("gang") or {}).get("reason") == reason), None)
    observations = Observations(
        generation=meta.get("generation", 0), nnodes=plan.nnodes, draft_model_path=plan.draft_model_path,
        master_address=plan.master_address,
        endpoint=f"http://{client_service_name(name)}.{namespace}.svc:{plan.http_port}",
        template_hash=plan.template_hash, export=export, stats=stats[0] if stats else None,
        stats_time=stats[1] if stats else None, groups=group_observations, gang=worst,
    )
    status = compute_status({k: v for k, v in old_status.items() if k != "gang"}, observations,
                            min_acceptance_rate=spec.speculative.min_acceptance_rate)
    status.pop("gang", None)  # per group now (status.groups[].gang)
    ready_groups = sum(1 for e in group_entries if e["phase"] == "Running")
    status.update({
        "replicas": len(group_entries), "readyReplicas": ready_groups,
        "updatedReplicas": sum(1 for e in group_entries if e["revision"] == update),
        "ready": f"{ready_groups}/{spec.replicas}", "selector": rank0_selector(name),
        "currentRevision": decision.current, "updateRevision": update, "groups": group_entries,
    })
    if decision.state:
        status["rollout"] = decision.state
    _serving_while_changing(status, ready_groups, spec, rolling=decision.current != update or not draft_ready)
    if status["phase"] not in ("Failed", "Exporting") and (decision.progressing[0] or
                                                           decision.progressing[1] == "CanaryFailed"):
        for cond in status["conditions"]:
            if cond["type"] == c.CONDITION_PROGRESSING:
                changed = cond["status"] != str(decision.progressing[0])
                cond.update({"status": str(decision.progressing[0]), "reason": decision.progressing[1],
                             "message": decision.progressing[2]})
                if changed:
                    cond["lastTransitionTime"] = utc_now()
    if applied:
        status["appliedHash"] = applied
    in_use = {update, decision.current} | set(decision.targets.values()) | set(group_revision.values())
    for stale in stale_revisions(cluster.revisions, in_use, settings.revision_history):
        kube.delete_controller_revision(namespace, stale)
    return Outcome(status, events)


def _serving_while_changing(status: dict[str, Any], ready_groups: int, spec: MtpDeploymentSpec,
                            rolling: bool) -> None:
    """While a new revision exports or rolls out, the fleet is up as long as enough groups serve
    (replicas - maxUnavailable, at least one): Ready stays True (`kubectl wait`, GitOps health) and
    Progressing says what is changing."""
    needed = max(1, spec.replicas - spec.rollout.max_unavailable)
    if not rolling or status["phase"] not in ("Exporting", "Starting") or ready_groups < needed:
        return
    status["phase"] = "Running"
    for cond in status["conditions"]:
        if cond["type"] == c.CONDITION_READY:
            if cond["status"] != "True":
                cond["lastTransitionTime"] = utc_now()
            cond.update({"status": "True", "reason": "GroupsServing",
                         "message": f"{ready_groups}/{spec.replicas} groups ready while a new revision "
                                    f"{'exports' if status.get('updateRevision') == status.get('currentRevision') else 'rolls out'}"})


def phase_event(old_status: Mapping[str, Any] | None, status: Mapping[str, Any]) -> tuple[str, str, str] | None:
    """An Event for a phase change: (type, reason, message), or None."""
    old_phase = (old_status or {}).get("phase")
    phase = status.get("phase")
    if phase == old_phase:
        return None
    ready = next((cond for cond in status.get("conditions", []) if cond["type"] == c.CONDITION_READY), {})
    event_type = "Warning" if phase in ("Failed", "Degraded") else "Normal"
    return event_type, f"Phase{phase}", f"{old_phase or 'new'} -> {phase}: {ready.get('message', '')}"
