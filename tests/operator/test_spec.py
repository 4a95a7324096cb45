"""Spec validation: defaults, and invalid specs rejected with the field named."""

from __future__ import annotations

import pytest

from mtp_operator.spec import SpecError, parse_spec


def test_minimal_spec_gets_defaults(make_spec):
    spec = parse_spec(make_spec())
    assert spec.engine == "builtin"
    assert spec.ports.http == 8000 and spec.ports.master == 29500
    assert spec.speculative.num_speculative_tokens == 1
    assert spec.accelerator.count == 0 and spec.accelerator.resource_name is None
    assert spec.model.mount_path == "/models"


INVALID = [
    ({"nnodes": 0}, "spec.nnodes"),
    ({"nnodes": -2}, "spec.nnodes"),
    ({"nnodes": "two"}, "spec.nnodes"),
    ({"engine": "sglang"}, "spec.engine"),
    ({"accelerator": {"resourceName": "nvidia.com/gpu", "count": -1}}, "spec.accelerator.count"),
    ({"accelerator": {"resourceName": "nvidia.com/gpu", "count": 0}}, "accelerator.count must be >= 1"),
    ({"accelerator": {"count": 4}}, "accelerator.resourceName is set"),
    ({"accelerator": {"resourceName": "example.com/tpu", "count": 1}}, "spec.accelerator.resourceName"),
    ({"model": {"path": "/models/ds; rm -rf /"}}, "spec.model.path"),
    ({"model": {"path": "/models/$(whoami)"}}, "spec.model.path"),
    ({"model": {"path": "relative/dir"}}, "spec.model.path"),
    ({"model": {"path": "/elsewhere/ds"}}, "model.path must lie under model.mountPath"),
    ({"export": {"outputPath": "/models/out`id`"}}, "spec.export.outputPath"),
    ({"export": None}, "set exactly one of spec.draftModel"),
    ({"draftModel": {"path": "/models/ds-mtp"}}, "set exactly one of spec.draftModel"),
    ({"export": {"outputPath": "/models/ds"}}, "export.outputPath must lie under model.mountPath and differ"),
    ({"model": {"volume": {"claimName": "models", "hostPath": "/mnt"}}}, "exactly one of volume.claimName"),
    ({"model": {"volume": {"claimName": None}}}, "exactly one of volume.claimName"),
    ({"model": {"volume": {"readOnly": True}}}, "model.volume.readOnly cannot be true"),
    ({"model": {"modelType": "llama"}}, "spec.model.modelType"),
    ({"speculative": {"numSpeculativeTokens": 0}}, "spec.speculative.numSpeculativeTokens"),
    ({"speculative": {"minAcceptanceRate": 1.5}}, "spec.speculative.minAcceptanceRate"),
    ({"runtime": {"maxMemoryUtilization": 0}}, "spec.runtime.maxMemoryUtilization"),
    ({"runtime": {"epSize": 0}}, "spec.runtime.epSize"),
    ({"ports": {"http": 70000}}, "spec.ports.http"),
    ({"ports": {"http": 29500}}, "ports.http and ports.master must differ"),
    ({"env": [{"name": "MTP_NODE_RANK", "value": "3"}]}, "env must not set MTP_NODE_RANK"),
    ({"env": [{"name": "BAD NAME", "value": "x"}]}, "spec.env.0.name"),
    ({"extraArgs": "--foo --bar"}, "spec.extraArgs"),
    ({"extraArgs": ["--a\n--b"]}, "extraArgs items are single argv entries"),
    ({"image": "bad image"}, "spec.image"),
    ({"resources": {"limits": {"memory": "lots"}}}, "spec.resources.limits.memory"),
    ({"service": {"type": "ExternalName"}}, "spec.service.type"),
    ({"unknownField": 1}, "spec.unknownField"),
]


@pytest.mark.parametrize("changes,expected", INVALID, ids=[e for _, e in INVALID])
def test_invalid_spec_names_the_field(make_spec, changes, expected):
    with pytest.raises(SpecError) as err:
        parse_spec(make_spec(changes))
    assert expected in str(err.value)


def test_path_error_explains_the_fix(make_spec):
    with pytest.raises(SpecError, match="absolute path without spaces or shell characters"):
        parse_spec(make_spec({"model": {"path": "/models/a b"}}))


def test_spec_must_be_a_mapping():
    with pytest.raises(SpecError, match="spec: expected a mapping"):
        parse_spec(["not", "a", "dict"])
