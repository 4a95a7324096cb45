"""Backend-neutral plan of one MtpDeployment: a pure function of its spec.

    spec = parse_spec(cr["spec"])
    plan = plan_deployment(name, namespace, spec, master_host=..., settings=OperatorSettings())

    plan.export             ExportStep | None: job_name (idempotent), argv, env, image,
                            output_path, resources ({"requests": {...}, "limits": {...}})
    plan.ranks[r]           RankLaunch: argv and env of rank r as concrete values (the
                            rank's own address is `rank_ip`, default 127.0.0.1),
                            http_port (None: serves no HTTP), is_master
    plan.pod_argv/pod_env   the rank-independent form for a StatefulSet template
                            (rank from MTP_NODE_RANK, Kubernetes `$(VAR)` syntax)
    plan.pod_field_env      env vars the pod fills from its own fields (downward API)
    plan.pod_ref_env        env vars from Secrets, ConfigMaps or pod fields the spec names
                            (name -> Kubernetes valueFrom; spec.env[].valueFrom, spec.apiKeySecret)
    plan.termination_grace_seconds  the ranks' grace period: the server's drain deadline plus a margin
    plan.master_address     host:port of rank 0's rendezvous
    plan.template_hash      changes exactly when the whole group must restart

The Kubernetes backend passes `master_host=kubernetes_master_host(name, ns)`
(pod 0's DNS name in the headless Service); the local backend passes
"127.0.0.1", `port_stride` = processes_per_rank(spec) and `device_stride` =
the accelerator count, so ranks on one machine get distinct HTTP ports and
devices (a pod sees only its own devices, numbered from 0); `first_device`
moves a whole group past the devices of the groups before it. manifests.py turns
a plan into Kubernetes objects.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

from mtp_operator import constants as c
from mtp_operator.engines import LaunchContext, PlanError, engine_argv, metrics_path, serves_http
from mtp_operator.settings import OperatorSettings
from mtp_operator.spec import MtpDeploymentSpec, Resources
from mtp_runtime.server.args import SHUTDOWN_TIMEOUT_DEFAULT

__all__ = ["PlanError", "ExportStep", "RankLaunch", "DeploymentPlan", "plan_deployment",
           "kubernetes_master_host", "statefulset_name", "headless_service_name", "client_service_name"]

# Env vars a pod fills from its own fields (downward API); the local backend
# substitutes the loopback address / the rank instead.
POD_IP_FIELD = "status.podIP"
POD_INDEX_FIELD = f"metadata.labels['{c.LABEL_POD_INDEX}']"
# Seconds a stopping rank gets beyond its drain deadline (spec.runtime.shutdownTimeout):
# the server's own backstop (5 s) and leaving the group, before the kubelet's SIGKILL.
SHUTDOWN_GRACE_MARGIN = 15


@dataclass(frozen=True)
class ExportStep:
    job_name: str
    argv: list[str]
    env: dict[str, str]
    image: str
    output_path: str
    resources: dict[str, dict[str, str]]
    fingerprint: str


@dataclass(frozen=True)
class RankLaunch:
    rank: int
    argv: list[str]
    env: dict[str, str]
    http_port: int | None
    is_master: bool


@dataclass(frozen=True)
class DeploymentPlan:
    name: str
    namespace: str
    engine: str
    image: str
    nnodes: int
    accelerator_kind: str  # "cpu" | "cuda" | "npu"
    draft_model_path: str
    export: ExportStep | None
    ranks: list[RankLaunch]
    pod_argv: list[str]
    pod_env: dict[str, str]
    pod_field_env: dict[str, str]
    resources: dict[str, dict[str, str]]
    http_port: int
    master_port: int
    master_address: str
    pod_ref_env: dict[str, dict] = field(default_factory=dict)
    termination_grace_seconds: int = int(SHUTDOWN_TIMEOUT_DEFAULT) + SHUTDOWN_GRACE_MARGIN
    health_path: str = "/health"
    metrics_path: str = "/metrics"
    template_hash: str = field(default="")


def statefulset_name(name: str, group: int = 0) -> str:
    """Group 0 keeps the one-group name (an MtpDeployment from before fleets keeps its pods)."""
    return name if group == 0 else f"{name}-g{group}"


def headless_service_name(name: str) -> str:
    return f"{name}-ranks"


def client_service_name(name: str) -> str:
    return name


def kubernetes_master_host(name: str, namespace: str, group: int = 0) -> str:
    """The group's pod 0: its stable DNS name inside the (shared) headless Service."""
    return f"{statefulset_name(name, group)}-0.{headless_service_name(name)}.{namespace}.svc"


def accelerator_kind(spec: MtpDeploymentSpec) -> str:
    resource = spec.accelerator.resource_name or ""
    if resource.startswith("huawei.com/"):
        return "npu"
    return "cuda" if resource else "cpu"


def device_list(kind: str, count: int, first: int = 0) -> str:
    return "cpu" if kind == "cpu" else ",".join(f"{kind}:{first + i}" for i in range(count))


def processes_per_rank(spec: MtpDeploymentSpec) -> int:
    """Engine processes one pod runs: one per device, except vLLM's one per pod."""
    if spec.engine == "vllm" or accelerator_kind(spec) == "cpu":
        return 1
    return max(spec.accelerator.count, 1)


def termination_grace_seconds(spec: MtpDeploymentSpec) -> int:
    """Above the drain deadline, so SIGKILL never races the clean end of streams."""
    timeout = spec.runtime.shutdown_timeout
    return int(SHUTDOWN_TIMEOUT_DEFAULT if timeout is None else timeout) + SHUTDOWN_GRACE_MARGIN


def reference_env(spec: MtpDeploymentSpec) -> dict[str, dict]:
    """Env vars whose values the kubelet reads (Secrets, ConfigMaps, pod fields), as valueFrom objects."""
    refs = {e.name: e.value_from.model_dump(by_alias=True, exclude_none=True)
            for e in spec.env if e.value_from is not None}
    if spec.api_key_secret is not None:
        name = c.ENV_VLLM_API_KEY if spec.engine == "vllm" else c.ENV_API_KEY
        refs[name] = {"secretKeyRef": spec.api_key_secret.model_dump(by_alias=True)}
    return refs


def resource_requirements(resources: Resources, accelerator: str | None = None, count: int = 0) -> dict:
    out: dict[str, dict[str, str]] = {}
    for part in ("requests", "limits"):
        values = getattr(resources, part).model_dump(exclude_none=True)
        if accelerator and count:
            values[accelerator] = str(count)  # extended resources: requests == limits
        if values:
            out[part] = values
    return out


def _digest(payload: object, length: int = 10) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:length]


def _export_step(name: str, spec: MtpDeploymentSpec, image: str) -> ExportStep | None:
    if spec.export is None:
        return None
    export_image = spec.export.image or image
    argv = ["mtp", "export", "--input-dir", spec.model.path, "--output-dir", spec.export.output_path]
    if spec.model.model_type != "auto":
        argv += ["--model-type", spec.model.model_type]
    if spec.export.force:
        argv.append("--force")
    fingerprint = _digest({"argv": argv, "image": export_image, "volume": spec.model.volume.model_dump()})
    # Job names become pod label values (<= 63 characters).
    job_name = f"{name[:44].rstrip('-')}-export-{fingerprint}"
    return ExportStep(job_name, argv, {}, export_image, spec.export.output_path,
                      resource_requirements(spec.export.resources), fingerprint)


def plan_deployment(name: str, namespace: str, spec: MtpDeploymentSpec, *, master_host: str,
                    settings: OperatorSettings | None = None, port_stride: int = 0, device_stride: int = 0,
                    rank_ip: str = "127.0.0.1", first_device: int = 0) -> DeploymentPlan:
    settings = settings or OperatorSettings()
    kind = accelerator_kind(spec)
    count = spec.accelerator.count
    image = spec.image or (settings.npu_runtime_image if kind == "npu" else settings.runtime_image)
    draft = spec.draft_model.path if spec.draft_model else spec.export.output_path  # type: ignore[union-attr]
    http = spec.ports.http
    master = f"{master_host}:{spec.ports.master}"

    common_env = {c.ENV_NNODES: str(spec.nnodes), c.ENV_MASTER_ADDR: master}
    if kind == "npu":
        common_env[c.ENV_HCCL_CONNECT_TIMEOUT] = c.HCCL_CONNECT_TIMEOUT_SECONDS
    common_env.update({e.name: e.value for e in spec.env if e.value is not None})
    ref_env = reference_env(spec)
    field_env = {c.ENV_NODE_RANK: POD_INDEX_FIELD, c.ENV_POD_IP: POD_IP_FIELD}
    if kind == "npu":
        field_env[c.ENV_HCCL_IF_IP] = POD_IP_FIELD

    def context(rank: int | None) -> LaunchContext:
        port = http + (rank or 0) * port_stride
        devices = device_list(kind, count, first=first_device + (rank or 0) * device_stride)
        return LaunchContext(rank, spec.nnodes, master_host, draft, devices, port)

    ranks = []
    for rank in range(spec.nnodes):
        env = {**common_env, c.ENV_NODE_RANK: str(rank), c.ENV_POD_IP: rank_ip}
        if kind == "npu":
            env[c.ENV_HCCL_IF_IP] = rank_ip
        port = http + rank * port_stride
        ranks.append(RankLaunch(rank, engine_argv(spec, context(rank), count), env,
                                port if serves_http(spec.engine, rank) else None, rank == 0))
    pod_argv = engine_argv(spec, context(None), count)
    resources = resource_requirements(spec.resources, spec.accelerator.resource_name, count)
    plan = DeploymentPlan(
        name=name, namespace=namespace, engine=spec.engine, image=image, nnodes=spec.nnodes,
        accelerator_kind=kind, draft_model_path=draft, export=_export_step(name, spec, image), ranks=ranks,
        pod_argv=pod_argv, pod_env=common_env, pod_field_env=field_env, resources=resources,
        http_port=http, master_port=spec.ports.master, master_address=master,
        pod_ref_env=ref_env, termination_grace_seconds=termination_grace_seconds(spec),
        metrics_path=metrics_path(spec.engine),
    )
    # Everything the pods run with, except status-like details: a change means a whole-group roll.
    pod_shape = {"argv": pod_argv, "env": common_env, "image": image, "resources": resources,
                 "volume": spec.model.volume.model_dump(), "mount": spec.model.mount_path,
                 "scheduling": spec.scheduling.model_dump(), "nnodes": spec.nnodes}
    if ref_env:  # absent when unset, like securityContext below
        pod_shape["refEnv"] = ref_env
    if spec.security_context is not None:  # absent when unset: existing groups keep their hash
        pod_shape["securityContext"] = spec.security_context.model_dump(by_alias=True, exclude_none=True)
    return _with_hash(plan, _digest(pod_shape))


def _with_hash(plan: DeploymentPlan, template_hash: str) -> DeploymentPlan:
    values = {f: getattr(plan, f) for f in plan.__dataclass_fields__}
    values["template_hash"] = template_hash
    return DeploymentPlan(**values)


def plan_as_dict(plan: DeploymentPlan) -> dict:
    """JSON-friendly view (for `mtp up --dry-run` style printing and tests)."""
    return asdict(plan)
