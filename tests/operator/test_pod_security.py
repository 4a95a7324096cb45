"""securityContext of the runtime pods: non-root by default, root on Ascend NPUs, spec override."""

from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import pytest

from mtp_operator.manifests import build_export_job, build_statefulset
from mtp_operator.plan import kubernetes_master_host, plan_deployment
from mtp_operator.pod_security import RUNTIME_GID, RUNTIME_UID
from mtp_operator.settings import OperatorSettings
from mtp_operator.spec import SpecError, parse_spec

REPO = Path(__file__).resolve().parents[2]
SETTINGS = OperatorSettings()
NPU = {"accelerator": {"resourceName": "huawei.com/Ascend910", "count": 8}}
GPU = {"accelerator": {"resourceName": "nvidia.com/gpu", "count": 8}}
OVERRIDE = {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "supplementalGroups": [1001],
            "seccompProfile": {"type": "Localhost", "localhostProfile": "profiles/npu.json"}}


def _pods(make_cr, changes):
    """(the StatefulSet's pod spec, the export Job's pod spec) for a spec with `changes`."""
    cr = make_cr(changes=changes)
    spec = parse_spec(cr["spec"])
    plan = plan_deployment("ds", "default", spec, master_host=kubernetes_master_host("ds", "default"),
                           settings=SETTINGS)
    sts = build_statefulset(plan, spec, cr, SETTINGS)
    job = build_export_job(plan, spec, cr, SETTINGS)
    for obj in (sts, job):
        kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)
    return sts["spec"]["template"]["spec"], job["spec"]["template"]["spec"]


@pytest.mark.parametrize("changes", [{}, GPU], ids=["cpu", "gpu"])
def test_non_root_by_default(make_cr, changes):
    for pod in _pods(make_cr, changes):
        context = pod["securityContext"]
        assert context["runAsNonRoot"] is True
        assert (context["runAsUser"], context["runAsGroup"]) == (RUNTIME_UID, RUNTIME_GID)
        # The export Job writes the draft into the model volume: the group must own it.
        assert context["fsGroup"] == RUNTIME_GID
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}
        (container,) = pod["containers"]
        assert container["securityContext"] == {"allowPrivilegeEscalation": False,
                                                "capabilities": {"drop": ["ALL"]}}


def test_ascend_npu_keeps_root_by_default(make_cr):
    for pod in _pods(make_cr, NPU):
        context = pod["securityContext"]
        assert context["runAsUser"] == 0 and context["runAsNonRoot"] is False
        assert "fsGroup" not in context
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}
        (container,) = pod["containers"]
        # Root keeps its capabilities (device files), but can never gain more.
        assert container["securityContext"] == {"allowPrivilegeEscalation": False}


@pytest.mark.parametrize("changes", [{}, NPU], ids=["cpu", "npu"])
def test_spec_security_context_replaces_the_default(make_cr, changes):
    for pod in _pods(make_cr, {**changes, "securityContext": OVERRIDE}):
        assert pod["securityContext"] == OVERRIDE


def test_security_context_change_rolls_the_group(make_cr):
    def template_hash(changes):
        return plan_deployment("ds", "default", parse_spec(make_cr(changes=changes)["spec"]), master_host="h") \
            .template_hash

    assert template_hash(NPU) != template_hash({**NPU, "securityContext": {"runAsUser": 1000}})
    assert template_hash({"securityContext": {"runAsUser": 1000}}) != \
        template_hash({"securityContext": {"runAsUser": 1001}})


@pytest.mark.parametrize(
    ("security_context", "expected"),
    [
        ({"runAsNonRoot": True, "runAsUser": 0}, "runAsNonRoot cannot be true with runAsUser 0"),
        ({"runAsUser": -1}, "spec.securityContext.runAsUser"),
        ({"seccompProfile": {"type": "Localhost"}}, "localhostProfile is set exactly when type is Localhost"),
        ({"seccompProfile": {"type": "Strict"}}, "spec.securityContext.seccompProfile.type"),
        ({"runAsNonroot": True}, "spec.securityContext.runAsNonroot"),
        ({"fsGroupChangePolicy": "Never"}, "spec.securityContext.fsGroupChangePolicy"),
    ],
    ids=["root-non-root", "negative-uid", "localhost-no-profile", "seccomp-type", "typo", "change-policy"],
)
def test_bad_security_context_names_the_field(make_spec, security_context, expected):
    with pytest.raises(SpecError, match=re.escape(expected)):
        parse_spec(make_spec({"securityContext": security_context}))


def test_default_uid_is_the_runtime_images_user():
    dockerfile = (REPO / "Dockerfile").read_text()
    assert re.search(rf"^ARG APP_UID={RUNTIME_UID}$", dockerfile, re.MULTILINE)
