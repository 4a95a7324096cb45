"""securityContext of the runtime pods (every rank and the export Job).

    pod_security_context(spec, accelerator_kind)   pod level: spec.securityContext, else the default
    container_security_context(accelerator_kind)   container level: no privilege escalation, ...

Default everywhere but on Ascend NPUs: non-root as the runtime images' user,
fsGroup so the export Job can write the draft into a PVC, RuntimeDefault
seccomp, no capabilities. Ascend's device files (/dev/davinci*) and driver
tools usually need root, so NPU pods run as root (still no privilege
escalation, RuntimeDefault seccomp) unless spec.securityContext says otherwise.
"""

from __future__ import annotations

from typing import Any

from mtp_operator.spec import MtpDeploymentSpec

# The user and group of the runtime images (the Dockerfile's APP_UID).
RUNTIME_UID = 10001
RUNTIME_GID = 10001
NPU = "npu"


def _default_pod_context(accelerator_kind: str) -> dict[str, Any]:
    seccomp = {"seccompProfile": {"type": "RuntimeDefault"}}
    if accelerator_kind == NPU:
        # Explicit: the runtime-npu image's USER is not root, the devices want it.
        return {"runAsNonRoot": False, "runAsUser": 0, **seccomp}
    return {"runAsNonRoot": True, "runAsUser": RUNTIME_UID, "runAsGroup": RUNTIME_GID, "fsGroup": RUNTIME_GID,
            # Re-chowning a large checkpoint volume on every mount would delay each start.
            "fsGroupChangePolicy": "OnRootMismatch", **seccomp}


def pod_security_context(spec: MtpDeploymentSpec, accelerator_kind: str) -> dict[str, Any]:
    if spec.security_context is not None:
        return spec.security_context.model_dump(by_alias=True, exclude_none=True)
    return _default_pod_context(accelerator_kind)


def container_security_context(accelerator_kind: str) -> dict[str, Any]:
    context: dict[str, Any] = {"allowPrivilegeEscalation": False}
    if accelerator_kind != NPU:
        # On NPUs root keeps its default capabilities: opening device files owned
        # by the driver's group needs CAP_DAC_OVERRIDE when running as root.
        context["capabilities"] = {"drop": ["ALL"]}
    return context
