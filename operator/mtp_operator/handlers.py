"""kopf wiring: startup settings, indices of children, and thin handlers.

    registry = build_registry(OperatorSettings.from_env())
    await kopf.operator(registry=registry, namespaces=[...], standalone=True)

Handlers only gather state (kopf indices, the per-object memo) and call
`reconcile.reconcile`; kopf applies the status patch itself (status
subresource). The same reconcile runs on create, on spec update, on operator
resume and on a timer (level-based: Job finished, pods ready, a rank
restarted). A second timer scrapes rank 0's metrics every
MTP_OPERATOR_METRICS_INTERVAL seconds.

What the operator writes on an MtpDeployment: `status` (via the status
subresource), kopf's bookkeeping annotations under kopf.mtp.inference.dev/,
and kopf's finalizer (timers need one, so they stop before the object goes).
It never writes `spec`.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import kopf

from mtp_operator import constants as c
from mtp_operator.indexing import job_summary, owner_key, pod_summary, statefulset_summary
from mtp_operator.kube import KubeApi, load_api_client, load_configuration
from mtp_operator.metrics import MetricsFormatError, interval_stats, read_counters
from mtp_operator.plan import kubernetes_master_host, plan_deployment
from mtp_operator.probes import fetch_metrics
from mtp_operator.reconcile import Cluster, phase_event, reconcile
from mtp_operator.settings import OperatorSettings
from mtp_operator.spec import SpecError, parse_spec
from mtp_operator.status import status_changes, utc_now, with_conditions_of

log = logging.getLogger(__name__)
OURS = {c.LABEL_MANAGED_BY: c.MANAGED_BY_VALUE}
RESOURCE = (c.GROUP, c.VERSION, c.PLURAL)
RETRY_BACKOFF = 5.0  # seconds before a failed handler (e.g. an API error) runs again


def build_registry(settings: OperatorSettings, api_client_factory: Callable[[], Any] | None = None,
                   kubeconfig: str | None = None) -> kopf.OperatorRegistry:
    """kopf's registry of our handlers; credentials from `kubeconfig` (default: in-cluster or KUBECONFIG)."""
    if api_client_factory is None:
        def api_client_factory() -> Any:
            return load_api_client(kubeconfig)
    registry = kopf.OperatorRegistry()
    state: dict[str, Any] = {}
    locks: dict[str, threading.Lock] = {}
    locks_guard = threading.Lock()

    def object_lock(uid: str) -> threading.Lock:
        with locks_guard:
            return locks.setdefault(uid, threading.Lock())

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        # Our annotations, not kopf's defaults, so users can tell who wrote them.
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=c.KOPF_ANNOTATION_PREFIX)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=c.KOPF_ANNOTATION_PREFIX)
        settings.posting.level = logging.WARNING
        # Watch exactly the namespaces we are given and the CRD installed before us: no cluster-wide
        # namespace/CRD watching, so a namespaced Role is enough RBAC.
        settings.scanning.disabled = True
        state["kube"] = KubeApi(api_client_factory())

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        # The same credentials for kopf's watches and for kube.py's client.
        return connection_info(load_configuration(kubeconfig))

    @kopf.index("batch", "v1", "jobs", id="mtp_jobs", labels=OURS, registry=registry)
    def mtp_jobs(body: kopf.Body, **_: Any) -> dict:
        key = owner_key(body)
        return {key: job_summary(body)} if key else {}

    @kopf.index("", "v1", "pods", id="mtp_pods", labels=OURS, registry=registry)
    def mtp_pods(body: kopf.Body, **_: Any) -> dict:
        key = owner_key(body)
        return {key: pod_summary(body)} if key else {}

    @kopf.index("apps", "v1", "statefulsets", id="mtp_statefulsets", labels=OURS, registry=registry)
    def mtp_statefulsets(body: kopf.Body, **_: Any) -> dict:
        key = owner_key(body)
        return {key: statefulset_summary(body)} if key else {}

    def run(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, mtp_jobs: kopf.Index,
            mtp_pods: kopf.Index, mtp_statefulsets: kopf.Index) -> None:
        key = (body["metadata"]["namespace"], body["metadata"]["name"])
        with object_lock(body["metadata"]["uid"]):
            cluster = Cluster(state["kube"], settings, list(mtp_jobs.get(key, [])), list(mtp_pods.get(key, [])),
                              list(mtp_statefulsets.get(key, [])))
            stats = memo.pop("fresh_stats", None)
            # A handler's body can predate the status this process wrote a moment ago (a timer that
            # waited for the lock, a watch event still in flight): decide from the newest we know.
            observed = dict(body.get("status") or {})
            # Other writers' conditions come from the object as read, never from our memory.
            known = with_conditions_of(memo["status"], observed) if memo.get("status") else observed
            outcome = reconcile({**body, "status": known}, cluster, stats, time.time())
            memo["status"] = outcome.status
        old = dict(body.get("status") or {})
        changes = status_changes(old, outcome.status)
        for field_name, value in changes.items():
            patch.status[field_name] = value
        change = phase_event(known, outcome.status)
        for event_type, reason, message in outcome.events + ([change] if change else []):
            state["kube"].post_event(body, reason, message, event_type)

    @kopf.on.create(*RESOURCE, id="created", backoff=RETRY_BACKOFF, registry=registry)
    def created(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **kw: Any) -> None:
        run(body, patch, memo, kw["mtp_jobs"], kw["mtp_pods"], kw["mtp_statefulsets"])

    @kopf.on.update(*RESOURCE, id="updated", backoff=RETRY_BACKOFF, registry=registry)
    def updated(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **kw: Any) -> None:
        run(body, patch, memo, kw["mtp_jobs"], kw["mtp_pods"], kw["mtp_statefulsets"])

    @kopf.on.resume(*RESOURCE, id="resumed", backoff=RETRY_BACKOFF, registry=registry)
    def resumed(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **kw: Any) -> None:
        run(body, patch, memo, kw["mtp_jobs"], kw["mtp_pods"], kw["mtp_statefulsets"])

    @kopf.timer(*RESOURCE, id="level", interval=settings.reconcile_interval, backoff=RETRY_BACKOFF,
                registry=registry)
    def level(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **kw: Any) -> None:
        run(body, patch, memo, kw["mtp_jobs"], kw["mtp_pods"], kw["mtp_statefulsets"])

    @kopf.timer(*RESOURCE, id="scrape", interval=settings.metrics_interval, initial_delay=settings.metrics_interval,
                backoff=RETRY_BACKOFF, registry=registry)
    def scrape(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **kw: Any) -> None:
        if scrape_rank0(body, memo, kw["mtp_pods"], settings):
            run(body, patch, memo, kw["mtp_jobs"], kw["mtp_pods"], kw["mtp_statefulsets"])

    return registry


def connection_info(cfg: Any) -> kopf.ConnectionInfo:
    header = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix("authorization")
    parts = header.split(" ", 1) if header else []
    scheme, token = (parts[0], parts[1]) if len(parts) == 2 else (None, parts[0] if parts else None)
    return kopf.ConnectionInfo(
        server=cfg.host, ca_path=cfg.ssl_ca_cert, insecure=not cfg.verify_ssl, username=cfg.username or None,
        password=cfg.password or None, scheme=scheme, token=token, certificate_path=cfg.cert_file,
        private_key_path=cfg.key_file)


def scrape_rank0(body: kopf.Body, memo: kopf.Memo, pods: kopf.Index, settings: OperatorSettings) -> bool:
    """Read rank 0's metrics into memo["fresh_stats"]; False when there is nothing to read."""
    if (body.get("status") or {}).get("phase") not in ("Running", "Degraded") or not settings.probe_pods:
        return False
    meta = body["metadata"]
    try:
        spec = parse_spec(body.get("spec"))
        plan = plan_deployment(meta["name"], meta["namespace"], spec,
                               master_host=kubernetes_master_host(meta["name"], meta["namespace"]), settings=settings)
    except (SpecError, ValueError):
        return False
    rank0 = next((p for p in pods.get((meta["namespace"], meta["name"]), [])
                  if p.get("component") == c.COMPONENT_SERVER and p.get("rank") == 0 and p.get("podIP")
                  and not p.get("terminating")), None)
    if rank0 is None:
        return False
    try:
        text = fetch_metrics(rank0["podIP"], plan.http_port, plan.metrics_path, settings.metrics_timeout)
        counters = read_counters(plan.engine, text, time.time())
    except (OSError, MetricsFormatError) as exc:
        log.warning("%s/%s: cannot read rank 0 metrics: %s", meta["namespace"], meta["name"], exc)
        return False
    previous = memo.get("counters")
    if previous is not None and previous[0] != rank0["uid"]:
        previous = None  # a new rank-0 pod: its counters start from zero, not from the old pod's
    stats = interval_stats(previous[1] if previous else None, counters, spec.speculative.num_speculative_tokens)
    memo["counters"] = (rank0["uid"], counters)
    memo["fresh_stats"] = (stats, utc_now())
    return True
