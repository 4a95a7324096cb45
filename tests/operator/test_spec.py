"""Spec validation: defaults, and invalid specs rejected with the field named.

One table of invalid specs: each row is the change to a valid spec and the
field its error must name (`spec.<field>: ...`), plus a fragment of the
reason where several rules guard one field.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any, NamedTuple

import pytest

from mtp_operator.settings import OperatorSettings, SettingsError
from mtp_operator.spec import (CONTAINER_SYSTEM_DIRS, HOST_SYSTEM_DIRS, PYTHON_RULES, SpecError, parse_quantity,
                               parse_spec)


def test_minimal_spec_gets_defaults(make_spec):
    spec = parse_spec(make_spec())
    assert spec.engine == "builtin"
    assert spec.ports.http == 8000 and spec.ports.master == 29500
    assert spec.speculative.num_speculative_tokens == 1
    assert spec.accelerator.count == 0 and spec.accelerator.resource_name is None
    assert spec.model.mount_path == "/models"


class Bad(NamedTuple):
    changes: dict[str, Any]
    field: str  # the error names it: "spec.<field>: ..."
    why: str = ""  # a fragment of the reason, where it matters which rule fired
    settings: OperatorSettings | None = None


def _host(path: str) -> dict[str, Any]:
    return {"model": {"volume": {"claimName": None, "hostPath": path}}}


def _mount(path: str) -> dict[str, Any]:
    return {"model": {"mountPath": path, "path": f"{path}/ds"}, "export": {"outputPath": f"{path}/ds-mtp"}}


def _env(*items: dict[str, Any]) -> dict[str, Any]:
    return {"env": list(items)}


DRAFT = {"export": None, "draftModel": {"path": "/models/ds-mtp"}}
DIGEST = "sha256:" + "a" * 64
PREFIXES = OperatorSettings(allowed_host_path_prefixes=("/mnt/models", "/data"))

INVALID: dict[str, Bad] = {
    # types: strict, as the API server (no coercion)
    "nnodes 0": Bad({"nnodes": 0}, "spec.nnodes"),
    "nnodes -2": Bad({"nnodes": -2}, "spec.nnodes"),
    "nnodes 'two'": Bad({"nnodes": "two"}, "spec.nnodes"),
    "nnodes '2'": Bad({"nnodes": "2"}, "spec.nnodes", "valid integer"),
    "nnodes 2.0": Bad({"nnodes": 2.0}, "spec.nnodes", "valid integer"),
    "nnodes true": Bad({"nnodes": True}, "spec.nnodes", "valid integer"),
    "count '8'": Bad({"accelerator": {"resourceName": "nvidia.com/gpu", "count": "8"}}, "spec.accelerator.count"),
    "port '8000'": Bad({"ports": {"http": "8000"}}, "spec.ports.http"),
    "readOnly 'off'": Bad({**DRAFT, "model": {"volume": {"readOnly": "off"}}}, "spec.model.volume.readOnly",
                          "valid boolean"),
    "enablePrefixCache 'off'": Bad({"runtime": {"enablePrefixCache": "off"}}, "spec.runtime.enablePrefixCache",
                                   "valid boolean"),
    "force 1": Bad({"export": {"force": 1}}, "spec.export.force"),
    "snake_case key": Bad({"extra_args": ["--served_model_name=x"]}, "spec.extra_args"),
    "unknown field": Bad({"unknownField": 1}, "spec.unknownField"),
    "extraArgs a string": Bad({"extraArgs": "--foo --bar"}, "spec.extraArgs"),
    "engine sglang": Bad({"engine": "sglang"}, "spec.engine"),
    "modelType llama": Bad({"model": {"modelType": "llama"}}, "spec.model.modelType"),
    "service ExternalName": Bad({"service": {"type": "ExternalName"}}, "spec.service.type"),
    # accelerator, speculative, ports
    "count -1": Bad({"accelerator": {"resourceName": "nvidia.com/gpu", "count": -1}}, "spec.accelerator.count"),
    "count 0 with a resource": Bad({"accelerator": {"resourceName": "nvidia.com/gpu", "count": 0}},
                                   "spec.accelerator", "accelerator.count must be >= 1"),
    "count without a resource": Bad({"accelerator": {"count": 4}}, "spec.accelerator", "resourceName is set"),
    "resource example.com/tpu": Bad({"accelerator": {"resourceName": "example.com/tpu", "count": 1}},
                                    "spec.accelerator.resourceName"),
    "k 0": Bad({"speculative": {"numSpeculativeTokens": 0}}, "spec.speculative.numSpeculativeTokens"),
    "minAcceptanceRate 1.5": Bad({"speculative": {"minAcceptanceRate": 1.5}}, "spec.speculative.minAcceptanceRate"),
    "maxMemoryUtilization 0": Bad({"runtime": {"maxMemoryUtilization": 0}}, "spec.runtime.maxMemoryUtilization"),
    "epSize 0": Bad({"runtime": {"epSize": 0}}, "spec.runtime.epSize"),
    "http 70000": Bad({"ports": {"http": 70000}}, "spec.ports.http"),
    "http == master": Bad({"ports": {"http": 29500}}, "spec.ports", "must differ"),
    # paths: shell characters, '.'/'..', empty segments, length
    "shell ;": Bad({"model": {"path": "/models/ds; rm -rf /"}}, "spec.model.path", "no spaces or shell characters"),
    "shell $()": Bad({"model": {"path": "/models/$(whoami)"}}, "spec.model.path"),
    "relative": Bad({"model": {"path": "relative/dir"}}, "spec.model.path"),
    "backquote": Bad({"export": {"outputPath": "/models/out`id`"}}, "spec.export.outputPath"),
    "'..' escapes the volume": Bad({"model": {"path": "/models/../etc"}}, "spec.model.path", "no '.' or '..'"),
    "'..' at the end": Bad({"model": {"path": "/models/ds/.."}}, "spec.model.path"),
    "'.' segment": Bad({"model": {"path": "/models/./ds"}}, "spec.model.path"),
    "empty segment": Bad({"model": {"path": "/models//ds"}}, "spec.model.path"),
    "trailing /": Bad({"model": {"path": "/models/ds/"}}, "spec.model.path"),
    "'..' in mountPath": Bad({"model": {"mountPath": "/models/.."}}, "spec.model.mountPath"),
    "'..' in draftModel.path": Bad({**DRAFT, "draftModel": {"path": "/models/../../etc"}}, "spec.draftModel.path"),
    "'..' in export.outputPath": Bad({"export": {"outputPath": "/models/x/../../var"}}, "spec.export.outputPath"),
    "path over 4096": Bad({"model": {"path": "/models/" + "a" * 4089}}, "spec.model.path", "at most 4096"),
    "hostPath over 4096": Bad(_host("/mnt/" + "a" * 4092), "spec.model.volume.hostPath", "at most 4096"),
    # containment, by path components
    "model outside mountPath": Bad({"model": {"path": "/elsewhere/ds"}}, "spec.model.path", "must lie under"),
    "model.path a string prefix only": Bad({"model": {"path": "/models2/ds"}}, "spec.model.path", "must lie under"),
    "model.path == mountPath": Bad({"model": {"path": "/models"}}, "spec.model.path", "must lie under"),
    "draft outside mountPath": Bad({**DRAFT, "draftModel": {"path": "/models2/ds-mtp"}}, "spec.draftModel.path",
                                   "must lie under"),
    "draft == model": Bad({**DRAFT, "draftModel": {"path": "/models/ds"}}, "spec.draftModel.path", "must differ"),
    "export outside mountPath": Bad({"export": {"outputPath": "/models2/ds-mtp"}}, "spec.export.outputPath",
                                    "must lie under"),
    "export == model": Bad({"export": {"outputPath": "/models/ds"}}, "spec.export.outputPath", "model.path"),
    "export inside model": Bad({"export": {"outputPath": "/models/ds/mtp"}}, "spec.export.outputPath", "model.path"),
    "export contains model": Bad({"model": {"path": "/models/ds/main"}, "export": {"outputPath": "/models/ds"}},
                                 "spec.export.outputPath", "model.path"),
    "neither draft nor export": Bad({"export": None}, "spec", "set exactly one of spec.draftModel"),
    "draft and export": Bad({"draftModel": {"path": "/models/ds-mtp"}}, "spec", "set exactly one of spec.draftModel"),
    "claim and hostPath": Bad({"model": {"volume": {"claimName": "models", "hostPath": "/mnt"}}}, "spec.model.volume",
                              "exactly one of volume.claimName"),
    "no volume source": Bad({"model": {"volume": {"claimName": None}}}, "spec.model.volume",
                            "exactly one of volume.claimName"),
    "read-only with export": Bad({"model": {"volume": {"readOnly": True}}}, "spec", "readOnly cannot be true"),
    # host paths: never the node's system directories (in, or containing them)
    "hostPath /": Bad(_host("/"), "spec.model.volume.hostPath"),
    "hostPath /etc": Bad(_host("/etc"), "spec.model.volume.hostPath", "system directory of the node"),
    "hostPath /etc/kubernetes": Bad(_host("/etc/kubernetes"), "spec.model.volume.hostPath", "system directory"),
    "hostPath /usr": Bad(_host("/usr"), "spec.model.volume.hostPath", "system directory"),
    "hostPath /lib64": Bad(_host("/lib64"), "spec.model.volume.hostPath", "system directory"),
    "hostPath /proc/1/root": Bad(_host("/proc/1/root"), "spec.model.volume.hostPath", "system directory"),
    "hostPath /dev": Bad(_host("/dev"), "spec.model.volume.hostPath", "system directory"),
    "hostPath /root": Bad(_host("/root"), "spec.model.volume.hostPath", "system directory"),
    "hostPath docker socket": Bad(_host("/var/run/docker.sock"), "spec.model.volume.hostPath", "system directory"),
    "hostPath kubelet pods": Bad(_host("/var/lib/kubelet/pods"), "spec.model.volume.hostPath", "system directory"),
    "hostPath /var (holds the kubelet)": Bad(_host("/var"), "spec.model.volume.hostPath", "system directory"),
    "hostPath /var/lib": Bad(_host("/var/lib"), "spec.model.volume.hostPath", "system directory"),
    "hostPath outside the allowed prefixes": Bad(_host("/srv/models"), "spec.model.volume.hostPath",
                                                 "outside the host paths this operator allows", PREFIXES),
    "hostPath a string prefix of an allowed one": Bad(_host("/mnt/models2"), "spec.model.volume.hostPath",
                                                      "MTP_OPERATOR_ALLOWED_HOST_PATH_PREFIXES", PREFIXES),
    "hostPath above an allowed prefix": Bad(_host("/mnt"), "spec.model.volume.hostPath", "outside", PREFIXES),
    # mountPath: never over the container's system directories
    "mountPath /usr": Bad(_mount("/usr"), "spec.model.mountPath", "system directory of the container"),
    "mountPath /etc/models": Bad(_mount("/etc/models"), "spec.model.mountPath", "system directory"),
    "mountPath /dev/shm": Bad(_mount("/dev/shm"), "spec.model.mountPath", "system directory"),
    "mountPath /proc": Bad(_mount("/proc"), "spec.model.mountPath", "system directory"),
    "mountPath /bin": Bad(_mount("/bin"), "spec.model.mountPath", "system directory"),
    "mountPath /var (holds /var/run)": Bad(_mount("/var"), "spec.model.mountPath", "system directory"),
    "mountPath /opt (holds the mtp launcher)": Bad(_mount("/opt"), "spec.model.mountPath", "system directory"),
    # flags the builtin `mtp serve` refuses at start (its own validator)
    "blockSize 2048": Bad({"runtime": {"blockSize": 2048}}, "spec.runtime.blockSize", "--block_size: 2048"),
    "dpSize 2": Bad({"runtime": {"dpSize": 2}}, "spec.runtime.dpSize", "--dp_size"),
    "epSize 3 on 2 ranks": Bad({"runtime": {"epSize": 3}}, "spec.runtime.epSize", "--ep_size"),
    "epSize 32 on 16 NPU processes": Bad({"accelerator": {"resourceName": "huawei.com/Ascend910", "count": 8},
                                          "runtime": {"epSize": 32}}, "spec.runtime.epSize", "--ep_size"),
    "maxTokensPerBatch below k+1": Bad({"speculative": {"numSpeculativeTokens": 2},
                                        "runtime": {"maxTokensPerBatch": 2}}, "spec.runtime.maxTokensPerBatch",
                                       "must be >= 3"),
    "extraArgs --block_size=0": Bad({"extraArgs": ["--block_size=0"]}, "spec.extraArgs", "--block_size"),
    "extraArgs --block_size 0": Bad({"extraArgs": ["--block_size", "0"]}, "spec.extraArgs", "--block_size"),
    "extraArgs unknown flag": Bad({"extraArgs": ["--no_such_flag"]}, "spec.extraArgs", "unrecognized arguments"),
    "extraArgs graph mode on 2 ranks": Bad({"extraArgs": ["--enable_graph=true"]}, "spec.extraArgs", "--enable_graph"),
    "shutdownTimeout -1": Bad({"runtime": {"shutdownTimeout": -1}}, "spec.runtime.shutdownTimeout"),
    "shutdownTimeout '30'": Bad({"runtime": {"shutdownTimeout": "30"}}, "spec.runtime.shutdownTimeout"),
    # extraArgs: single entries, never a flag the operator sets
    "newline": Bad({"extraArgs": ["--a\n--b"]}, "spec", "single argv entries"),
    "--port=9000": Bad({"extraArgs": ["--port=9000"]}, "spec.extraArgs", "a flag the operator sets"),
    "--port 9000": Bad({"extraArgs": ["--port", "9000"]}, "spec.extraArgs", "a flag the operator sets"),
    "--model": Bad({"extraArgs": ["--model=/models/other"]}, "spec.extraArgs", "a flag the operator sets"),
    "--draft-model": Bad({"extraArgs": ["--draft-model", "/models/x"]}, "spec.extraArgs", "a flag the operator sets"),
    "--nnodes": Bad({"extraArgs": ["--nnodes=8"]}, "spec.extraArgs", "a flag the operator sets"),
    "--node-rank": Bad({"extraArgs": ["--node-rank=0"]}, "spec.extraArgs", "a flag the operator sets"),
    "--master_node_addr": Bad({"extraArgs": ["--master_node_addr=evil:1"]}, "spec.extraArgs", "a flag the operator"),
    "--devices": Bad({"extraArgs": ["--devices=cuda:0"]}, "spec.extraArgs", "a flag the operator sets"),
    "-nnodes (gflags)": Bad({"engine": "xllm", "extraArgs": ["-nnodes=4"]}, "spec.extraArgs", "a flag the operator"),
    "--api_key in argv": Bad({"extraArgs": ["--api_key=secret"]}, "spec.extraArgs", "spec.apiKeySecret"),
    "--shutdown-timeout": Bad({"extraArgs": ["--shutdown-timeout=1"]}, "spec.extraArgs", "a flag the operator"),
    "vllm -tp": Bad({"engine": "vllm", "extraArgs": ["-tp", "4"]}, "spec.extraArgs", "a flag the operator sets"),
    "vllm --tensor-parallel-size": Bad({"engine": "vllm", "extraArgs": ["--tensor-parallel-size=4"]},
                                       "spec.extraArgs", "a flag the operator sets"),
    # env
    "env name with a space": Bad(_env({"name": "BAD NAME", "value": "x"}), "spec.env.0.name"),
    "env MTP_NODE_RANK": Bad(_env({"name": "MTP_NODE_RANK", "value": "3"}), "spec.env", "must not set"),
    "env MTP_POD_IP": Bad(_env({"name": "MTP_POD_IP", "value": "1.2.3.4"}), "spec.env", "must not set"),
    "env HCCL_IF_IP": Bad(_env({"name": "HCCL_IF_IP", "value": "1.2.3.4"}), "spec.env", "must not set"),
    "env MTP_API_KEY": Bad(_env({"name": "MTP_API_KEY", "value": "k"}), "spec.env", "must not set"),
    "env twice": Bad(_env({"name": "A", "value": "1"}, {"name": "A", "value": "2"}), "spec.env", "twice"),
    "env without value": Bad(_env({"name": "A"}), "spec.env.0", "exactly one of env[].value"),
    "env value and valueFrom": Bad(_env({"name": "A", "value": "1", "valueFrom": {"fieldRef": {
        "fieldPath": "spec.nodeName"}}}), "spec.env.0", "exactly one of env[].value"),
    "env valueFrom empty": Bad(_env({"name": "A", "valueFrom": {}}), "spec.env.0.valueFrom", "exactly one of"),
    "env valueFrom two sources": Bad(_env({"name": "A", "valueFrom": {
        "secretKeyRef": {"name": "s", "key": "k"}, "configMapKeyRef": {"name": "c", "key": "k"}}}),
        "spec.env.0.valueFrom", "exactly one of"),
    "env secret name": Bad(_env({"name": "A", "valueFrom": {"secretKeyRef": {"name": "Bad_Name", "key": "k"}}}),
                           "spec.env.0.valueFrom.secretKeyRef.name"),
    "env secret key": Bad(_env({"name": "A", "valueFrom": {"secretKeyRef": {"name": "s", "key": "a/b"}}}),
                          "spec.env.0.valueFrom.secretKeyRef.key"),
    "env fieldRef not downward API": Bad(_env({"name": "A", "valueFrom": {"fieldRef": {
        "fieldPath": "spec.containers"}}}), "spec.env.0.valueFrom.fieldRef.fieldPath"),
    # quantities: Kubernetes' grammar, requests within limits
    "quantity lots": Bad({"resources": {"limits": {"memory": "lots"}}}, "spec.resources.limits.memory"),
    "quantity 1.2.3": Bad({"resources": {"limits": {"memory": "1.2.3"}}}, "spec.resources.limits.memory",
                          "Kubernetes quantity"),
    "quantity .": Bad({"resources": {"requests": {"cpu": "."}}}, "spec.resources.requests.cpu"),
    "quantity 1e": Bad({"resources": {"requests": {"cpu": "1e"}}}, "spec.resources.requests.cpu"),
    "quantity 1Gb": Bad({"resources": {"requests": {"memory": "1Gb"}}}, "spec.resources.requests.memory"),
    "quantity -1": Bad({"resources": {"requests": {"cpu": "-1"}}}, "spec.resources.requests.cpu"),
    "quantity a number": Bad({"resources": {"requests": {"cpu": 2}}}, "spec.resources.requests.cpu"),
    "export quantity 1.2.3": Bad({"export": {"resources": {"requests": {"cpu": "1.2.3"}}}},
                                 "spec.export.resources.requests.cpu"),
    "memory request above limit": Bad({"resources": {"requests": {"memory": "8Gi"}, "limits": {"memory": "4Gi"}}},
                                      "spec.resources.requests.memory", "must not exceed limits.memory"),
    "cpu request above limit": Bad({"resources": {"requests": {"cpu": "2"}, "limits": {"cpu": "1500m"}}},
                                   "spec.resources.requests.cpu", "must not exceed limits.cpu"),
    "export request above limit": Bad({"export": {"resources": {"requests": {"memory": "1e10"},
                                                                "limits": {"memory": "9G"}}}},
                                      "spec.export.resources.requests.memory", "must not exceed"),
    # image references
    "image with a space": Bad({"image": "bad image"}, "spec.image"),
    "image uppercase repository": Bad({"image": "example.com/Mtp/runtime:1"}, "spec.image", "image reference"),
    "image uppercase, no registry": Bad({"image": "MtpRuntime:1"}, "spec.image", "image reference"),
    "image empty tag": Bad({"image": "example.com/mtp/runtime:"}, "spec.image"),
    "image empty component": Bad({"image": "example.com//runtime"}, "spec.image"),
    "image short digest": Bad({"image": "example.com/mtp/runtime@sha256:abc"}, "spec.image"),
    "export image uppercase": Bad({"export": {"image": "Runtime"}}, "spec.export.image"),
    # the API key Secret
    "apiKeySecret with xllm": Bad({"engine": "xllm", "apiKeySecret": {"name": "api", "key": "k"}},
                                  "spec.apiKeySecret", "builtin and vllm"),
    "apiKeySecret without key": Bad({"apiKeySecret": {"name": "api"}}, "spec.apiKeySecret.key"),
    "apiKeySecret bad name": Bad({"apiKeySecret": {"name": "API", "key": "k"}}, "spec.apiKeySecret.name"),
}


@pytest.mark.parametrize("case", INVALID.values(), ids=INVALID.keys())
def test_invalid_spec_names_the_field(make_spec, case):
    with pytest.raises(SpecError) as err:
        parse_spec(make_spec(case.changes), settings=case.settings)
    message = str(err.value)
    assert f"{case.field}: " in message, message
    assert case.why in message, message


VALID: dict[str, dict[str, Any]] = {
    "dotted names": {"model": {"path": "/models/.cache/ds...v3"}, "export": {"outputPath": "/models/.a/ds-mtp"}},
    "draft inside the model folder": {**DRAFT, "draftModel": {"path": "/models/ds/mtp"}},
    "export next to a model of a longer name": {"model": {"path": "/models/ds-v3"},
                                                "export": {"outputPath": "/models/ds"}},
    "hostPath that only starts like a system dir": _host("/etcetera/models"),
    "hostPath /var/lib/models": _host("/var/lib/models"),
    "hostPath /libraries": _host("/libraries"),
    "mountPath /opt/models": _mount("/opt/models"),
    "mountPath /data/models": _mount("/data/models"),
    "quantities": {"resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"cpu": "1e3",
                                                                                          "memory": "1024Mi"}},
                   "export": {"resources": {"requests": {"cpu": "0.5", "memory": ".5Gi"},
                                            "limits": {"cpu": "1", "memory": "1E"}}}},
    "floats for a number": {"runtime": {"maxMemoryUtilization": 1}, "speculative": {"minAcceptanceRate": 0}},
    "images": {"image": "registry.example.com:5000/mtp/runtime_cpu:0.1.0-rc.1", "export": {
        "image": f"localhost/mtp/runtime@{DIGEST}"}},
    "image with an uppercase registry": {"image": "Registry.Example.com/mtp/runtime:1"},
    "image on an IPv6 registry": {"image": f"[::1]:5000/mtp/runtime:1@{DIGEST}"},
    "extraArgs mtp serve knows": {"extraArgs": ["--served_model_name=ds", "--max_waiting_requests", "16"]},
    "flags of other engines are theirs": {"engine": "vllm", "runtime": {"dpSize": 2, "blockSize": 4096},
                                          "extraArgs": ["--trust-remote-code", "--portal=1"]},
    "epSize = processes": {"accelerator": {"resourceName": "huawei.com/Ascend910", "count": 8},
                           "runtime": {"epSize": 16}},
    "env sources": _env({"name": "A", "value": ""}, {"name": "B", "valueFrom": {"secretKeyRef": {
        "name": "s.x", "key": "k_1.a"}}}, {"name": "C", "valueFrom": {"configMapKeyRef": {
            "name": "c", "key": "k", "optional": True}}}, {"name": "D", "valueFrom": {"fieldRef": {
                "fieldPath": "metadata.labels['app.kubernetes.io/name']"}}}, {"name": "HCCL_BUFFSIZE",
                                                                                "value": "120"}),
    "apiKeySecret": {"apiKeySecret": {"name": "mtp-api", "key": "token"}, "runtime": {"shutdownTimeout": 120}},
}


@pytest.mark.parametrize("changes", VALID.values(), ids=VALID.keys())
def test_valid_spec(make_spec, changes):
    parse_spec(make_spec(changes))


def test_allowed_host_path_prefixes_admit_paths_under_them(make_spec):
    for path in ("/mnt/models", "/mnt/models/ds", "/data"):
        parse_spec(make_spec(_host(path)), settings=PREFIXES)
    # Without the setting any non-system host path is allowed; system ones never are.
    parse_spec(make_spec(_host("/srv/models")))
    with pytest.raises(SpecError, match="system directory"):
        parse_spec(make_spec(_host("/etc")), settings=OperatorSettings(allowed_host_path_prefixes=("/etc",)))


@pytest.mark.parametrize("prefix", ["relative", "/", "/mnt/", "/mnt//x", "/mnt/../etc"])
def test_allowed_host_path_prefixes_must_be_canonical(prefix):
    with pytest.raises(SettingsError, match="MTP_OPERATOR_ALLOWED_HOST_PATH_PREFIXES"):
        OperatorSettings.from_env({"MTP_OPERATOR_ALLOWED_HOST_PATH_PREFIXES": f"/ok,{prefix}"})


def test_system_directory_lists_cover_the_issue():
    for path in ("/etc", "/usr", "/bin", "/sbin", "/lib", "/lib64", "/boot", "/dev", "/proc", "/sys", "/run",
                 "/var/run", "/root", "/var/lib/kubelet"):
        assert path in HOST_SYSTEM_DIRS
    for path in ("/usr", "/etc", "/dev", "/proc", "/bin"):
        assert path in CONTAINER_SYSTEM_DIRS


def test_python_only_rules_are_listed():
    assert [r.name for r in PYTHON_RULES] == ["host path under the operator's allowed prefixes",
                                              "builtin engine flags, by mtp serve's validator"]


@pytest.mark.parametrize("text,value", [("500m", "0.5"), ("1Gi", "1073741824"), ("1e3", "1000"), ("0.5", "0.5"),
                                        (".5", "0.5"), ("2", "2"), ("1E", "1e18"), ("1E3", "1000"), ("3k", "3000"),
                                        ("5.", "5"), ("1e-2", "0.01"), ("100n", "1e-7")])
def test_parse_quantity(text, value):
    assert parse_quantity(text) == Decimal(value)


@pytest.mark.parametrize("text", ["1.2.3", ".", "1e", "", "-1", "1Gb", "Gi"])
def test_parse_quantity_refuses_what_kubernetes_refuses(text):
    with pytest.raises(ValueError):
        parse_quantity(text)


def test_several_errors_are_all_reported(make_spec):
    with pytest.raises(SpecError) as err:
        parse_spec(make_spec({"nnodes": "2", "image": "Bad", "model": {"path": "/models/../x"}}))
    for field in ("spec.nnodes: ", "spec.image: ", "spec.model.path: "):
        assert field in str(err.value)


def test_spec_must_be_a_mapping():
    with pytest.raises(SpecError, match="spec: expected a mapping"):
        parse_spec(["not", "a", "dict"])
