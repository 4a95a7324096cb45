"""One level-based reconcile of an MtpDeployment on Kubernetes.

    outcome = reconcile(body, Cluster(kube, settings, jobs, pods, statefulsets), stats, now)
    patch.status.update(status_changes(body["status"], outcome.status)); post outcome.events

Flow: validate and plan -> export Job (create once; its name is derived from
the export settings, so a restarted operator finds it instead of making a
second one, and a finished Job of the same settings is reused; if that Job
was deleted, the new one's `mtp export` finds the output's mtp-export.json
up to date and exits at once) -> when the draft is ready, create/patch the Services and the
StatefulSet (only when what we want differs from what we last applied) ->
roll the whole group when the template hash changed -> gang restart when a
rank restarted alone -> probe /health -> compute status.
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
from mtp_operator.kube import KubeApi, selector
from mtp_operator.manifests import (build_client_service, build_export_job, build_headless_service,
                                    build_statefulset, server_selector)
from mtp_operator.metrics import SpecDecodeStats
from mtp_operator.observations import Observations
from mtp_operator.plan import client_service_name, kubernetes_master_host, plan_deployment
from mtp_operator.probes import probe_health
from mtp_operator.settings import OperatorSettings
from mtp_operator.spec import SpecError, parse_spec
from mtp_operator.status import compute_status

log = logging.getLogger(__name__)


@dataclass
class Cluster:
    """The operator's view of one MtpDeployment's children, plus the API to change them."""

    kube: KubeApi
    settings: OperatorSettings
    jobs: list[dict] = field(default_factory=list)
    pods: list[dict] = field(default_factory=list)
    statefulsets: list[dict] = field(default_factory=list)


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


def reconcile(body: Mapping[str, Any], cluster: Cluster, stats: tuple[SpecDecodeStats, str] | None,
              now: float) -> Outcome:
    meta = body["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    old_status = dict(body.get("status") or {})
    try:
        spec = parse_spec(body.get("spec"), settings=cluster.settings)  # with the rules the API server lacks
        plan = plan_deployment(name, namespace, spec, master_host=kubernetes_master_host(name, namespace),
                               settings=cluster.settings)
    except (SpecError, PlanError) as exc:
        return _failed(body, "InvalidSpec", str(exc))
    kube, settings = cluster.kube, cluster.settings
    events: list[tuple[str, str, str]] = []

    export = None
    if plan.export is not None:
        export = export_observation(plan.export.job_name, cluster.jobs, cluster.pods)
        if export.state == "absent" and kube.create_job(namespace, build_export_job(plan, spec, body, settings)):
            events.append(("Normal", "ExportStarted", f"created export job {plan.export.job_name}"))
    draft_ready = export is None or export.state == "succeeded"

    applied = old_status.get("appliedHash")
    server_pods = [p for p in cluster.pods if p.get("component") == c.COMPONENT_SERVER]
    if draft_ready:
        desired = [build_headless_service(plan, body), build_client_service(plan, spec, body),
                   build_statefulset(plan, spec, body, settings)]
        digest = _digest(desired)
        if digest != applied or not any(s["name"] == plan.name for s in cluster.statefulsets):
            for service in desired[:2]:
                kube.apply_service(namespace, service)
            kube.apply_statefulset(namespace, desired[2])
            applied = digest
        if any(p["templateHash"] != plan.template_hash and not p["terminating"] for p in server_pods):
            # OnDelete StatefulSet: delete the whole old group at once; never rank by rank.
            kube.delete_pods(namespace, selector(server_selector(plan), {c.LABEL_TEMPLATE_HASH: plan.template_hash}))
            events.append(("Normal", "GroupRolling", f"restarting all ranks on template {plan.template_hash}"))

    ranks = rank_observations(server_pods, plan.template_hash)
    record = old_status.get("gang") if old_status.get("templateHash") == plan.template_hash else empty_record()
    decision = evaluate_gang(record, ranks, nnodes=plan.nnodes, now=now,
                             budget=settings.gang_restart_budget, backoff=settings.gang_restart_backoff)
    if decision.restart:
        kube.delete_pods(namespace, selector(server_selector(plan)))
        events.append(("Warning", "GangRestart", decision.message))
    elif decision.exhausted and old_status.get("gang", {}).get("reason") != decision.reason:
        events.append(("Warning", decision.reason, decision.message))

    if settings.probe_pods and draft_ready and not decision.restart:
        ips = {p["rank"]: p["podIP"] for p in server_pods if p["templateHash"] == plan.template_hash}
        probed = []
        for rank in ranks:
            if rank.ready and rank.current and not rank.terminating and serves_http(plan.engine, rank.rank) \
                    and ips.get(rank.rank):
                result = probe_health(ips[rank.rank], plan.http_port, plan.health_path, settings.health_timeout)
                rank = replace(rank, healthy=result.healthy, health_detail=result.detail)
            probed.append(rank)
        ranks = probed

    observations = Observations(
        generation=meta.get("generation", 0), nnodes=plan.nnodes, draft_model_path=plan.draft_model_path,
        master_address=plan.master_address,
        endpoint=f"http://{client_service_name(name)}.{namespace}.svc:{plan.http_port}",
        template_hash=plan.template_hash, export=export, ranks=[] if decision.restart else ranks,
        stats=stats[0] if stats else None, stats_time=stats[1] if stats else None, gang=decision.record,
    )
    status = compute_status(old_status, observations, min_acceptance_rate=spec.speculative.min_acceptance_rate)
    if applied:
        status["appliedHash"] = applied
    return Outcome(status, events)


def phase_event(old_status: Mapping[str, Any] | None, status: Mapping[str, Any]) -> tuple[str, str, str] | None:
    """An Event for a phase change: (type, reason, message), or None."""
    old_phase = (old_status or {}).get("phase")
    phase = status.get("phase")
    if phase == old_phase:
        return None
    ready = next((cond for cond in status.get("conditions", []) if cond["type"] == c.CONDITION_READY), {})
    event_type = "Warning" if phase in ("Failed", "Degraded") else "Normal"
    return event_type, f"Phase{phase}", f"{old_phase or 'new'} -> {phase}: {ready.get('message', '')}"
