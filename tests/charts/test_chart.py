"""helm lint / helm template of charts/mtp-operator, with default and
non-default values; every rendered object validated against the Kubernetes
schemas (strict: unknown fields are errors) of 1.28 and the newest release."""

from __future__ import annotations

from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

KUBE_VERSIONS = ["1.28", kubernetes_validate.latest_version()]

NON_DEFAULT_VALUES: dict[str, Any] = {
    "image": {"repository": "registry.example/mtp/operator", "tag": "9.9.9", "pullPolicy": "Always"},
    "imagePullSecrets": [{"name": "regcred"}],
    "fullnameOverride": "mtpop",
    "serviceAccount": {"create": True, "name": "mtp-sa", "annotations": {"team": "infer"}},
    "rbac": {"create": True, "clusterWide": False},
    "watchNamespace": "models",
    "settings": {"runtimeImage": "registry.example/mtp/runtime:9.9.9"},
    "extraEnv": [{"name": "TZ", "value": "UTC"}],
    "healthPort": 9090,
    "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"cpu": "1", "memory": "512Mi"}},
    "podAnnotations": {"example.com/scrape": "false"},
    "podLabels": {"team": "infer"},
    "priorityClassName": "system-cluster-critical",
    "nodeSelector": {"kubernetes.io/os": "linux", "node-role": "control"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ops", "effect": "NoSchedule"}],
    "affinity": {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}]}
                ]
            }
        }
    },
    "serviceMonitor": {"enabled": True, "interval": "15s", "labels": {"release": "prom"}},
}

# The Prometheus Operator's ServiceMonitor is a CRD no Kubernetes schema set
# knows; its spec is checked against the fields of monitoring.coreos.com/v1
# that the chart uses (unknown fields rejected, like strict mode).
SERVICE_MONITOR_SPEC_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["selector", "endpoints"],
    "properties": {
        "selector": {
            "type": "object",
            "additionalProperties": False,
            "properties": {"matchLabels": {"type": "object", "additionalProperties": {"type": "string"}}},
        },
        "namespaceSelector": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "any": {"type": "boolean"},
                "matchNames": {"type": "array", "items": {"type": "string"}},
            },
        },
        "endpoints": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["port"],
                "properties": {
                    "port": {"type": "string"},
                    "path": {"type": "string"},
                    "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                    "scrapeTimeout": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                },
            },
        },
    },
}


def validate_object(obj: dict[str, Any], version: str) -> None:
    if obj["kind"] == "ServiceMonitor":
        assert obj["apiVersion"] == "monitoring.coreos.com/v1"
        # Its metadata is an ordinary ObjectMeta: validate it as one.
        kubernetes_validate.validate(
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj["metadata"]}, version, strict=True
        )
        jsonschema.validate(obj["spec"], SERVICE_MONITOR_SPEC_SCHEMA)
        return
    kubernetes_validate.validate(obj, version, strict=True)


@pytest.fixture(params=["default", "non-default"])
def rendered(request, chart) -> list[dict[str, Any]]:
    values = None if request.param == "default" else chart.values(NON_DEFAULT_VALUES)
    return chart.template(values, include_crds=True)


@pytest.mark.parametrize("values", [None, NON_DEFAULT_VALUES], ids=["default", "non-default"])
def test_helm_lint_strict(chart, values):
    args = ["lint", "--strict", str(chart.path)]
    if values is not None:
        args += ["--values", str(chart.values(values))]
    done = chart.helm(*args)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_every_object_validates_strictly(rendered, version):
    assert rendered, "the chart rendered nothing"
    for obj in rendered:
        try:
            validate_object(obj, version)
        except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as err:
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} is invalid for Kubernetes {version}: {err}")


def test_validation_catches_a_bad_object(chart):
    # The check above must be able to fail: a misspelled field is rejected.
    deployment = chart.only(chart.template(), "Deployment")
    deployment["spec"]["replicaz"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBE_VERSIONS[-1], strict=True)


def test_default_objects(chart):
    objects = chart.template()
    kinds = sorted(obj["kind"] for obj in objects)
    assert kinds == sorted(["ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment"])
    assert not chart.by_kind(objects, "ServiceMonitor")


def test_operator_deployment_defaults(chart):
    deployment = chart.only(chart.template(), "Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == "mtp-operator:0.1.0"
    assert container["args"] == ["operator"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["MTP_OPERATOR_ALL_NAMESPACES"] == "true"
    assert "MTP_OPERATOR_NAMESPACE" not in env
    probe = container["livenessProbe"]
    assert probe["httpGet"]["path"] == "/healthz"
    port_names = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert port_names[probe["httpGet"]["port"]] == 8080
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    assert pod["serviceAccountName"] == "mtp-mtp-operator"


def test_operator_pod_security(rendered):
    pod = [o for o in rendered if o["kind"] == "Deployment"][0]["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    for container in pod["containers"]:
        sc = container["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"]["drop"] == ["ALL"]
        assert "add" not in sc["capabilities"]
        # A read-only root still needs somewhere for temporary files.
        assert any(m["mountPath"] == "/tmp" for m in container["volumeMounts"])


def test_non_default_values_reach_the_objects(chart):
    objects = chart.template(chart.values(NON_DEFAULT_VALUES))
    deployment = chart.only(objects, "Deployment")
    assert deployment["metadata"]["name"] == "mtpop"
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == "registry.example/mtp/operator:9.9.9"
    assert container["imagePullPolicy"] == "Always"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["nodeSelector"] == NON_DEFAULT_VALUES["nodeSelector"]
    assert pod["tolerations"] == NON_DEFAULT_VALUES["tolerations"]
    assert pod["affinity"] == NON_DEFAULT_VALUES["affinity"]
    assert pod["priorityClassName"] == "system-cluster-critical"
    assert pod["serviceAccountName"] == "mtp-sa"
    assert deployment["spec"]["template"]["metadata"]["labels"]["team"] == "infer"
    assert container["resources"] == NON_DEFAULT_VALUES["resources"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["MTP_OPERATOR_RUNTIME_IMAGE"] == "registry.example/mtp/runtime:9.9.9"
    assert env["TZ"] == "UTC"
    assert env["MTP_OPERATOR_NAMESPACE"] == "models"
    assert "MTP_OPERATOR_ALL_NAMESPACES" not in env
    assert {p["containerPort"] for p in container["ports"]} == {9090}
    monitor = chart.only(objects, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["models"]}
    assert monitor["spec"]["endpoints"][0]["interval"] == "15s"


def test_empty_settings_are_not_set(chart):
    container = chart.only(chart.template(), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    names = [e["name"] for e in container["env"]]
    assert "MTP_OPERATOR_RUNTIME_IMAGE" not in names


def test_existing_service_account_must_be_named(chart):
    values = chart.values({"serviceAccount": {"create": False, "name": ""}})
    done = chart.helm("template", "x", str(chart.path), "--values", str(values))
    assert done.returncode != 0
    assert "serviceAccount.name" in done.stderr


def test_settings_env_is_what_the_operator_reads(chart):
    # Every settings key of values.yaml, given a value, must become an
    # MTP_OPERATOR_* variable that OperatorSettings knows and accepts.
    from mtp_operator.settings import PREFIX, OperatorSettings

    defaults = yaml.safe_load((chart.path / "values.yaml").read_text())
    samples = {"runtimeImage": "r:1", "npuRuntimeImage": "n:1", "imagePullSecrets": "a,b",
               "metricsInterval": 7, "gangRestartBudget": 2, "gangRestartBackoff": 3, "reconcileInterval": 4,
               "healthTimeout": 1.5, "metricsTimeout": 2.5, "probePods": False,
               "allowedHostPathPrefixes": "/mnt/models,/data", "revisionHistory": 3}
    assert set(defaults["settings"]) == set(samples), "new settings key: add a sample value here"
    # Every setting the operator reads can be set from the chart; the watch
    # scope and the health port come from rbac.* and healthPort.
    from_chart_values = {"namespace", "all_namespaces", "health_port"}
    fields = {f for f in OperatorSettings.__dataclass_fields__ if not f.startswith("_")} - from_chart_values
    camel = {f.split("_")[0] + "".join(w.title() for w in f.split("_")[1:]) for f in fields}
    assert set(defaults["settings"]) == camel
    for rbac_mode in (True, False):
        values = chart.values({"settings": samples, "rbac": {"clusterWide": rbac_mode}}, f"v{rbac_mode}.yaml")
        container = chart.only(chart.template(values), "Deployment")["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e["value"] for e in container["env"] if e["name"].startswith(PREFIX)}
        known = {PREFIX + f.upper() for f in OperatorSettings.__dataclass_fields__ if not f.startswith("_")}
        assert set(env) <= known, f"the operator does not read {set(env) - known}"
        settings = OperatorSettings.from_env(env)
        assert settings.metrics_interval == 7.0 and settings.image_pull_secrets == ("a", "b")
        assert settings.npu_runtime_image == "n:1" and settings.health_port == 8080
        assert settings.probe_pods is False and settings.metrics_timeout == 2.5
        assert settings.allowed_host_path_prefixes == ("/mnt/models", "/data")
        assert settings.all_namespaces is rbac_mode
        assert settings.namespace == (() if rbac_mode else (chart.namespace,))


def test_chart_crd_is_the_generated_one(chart):
    from mtp_operator.crd import render_crd

    objects = chart.template(include_crds=True)
    crd = chart.only(objects, "CustomResourceDefinition")
    assert crd == yaml.safe_load(render_crd())
    assert crd["metadata"]["name"] == "mtpdeployments.mtp.inference.dev"


def _operator_children(chart) -> tuple[object, list[dict[str, Any]]]:
    """The plan and every object the operator creates for the tiny sample, from its own builders."""
    from mtp_operator.manifests import (build_client_service, build_export_job, build_headless_service,
                                        build_statefulset)
    from mtp_operator.plan import kubernetes_master_host, plan_deployment
    from mtp_operator.settings import OperatorSettings
    from mtp_operator.spec import parse_spec

    cr = yaml.safe_load((chart.path.parents[1] / "crds/samples/tiny-cpu.yaml").read_text())
    cr["metadata"].update(namespace="default", uid="uid-1")
    spec = parse_spec(cr["spec"])
    plan = plan_deployment("tiny-cpu", "default", spec, master_host=kubernetes_master_host("tiny-cpu", "default"))
    settings = OperatorSettings()
    return plan, [build_headless_service(plan, cr), build_client_service(plan, spec, cr),
                  build_statefulset(plan, spec, cr, settings), build_export_job(plan, spec, cr, settings)]


def test_service_monitor_selects_only_the_client_service(chart):
    # A ServiceMonitor picks Services by label and scrapes the pods behind them:
    # it must pick the client Service (rank 0 only) and not the headless one.
    from mtp_operator import constants as c

    monitor = chart.only(chart.template(chart.values({"serviceMonitor": {"enabled": True}})), "ServiceMonitor")
    plan, children = _operator_children(chart)
    selector = monitor["spec"]["selector"]["matchLabels"].items()
    picked = [o for o in children if o["kind"] == "Service" and selector <= o["metadata"]["labels"].items()]
    assert [s["metadata"]["name"] for s in picked] == ["tiny-cpu"]
    (client,) = picked
    assert client["metadata"]["labels"][c.LABEL_SERVICE_ROLE] == c.SERVICE_ROLE_CLIENT
    assert "mtp.inference.dev/deployment" not in dict(selector), "one monitor serves every MtpDeployment"
    # The client Service reaches exactly the rank-0 pod of the StatefulSet.
    sts = next(o for o in children if o["kind"] == "StatefulSet")
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    by_rank = {rank: {**pod_labels, c.LABEL_POD_INDEX: str(rank)} for rank in range(3)}
    assert [r for r, labels in by_rank.items() if client["spec"]["selector"].items() <= labels.items()] == [0]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in client["spec"]["ports"]}
    assert endpoint["port"] == c.PORT_NAME_HTTP and endpoint["path"] == plan.metrics_path
    assert monitor["spec"]["namespaceSelector"] == {"any": True}


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"rbac": {"clusterWide": "yes"}}, "/rbac/clusterWide"),
        ({"healthPort": 0}, "/healthPort"),
        ({"settngs": {"metricsInterval": 3}}, "settngs"),
        ({"settings": {"metricsIntervall": 3}}, "metricsIntervall"),
        ({"image": {"repository": "x", "pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
        ({"watchNamespace": "Team_A"}, "/watchNamespace"),
        ({"serviceMonitor": {"enabled": True, "interval": "soon"}}, "/serviceMonitor/interval"),
    ],
    ids=["bool", "port", "typo-top", "typo-setting", "enum", "namespace", "duration"],
)
def test_bad_values_are_refused_naming_the_field(chart, values, field):
    done = chart.helm("template", "x", str(chart.path), "--values", str(chart.values(values)))
    assert done.returncode != 0
    assert field in done.stderr, done.stderr


def test_every_default_value_is_in_the_schema(chart):
    # The schema forbids unknown keys, so a value added to values.yaml
    # without a schema entry would make the chart unusable: catch it here.
    import json

    schema = json.loads((chart.path / "values.schema.json").read_text())
    defaults = yaml.safe_load((chart.path / "values.yaml").read_text())
    assert set(defaults) == set(schema["properties"])
    jsonschema.validate(defaults, schema)
