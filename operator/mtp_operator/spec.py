"""The MtpDeployment spec: pydantic models, the single source of the CRD schema.

Field names are snake_case in Python and camelCase in YAML (aliases). A spec
is checked in three layers; every error is `spec.<field>: why`:

1. Schema: types (strict, as the API server: `nnodes: "2"` or `true` is not
   an integer, `"off"` is not a boolean), patterns, bounds and lengths in
   each `Field`. They become the CRD's OpenAPI schema. One difference: an
   integral float (`nnodes: 2.0`) is refused here, while kube-apiserver
   admits it in an integer field no CEL rule reads (storing 2; a rule that
   reads the field fails on it) and kubectl sends YAML's 2.0 as 2 anyway.
2. `CelRule`s of a model (`cel_rules`), for rules that span fields: the CEL
   text goes into the CRD's `x-kubernetes-validations` (the API server
   enforces it; `field` becomes its `fieldPath`) and the same rule in Python
   runs in the model validator, so `mtp up`, the operator and tests reject
   the same specs with the same message.
3. `PYTHON_RULES`: what the API server cannot check, run by `parse_spec`
   only, after 1 and 2 pass. The API server admits such a spec; the operator
   then reports it InvalidSpec. Today: host paths outside the operator's
   MTP_OPERATOR_ALLOWED_HOST_PATH_PREFIXES, and the builtin engine's flags as
   `mtp serve`'s own validator judges them (engine_flags.py).

    spec = parse_spec(cr["spec"], settings=settings)   # MtpDeploymentSpec, or SpecError naming the field

Paths are canonical (absolute, no `.`/`..` or empty segments, no trailing
`/`), so "lies under" is a comparison of path components; CEL's
`startsWith(dir + '/')` says the same thing for canonical paths.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Annotated, Any, Callable, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, model_validator
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

from mtp_operator import constants as c
from mtp_operator.settings import OperatorSettings

if TYPE_CHECKING:
    from collections.abc import Sequence

# An absolute path of `/`-separated names: no spaces or shell metacharacters
# (it lands in argv and in volume mounts), no `.` or `..` segment, no empty
# segment, no trailing `/`. A segment may start with dots only if something
# else follows (`.cache`, `...`). Go's RE2 and pydantic's regex both read it.
_SEGMENT = r"(?:[A-Za-z0-9_@+=-]|\.[A-Za-z0-9_@+=-]|\.\.[A-Za-z0-9._@+=-])[A-Za-z0-9._@+=-]*"
PATH_PATTERN = rf"^(?:/{_SEGMENT})+$"
MAX_PATH = 4096  # Linux PATH_MAX
# Image references as the distribution reference grammar has them: optional
# registry host[:port], lowercase repository path components, :tag, @digest.
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[a-fA-F0-9:]+\])(?::[0-9]+)?"
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_TAG = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
IMAGE_PATTERN = rf"^(?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*(?::{_TAG})?(?:@{_DIGEST})?$"
# Kubernetes' quantity grammar (`500m`, `1Gi`, `1e3`, `0.5`, `.5`), without a
# sign (a negative request is refused by the kubelet anyway) and with an
# exponent of at most two digits.
QUANTITY_PATTERN = r"^(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[KMGTPE]i|[numkMGTPE]|[eE][-+]?[0-9]{1,2})?$"
ACCELERATOR_PATTERN = r"^(huawei\.com/Ascend[A-Za-z0-9-]+|nvidia\.com/gpu)$"
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
CONFIG_KEY_PATTERN = r"^[-._a-zA-Z0-9]+$"  # a key of a Secret or ConfigMap
# The pod fields Kubernetes lets an environment variable read (downward API).
FIELD_PATH_PATTERN = (r"^(metadata\.(name|namespace|uid)|spec\.(nodeName|serviceAccountName)"
                      r"|status\.(hostIP|hostIPs|podIP|podIPs)|metadata\.(labels|annotations)\['[A-Za-z0-9._/-]+'\])$")

# Environment variables the operator sets in rank pods itself (plan.py, manifests.py).
RESERVED_ENV = (c.ENV_NODE_RANK, c.ENV_NNODES, c.ENV_MASTER_ADDR, c.ENV_POD_IP, c.ENV_HCCL_IF_IP,
                c.ENV_HCCL_CONNECT_TIMEOUT, c.ENV_API_KEY, c.ENV_VLLM_API_KEY)
# Engine flags the operator sets (every engine's, `_` spelling): extraArgs must
# not set them in any spelling (`--x=v`, `--x v`, `-x`, `_` or `-`).
OPERATOR_FLAGS = (
    "model", "draft_model", "num_speculative_tokens", "devices", "draft_devices", "host", "port",
    "master_node_addr", "nnodes", "node_rank", "api_key", "shutdown_timeout", "communication_backend",
    "speculative_adaptive",
    # vLLM's, with its short forms
    "speculative_config", "tensor_parallel_size", "data_parallel_size", "data_parallel_size_local",
    "data_parallel_address", "data_parallel_rpc_port", "data_parallel_start_rank", "headless",
    "tp", "dp", "dpl", "dpa", "dpp", "dpr",
)
_OWNED_FLAG_REGEX = "^--?(" + "|".join(f.replace("_", "[-_]") for f in OPERATOR_FLAGS) + ")(=|$)"
# Node directories a hostPath must not be, lie in, or contain: the node's OS,
# its devices and kernel interfaces, the kubelet's and the container
# runtime's state (other pods' volumes, Secrets and images), CNI plugins, logs.
HOST_SYSTEM_DIRS = (
    "/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/root", "/run",
    "/sbin", "/sys", "/usr", "/var/run", "/var/lock", "/var/log", "/var/lib/kubelet", "/var/lib/containerd",
    "/var/lib/docker", "/var/lib/cri-o", "/var/lib/etcd", "/var/lib/cni", "/opt/cni", "/snap",
)
# Container directories the model volume must not hide (be, lie in, or
# contain): the image's OS, /dev (and /dev/shm), kernel interfaces, and the
# runtime image's `mtp` launcher in /opt/mtp.
CONTAINER_SYSTEM_DIRS = (
    "/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/run", "/sbin", "/sys",
    "/usr", "/var/run", "/opt/mtp",
)


class SpecError(ValueError):
    """An invalid MtpDeployment spec; the message names every offending field."""


@dataclass(frozen=True)
class CelRule:
    """A cross-field rule: CEL for the API server, `holds` for Python (camelCase dict).

    `field` is where the error is reported, relative to the model (`.path`,
    `.export.outputPath`): the CRD rule's fieldPath, and the Python error's
    location.
    """

    rule: str
    message: str
    holds: Callable[[dict[str, Any]], bool]
    field: str = ""


@dataclass(frozen=True)
class PythonRule:
    """A check the API server cannot make (it needs operator settings or the
    runtime's validator); `parse_spec` runs it after the schema and CEL rules.
    `errors(spec, settings)` returns `field: why` texts, fields below `spec`."""

    name: str
    errors: Callable[["MtpDeploymentSpec", OperatorSettings], "Sequence[str]"]


def cel_list(values: tuple[str, ...]) -> str:
    return "[" + ", ".join(f"'{v}'" for v in values) + "]"


def is_within(path: str, directory: str) -> bool:
    """`path` is `directory` or lies inside it, by path components."""
    return PurePosixPath(path).parts[:len(PurePosixPath(directory).parts)] == PurePosixPath(directory).parts


def overlaps(path: str, directory: str) -> bool:
    """One of the two contains the other (or they are equal)."""
    return is_within(path, directory) or is_within(directory, path)


def _touches_cel(field: str, dirs: tuple[str, ...]) -> str:
    """CEL: `field` equals, lies in or contains one of `dirs` (canonical paths)."""
    return (f"{cel_list(dirs)}.exists(d, {field} == d || {field}.startsWith(d + '/')"
            f" || d.startsWith({field} + '/'))")


_DECIMAL_SUFFIX = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_BINARY_SUFFIX = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_QUANTITY = re.compile(r"^([0-9]*\.?[0-9]*)(.*)$")


def parse_quantity(text: str) -> Decimal:
    """The value of a quantity that matches QUANTITY_PATTERN (`1Gi` -> 1073741824)."""
    match = _QUANTITY.match(text)
    if match is None or not re.match(QUANTITY_PATTERN, text):
        raise ValueError(f"{text!r} is not a Kubernetes quantity")
    number, suffix = Decimal(match.group(1)), match.group(2)
    if suffix in _BINARY_SUFFIX:
        return number * (2 ** _BINARY_SUFFIX[suffix])
    if suffix in _DECIMAL_SUFFIX:
        return number.scaleb(_DECIMAL_SUFFIX[suffix])
    return number.scaleb(int(suffix[1:]))  # e/E exponent


class ApiModel(BaseModel):
    # strict: the API server's types (no "2" for 2, no 2.0 or true for an integer, no "off" for false).
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", strict=True)
    cel_rules: ClassVar[tuple[CelRule, ...]] = ()

    @model_validator(mode="after")
    def _check_cel_rules(self) -> "ApiModel":
        data = self.model_dump(by_alias=True, exclude_none=True)
        for rule in self.cel_rules:
            if not rule.holds(data):
                raise PydanticCustomError("cel_rule", "{message}", {"message": rule.message, "field": rule.field})
        return self


PathStr = Annotated[str, StringConstraints(pattern=PATH_PATTERN, max_length=MAX_PATH)]


class ModelVolume(ApiModel):
    """Where checkpoints live: exactly one of a PVC or a node's hostPath."""

    claim_name: str | None = Field(None, pattern=DNS_LABEL_PATTERN, max_length=63,
                                   description="PersistentVolumeClaim name.")
    host_path: PathStr | None = Field(None, description="Directory on the node; never a system directory "
                                      "(the operator may also allow only some prefixes).")
    read_only: bool = Field(False, description="Mount read-only (only when the draft already exists).")
    cel_rules = (
        CelRule(
            "has(self.claimName) != has(self.hostPath)",
            "set exactly one of volume.claimName or volume.hostPath",
            lambda d: ("claimName" in d) != ("hostPath" in d),
        ),
        CelRule(
            "!has(self.hostPath) || !" + _touches_cel("self.hostPath", HOST_SYSTEM_DIRS),
            "hostPath must not be, lie in or contain a system directory of the node "
            f"({', '.join(HOST_SYSTEM_DIRS)})",
            lambda d: "hostPath" not in d or not any(overlaps(d["hostPath"], x) for x in HOST_SYSTEM_DIRS),
            field=".hostPath",
        ),
    )


class ModelSource(ApiModel):
    path: PathStr = Field(description="Main checkpoint directory inside the pod.")
    model_type: Literal["auto", "deepseek_v3", "deepseek_v32", "glm4_moe"] = "auto"
    volume: ModelVolume
    mount_path: PathStr = Field("/models", description="Where the volume is mounted; never over a system "
                                "directory of the container.")
    cel_rules = (
        CelRule(
            "self.path.startsWith(self.mountPath + '/')",
            "model.path must lie under model.mountPath (the model volume)",
            lambda d: is_within(d["path"], d["mountPath"]) and d["path"] != d["mountPath"],
            field=".path",
        ),
        CelRule(
            "!" + _touches_cel("self.mountPath", CONTAINER_SYSTEM_DIRS),
            "mountPath must not be, lie in or contain a system directory of the container "
            f"({', '.join(CONTAINER_SYSTEM_DIRS)}): the volume would hide it",
            lambda d: not any(overlaps(d["mountPath"], x) for x in CONTAINER_SYSTEM_DIRS),
            field=".mountPath",
        ),
    )


class DraftModel(ApiModel):
    path: PathStr = Field(description="An existing exported draft directory.")


Quantity = Annotated[str, StringConstraints(pattern=QUANTITY_PATTERN, max_length=64)]


class ResourceList(ApiModel):
    cpu: Quantity | None = None
    memory: Quantity | None = None


def _request_within_limit(resource: str) -> CelRule:
    def holds(d: dict[str, Any]) -> bool:
        request, limit = d.get("requests", {}).get(resource), d.get("limits", {}).get(resource)
        return request is None or limit is None or parse_quantity(request) <= parse_quantity(limit)

    return CelRule(
        f"!has(self.requests) || !has(self.limits) || !has(self.requests.{resource}) || "
        f"!has(self.limits.{resource}) || "
        f"quantity(self.requests.{resource}).compareTo(quantity(self.limits.{resource})) <= 0",
        f"requests.{resource} must not exceed limits.{resource}",
        holds,
        field=f".requests.{resource}",
    )


class Resources(ApiModel):
    requests: ResourceList = Field(default_factory=ResourceList)
    limits: ResourceList = Field(default_factory=ResourceList)
    cel_rules = (_request_within_limit("cpu"), _request_within_limit("memory"))


Image = Annotated[str, StringConstraints(pattern=IMAGE_PATTERN, max_length=512)]


class ExportSpec(ApiModel):
    """Cut the MTP layer out of `model` with `mtp export` in a Job."""

    output_path: PathStr = Field(description="Draft directory to write (model volume).")
    image: Image | None = Field(None, description="Defaults to spec.image.")
    resources: Resources = Field(default_factory=Resources)
    force: bool = Field(False, description="Re-export even if the output's manifest is up to date.")


class Accelerator(ApiModel):
    resource_name: str | None = Field(
        None, pattern=ACCELERATOR_PATTERN, max_length=253,
        description="e.g. huawei.com/Ascend910 or nvidia.com/gpu; none = CPU.",
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
    adaptive: bool | None = Field(
        None, description="Adaptive depth: numSpeculativeTokens is the largest k and the engine picks every step's "
        "k in 0..K from measured acceptance and step cost (builtin engine: --speculative_adaptive=true; vllm and "
        "xllm have no equivalent and are refused).")
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
    shutdown_timeout: int | None = Field(
        None, ge=0, le=3600, description="Seconds a stopping rank lets in-flight requests finish (builtin engine: "
        "--shutdown_timeout, default 30); the pods' terminationGracePeriodSeconds is this plus a margin.")


class ObjectKeyRef(ApiModel):
    """A key of a Secret or ConfigMap in the MtpDeployment's namespace."""

    name: str = Field(pattern=DNS_SUBDOMAIN_PATTERN, max_length=253)
    key: str = Field(pattern=CONFIG_KEY_PATTERN, max_length=253)
    optional: bool | None = None


class PodFieldRef(ApiModel):
    field_path: str = Field(pattern=FIELD_PATH_PATTERN, max_length=512,
                            description="A pod field the downward API gives containers, e.g. status.hostIP.")
    api_version: Literal["v1"] | None = None


class EnvVarSource(ApiModel):
    secret_key_ref: ObjectKeyRef | None = None
    config_map_key_ref: ObjectKeyRef | None = None
    field_ref: PodFieldRef | None = None
    cel_rules = (
        CelRule(
            "(has(self.secretKeyRef) ? 1 : 0) + (has(self.configMapKeyRef) ? 1 : 0) + (has(self.fieldRef) ? 1 : 0)"
            " == 1",
            "valueFrom needs exactly one of secretKeyRef, configMapKeyRef or fieldRef",
            lambda d: sum(k in d for k in ("secretKeyRef", "configMapKeyRef", "fieldRef")) == 1,
        ),
    )


class EnvVar(ApiModel):
    name: str = Field(pattern=ENV_NAME_PATTERN, max_length=256)
    value: str | None = Field(None, max_length=32768)
    value_from: EnvVarSource | None = None
    cel_rules = (
        CelRule(
            "has(self.value) != has(self.valueFrom)",
            "set exactly one of env[].value or env[].valueFrom",
            lambda d: ("value" in d) != ("valueFrom" in d),
        ),
    )


class ApiKeySecret(ApiModel):
    """The Secret key holding the API key clients must send (Authorization: Bearer)."""

    name: str = Field(pattern=DNS_SUBDOMAIN_PATTERN, max_length=253, description="Secret in the same namespace.")
    key: str = Field(pattern=CONFIG_KEY_PATTERN, max_length=253, description="Key of the Secret.")


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


def _owned_flag(arg: str) -> bool:
    """`arg` sets a flag in OPERATOR_FLAGS (any spelling); the Python twin of _OWNED_FLAG_REGEX."""
    dashes = len(arg) - len(arg.lstrip("-"))
    name = arg[dashes:].split("=", 1)[0].replace("-", "_")
    return dashes in (1, 2) and name in OPERATOR_FLAGS


class CanarySpec(ApiModel):
    """How a new revision is judged on its first groups before the rest follow (mtp_operator.rollout)."""

    groups: int = Field(1, ge=1, le=1000, description="Groups that take a new revision first.")
    analysis_seconds: int = Field(
        60, ge=0, le=86400, description="How long the canary groups' rank-0 figures are compared once Ready.")
    min_acceptance_ratio: float = Field(
        0.9, ge=0, le=10, description="Fail unless new acceptance rate / old acceptance rate >= this.")
    max_tpot_ratio: float = Field(
        1.2, gt=0, le=100, description="Fail unless new time per output token / old <= this.")
    min_draft_tokens: int = Field(
        100, ge=0, le=1_000_000_000, description="Drafted tokens the canary groups need before they are judged.")


class RolloutSpec(ApiModel):
    """A template change updates whole groups (never single ranks): canaries first, then the rest."""

    max_unavailable: int = Field(1, ge=0, le=1000, description="Groups that may be down for an update at once.")
    max_surge: int = Field(
        0, ge=0, le=1000, description="Extra groups on the new revision during a rollout (the canaries, then "
        "spare capacity while old groups are updated).")
    paused: bool = Field(False, description="Make no further rollout step until unpaused.")
    canary: CanarySpec = Field(default_factory=CanarySpec)
    cel_rules = (
        CelRule("self.maxUnavailable + self.maxSurge >= 1",
                "rollout.maxUnavailable and rollout.maxSurge cannot both be 0 (no group could be updated)",
                lambda d: d["maxUnavailable"] + d["maxSurge"] >= 1),
    )


class MtpDeploymentSpec(ApiModel):
    model: ModelSource
    draft_model: DraftModel | None = Field(None, description="Use this draft; else set export.")
    export: ExportSpec | None = Field(None, description="Export the draft from model; else set draftModel.")
    nnodes: int = Field(1, ge=1, le=128, description="Nodes (pods, ranks) in the group.")
    replicas: int = Field(
        1, ge=0, le=1000, description="Groups of nnodes ranks, each with its own master (the scale "
        "subresource: kubectl scale, HPA, KEDA). 0 keeps the export and the Services.")
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    engine: Literal["builtin", "xllm", "vllm"] = "builtin"
    image: Image | None = Field(None, description="Runtime image; default from the operator.")
    accelerator: Accelerator = Field(default_factory=Accelerator)
    resources: Resources = Field(default_factory=Resources)
    speculative: Speculative = Field(default_factory=Speculative)
    runtime: RuntimeFlags = Field(default_factory=RuntimeFlags)
    api_key_secret: ApiKeySecret | None = Field(
        None, description="Clients must send this Secret's key as a Bearer token; the ranks read it from the "
        "Secret (env MTP_API_KEY, VLLM_API_KEY for vllm), so it is never in argv, status or Events.")
    env: list[EnvVar] = Field(default_factory=list, max_length=128)
    extra_args: list[Annotated[str, StringConstraints(max_length=1024)]] = Field(
        default_factory=list, max_length=128,
        description="Appended to the engine's argv, as is; never a flag the operator sets.",
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
            lambda d: "draftModel" not in d or (is_within(d["draftModel"]["path"], d["model"]["mountPath"])
                                                and d["draftModel"]["path"] != d["model"]["mountPath"]),
            field=".draftModel.path",
        ),
        CelRule(
            "!has(self.draftModel) || self.draftModel.path != self.model.path",
            "draftModel.path must differ from model.path (the draft is the `mtp export` output, not the checkpoint)",
            lambda d: "draftModel" not in d or d["draftModel"]["path"] != d["model"]["path"],
            field=".draftModel.path",
        ),
        CelRule(
            "!has(self.export) || self.export.outputPath.startsWith(self.model.mountPath + '/')",
            "export.outputPath must lie under model.mountPath (the model volume)",
            lambda d: "export" not in d or (is_within(d["export"]["outputPath"], d["model"]["mountPath"])
                                            and d["export"]["outputPath"] != d["model"]["mountPath"]),
            field=".export.outputPath",
        ),
        CelRule(
            "!has(self.export) || !(self.export.outputPath == self.model.path"
            " || self.export.outputPath.startsWith(self.model.path + '/')"
            " || self.model.path.startsWith(self.export.outputPath + '/'))",
            "export.outputPath must not be, lie in or contain model.path (the export would overwrite the checkpoint)",
            lambda d: "export" not in d or not overlaps(d["export"]["outputPath"], d["model"]["path"]),
            field=".export.outputPath",
        ),
        CelRule(
            "!has(self.export) || !has(self.model.volume.readOnly) || !self.model.volume.readOnly",
            "model.volume.readOnly cannot be true when export writes the draft into it",
            lambda d: "export" not in d or not d["model"]["volume"]["readOnly"],
        ),
        CelRule(
            f"!has(self.env) || self.env.all(e, !(e.name in {cel_list(RESERVED_ENV)}))",
            f"env must not set {', '.join(RESERVED_ENV)} (the operator sets them)",
            lambda d: all(e["name"] not in RESERVED_ENV for e in d["env"]),
            field=".env",
        ),
        CelRule(
            "!has(self.env) || self.env.all(e, self.env.exists_one(f, f.name == e.name))",
            "env must not name a variable twice",
            lambda d: len({e["name"] for e in d["env"]}) == len(d["env"]),
            field=".env",
        ),
        CelRule(
            "!has(self.extraArgs) || self.extraArgs.all(a, !a.contains('\\n'))",
            "extraArgs items are single argv entries and must not contain newlines",
            lambda d: all("\n" not in a for a in d["extraArgs"]),
        ),
        CelRule(
            f"!has(self.extraArgs) || self.extraArgs.all(a, !a.matches('{_OWNED_FLAG_REGEX}'))",
            "extraArgs must not set a flag the operator sets (" + ", ".join(f"--{f}" for f in OPERATOR_FLAGS)
            + "): use the spec's own fields (spec.model, spec.ports, spec.runtime, spec.apiKeySecret, ...)",
            lambda d: not any(_owned_flag(a) for a in d["extraArgs"]),
            field=".extraArgs",
        ),
        CelRule(
            "!has(self.apiKeySecret) || self.engine != 'xllm'",
            "apiKeySecret is for engines builtin and vllm (xllm reads no API key from the environment)",
            lambda d: "apiKeySecret" not in d or d["engine"] != "xllm",
            field=".apiKeySecret",
        ),
    )


def _host_path_allowed(spec: MtpDeploymentSpec, settings: OperatorSettings) -> list[str]:
    host_path, allowed = spec.model.volume.host_path, settings.allowed_host_path_prefixes
    if host_path is None or not allowed or any(is_within(host_path, prefix) for prefix in allowed):
        return []
    return [f"model.volume.hostPath: {host_path} is outside the host paths this operator allows "
            f"({', '.join(allowed)}; MTP_OPERATOR_ALLOWED_HOST_PATH_PREFIXES); use one under them or a "
            "PersistentVolumeClaim (volume.claimName)"]


def _builtin_engine_flags(spec: MtpDeploymentSpec, settings: OperatorSettings) -> list[str]:
    from mtp_operator.engine_flags import builtin_flag_errors  # engines.py imports this module

    return builtin_flag_errors(spec)


# Checks the API server cannot make: they run in parse_spec only (see the module docstring).
PYTHON_RULES = (
    PythonRule("host path under the operator's allowed prefixes", _host_path_allowed),
    PythonRule("builtin engine flags, by mtp serve's validator", _builtin_engine_flags),
)


def _describe(error: dict[str, Any], prefix: str) -> str:
    parts = [str(part) for part in error["loc"] if not str(part).startswith("function-")]
    if error["type"] == "cel_rule" and error["ctx"]["field"]:
        parts += error["ctx"]["field"].lstrip(".").split(".")
    where = ".".join(parts)
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "string_pattern_mismatch" and error.get("ctx", {}).get("pattern") == PATH_PATTERN:
        message += (" (an absolute path of /-separated names: no spaces or shell characters, no '.' or '..' "
                    "or empty segment, no trailing '/')")
    elif error["type"] == "string_pattern_mismatch" and error.get("ctx", {}).get("pattern") == IMAGE_PATTERN:
        message += " (an image reference: [registry[:port]/]lowercase/path[:tag][@digest])"
    elif error["type"] == "string_pattern_mismatch" and error.get("ctx", {}).get("pattern") == QUANTITY_PATTERN:
        message += " (a Kubernetes quantity such as 500m, 2, 1.5, 1Gi or 1e3)"
    return f"{prefix}.{where}: {message}" if where else f"{prefix}: {message}"


def parse_spec(data: Any, prefix: str = "spec", settings: OperatorSettings | None = None) -> MtpDeploymentSpec:
    """Validate a camelCase spec dict; SpecError lists each bad field and why.

    Schema and CEL rules first (what the API server also enforces), then
    PYTHON_RULES with `settings` (default: the operator's defaults).
    """
    if not isinstance(data, dict):
        raise SpecError(f"{prefix}: expected a mapping, got {type(data).__name__}")
    try:
        # YAML keys are the camelCase aliases only, as in the CRD (snake_case is Python's spelling).
        spec = MtpDeploymentSpec.model_validate(data, by_alias=True, by_name=False)
    except ValidationError as exc:
        raise SpecError("; ".join(_describe(e, prefix) for e in exc.errors())) from None
    settings = settings or OperatorSettings()
    errors = [f"{prefix}.{error}" for rule in PYTHON_RULES for error in rule.errors(spec, settings)]
    if errors:
        raise SpecError("; ".join(errors))
    return spec
