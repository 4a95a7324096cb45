"""kopf wiring: startup settings, indices of children, and thin handlers.

    registry = build_registry(OperatorSettings.from_env())
    await kopf.operator(registry=registry, namespaces=[...], standalone=True)

Handlers only gather state (kopf indices, the per-object memo) and call
`reconcile.reconcile`; kopf applies the status patch itself (status
subresource): a merge patch of our fields, or, when our conditions change
(a list other controllers write too), one JSON patch of the whole status
tested against the resourceVersion of the newest copy (status.StatusUpdate).
The same reconcile runs on create, on spec update, on operator resume and on
a timer (level-based: Job finished, pods ready, a rank restarted). A second timer scrapes rank 0's metrics every
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
from mtp_operator.indexing import job_summary, owner_key, pod_summary, revision_summary, statefulset_summary
from mtp_operator.kube import KubeApi, load_api_client, load_configuration
from mtp_operator.metrics import MetricsFormatError, combine_stats, interval_stats, read_counters
from mtp_operator.plan import kubernetes_master_host, plan_deployment
from mtp_operator.probes import fetch_metrics
from mtp_operator.reconcile import Cluster, phase_event, reconcile
from mtp_operator.rollout import Counters
from mtp_operator.settings import OperatorSettings
from mtp_operator.spec import SpecError, parse_spec
from mtp_operator.status import StatusUpdate, status_changes, utc_now, with_conditions_of

log = logging.getLogger(__name__)
OURS = {c.LABEL_MANAGED_BY: c.MANAGED_BY_VALUE}
RESOURCE = (c.GROUP, c.VERSION, c.PLURAL)
RETRY_BACKOFF = 5.0  # seconds before a failed handler (e.g. an API error) runs again
TIMER_EXIT_POLL = 1.0  # seconds between kopf's checks that a deleted object's timers have exited


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
        # A timer still running when its object is deleted (a slow probe, a reconcile waiting for
        # the object's lock) holds the finalizer until it returns. kopf then looks again only after
        # this many seconds, or at the object's next watch event; its default of 60 s left a
        # deleted MtpDeployment (and its children, which wait for it) for a minute.
        settings.background.cancellation_polling = TIMER_EXIT_POLL
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

    # Only ours: the StatefulSet controller makes ControllerRevisions too, labelled like our pods.
    @kopf.index("apps", "v1", "controllerrevisions", id="mtp_revisions",
                labels={**OURS, c.LABEL_REVISION_HASH: kopf.PRESENT}, registry=registry)
    def mtp_revisions(body: kopf.Body, **_: Any) -> dict:
        key = owner_key(body)
        return {key: revision_summary(body)} if key else {}

    def run(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, mtp_jobs: kopf.Index,
            mtp_pods: kopf.Index, mtp_statefulsets: kopf.Index, mtp_revisions: kopf.Index) -> None:
        key = (body["metadata"]["namespace"], body["metadata"]["name"])
        with object_lock(body["metadata"]["uid"]):
            cluster = Cluster(state["kube"], settings, list(mtp_jobs.get(key, [])), list(mtp_pods.get(key, [])),
                              list(mtp_statefulsets.get(key, [])), list(mtp_revisions.get(key, [])))
            stats = memo.pop("fresh_stats", None)
            group_stats = memo.pop("group_stats", None)
            # A handler's body can predate the status this process wrote a moment ago (a timer that
            # waited for the lock, a watch event still in flight): decide from the newest we know.
            observed = dict(body.get("status") or {})
            # Other writers' conditions come from the object as read, never from our memory.
            known = with_conditions_of(memo["status"], observed) if memo.get("status") else observed
            outcome = reconcile({**body, "status": known}, cluster, stats, time.time(), group_stats=group_stats,
                                counters=memo.get("group_counters"))
            memo["status"] = outcome.status
        old = dict(body.get("status") or {})
        changes = status_changes(old, outcome.status)
        # Conditions are shared with other writers: a change to ours is never merge-patched (that
        # replaces the list with `body`'s copy of theirs) but written with the rest of our status onto
        # the newest copy, under kopf's resourceVersion test. It replaces one of ours still pending
        # from a run whose test failed, which would otherwise be applied after this run's changes.
        pending = [fn for fn in patch.fns if isinstance(fn, StatusUpdate)]
        if "conditions" in changes or pending:
            patch.fns[:] = [fn for fn in patch.fns if fn not in pending] + [StatusUpdate(outcome.status)]
        else:
            for field_name, value in changes.items():
                patch.status[field_name] = value
        change = phase_event(known, outcome.status)
        for event_type, reason, message in outcome.events + ([change] if change else []):
            state["kube"].post_event(body, reason, message, event_type)

    @kopf.on.create(*RESOURCE, id="created", backoff=RETRY_BACKOFF, registry=registry)
    def created(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **kw: Any) -> None:
        run(body, patch, memo, kw["mtp_jobs"], kw["mtp_pods"], kw["mtp_statefulsets"], kw["mtp_revisions"])

    @kopf.on.update(*RESOURCE, id="updated", backoff=RETRY_BACKOFF, registry=registry)
    def updated(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **kw: Any) -> None:
        run(body, patch, memo, kw["mtp_jobs"], kw["mtp_pods"], kw["mtp_statefulsets"], kw["mtp_revisions"])

    @kopf.on.resume(*RESOURCE, id="resumed", backoff=RETRY_BACKOFF, registry=registry)
    def resumed(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **kw: Any) -> None:
        run(body, patch, memo, kw["mtp_jobs"], kw["mtp_pods"], kw["mtp_statefulsets"], kw["mtp_revisions"])

    @kopf.timer(*RESOURCE, id="level", interval=settings.reconcile_interval, backoff=RETRY_BACKOFF,
                registry=registry)
    def level(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **kw: Any) -> None:
        run(body, patch, memo, kw["mtp_jobs"], kw["mtp_pods"], kw["mtp_statefulsets"], kw["mtp_revisions"])

    @kopf.timer(*RESOURCE, id="scrape", interval=settings.metrics_interval, initial_delay=settings.metrics_interval,
                backoff=RETRY_BACKOFF, registry=registry)
    def scrape(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **kw: Any) -> None:
        if scrape_rank0(body, memo, kw["mtp_pods"], settings):
            run(body, patch, memo, kw["mtp_jobs"], kw["mtp_pods"], kw["mtp_statefulsets"], kw["mtp_revisions"])

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
    """Read every group's rank-0 metrics: memo["fresh_stats"] (the fleet's figures, weighted by drafted
    tokens), memo["group_stats"] (per group, this interval) and memo["group_counters"] (per group,
    cumulative, for rollout analysis). False when there is nothing to read."""
    if (body.get("status") or {}).get("phase") in (None, "Exporting", "Failed") or not settings.probe_pods:
        return False
    meta = body["metadata"]
    try:
        spec = parse_spec(body.get("spec"), settings=settings)
        plan = plan_deployment(meta["name"], meta["namespace"], spec,
                               master_host=kubernetes_master_host(meta["name"], meta["namespace"]), settings=settings)
    except (SpecError, ValueError):
        return False
    rank0s = {p["group"]: p for p in pods.get((meta["namespace"], meta["name"]), [])
              if p.get("component") == c.COMPONENT_SERVER and p.get("rank") == 0 and p.get("podIP")
              and p.get("ready") and not p.get("terminating") and p.get("group") is not None}
    previous_all = memo.get("counters") if isinstance(memo.get("counters"), dict) else {}
    group_stats, group_counters, latest = {}, {}, {}
    for group, rank0 in sorted(rank0s.items()):
        try:
            text = fetch_metrics(rank0["podIP"], plan.http_port, plan.metrics_path, settings.metrics_timeout)
            counters = read_counters(plan.engine, text, time.time())
        except (OSError, MetricsFormatError) as exc:
            log.warning("%s/%s: cannot read group %d's rank 0 metrics: %s", meta["namespace"], meta["name"],
                        group, exc)
            continue
        previous = previous_all.get(group)
        if previous is not None and previous[0] != rank0["uid"]:
            previous = None  # a new rank-0 pod: its counters start from zero, not from the old pod's
        group_stats[group] = interval_stats(previous[1] if previous else None, counters,
                                            spec.speculative.num_speculative_tokens)
        latest[group] = (rank0["uid"], counters)
        # The pod and its container restarts: a restarted container counts from zero again.
        group_counters[group] = Counters(f"{rank0['uid']}/{rank0.get('restarts', 0)}", counters.draft_tokens or 0.0,
                                         counters.accepted_tokens or 0.0, counters.tpot_sum or 0.0,
                                         counters.tpot_count or 0.0)
    if not group_stats:
        return False
    memo["counters"] = latest
    fleet = combine_stats([group_stats[g] for g in sorted(group_stats)])
    memo["fresh_stats"] = (fleet, utc_now())
    memo["group_stats"] = group_stats
    memo["group_counters"] = group_counters
    return True
