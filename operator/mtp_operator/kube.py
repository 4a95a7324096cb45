"""Every Kubernetes API call the operator's own code makes, in one place.

The Helm chart's RBAC is checked against this module: each call below uses
the official client's standard method name (verb + resource), e.g.
`create_namespaced_job` -> create jobs.batch.

Calls made here:
    batch/v1 jobs           create_namespaced_job
    v1 services             create_namespaced_service, patch_namespaced_service
    apps/v1 statefulsets    create_namespaced_stateful_set, patch_namespaced_stateful_set,
                            delete_namespaced_stateful_set      (scaling a fleet down)
    apps/v1 controllerrevisions  create_namespaced_controller_revision,
                            delete_namespaced_controller_revision   (revision history)
    v1 pods                 delete_collection_namespaced_pod   (whole-group restarts and rolls)
    v1 events               create_namespaced_event            (phase changes)

kopf's own needs (not calls in this file, but the same RBAC):
    mtpdeployments.mtp.inference.dev       list, watch, patch (annotations: progress, last-handled spec)
    mtpdeployments/status                  patch (kopf writes `status` from handler patches)
    jobs.batch, pods, statefulsets.apps, controllerrevisions.apps
                                           list, watch (kopf indices feed the reconcile)
    events                                 create (kopf's own error events)
    API discovery (GET /api, /apis/...)    non-resource URLs, granted to every user by default
kopf's namespace and CRD scanning is disabled (handlers.py), so it needs no
namespaces or customresourcedefinitions permissions; the CRD must exist
before the operator starts (the Helm chart installs it first).
"""

from __future__ import annotations

import logging
import os
from datetime import datetime, timezone
from typing import Any, Mapping

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from mtp_operator import constants as c

log = logging.getLogger(__name__)
MERGE_PATCH = "application/merge-patch+json"
# We never read responses: skip the client's model parsing, and never wait forever.
CALL = {"_preload_content": False, "_request_timeout": 30}


def load_configuration(kubeconfig: str | None = None) -> client.Configuration:
    """In-cluster service account if present, else the kubeconfig (KUBECONFIG or ~/.kube/config)."""
    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException:
        # Read KUBECONFIG now: the client library reads it once, when first imported.
        path = kubeconfig or os.environ.get("KUBECONFIG") or None
        config.load_kube_config(config_file=path, client_configuration=configuration)
    return configuration


def load_api_client(kubeconfig: str | None = None) -> client.ApiClient:
    return client.ApiClient(load_configuration(kubeconfig))


def selector(labels: Mapping[str, str], exclude: Mapping[str, str] | None = None) -> str:
    """A label selector string: key=value,... plus key!=value for `exclude`."""
    parts = [f"{k}={v}" for k, v in labels.items()]
    parts += [f"{k}!={v}" for k, v in (exclude or {}).items()]
    return ",".join(parts)


def _exists(exc: ApiException) -> bool:
    """A create's 409 (the object exists: False, nothing to do); any other error is raised."""
    if exc.status == 409:
        return False
    raise exc


class KubeApi:
    def __init__(self, api_client: client.ApiClient):
        self.core = client.CoreV1Api(api_client)
        self.batch = client.BatchV1Api(api_client)
        self.apps = client.AppsV1Api(api_client)

    def create_job(self, namespace: str, body: dict[str, Any]) -> bool:
        """True if created; False if a Job of that name exists already (idempotent)."""
        try:
            self.batch.create_namespaced_job(namespace, body, **CALL)
            return True
        except ApiException as exc:
            return _exists(exc)

    def apply_service(self, namespace: str, body: dict[str, Any]) -> None:
        try:
            self.core.create_namespaced_service(namespace, body, **CALL)
        except ApiException as exc:
            if exc.status != 409:
                raise
            self.core.patch_namespaced_service(body["metadata"]["name"], namespace, body,
                                               _content_type=MERGE_PATCH, **CALL)

    def apply_statefulset(self, namespace: str, body: dict[str, Any]) -> None:
        try:
            self.apps.create_namespaced_stateful_set(namespace, body, **CALL)
        except ApiException as exc:
            if exc.status != 409:
                raise
            # Merge patch: replicas, template and annotations are ours; selector is immutable and unchanged.
            self.apps.patch_namespaced_stateful_set(body["metadata"]["name"], namespace, body,
                                                    _content_type=MERGE_PATCH, **CALL)

    def delete_statefulset(self, namespace: str, name: str) -> None:
        """Remove a group (its pods go with it, through the garbage collector); gone already is fine."""
        try:
            self.apps.delete_namespaced_stateful_set(name, namespace, propagation_policy="Background", **CALL)
        except ApiException as exc:
            if exc.status != 404:
                raise

    def create_controller_revision(self, namespace: str, body: dict[str, Any]) -> bool:
        """True if created; False if it exists already (idempotent, like create_job)."""
        try:
            self.apps.create_namespaced_controller_revision(namespace, body, **CALL)
            return True
        except ApiException as exc:
            return _exists(exc)

    def delete_controller_revision(self, namespace: str, name: str) -> None:
        try:
            self.apps.delete_namespaced_controller_revision(name, namespace, **CALL)
        except ApiException as exc:
            if exc.status != 404:
                raise

    def delete_pods(self, namespace: str, label_selector: str) -> None:
        """Delete every matching pod at once (the StatefulSet recreates them together)."""
        self.core.delete_collection_namespaced_pod(namespace, label_selector=label_selector,
                                                   grace_period_seconds=0, **CALL)

    def post_event(self, owner: Mapping[str, Any], reason: str, message: str, event_type: str = "Normal") -> None:
        meta = owner["metadata"]
        now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": c.API_VERSION, "kind": c.KIND, "name": meta["name"],
                               "namespace": meta["namespace"], "uid": meta.get("uid")},
            "reason": reason, "message": message[:1024], "type": event_type,
            "source": {"component": c.MANAGED_BY_VALUE}, "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }
        try:
            self.core.create_namespaced_event(meta["namespace"], body, **CALL)
        except ApiException as exc:  # an event is best effort; never fail a reconcile for it
            log.warning("could not post event %s for %s/%s: %s", reason, meta["namespace"], meta["name"], exc.reason)
