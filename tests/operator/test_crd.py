"""The generated CRD: drift against every committed copy, schema vs samples, CEL rules."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from mtp_operator import crd
from mtp_operator.spec import MtpDeploymentSpec, SpecError, parse_spec

REPO = Path(__file__).resolve().parents[2]
SAMPLES = sorted((REPO / "crds" / "samples").glob("*.yaml"))


def _schema() -> dict:
    return crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


@pytest.mark.parametrize("path", crd.crd_paths(REPO), ids=lambda p: str(p.relative_to(REPO)))
def test_committed_crd_matches_the_models(path):
    assert path.exists(), f"{path.relative_to(REPO)} missing: run python hack/gen_crds.py"
    assert path.read_text() == crd.render_crd(), f"{path.relative_to(REPO)} drifted: run python hack/gen_crds.py"


def test_write_crds_writes_chart_copy_only_when_chart_exists(tmp_path):
    assert [p.relative_to(tmp_path) for p in crd.write_crds(tmp_path)] == [crd.CRD_FILE]
    (tmp_path / "charts" / "mtp-operator").mkdir(parents=True)
    written = crd.write_crds(tmp_path)
    assert [p.relative_to(tmp_path) for p in written] == [crd.CRD_FILE, crd.CHART_CRD_FILE]
    assert written[0].read_bytes() == written[1].read_bytes()


@pytest.mark.parametrize("version", ["1.28", kubernetes_validate.latest_version()])
def test_crd_is_a_valid_kubernetes_object(version):
    kubernetes_validate.validate(crd.build_crd(), version, strict=True)


def validate_cr(cr: dict) -> None:
    # OpenAPI 3.0 schemas follow JSON-schema draft 4 (boolean exclusiveMinimum).
    jsonschema.Draft4Validator(_schema()).validate(cr)


def _walk(node, path=""):
    yield path, node
    for key, child in node.get("properties", {}).items():
        yield from _walk(child, f"{path}.{key}" if path else key)
    if "items" in node:
        yield from _walk(node["items"], f"{path}[]")


def test_schema_is_structural():
    for path, node in _walk(_schema()):
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), path
        for banned in ("$ref", "anyOf", "oneOf", "allOf", "title", "additionalProperties"):
            if banned == "additionalProperties" and "properties" not in node:
                continue
            assert banned not in node, f"{path} has {banned}"


def test_printer_columns_and_status_subresource():
    version = crd.build_crd()["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}, "scale": {
        "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector"}}
    names = [col["name"] for col in version["additionalPrinterColumns"]]
    assert names[:4] == ["Ready", "Nodes", "Phase", "Acceptance"] and "Age" in names


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.name)
def test_samples_validate_against_schema_and_models(sample):
    cr = yaml.safe_load(sample.read_text())
    validate_cr(cr)
    parse_spec(cr["spec"])


def test_schema_rejects_what_the_models_reject(make_cr):
    bad = make_cr(changes={"nnodes": 0, "engine": "sglang", "model": {"path": "/models/x;y"}})
    errors = {".".join(map(str, e.absolute_path)) for e in jsonschema.Draft4Validator(_schema()).iter_errors(bad)}
    assert errors == {"spec.nnodes", "spec.engine", "spec.model.path"}


def _rules_by_path() -> dict[str, list[str]]:
    return {path: [v["rule"] for v in node["x-kubernetes-validations"]]
            for path, node in _walk(_schema()) if "x-kubernetes-validations" in node}


def test_every_cel_rule_of_every_model_is_in_the_crd():
    rules = _rules_by_path()
    assert rules["spec"] == [r.rule for r in MtpDeploymentSpec.cel_rules]
    assert "has(self.claimName) != has(self.hostPath)" in rules["spec.model.volume"]
    assert "self.http != self.master" in rules["spec.ports"]
    assert "has(self.resourceName) == (self.count > 0)" in rules["spec.accelerator"]
    assert len(rules["spec.securityContext"]) == 1 and len(rules["spec.securityContext.seccompProfile"]) == 1
    assert "has(self.value) != has(self.valueFrom)" in rules["spec.env[]"]
    assert len(rules["spec.resources"]) == 2 and len(rules["spec.export.resources"]) == 2
    assert len([r for rs in rules.values() for r in rs]) == 26
    assert len(rules["spec.rollout"]) == 1


def test_cel_field_paths_name_fields_of_the_schema():
    # The API server refuses a CRD whose rule's fieldPath is not a field below the rule's object.
    for path, node in _walk(_schema()):
        for rule in node.get("x-kubernetes-validations", []):
            target = node
            for part in rule.get("fieldPath", "").lstrip(".").split(".") if rule.get("fieldPath") else []:
                target = target["properties"][part]
            assert "type" in target, (path, rule)


# Each CEL rule's intent, checked in Python: a spec that breaks exactly that rule
# passes the plain schema (so only the CEL rule can catch it) and the models refuse it.
CEL_VIOLATIONS = {
    "draft xor export, neither": {"export": None},
    "draft xor export, both": {"draftModel": {"path": "/models/d"}},
    "draft under mount": {"export": None, "draftModel": {"path": "/other/d"}},
    "export under mount": {"export": {"outputPath": "/other/d"}},
    "export differs from model": {"export": {"outputPath": "/models/ds"}},
    "read-only volume with export": {"model": {"volume": {"readOnly": True}}},
    "reserved env": {"env": [{"name": "MTP_NNODES", "value": "1"}]},
    "newline in extraArgs": {"extraArgs": ["a\nb"]},
    "volume: both sources": {"model": {"volume": {"hostPath": "/mnt"}}},
    "model under mount": {"model": {"path": "/data/ds"}},
    "accelerator count without name": {"accelerator": {"count": 1}},
    "ports equal": {"ports": {"http": 9000, "master": 9000}},
    "non-root as uid 0": {"securityContext": {"runAsNonRoot": True, "runAsUser": 0}},
    "localhost seccomp without profile": {"securityContext": {"seccompProfile": {"type": "Localhost"}}},
    "draft equals model": {"export": None, "draftModel": {"path": "/models/ds"}},
    "export inside model": {"export": {"outputPath": "/models/ds/mtp"}},
    "export contains model": {"model": {"path": "/models/ds/main"}, "export": {"outputPath": "/models/ds"}},
    "system hostPath": {"model": {"volume": {"claimName": None, "hostPath": "/var/lib/kubelet"}}},
    "host dir holding a system dir": {"model": {"volume": {"claimName": None, "hostPath": "/var"}}},
    "mountPath over /usr": {"model": {"mountPath": "/usr", "path": "/usr/ds"},
                            "export": {"outputPath": "/usr/ds-mtp"}},
    "operator env MTP_POD_IP": {"env": [{"name": "MTP_POD_IP", "value": "1.2.3.4"}]},
    "env twice": {"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]},
    "env value and valueFrom": {"env": [{"name": "A", "value": "1",
                                         "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]},
    "env valueFrom of two kinds": {"env": [{"name": "A", "valueFrom": {
        "fieldRef": {"fieldPath": "spec.nodeName"}, "secretKeyRef": {"name": "s", "key": "k"}}}]},
    "operator flag in extraArgs": {"extraArgs": ["--node-rank", "3"]},
    "memory request above limit": {"resources": {"requests": {"memory": "2Gi"}, "limits": {"memory": "1Gi"}}},
    "cpu request above limit": {"export": {"resources": {"requests": {"cpu": "2"}, "limits": {"cpu": "1"}}}},
    "api key with xllm": {"engine": "xllm", "apiKeySecret": {"name": "api", "key": "k"}},
}


# Python-only rules (spec.PYTHON_RULES): the CRD admits these; parse_spec refuses them.
PYTHON_ONLY_VIOLATIONS = {
    "blockSize mtp serve refuses": {"runtime": {"blockSize": 4096}},
    "epSize that does not fit the processes": {"runtime": {"epSize": 3}},
    "unknown mtp serve flag": {"extraArgs": ["--no_such_flag"]},
}


@pytest.mark.parametrize("changes", PYTHON_ONLY_VIOLATIONS.values(), ids=PYTHON_ONLY_VIOLATIONS.keys())
def test_python_only_rule_intent(make_cr, changes):
    cr = make_cr(changes=changes)
    validate_cr(cr)
    with pytest.raises(SpecError):
        parse_spec(cr["spec"])


@pytest.mark.parametrize("changes", CEL_VIOLATIONS.values(), ids=CEL_VIOLATIONS.keys())
def test_cel_rule_intent(make_cr, changes):
    cr = make_cr(changes=changes)
    validate_cr(cr)
    with pytest.raises(SpecError):
        parse_spec(cr["spec"])
