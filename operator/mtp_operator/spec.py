"""The MtpDeployment spec: pydantic models, the single source of the CRD schema.

Field names are snake_case in Python and camelCase in YAML (aliases). Rules
that span fields are `CelRule`s: the CEL text goes into the CRD's
`x-kubernetes-validations` (the API server enforces it) and the same rule in
Python runs in the model validator, so `mtp up`, the operator and tests reject
the same specs with the same message.

    spec = parse_spec(cr["spec"])   # -> MtpDeploymentSpec, or SpecError naming the field
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Callable, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from mtp_operator.constants import ENV_MASTER_ADDR, ENV_NNODES, ENV_NODE_RANK

# An absolute path with no spaces or shell metacharacters: it lands in argv and
# in volume mounts, so anything a shell would interpret is refused up front.
PATH_PATTERN = r"^/[A-Za-z0-9._@+=/-]*$"
IMAGE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/:@-]*$"
QUANTITY_PATTERN = r"^([+]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"
ACCELERATOR_PATTERN = r"^(huawei\.com/Ascend[A-Za-z0-9-]+|nvidia\.com/gpu)$"
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
RESERVED_ENV = (ENV_NODE_RANK, ENV_NNODES, ENV_MASTER_ADDR)


class SpecError(ValueError):
    """An invalid MtpDeployment spec; the message names every offending field."""


@dataclass(frozen=True)
class CelRule:
    """A cross-field rule: CEL for the API server, `holds` for Python (camelCase dict)."""

    rule: str
    message: str
    holds: Callable[[dict[str, Any]], bool]


class ApiModel(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")
    cel_rules: ClassVar[tuple[CelRule, ...]] = ()

    @model_validator(mode="after")
    def _check_cel_rules(self) -> "ApiModel":
        data = self.model_dump(by_alias=True, exclude_none=True)
        for rule in self.cel_rules:
            if not rule.holds(data):
                raise ValueError(rule.message)
        return self


class ModelVolume(ApiModel):
    """Where checkpoints live: exactly one of a PVC or a node's hostPath."""

    claim_name: str | None = Field(None, pattern=DNS_LABEL_PATTERN, description="PersistentVolumeClaim name.")
    host_path: str | None = Field(None, pattern=PATH_PATTERN, description="Directory on the node.")
    read_only: bool = Field(False, description="Mount read-only (only when the draft already exists).")
    cel_rules = (
        CelRule(
            "has(self.claimName) != has(self.hostPath)",
            "set exactly one of volume.claimName or volume.hostPath",
            lambda d: ("claimName" in d) != ("hostPath" in d),
        ),
    )


class ModelSource(ApiModel):
    path: str = Field(pattern=PATH_PATTERN, description="Main checkpoint directory inside the pod.")
    model_type: Literal["auto", "deepseek_v3", "deepseek_v32", "glm4_moe"] = "auto"
    volume: ModelVolume
    mount_path: str = Field("/models", pattern=PATH_PATTERN, description="Where the volume is mounted.")
    cel_rules = (
        CelRule(
            "self.path.startsWith(self.mountPath + '/')",
            "model.path must lie under model.mountPath (the model volume)",
            lambda d: d["path"].startswith(d["mountPath"] + "/"),
        ),
    )


class DraftModel(ApiModel):
    path: str = Field(pattern=PATH_PATTERN, description="An existing exported draft directory.")


class ResourceList(ApiModel):
    cpu: str | None = Field(None, pattern=QUANTITY_PATTERN)
    memory: str | None = Field(None, pattern=QUANTITY_PATTERN)


class Resources(ApiModel):
    requests: ResourceList = Field(default_factory=ResourceList)
    limits: ResourceList = Field(default_factory=ResourceList)


class ExportSpec(ApiModel):
    """Cut the MTP layer out of `model` with `mtp export` in a Job."""

    output_path: str = Field(pattern=PATH_PATTERN, description="Draft directory to write (model volume).")
    image: str | None = Field(None, pattern=IMAGE_PATTERN, description="Defaults to spec.image.")
    resources: Resources = Field(default_factory=Resources)
    force: bool = Field(False, description="Re-export even if the output's manifest is up to date.")


class Accelerator(ApiModel):
    resource_name: str | None = Field(
        None, pattern=ACCELERATOR_PATTERN, description="e.g. huawei.com/Ascend910 or nvidia.com/gpu; none = CPU."
    )
    count: int = Field(0, ge=0, le=64, description="Devices per node (pod).")
    cel_rules = (
        CelRule(
            "has(self.resourceName) == (self.count > 0)",
            "accelerator.count must be >= 1 exactly when accelerator.resourceName is set",
            lambda d: ("resourceName" in d) == (d["count"] > 0),
        ),
    )


class Speculative(ApiModel):
    num_speculative_tokens: int = Field(1, ge=1, le=8, description="Draft tokens verified per step (k).")
    min_acceptance_rate: float | None = Field(
        None, ge=0, le=1, description="Below this, condition Degraded=True reason LowAcceptance."
    )


class RuntimeFlags(ApiModel):
    """The serve flags; unset ones keep the engine's defaults."""

    max_memory_utilization: float | None = Field(None, gt=0, le=1)
    max_tokens_per_batch: int | None = Field(None, ge=1)
    max_seqs_per_batch: int | None = Field(None, ge=1)
    block_size: int | None = Field(None, ge=1)
    ep_size: int | None = Field(None, ge=1)
    dp_size: int | None = Field(None, ge=1)
    enable_prefix_cache: bool | None = None
    enable_chunked_prefill: bool | None = None


class EnvVar(ApiModel):
    name: str = Field(pattern=ENV_NAME_PATTERN, max_length=256)
    value: str = Field("", max_length=32768)


class Ports(ApiModel):
    http: int = Field(8000, ge=1, le=65535, description="HTTP port of every rank (/health, /metrics, API).")
    master: int = Field(29500, ge=1, le=65535, description="Rank 0's rendezvous port.")
    cel_rules = (CelRule("self.http != self.master", "ports.http and ports.master must differ",
                         lambda d: d["http"] != d["master"]),)


class Scheduling(ApiModel):
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    affinity: dict[str, Any] | None = None
    priority_class_name: str | None = Field(None, pattern=DNS_LABEL_PATTERN)
    scheduler_name: str | None = Field(None, pattern=DNS_LABEL_PATTERN)


class ServiceSpec(ApiModel):
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"


class SeccompProfile(ApiModel):
    type: Literal["RuntimeDefault", "Localhost", "Unconfined"]
    localhost_profile: str | None = Field(None, max_length=4096, description="Only with type Localhost.")
    cel_rules = (
        CelRule(
            "has(self.localhostProfile) == (self.type == 'Localhost')",
            "securityContext.seccompProfile.localhostProfile is set exactly when type is Localhost",
            lambda d: ("localhostProfile" in d) == (d["type"] == "Localhost"),
        ),
    )


class SELinuxOptions(ApiModel):
    user: str | None = None
    role: str | None = None
    type: str | None = None
    level: str | None = None


class Sysctl(ApiModel):
    name: str = Field(pattern=r"^[a-z0-9._/-]+$", max_length=253)
    value: str = Field(max_length=1024)


class PodSecurityContext(ApiModel):
    """Kubernetes' PodSecurityContext, the fields a runtime pod may need; replaces the operator's default."""

    run_as_user: int | None = Field(None, ge=0)
    run_as_group: int | None = Field(None, ge=0)
    run_as_non_root: bool | None = None
    fs_group: int | None = Field(None, ge=0)
    fs_group_change_policy: Literal["Always", "OnRootMismatch"] | None = None
    supplemental_groups: list[Annotated[int, Field(ge=0)]] | None = Field(None, max_length=64)
    seccomp_profile: SeccompProfile | None = None
    se_linux_options: SELinuxOptions | None = None
    sysctls: list[Sysctl] | None = Field(None, max_length=64)
    cel_rules = (
        CelRule(
            "!(has(self.runAsNonRoot) && self.runAsNonRoot && has(self.runAsUser) && self.runAsUser == 0)",
            "securityContext.runAsNonRoot cannot be true with runAsUser 0 (the kubelet would refuse the pod)",
            lambda d: not (d.get("runAsNonRoot") and d.get("runAsUser") == 0),
        ),
    )


class MtpDeploymentSpec(ApiModel):
    model: ModelSource
    draft_model: DraftModel | None = Field(None, description="Use this draft; else set export.")
    export: ExportSpec | None = Field(None, description="Export the draft from model; else set draftModel.")
    nnodes: int = Field(1, ge=1, le=128, description="Nodes (pods, ranks) in the group.")
    engine: Literal["builtin", "xllm", "vllm"] = "builtin"
    image: str | None = Field(None, pattern=IMAGE_PATTERN, description="Runtime image; default from the operator.")
    accelerator: Accelerator = Field(default_factory=Accelerator)
    resources: Resources = Field(default_factory=Resources)
    speculative: Speculative = Field(default_factory=Speculative)
    runtime: RuntimeFlags = Field(default_factory=RuntimeFlags)
    env: list[EnvVar] = Field(default_factory=list, max_length=128)
    extra_args: list[Annotated[str, StringConstraints(max_length=1024)]] = Field(
        default_factory=list, max_length=128, description="Appended to the engine's argv, as is."
    )
    ports: Ports = Field(default_factory=Ports)
    scheduling: Scheduling = Field(default_factory=Scheduling)
    service: ServiceSpec = Field(default_factory=ServiceSpec)
    security_context: PodSecurityContext | None = Field(
        None, description="Pod securityContext of the ranks and the export Job; default: non-root (uid 10001) "
        "except on Ascend NPUs, whose device files usually need root."
    )
    cel_rules = (
        CelRule(
            "has(self.draftModel) != has(self.export)",
            "set exactly one of spec.draftModel (an existing draft) or spec.export (export one from spec.model)",
            lambda d: ("draftModel" in d) != ("export" in d),
        ),
        CelRule(
            "!has(self.draftModel) || self.draftModel.path.startsWith(self.model.mountPath + '/')",
            "draftModel.path must lie under model.mountPath (the model volume)",
            lambda d: "draftModel" not in d or d["draftModel"]["path"].startswith(d["model"]["mountPath"] + "/"),
        ),
        CelRule(
            "!has(self.export) || (self.export.outputPath.startsWith(self.model.mountPath + '/')"
            " && self.export.outputPath != self.model.path)",
            "export.outputPath must lie under model.mountPath and differ from model.path",
            lambda d: "export" not in d or (
                d["export"]["outputPath"].startswith(d["model"]["mountPath"] + "/")
                and d["export"]["outputPath"] != d["model"]["path"]
            ),
        ),
        CelRule(
            "!has(self.export) || !has(self.model.volume.readOnly) || !self.model.volume.readOnly",
            "model.volume.readOnly cannot be true when export writes the draft into it",
            lambda d: "export" not in d or not d["model"]["volume"]["readOnly"],
        ),
        CelRule(
            "!has(self.env) || self.env.all(e, !(e.name in ['MTP_NODE_RANK', 'MTP_NNODES', 'MTP_MASTER_ADDR']))",
            "env must not set MTP_NODE_RANK, MTP_NNODES or MTP_MASTER_ADDR (the operator sets them)",
            lambda d: all(e["name"] not in RESERVED_ENV for e in d["env"]),
        ),
        CelRule(
            "!has(self.extraArgs) || self.extraArgs.all(a, !a.contains('\\n'))",
            "extraArgs items are single argv entries and must not contain newlines",
            lambda d: all("\n" not in a for a in d["extraArgs"]),
        ),
    )


def _describe(error: dict[str, Any], prefix: str) -> str:
    where = ".".join(str(part) for part in error["loc"] if not str(part).startswith("function-"))
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "string_pattern_mismatch" and error.get("ctx", {}).get("pattern") == PATH_PATTERN:
        message += " (an absolute path without spaces or shell characters)"
    return f"{prefix}.{where}: {message}" if where else f"{prefix}: {message}"


def parse_spec(data: Any, prefix: str = "spec") -> MtpDeploymentSpec:
    """Validate a camelCase spec dict; SpecError lists each bad field and why."""
    if not isinstance(data, dict):
        raise SpecError(f"{prefix}: expected a mapping, got {type(data).__name__}")
    try:
        return MtpDeploymentSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError("; ".join(_describe(e, prefix) for e in exc.errors())) from None
