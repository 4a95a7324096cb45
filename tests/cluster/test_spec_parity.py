"""One parity test for every rejection rule: the API server and `parse_spec` refuse the same spec,
naming the same field.

Every rule comes from the CRD itself, so a new constraint is covered the day it is added:
- each schema constraint of the generated CRD (type, minimum/maximum, enum, pattern, maxLength,
  maxItems, required, unknown fields) gets a spec, built from one valid spec that sets every field
  (MAXIMAL), that breaks only that constraint;
- each CEL rule (`CelRule`s of the pydantic models) has a breaking edit in CEL_BREAKERS; a rule
  without one fails the test.
Both directions: the server (POST with fieldValidation=Strict, dry run) must answer 422/400 naming the
field, and parse_spec must raise SpecError naming the same field; MAXIMAL itself passes both.
"""

from __future__ import annotations

import copy
import re
from typing import Any, Callable, Iterator

import pytest

from mtp_operator.crd import build_crd
from mtp_operator.settings import OperatorSettings
from mtp_operator.spec import ApiModel, SpecError, parse_spec

pytestmark = pytest.mark.cluster

# A valid spec that sets every field of the schema (the draftModel branch is checked on its own).
MAXIMAL: dict[str, Any] = {
    "model": {"path": "/models/ds", "modelType": "deepseek_v3", "mountPath": "/models",
              "volume": {"claimName": "models", "readOnly": False}},
    "export": {"outputPath": "/models/ds-mtp", "image": "registry.example/mtp/runtime:1", "force": False,
               "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"cpu": "2", "memory": "2Gi"}}},
    "nnodes": 2,
    "replicas": 3,
    "rollout": {"maxUnavailable": 1, "maxSurge": 1, "paused": False,
                "canary": {"groups": 1, "analysisSeconds": 60, "minAcceptanceRatio": 0.9, "maxTpotRatio": 1.2,
                           "minDraftTokens": 100}},
    "engine": "builtin",
    "image": "registry.example/mtp/runtime:1",
    "accelerator": {"resourceName": "nvidia.com/gpu", "count": 1},
    "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"cpu": "2", "memory": "2Gi"}},
    "speculative": {"numSpeculativeTokens": 2, "adaptive": True, "minAcceptanceRate": 0.5},
    "runtime": {"maxMemoryUtilization": 0.9, "maxTokensPerBatch": 512, "maxSeqsPerBatch": 16, "blockSize": 16,
                "epSize": 1, "dpSize": 1, "enablePrefixCache": True, "enableChunkedPrefill": False,
                "shutdownTimeout": 30},
    "env": [{"name": "LOG_LEVEL", "value": "info"}],
    "apiKeySecret": {"name": "mtp-api", "key": "token"},
    "extraArgs": ["--served_model_name=ds"],
    "ports": {"http": 8000, "master": 29500},
    "scheduling": {"nodeSelector": {"pool": "gpu"}, "tolerations": [{"key": "gpu", "operator": "Exists"}],
                   "affinity": {}, "priorityClassName": "high", "schedulerName": "default-scheduler"},
    "service": {"type": "ClusterIP"},
    "securityContext": {"runAsUser": 1000, "runAsGroup": 1000, "runAsNonRoot": True, "fsGroup": 1000,
                        "fsGroupChangePolicy": "OnRootMismatch", "supplementalGroups": [1000],
                        "seccompProfile": {"type": "RuntimeDefault"},
                        "seLinuxOptions": {"user": "u", "role": "r", "type": "t", "level": "s0"},
                        "sysctls": [{"name": "net.core.somaxconn", "value": "1024"}]},
}
# Fields that exclude one another in MAXIMAL are set in these variants instead.
DRAFT_VARIANT = {**{k: v for k, v in MAXIMAL.items() if k != "export"}, "draftModel": {"path": "/models/ds-draft"}}
HOST_PATH_VARIANT = {**MAXIMAL, "model": {**MAXIMAL["model"], "volume": {"hostPath": "/data/models"}}}
LOCALHOST_VARIANT = {**MAXIMAL, "securityContext": {
    **MAXIMAL["securityContext"], "seccompProfile": {"type": "Localhost", "localhostProfile": "profiles/mtp.json"}}}
SECRET_ENV_VARIANT = {**MAXIMAL, "env": [{"name": "TOKEN", "valueFrom": {
    "secretKeyRef": {"name": "creds", "key": "token", "optional": False}}}]}
CONFIG_ENV_VARIANT = {**MAXIMAL, "env": [{"name": "MODE", "valueFrom": {
    "configMapKeyRef": {"name": "settings", "key": "mode", "optional": True}}}]}
FIELD_ENV_VARIANT = {**MAXIMAL, "env": [{"name": "NODE", "valueFrom": {
    "fieldRef": {"fieldPath": "spec.nodeName", "apiVersion": "v1"}}}]}
VARIANTS = [MAXIMAL, DRAFT_VARIANT, HOST_PATH_VARIANT, LOCALHOST_VARIANT, SECRET_ENV_VARIANT, CONFIG_ENV_VARIANT,
            FIELD_ENV_VARIANT]


def _set(spec: dict, path: list, value: Any) -> dict:
    out = copy.deepcopy(spec)
    node = out
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    return out


def _delete(spec: dict, path: list) -> dict:
    out = copy.deepcopy(spec)
    node = out
    for part in path[:-1]:
        node = node[part]
    del node[path[-1]]
    return out


def _get(spec: dict, path: list) -> Any:
    node = spec
    for part in path:
        node = node[part]
    return node


def _failing_pattern_value(pattern: str, valid: Any) -> str:
    for candidate in ("", "NOT VALID !", "a b", "relative/path", "x;y", "\u00e9"):
        if not re.search(pattern, candidate):
            return candidate
    raise AssertionError(f"no candidate breaks pattern {pattern!r}")


# Too-long values the generic padding cannot build (a pattern that fixes the value's shape).
LONG_VALUES = {"spec.accelerator.resourceName": lambda n: "huawei.com/Ascend" + "9" * n,
               "spec.env.0.valueFrom.fieldRef.fieldPath": lambda n: "metadata.labels['" + "a" * n + "']"}


def _long_value(valid: str, max_length: int, pattern: str | None, where: str = "") -> str | None:
    if where in LONG_VALUES:
        return LONG_VALUES[where](max_length)
    pad = "a" * (max_length + 1 - len(valid))
    for candidate in (valid + pad, valid + "/" + pad, valid + valid[-1:] * len(pad), valid[:1] * (max_length + 1),
                      "a" * (max_length + 1)):
        if len(candidate) > max_length and (pattern is None or re.search(pattern, candidate)):
            return candidate
    return None


def _spread(item: Any, index: int) -> Any:
    """Copy `index` of a list item, distinct where items carry names."""
    item = copy.deepcopy(item)
    if isinstance(item, dict) and isinstance(item.get("name"), str):
        item["name"] = f"{item['name']}{index}"
    return item


Case = tuple[str, dict, str]  # (id, spec, field the error must name)
UNSET: list[str] = []  # schema fields no base spec sets, so their rules would go unchecked


def schema_cases() -> Iterator[Case]:
    """One spec per schema constraint of the CRD's spec, breaking only it."""
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    yield from _walk(schema, [])


def _resolves(spec: dict, path: list) -> bool:
    try:
        _get(spec, path)
        return True
    except (KeyError, IndexError):
        return False


def _walk(node: dict, path: list) -> Iterator[Case]:
    where = ".".join(["spec", *map(str, path)])
    base = next((b for b in VARIANTS if _resolves(b, path)), None)
    if base is None:
        UNSET.append(where)  # test_maximal_sets_every_field fails on it
        return
    value = _get(base, path)
    kind = node.get("type")
    if path:
        wrong = {"integer": "2", "number": "0.5", "boolean": "off", "string": 7, "object": "x", "array": "x"}
        if kind in wrong:
            yield f"{where}:type", _set(base, path, wrong[kind]), where
        if kind == "integer" and isinstance(value, int):
            yield f"{where}:type-float", _set(base, path, float(value) + 0.5), where
            yield f"{where}:type-bool", _set(base, path, True), where
    if "minimum" in node:
        low = node["minimum"] if node.get("exclusiveMinimum") else node["minimum"] - (1 if kind == "integer" else 0.5)
        yield f"{where}:minimum", _set(base, path, low), where
    if "maximum" in node:
        high = node["maximum"] if node.get("exclusiveMaximum") else node["maximum"] + (1 if kind == "integer" else 0.5)
        yield f"{where}:maximum", _set(base, path, high), where
    if "enum" in node:
        yield f"{where}:enum", _set(base, path, "NotAChoice"), where
    if "pattern" in node:
        yield f"{where}:pattern", _set(base, path, _failing_pattern_value(node["pattern"], value)), where
    if "maxLength" in node and isinstance(value, str):
        long = _long_value(value, node["maxLength"], node.get("pattern"), where)
        if long is None:
            UNSET.append(f"{where} (no too-long value matches its pattern: add one to LONG_VALUES)")
        else:
            yield f"{where}:maxLength", _set(base, path, long), where
    if kind == "array":
        if not value:
            UNSET.append(f"{where}[0]")
            return
        if "maxItems" in node:
            yield f"{where}:maxItems", _set(base, path, [_spread(value[0], i) for i in range(node["maxItems"] + 1)]), \
                where
        yield from _walk(node["items"], [*path, 0])
    if kind == "object" and "properties" in node:
        if not node.get("x-kubernetes-preserve-unknown-fields"):
            yield f"{where}:unknown-field", _set(base, [*path, "bogusField"], 1) if path else \
                {**base, "bogusField": 1}, f"{where}.bogusField"
        for required in node.get("required", []):
            if path or required in base:
                yield f"{where}.{required}:required", _delete(base, [*path, required]), f"{where}.{required}"
        for name, child in node["properties"].items():
            yield from _walk(child, [*path, name])


# For each CEL rule (by message): an edit of MAXIMAL that breaks that rule alone, and the field
# (the object that carries the rule) the error must name.
CEL_BREAKERS: dict[str, tuple[Callable[[dict], dict], str]] = {
    "set exactly one of volume.claimName or volume.hostPath": (
        lambda s: _set(s, ["model", "volume", "hostPath"], "/data/models"), "spec.model.volume"),
    "hostPath must not be, lie in or contain a system directory of the node": (
        lambda s: _set(s, ["model", "volume"], {"hostPath": "/var/lib/kubelet/pods"}),
        "spec.model.volume.hostPath"),
    "model.path must lie under model.mountPath (the model volume)": (
        lambda s: _set(s, ["model", "path"], "/elsewhere/ds"), "spec.model.path"),
    "mountPath must not be, lie in or contain a system directory of the container": (
        lambda s: {**s, "model": {**s["model"], "mountPath": "/usr", "path": "/usr/ds"},
                   "export": {**s["export"], "outputPath": "/usr/ds-mtp"}}, "spec.model.mountPath"),
    "requests.cpu must not exceed limits.cpu": (
        lambda s: _set(s, ["resources", "requests", "cpu"], "3"), "spec.resources.requests.cpu"),
    "requests.memory must not exceed limits.memory": (
        lambda s: _set(s, ["export", "resources", "requests", "memory"], "3Gi"),
        "spec.export.resources.requests.memory"),
    "accelerator.count must be >= 1 exactly when accelerator.resourceName is set": (
        lambda s: _set(s, ["accelerator", "count"], 0), "spec.accelerator"),
    "valueFrom needs exactly one of secretKeyRef, configMapKeyRef or fieldRef": (
        lambda s: _set(SECRET_ENV_VARIANT, ["env", 0, "valueFrom", "fieldRef"], {"fieldPath": "spec.nodeName"}),
        "spec.env.0.valueFrom"),
    "set exactly one of env[].value or env[].valueFrom": (
        lambda s: _set(SECRET_ENV_VARIANT, ["env", 0, "value"], "x"), "spec.env.0"),
    "ports.http and ports.master must differ": (lambda s: _set(s, ["ports", "master"], 8000), "spec.ports"),
    "securityContext.seccompProfile.localhostProfile is set exactly when type is Localhost": (
        lambda s: _set(s, ["securityContext", "seccompProfile", "type"], "Localhost"),
        "spec.securityContext.seccompProfile"),
    "securityContext.runAsNonRoot cannot be true with runAsUser 0 (the kubelet would refuse the pod)": (
        lambda s: _set(s, ["securityContext", "runAsUser"], 0), "spec.securityContext"),
    "set exactly one of spec.draftModel (an existing draft) or spec.export (export one from spec.model)": (
        lambda s: {**s, "draftModel": {"path": "/models/ds-draft"}}, "spec"),
    "draftModel.path must lie under model.mountPath (the model volume)": (
        lambda s: {**DRAFT_VARIANT, "draftModel": {"path": "/other/draft"}}, "spec.draftModel.path"),
    "draftModel.path must differ from model.path": (
        lambda s: {**DRAFT_VARIANT, "draftModel": {"path": "/models/ds"}}, "spec.draftModel.path"),
    "export.outputPath must lie under model.mountPath (the model volume)": (
        lambda s: _set(s, ["export", "outputPath"], "/other/ds-mtp"), "spec.export.outputPath"),
    "export.outputPath must not be, lie in or contain model.path": (
        lambda s: _set(s, ["export", "outputPath"], "/models/ds/mtp"), "spec.export.outputPath"),
    "model.volume.readOnly cannot be true when export writes the draft into it": (
        lambda s: _set(s, ["model", "volume", "readOnly"], True), "spec"),
    "env must not set MTP_NODE_RANK, MTP_NNODES, MTP_MASTER_ADDR, MTP_POD_IP": (
        lambda s: _set(s, ["env"], [{"name": "MTP_POD_IP", "value": "127.0.0.1"}]), "spec.env"),
    "env must not name a variable twice": (
        lambda s: _set(s, ["env"], [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]), "spec.env"),
    "extraArgs items are single argv entries and must not contain newlines": (
        lambda s: _set(s, ["extraArgs"], ["--a=1\n--b=2"]), "spec"),
    "extraArgs must not set a flag the operator sets": (
        lambda s: _set(s, ["extraArgs"], ["--node-rank", "3"]), "spec.extraArgs"),
    "rollout.maxUnavailable and rollout.maxSurge cannot both be 0": (
        lambda s: _set(s, ["rollout"], {"maxUnavailable": 0, "maxSurge": 0}), "spec.rollout"),
    "apiKeySecret is for engines builtin and vllm": (
        lambda s: {**s, "engine": "xllm", "runtime": {}, "speculative": {"numSpeculativeTokens": 1}},
        "spec.apiKeySecret"),
}


def _breaker(message: str) -> tuple[Callable[[dict], dict], str] | None:
    """The CEL_BREAKERS entry of a rule: keyed by its message, or by the start of a long one."""
    return next((v for k, v in CEL_BREAKERS.items() if message == k or message.startswith(k)), None)


def cel_rules() -> list[str]:
    messages, pending = [], [ApiModel]
    while pending:
        cls = pending.pop()
        for sub in cls.__subclasses__():
            messages += [rule.message for rule in sub.__dict__.get("cel_rules", ())]
            pending.append(sub)
    return sorted(set(messages))


def cel_cases() -> Iterator[Case]:
    for message in cel_rules():
        breaker = _breaker(message)
        if breaker is not None:
            edit, where = breaker
            yield f"cel:{message[:60]}", edit(MAXIMAL), where


def _norm(text: str) -> str:
    """Field paths as both sides spell them: spec.env[0].name and spec.env.0.name -> spec.env.0.name."""
    return re.sub(r"\[(\d+)\]", r".\1", text)


def _server_fields(answer: Any) -> tuple[list[str], str]:
    if not isinstance(answer, dict):
        return [], str(answer)
    causes = (answer.get("details") or {}).get("causes") or []
    return [_norm(c.get("field", "")) for c in causes], _norm(answer.get("message", ""))


ALL_CASES = list(schema_cases()) + list(cel_cases())


def test_maximal_sets_every_field():
    assert not UNSET, f"set these in MAXIMAL (or a variant) so their constraints are checked: {UNSET}"


@pytest.fixture(scope="module")
def parity_namespace(kube, crd):
    """One namespace for the whole table (dry runs create nothing)."""
    name = "spec-parity"
    kube.try_call("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    yield name
    kube.try_call("DELETE", f"/api/v1/namespaces/{name}")


# The rules only the operator and `mtp up` check (spec.PYTHON_RULES): the API server admits these.
PYTHON_ONLY = {
    "blockSize mtp serve refuses": (_set(MAXIMAL, ["runtime", "blockSize"], 4096), "spec.runtime", None),
    "unknown mtp serve flag": (_set(MAXIMAL, ["extraArgs"], ["--no_such_flag"]), "spec.extraArgs", None),
    "hostPath outside the allowed prefixes": (HOST_PATH_VARIANT, "spec.model.volume.hostPath",
                                              OperatorSettings(allowed_host_path_prefixes=("/srv/models",))),
}


@pytest.mark.parametrize("case", PYTHON_ONLY.values(), ids=PYTHON_ONLY.keys())
def test_python_only_rules_are_the_operators(kube, parity_namespace, case):
    spec, field, settings = case
    code, answer = kube.create_cr(parity_namespace, "python-only", spec, dry_run=True)
    assert code in (200, 201), f"the API server now checks this too; move it to a CEL rule: {answer}"
    with pytest.raises(SpecError) as caught:
        parse_spec(copy.deepcopy(spec), **({"settings": settings} if settings else {}))
    assert field in _norm(str(caught.value)), caught.value


def test_every_cel_rule_has_a_breaking_case():
    missing = [m for m in cel_rules() if _breaker(m) is None]
    assert not missing, f"add a CEL_BREAKERS entry for each new rule: {missing}"


@pytest.mark.parametrize("spec", VARIANTS, ids=["maximal", "draftModel", "hostPath", "localhostProfile",
                                                 "secretKeyRef", "configMapKeyRef", "fieldRef"])
def test_maximal_spec_passes_both(kube, parity_namespace, spec):
    parse_spec(copy.deepcopy(spec))
    code, answer = kube.create_cr(parity_namespace, "maximal", spec, dry_run=True)
    assert code in (200, 201), answer


@pytest.mark.parametrize("case", ALL_CASES, ids=[c[0] for c in ALL_CASES])
def test_server_and_parse_spec_reject_the_same_field(kube, parity_namespace, case):
    _, spec, field = case
    code, answer = kube.create_cr(parity_namespace, "bad", spec, dry_run=True)
    fields, message = _server_fields(answer)
    assert code in (400, 422), f"the API server accepted it ({code})"
    named_by_server = any(f == field or f.startswith(field + ".") for f in fields) or \
        re.search(re.escape(field) + r"\b", message)
    assert named_by_server, f"the server did not name {field}: {answer}"
    with pytest.raises(SpecError) as caught:
        parse_spec(copy.deepcopy(spec))
    text = _norm(str(caught.value))
    assert re.search(re.escape(field) + r"\b", text), f"parse_spec did not name {field}: {caught.value}"
    if case[0].startswith("cel:"):
        rule_message = next(m for m in cel_rules() if f"cel:{m[:60]}" == case[0])
        assert rule_message in message and rule_message in str(caught.value)
