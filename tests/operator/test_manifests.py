"""Manifests built from plans: shape, and strict validation against Kubernetes schemas."""

from __future__ import annotations

import kubernetes_validate
import pytest

from mtp_operator import constants as c
from mtp_operator.manifests import (build_client_service, build_export_job, build_headless_service,
                                    build_statefulset)
from mtp_operator.plan import kubernetes_master_host, plan_deployment
from mtp_operator.settings import OperatorSettings
from mtp_operator.spec import parse_spec

VERSIONS = ["1.28", kubernetes_validate.latest_version()]
SETTINGS = OperatorSettings(image_pull_secrets=("regcred",))
VARIANTS = {
    "builtin-cpu": {},
    "builtin-npu": {"accelerator": {"resourceName": "huawei.com/Ascend910", "count": 8}},
    "builtin-gpu": {"accelerator": {"resourceName": "nvidia.com/gpu", "count": 4}},
    "xllm-npu": {"engine": "xllm", "accelerator": {"resourceName": "huawei.com/Ascend910", "count": 8}},
    "vllm-gpu": {"engine": "vllm", "accelerator": {"resourceName": "nvidia.com/gpu", "count": 8},
                 "service": {"type": "LoadBalancer"}},
    "hostpath-scheduling": {"model": {"volume": {"claimName": None, "hostPath": "/mnt/models"}},
                            "scheduling": {"nodeSelector": {"a": "b"},
                                           "tolerations": [{"key": "k", "operator": "Exists"}],
                                           "affinity": {"nodeAffinity": {}}, "priorityClassName": "high",
                                           "schedulerName": "volcano"},
                            "resources": {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"memory": "8Gi"}},
                            "env": [{"name": "FOO", "value": "bar"}],
                            "export": {"resources": {"requests": {"cpu": "1"}}}},
    "npu-security-context": {"accelerator": {"resourceName": "huawei.com/Ascend910", "count": 8},
                             "securityContext": {"runAsUser": 1000, "runAsGroup": 1000, "runAsNonRoot": True,
                                                 "fsGroup": 1000, "fsGroupChangePolicy": "Always",
                                                 "supplementalGroups": [1001],
                                                 "seccompProfile": {"type": "Unconfined"},
                                                 "seLinuxOptions": {"level": "s0:c123,c456"},
                                                 "sysctls": [{"name": "net.core.somaxconn", "value": "1024"}]}},
    "secrets-and-drain": {"apiKeySecret": {"name": "mtp-api", "key": "token"}, "runtime": {"shutdownTimeout": 90},
                          "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "t"}}},
                                  {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                                  {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "mode",
                                                                                     "optional": True}}}]},
}


def _all(make_cr, changes):
    cr = make_cr(changes=changes)
    spec = parse_spec(cr["spec"])
    plan = plan_deployment("ds", "default", spec, master_host=kubernetes_master_host("ds", "default"),
                           settings=SETTINGS)
    return plan, {
        "job": build_export_job(plan, spec, cr, SETTINGS),
        "headless": build_headless_service(plan, cr),
        "client": build_client_service(plan, spec, cr),
        "statefulset": build_statefulset(plan, spec, cr, SETTINGS),
    }


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("variant", VARIANTS.keys())
def test_every_manifest_is_valid_kubernetes(make_cr, variant, version):
    _, objects = _all(make_cr, VARIANTS[variant])
    for obj in objects.values():
        kubernetes_validate.validate(obj, version, strict=True)


def test_statefulset_shape(make_cr):
    plan, objects = _all(make_cr, VARIANTS["builtin-npu"])
    sts = objects["statefulset"]
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    assert sts["spec"]["updateStrategy"] == {"type": "OnDelete"}
    assert sts["spec"]["replicas"] == 2 and sts["spec"]["serviceName"] == "ds-ranks"
    assert sts["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert sts["metadata"]["annotations"][c.ANNOTATION_TEMPLATE_HASH] == plan.template_hash
    pod = sts["spec"]["template"]
    assert pod["metadata"]["labels"][c.LABEL_TEMPLATE_HASH] == plan.template_hash
    container = pod["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env[c.ENV_NODE_RANK]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.labels['apps.kubernetes.io/pod-index']"
    assert env[c.ENV_HCCL_IF_IP]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["resources"]["limits"]["huawei.com/Ascend910"] == "8"
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert set(sts["spec"]["selector"]["matchLabels"].items()) <= set(pod["metadata"]["labels"].items())


def test_compiled_code_is_cached_in_a_volume_the_container_keeps_across_restarts(make_cr):
    """The runtime's inductor cache and its ahead-of-time decode steps live in the pod's compile-cache
    emptyDir (a restarted container loads them); a spec that names its own directory keeps it."""
    from mtp_operator.manifests import AOT_CACHE_ENV, COMPILE_CACHE_ENV, COMPILE_CACHE_PATH, COMPILE_CACHE_VOLUME

    _, objects = _all(make_cr, VARIANTS["builtin-cpu"])
    pod = objects["statefulset"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env[COMPILE_CACHE_ENV] == f"{COMPILE_CACHE_PATH}/inductor" and env[AOT_CACHE_ENV] == f"{COMPILE_CACHE_PATH}/aot"
    assert {"name": COMPILE_CACHE_VOLUME, "mountPath": COMPILE_CACHE_PATH} in container["volumeMounts"]
    assert {"name": COMPILE_CACHE_VOLUME, "emptyDir": {}} in pod["volumes"]
    _, objects = _all(make_cr, {"env": [{"name": AOT_CACHE_ENV, "value": "/models/aot"}]})
    env = [(e["name"], e.get("value")) for e in objects["statefulset"]["spec"]["template"]["spec"]["containers"][0]["env"]]
    assert (AOT_CACHE_ENV, "/models/aot") in env and (AOT_CACHE_ENV, f"{COMPILE_CACHE_PATH}/aot") not in env


def test_vllm_workers_get_no_http_readiness_probe(make_cr):
    _, objects = _all(make_cr, VARIANTS["vllm-gpu"])
    container = objects["statefulset"]["spec"]["template"]["spec"]["containers"][0]
    assert "readinessProbe" not in container and container["command"] == ["/bin/sh"]


def test_services(make_cr):
    _, objects = _all(make_cr, VARIANTS["vllm-gpu"])
    headless, client = objects["headless"], objects["client"]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    assert client["spec"]["selector"][c.LABEL_POD_INDEX] == "0"
    assert client["spec"]["type"] == "LoadBalancer"
    # Distinct roles, so a ServiceMonitor can pick the client Service (rank 0) alone.
    assert client["metadata"]["labels"][c.LABEL_SERVICE_ROLE] == c.SERVICE_ROLE_CLIENT
    assert headless["metadata"]["labels"][c.LABEL_SERVICE_ROLE] == c.SERVICE_ROLE_HEADLESS
    assert c.LABEL_POD_INDEX not in headless["spec"]["selector"]


def test_export_job(make_cr):
    plan, objects = _all(make_cr, VARIANTS["hostpath-scheduling"])
    job = objects["job"]
    assert job["metadata"]["name"] == plan.export.job_name
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert [container["command"][0], *container["args"]] == plan.export.argv
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert pod["volumes"][0]["hostPath"]["path"] == "/mnt/models"
    assert container["resources"] == {"requests": {"cpu": "1"}}


def test_no_export_job_without_export(make_cr):
    cr = make_cr(changes={"export": None, "draftModel": {"path": "/models/d"}})
    spec = parse_spec(cr["spec"])
    plan = plan_deployment("ds", "default", spec, master_host="h")
    with pytest.raises(ValueError, match="spec.draftModel is set"):
        build_export_job(plan, spec, cr, SETTINGS)


def test_strict_validation_is_not_vacuous(make_cr):
    _, objects = _all(make_cr, {})
    sts = objects["statefulset"]
    sts["spec"]["template"]["spec"]["containers"][0]["commandd"] = ["typo"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, "1.28", strict=True)


def _server(objects):
    pod = objects["statefulset"]["spec"]["template"]["spec"]
    return pod, pod["containers"][0]


def test_api_key_comes_from_the_secret_never_argv(make_cr):
    secret = "mtp-api-key-secret-name"
    plan, objects = _all(make_cr, {"apiKeySecret": {"name": secret, "key": "token"}})
    _, container = _server(objects)
    env = {e["name"]: e for e in container["env"]}
    assert env[c.ENV_API_KEY] == {"name": c.ENV_API_KEY,
                                  "valueFrom": {"secretKeyRef": {"name": secret, "key": "token"}}}
    argv = container["command"] + container["args"]
    assert not any("api_key" in a or secret in a for a in argv)
    assert all(c.ENV_API_KEY not in rank.env for rank in plan.ranks)  # concrete env: the kubelet fills it in
    # vLLM reads its own variable from the same Secret.
    _, objects = _all(make_cr, {"engine": "vllm", "apiKeySecret": {"name": secret, "key": "token"}})
    env = {e["name"]: e for e in _server(objects)[1]["env"]}
    assert env[c.ENV_VLLM_API_KEY]["valueFrom"] == {"secretKeyRef": {"name": secret, "key": "token"}}
    assert c.ENV_API_KEY not in env


def test_env_value_from_is_passed_through(make_cr):
    plan, objects = _all(make_cr, VARIANTS["secrets-and-drain"])
    env = {e["name"]: e for e in _server(objects)[1]["env"]}
    assert env["HF_TOKEN"] == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "t"}}}
    assert env["NODE"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["MODE"]["valueFrom"] == {"configMapKeyRef": {"name": "cfg", "key": "mode", "optional": True}}
    assert "value" not in env["HF_TOKEN"] and "HF_TOKEN" not in plan.pod_env
    # A new Secret reference changes what the pods run with: the group rolls.
    other, _ = _all(make_cr, {**VARIANTS["secrets-and-drain"], "apiKeySecret": {"name": "other", "key": "token"}})
    assert other.template_hash != plan.template_hash


def test_grace_period_outlasts_the_drain_deadline(make_cr):
    from mtp_runtime.server.args import SHUTDOWN_TIMEOUT_DEFAULT

    pod, container = _server(_all(make_cr, {})[1])
    # Default: the server drains for its default 30 s; the kubelet's own default (30 s) would race it.
    assert pod["terminationGracePeriodSeconds"] > SHUTDOWN_TIMEOUT_DEFAULT
    assert not any(a.startswith("--shutdown_timeout") for a in container["args"])
    pod, container = _server(_all(make_cr, VARIANTS["secrets-and-drain"])[1])
    assert "--shutdown_timeout=90" in container["args"]
    assert pod["terminationGracePeriodSeconds"] == 90 + 15
    # Per-device pods pass it to every process, through the script's shared arguments.
    pod, container = _server(_all(make_cr, {**VARIANTS["builtin-npu"], "runtime": {"shutdownTimeout": 5}})[1])
    assert "--shutdown_timeout=5" in container["args"] and pod["terminationGracePeriodSeconds"] == 20
    # Other engines get the grace period (their own drain flags are theirs to set).
    pod, container = _server(_all(make_cr, {"engine": "vllm", "runtime": {"shutdownTimeout": 60}})[1])
    assert pod["terminationGracePeriodSeconds"] == 75
    assert not any("shutdown" in a for a in container["args"])
