"""Operator settings, read once from MTP_OPERATOR_* environment variables.

The Helm chart sets these (values `settings.<camelCase>` become
MTP_OPERATOR_<UPPER_SNAKE>). Every setting, its variable and its default:

    MTP_OPERATOR_NAMESPACE            ""      watch one namespace (comma-separated for several)
    MTP_OPERATOR_ALL_NAMESPACES       false   watch every namespace (cluster-wide RBAC)
    MTP_OPERATOR_RECONCILE_INTERVAL   5       seconds between level-based reconciles (timer)
    MTP_OPERATOR_METRICS_INTERVAL     30      seconds between rank-0 /metrics scrapes
    MTP_OPERATOR_GANG_RESTART_BUDGET  5       whole-group restarts allowed per spec generation
    MTP_OPERATOR_GANG_RESTART_BACKOFF 10      seconds before the first restart; doubles each time
    MTP_OPERATOR_HEALTH_TIMEOUT       2       seconds for one rank's GET /health
    MTP_OPERATOR_METRICS_TIMEOUT      5       seconds for rank 0's GET /metrics
    MTP_OPERATOR_RUNTIME_IMAGE        mtp-runtime:0.1.0      default runtime image (CPU/GPU)
    MTP_OPERATOR_NPU_RUNTIME_IMAGE    mtp-runtime-npu:0.1.0  default image when the accelerator is an NPU
    MTP_OPERATOR_IMAGE_PULL_SECRETS   ""      comma-separated secret names for runtime/export pods
    MTP_OPERATOR_HEALTH_PORT          8080    the operator's own liveness endpoint (/healthz)
    MTP_OPERATOR_PROBE_PODS           true    GET /health and /metrics from pods (off: readiness only)
    MTP_OPERATOR_REVISION_HISTORY     10      ControllerRevisions kept per MtpDeployment (besides those in use)
    MTP_OPERATOR_ALLOWED_HOST_PATH_PREFIXES  ""  comma-separated node directories; when set, an
                                      MtpDeployment's hostPath must lie under one of them (system
                                      directories such as /etc or /var/lib/kubelet are refused always)

Bad values fail at startup with the variable's name, never silently.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

PREFIX = "MTP_OPERATOR_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class SettingsError(ValueError):
    """An MTP_OPERATOR_* variable with a value that cannot be used."""


@dataclass(frozen=True)
class OperatorSettings:
    namespace: tuple[str, ...] = ()
    all_namespaces: bool = False
    reconcile_interval: float = 5.0
    metrics_interval: float = 30.0
    gang_restart_budget: int = 5
    gang_restart_backoff: float = 10.0
    health_timeout: float = 2.0
    metrics_timeout: float = 5.0
    runtime_image: str = "mtp-runtime:0.1.0"
    npu_runtime_image: str = "mtp-runtime-npu:0.1.0"
    image_pull_secrets: tuple[str, ...] = ()
    health_port: int = 8080
    probe_pods: bool = True
    revision_history: int = 10
    allowed_host_path_prefixes: tuple[str, ...] = ()
    _positive: tuple[str, ...] = field(default=("reconcile_interval", "metrics_interval", "health_timeout",
                                                 "metrics_timeout"), repr=False)

    def __post_init__(self) -> None:
        for name in self._positive:
            if getattr(self, name) <= 0:
                raise SettingsError(f"{PREFIX}{name.upper()} must be > 0, got {getattr(self, name)}")
        if self.revision_history < 0:
            raise SettingsError(f"{PREFIX}REVISION_HISTORY must be >= 0, got {self.revision_history}")
        if self.gang_restart_budget < 0 or self.gang_restart_backoff < 0:
            raise SettingsError(f"{PREFIX}GANG_RESTART_BUDGET and _BACKOFF must be >= 0")
        if not 0 < self.health_port < 65536:
            raise SettingsError(f"{PREFIX}HEALTH_PORT must be a TCP port, got {self.health_port}")
        for prefix in self.allowed_host_path_prefixes:
            segments = prefix[1:].split("/")
            if not prefix.startswith("/") or any(seg in ("", ".", "..") for seg in segments):
                raise SettingsError(f"{PREFIX}ALLOWED_HOST_PATH_PREFIXES: {prefix!r} is not an absolute directory "
                                    "without '.', '..', empty segments or a trailing '/' (leave the setting "
                                    "empty to allow any host path)")
        if self.all_namespaces and self.namespace:
            raise SettingsError(f"set either {PREFIX}NAMESPACE or {PREFIX}ALL_NAMESPACES, not both")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> "OperatorSettings":
        """Defaults <- environment <- explicit overrides (command-line flags)."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name.startswith("_"):
                continue
            var = PREFIX + f.name.upper()
            if var in environ:
                values[f.name] = _convert(var, environ[var], f.default)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def _convert(var: str, raw: str, default: Any) -> Any:
    text = raw.strip()
    try:
        if isinstance(default, bool):
            if text.lower() not in _TRUE | _FALSE:
                raise ValueError("expected true or false")
            return text.lower() in _TRUE
        if isinstance(default, int):
            return int(text)
        if isinstance(default, float):
            return float(text)
        if isinstance(default, tuple):
            return tuple(part.strip() for part in text.split(",") if part.strip())
        return text
    except ValueError as exc:
        raise SettingsError(f"{var}={raw!r}: {exc}") from None
