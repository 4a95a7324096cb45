"""Kubernetes manifests of a DeploymentPlan, as plain dicts (no API calls here).

    build_export_job(plan, spec, owner, settings)      batch/v1 Job running `mtp export`
    build_headless_service(plan, owner)                rank discovery (publishNotReadyAddresses)
    build_client_service(plan, spec, owner)            the OpenAI endpoint, rank 0 only
    build_statefulset(plan, spec, owner, settings)     one pod per rank, Parallel, OnDelete
    owner_reference(owner)                             from the MtpDeployment's body

Updates use OnDelete: the operator deletes the whole group's pods at once
when the template hash changes, so a multi-node group never runs mixed
versions rank by rank.
"""

from __future__ import annotations

from typing import Any, Mapping

from mtp_operator import constants as c
from mtp_operator.pod_security import container_security_context, pod_security_context
from mtp_operator.plan import DeploymentPlan, client_service_name, headless_service_name, statefulset_name
from mtp_operator.settings import OperatorSettings
from mtp_operator.spec import MtpDeploymentSpec

ANNOTATION_EXPORT_FINGERPRINT = f"{c.GROUP}/export-fingerprint"
SHM_VOLUME = "dshm"
# The runtime's compiled graphs (graph mode, the default of the builtin engine) and its ahead-of-time
# compiled decode steps: an emptyDir, so a restarted container loads them instead of compiling again.
# Under /opt/mtp, where no spec may mount.
COMPILE_CACHE_VOLUME = "compile-cache"
COMPILE_CACHE_PATH = "/opt/mtp/compile-cache"
COMPILE_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
AOT_CACHE_ENV = "MTP_AOT_CACHE_DIR"


def owner_reference(owner: Mapping[str, Any]) -> dict[str, Any]:
    meta = owner["metadata"]
    return {"apiVersion": c.API_VERSION, "kind": c.KIND, "name": meta["name"], "uid": meta["uid"],
            "controller": True, "blockOwnerDeletion": True}


def _metadata(name: str, plan: DeploymentPlan, owner: Mapping[str, Any], component: str,
              annotations: dict[str, str] | None = None) -> dict[str, Any]:
    meta = {"name": name, "namespace": plan.namespace, "labels": c.child_labels(plan.name, component),
            "ownerReferences": [owner_reference(owner)]}
    if annotations:
        meta["annotations"] = annotations
    return meta


def _model_volume(spec: MtpDeploymentSpec, read_only: bool) -> dict[str, Any]:
    volume = spec.model.volume
    if volume.claim_name:
        return {"name": c.MODEL_VOLUME_NAME,
                "persistentVolumeClaim": {"claimName": volume.claim_name, "readOnly": read_only}}
    return {"name": c.MODEL_VOLUME_NAME, "hostPath": {"path": volume.host_path, "type": "Directory"}}


def _pull_secrets(settings: OperatorSettings) -> list[dict[str, str]]:
    return [{"name": name} for name in settings.image_pull_secrets]


def _scheduling(spec: MtpDeploymentSpec) -> dict[str, Any]:
    sched = spec.scheduling
    out: dict[str, Any] = {}
    if sched.node_selector:
        out["nodeSelector"] = dict(sched.node_selector)
    if sched.tolerations:
        out["tolerations"] = list(sched.tolerations)
    if sched.affinity:
        out["affinity"] = dict(sched.affinity)
    if sched.priority_class_name:
        out["priorityClassName"] = sched.priority_class_name
    if sched.scheduler_name:
        out["schedulerName"] = sched.scheduler_name
    return out


def build_export_job(plan: DeploymentPlan, spec: MtpDeploymentSpec, owner: Mapping[str, Any],
                     settings: OperatorSettings) -> dict[str, Any]:
    step = plan.export
    if step is None:
        raise ValueError(f"{plan.namespace}/{plan.name}: spec.draftModel is set, there is no export Job to build")
    labels = c.child_labels(plan.name, c.COMPONENT_EXPORT)
    container = {
        "name": c.CONTAINER_EXPORT, "image": step.image, "command": step.argv[:1], "args": step.argv[1:],
        "env": [{"name": k, "value": v} for k, v in step.env.items()],
        "volumeMounts": [{"name": c.MODEL_VOLUME_NAME, "mountPath": spec.model.mount_path}],
        # On failure the log tail becomes the termination message the operator reports.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": container_security_context(plan.accelerator_kind),
    }
    if step.resources:
        container["resources"] = step.resources
    # Same user as the ranks: the draft it writes is read by them from the same volume.
    pod_spec: dict[str, Any] = {"restartPolicy": "Never", "containers": [container],
                                "securityContext": pod_security_context(spec, plan.accelerator_kind),
                                "volumes": [_model_volume(spec, read_only=False)], **_scheduling(spec)}
    if settings.image_pull_secrets:
        pod_spec["imagePullSecrets"] = _pull_secrets(settings)
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": _metadata(step.job_name, plan, owner, c.COMPONENT_EXPORT,
                              {ANNOTATION_EXPORT_FINGERPRINT: step.fingerprint}),
        "spec": {"backoffLimit": 1, "template": {"metadata": {"labels": labels}, "spec": pod_spec}},
    }


def _service_ports(plan: DeploymentPlan) -> list[dict[str, Any]]:
    return [{"name": c.PORT_NAME_HTTP, "port": plan.http_port, "targetPort": c.PORT_NAME_HTTP, "protocol": "TCP"},
            {"name": c.PORT_NAME_MASTER, "port": plan.master_port, "targetPort": c.PORT_NAME_MASTER,
             "protocol": "TCP"}]


def server_selector(plan: DeploymentPlan) -> dict[str, str]:
    """Every rank pod of every group (the headless Service)."""
    return {**c.selector_labels(plan.name), c.LABEL_COMPONENT: c.COMPONENT_SERVER}


def group_selector(plan: DeploymentPlan, group: int) -> dict[str, str]:
    """A group's StatefulSet selector. Group 0's is the one-group selector, unchanged (a selector is
    immutable); it also matches other groups' pods, which the StatefulSet controller never adopts
    (their names are not its ordinals) and our own deletes exclude (`group_pods_selector`)."""
    return server_selector(plan) if group == 0 else {**server_selector(plan), c.LABEL_GROUP: str(group)}


def group_pods_selector(plan: DeploymentPlan, group: int, other_groups: list[int],
                        exclude: Mapping[str, str] | None = None) -> str:
    """A label selector for exactly the pods of `group` (group 0's older pods carry no group label)."""
    parts = [f"{k}={v}" for k, v in server_selector(plan).items()]
    if group == 0:
        others = sorted(g for g in other_groups if g != 0)
        if others:
            parts.append(f"{c.LABEL_GROUP} notin ({','.join(str(g) for g in others)})")
    else:
        parts.append(f"{c.LABEL_GROUP}={group}")
    parts += [f"{k}!={v}" for k, v in (exclude or {}).items()]
    return ",".join(parts)


def _service_metadata(name: str, plan: DeploymentPlan, owner: Mapping[str, Any], role: str) -> dict[str, Any]:
    meta = _metadata(name, plan, owner, c.COMPONENT_SERVER)
    meta["labels"][c.LABEL_SERVICE_ROLE] = role
    return meta


def build_headless_service(plan: DeploymentPlan, owner: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": _service_metadata(headless_service_name(plan.name), plan, owner, c.SERVICE_ROLE_HEADLESS),
        # Ranks must resolve each other before they are ready: readiness needs the whole group.
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": server_selector(plan),
                 "ports": _service_ports(plan)},
    }


def build_client_service(plan: DeploymentPlan, spec: MtpDeploymentSpec, owner: Mapping[str, Any]) -> dict[str, Any]:
    selector = {**server_selector(plan), c.LABEL_POD_INDEX: "0"}  # only rank 0 serves the API
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": _service_metadata(client_service_name(plan.name), plan, owner, c.SERVICE_ROLE_CLIENT),
        "spec": {"type": spec.service.type, "selector": selector,
                 "ports": [{"name": c.PORT_NAME_HTTP, "port": plan.http_port, "targetPort": c.PORT_NAME_HTTP,
                            "protocol": "TCP"}]},
    }


def _compile_cache(plan: DeploymentPlan) -> bool:
    """Whether the pods get the compile-cache volume: yes, unless the spec names its own cache."""
    return COMPILE_CACHE_ENV not in plan.pod_env and COMPILE_CACHE_ENV not in plan.pod_ref_env


def _server_container(plan: DeploymentPlan, spec: MtpDeploymentSpec) -> dict[str, Any]:
    env = [{"name": k, "valueFrom": {"fieldRef": {"fieldPath": path}}} for k, path in plan.pod_field_env.items()]
    env += [{"name": k, "value": v} for k, v in plan.pod_env.items()]
    # Secrets and ConfigMaps are read by the kubelet: their values never pass through the operator.
    env += [{"name": k, "valueFrom": source} for k, source in plan.pod_ref_env.items()]
    mounts = [{"name": c.MODEL_VOLUME_NAME, "mountPath": spec.model.mount_path, "readOnly": True}]
    if plan.accelerator_kind != "cpu":
        mounts.append({"name": SHM_VOLUME, "mountPath": "/dev/shm"})
    if _compile_cache(plan):
        env.append({"name": COMPILE_CACHE_ENV, "value": f"{COMPILE_CACHE_PATH}/inductor"})
        if AOT_CACHE_ENV not in plan.pod_env and AOT_CACHE_ENV not in plan.pod_ref_env:
            env.append({"name": AOT_CACHE_ENV, "value": f"{COMPILE_CACHE_PATH}/aot"})
        mounts.append({"name": COMPILE_CACHE_VOLUME, "mountPath": COMPILE_CACHE_PATH})
    container: dict[str, Any] = {
        "name": c.CONTAINER_SERVER, "image": plan.image, "command": plan.pod_argv[:1], "args": plan.pod_argv[1:],
        "env": env, "volumeMounts": mounts,
        "ports": [{"name": c.PORT_NAME_HTTP, "containerPort": plan.http_port, "protocol": "TCP"},
                  {"name": c.PORT_NAME_MASTER, "containerPort": plan.master_port, "protocol": "TCP"}],
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": container_security_context(plan.accelerator_kind),
    }
    if plan.resources:
        container["resources"] = plan.resources
    if all(rank.http_port is not None for rank in plan.ranks):
        # /health is 200 only when this rank is loaded and the whole group is connected.
        container["readinessProbe"] = {"httpGet": {"path": plan.health_path, "port": c.PORT_NAME_HTTP},
                                       "periodSeconds": 5, "failureThreshold": 3}
    return container


def build_statefulset(plan: DeploymentPlan, spec: MtpDeploymentSpec, owner: Mapping[str, Any],
                      settings: OperatorSettings, group: int = 0, revision: str = "") -> dict[str, Any]:
    """Group `group`'s StatefulSet, from the plan of the revision it runs (`plan` was made with that
    group's master host)."""
    labels = {**c.child_labels(plan.name, c.COMPONENT_SERVER), c.LABEL_TEMPLATE_HASH: plan.template_hash,
              c.LABEL_GROUP: str(group)}
    volumes = [_model_volume(spec, read_only=True)]
    if plan.accelerator_kind != "cpu":
        volumes.append({"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}})
    if _compile_cache(plan):
        volumes.append({"name": COMPILE_CACHE_VOLUME, "emptyDir": {}})
    pod_spec: dict[str, Any] = {"containers": [_server_container(plan, spec)], "volumes": volumes,
                                "securityContext": pod_security_context(spec, plan.accelerator_kind),
                                "subdomain": headless_service_name(plan.name),
                                # Above the server's drain deadline: SIGKILL must not cut the last streams.
                                "terminationGracePeriodSeconds": plan.termination_grace_seconds,
                                **_scheduling(spec)}
    if settings.image_pull_secrets:
        pod_spec["imagePullSecrets"] = _pull_secrets(settings)
    annotations = {c.ANNOTATION_TEMPLATE_HASH: plan.template_hash}
    if revision:
        annotations[c.ANNOTATION_REVISION] = revision
    metadata = _metadata(statefulset_name(plan.name, group), plan, owner, c.COMPONENT_SERVER, annotations)
    metadata["labels"][c.LABEL_GROUP] = str(group)
    return {
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": metadata,
        "spec": {
            "replicas": plan.nnodes,
            "serviceName": headless_service_name(plan.name),
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "OnDelete"},
            "selector": {"matchLabels": group_selector(plan, group)},
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }
