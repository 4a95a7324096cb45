"""Planning for each engine and accelerator kind (pure; no cluster)."""

from __future__ import annotations

import json

import pytest

from mtp_operator import constants as c
from mtp_operator.plan import PlanError, kubernetes_master_host, plan_deployment
from mtp_operator.settings import OperatorSettings
from mtp_operator.spec import parse_spec

NPU = {"accelerator": {"resourceName": "huawei.com/Ascend910", "count": 8}}
GPU = {"accelerator": {"resourceName": "nvidia.com/gpu", "count": 4}}


def _plan(make_spec, changes=None, **kwargs):
    spec = parse_spec(make_spec(changes))
    kwargs.setdefault("master_host", kubernetes_master_host("ds", "team"))
    return plan_deployment("ds", "team", spec, **kwargs)


def test_builtin_cpu_flags_follow_the_contract(make_spec):
    plan = _plan(make_spec, {"runtime": {"maxSeqsPerBatch": 8, "enablePrefixCache": True}})
    rank1 = plan.ranks[1].argv
    assert rank1[:2] == ["mtp", "serve"]
    assert "--model=/models/ds" in rank1 and "--draft_model=/models/ds-mtp" in rank1
    assert "--devices=cpu" in rank1 and "--num_speculative_tokens=1" in rank1
    assert "--master_node_addr=ds-0.ds-ranks.team.svc:29500" in rank1
    assert "--nnodes=2" in rank1 and "--node_rank=1" in rank1
    assert "--max_seqs_per_batch=8" in rank1 and "--enable_prefix_cache=true" in rank1
    assert "--node_rank=$(MTP_NODE_RANK)" in plan.pod_argv
    assert plan.ranks[0].is_master and not plan.ranks[1].is_master
    assert plan.accelerator_kind == "cpu" and plan.resources == {}
    assert plan.image == "example.com/mtp/runtime:1"


def test_npu_devices_hccl_env_and_resources(make_spec):
    plan = _plan(make_spec, NPU)
    assert "--devices=" + ",".join(f"npu:{i}" for i in range(8)) in plan.pod_argv
    assert plan.pod_field_env[c.ENV_HCCL_IF_IP] == "status.podIP"
    assert plan.pod_env[c.ENV_HCCL_CONNECT_TIMEOUT] == c.HCCL_CONNECT_TIMEOUT_SECONDS
    assert plan.resources["limits"]["huawei.com/Ascend910"] == "8"
    assert plan.ranks[1].env[c.ENV_HCCL_IF_IP] == "127.0.0.1"


def test_default_image_depends_on_accelerator(make_spec):
    settings = OperatorSettings(runtime_image="cpu-img:1", npu_runtime_image="npu-img:1")
    assert _plan(make_spec, {"image": None}, settings=settings).image == "cpu-img:1"
    assert _plan(make_spec, {"image": None, **NPU}, settings=settings).image == "npu-img:1"


def test_xllm_uses_its_launch_flags(make_spec):
    plan = _plan(make_spec, {"engine": "xllm", **NPU, "speculative": {"numSpeculativeTokens": 2},
                             "runtime": {"epSize": 16, "blockSize": 128}})
    argv = plan.ranks[1].argv
    assert argv[0] == "xllm"
    for flag in ("--model=/models/ds", "--port=8000", "--master_node_addr=ds-0.ds-ranks.team.svc:29500",
                 "--nnodes=2", "--node_rank=1", "--draft_model=/models/ds-mtp", "--num_speculative_tokens=2",
                 "--communication_backend=hccl", "--ep_size=16", "--block_size=128"):
        assert flag in argv, flag
    assert any(a.startswith("--draft_devices=npu:0,") for a in argv)
    assert plan.metrics_path == "/vars"


def test_vllm_multinode_flags_and_headless_workers(make_spec):
    plan = _plan(make_spec, {"engine": "vllm", **GPU, "runtime": {"dpSize": 4, "epSize": 4},
                             "speculative": {"numSpeculativeTokens": 2}})
    rank0, rank1 = plan.ranks[0].argv, plan.ranks[1].argv
    assert rank0[:3] == ["vllm", "serve", "/models/ds"]
    config = json.loads(rank0[rank0.index("--speculative-config") + 1])
    assert config == {"method": "deepseek_mtp", "num_speculative_tokens": 2}
    assert rank0[rank0.index("--data-parallel-size") + 1] == "4"
    assert rank0[rank0.index("--data-parallel-size-local") + 1] == "2"
    assert rank0[rank0.index("--tensor-parallel-size") + 1] == "2"
    assert rank0[rank0.index("--data-parallel-address") + 1] == "ds-0.ds-ranks.team.svc"
    assert "--enable-expert-parallel" in rank0 and "--headless" not in rank0
    assert rank1[-3:] == ["--headless", "--data-parallel-start-rank", "2"]
    assert plan.ranks[1].http_port is None and plan.ranks[0].http_port == 8000
    # The pod template reads the rank from the environment; user values are positional args.
    assert plan.pod_argv[:2] == ["/bin/sh", "-c"] and plan.pod_argv[4:] == rank0
    assert "MTP_NODE_RANK * 2" in plan.pod_argv[2]


def test_vllm_layout_errors_name_the_field(make_spec):
    with pytest.raises(PlanError, match="spec.runtime.dpSize=3"):
        _plan(make_spec, {"engine": "vllm", **GPU, "runtime": {"dpSize": 3}})
    with pytest.raises(PlanError, match="spec.accelerator.count=4"):
        _plan(make_spec, {"engine": "vllm", **GPU, "runtime": {"dpSize": 16}})


def test_local_backend_gets_distinct_ports_and_loopback_master(make_spec):
    plan = _plan(make_spec, {"nnodes": 3}, master_host="127.0.0.1", port_stride=1)
    assert [r.http_port for r in plan.ranks] == [8000, 8001, 8002]
    assert "--port=8002" in plan.ranks[2].argv
    assert plan.master_address == "127.0.0.1:29500"


def test_export_step_is_idempotent_and_follows_export_settings(make_spec):
    first, again = _plan(make_spec), _plan(make_spec)
    assert first.export == again.export
    step = first.export
    assert step.argv == ["mtp", "export", "--input-dir", "/models/ds", "--output-dir", "/models/ds-mtp",
                         "--model-type", "deepseek_v3"]
    assert step.job_name.startswith("ds-export-") and len(step.job_name) <= 63
    forced = _plan(make_spec, {"export": {"force": True}}).export
    assert forced.argv[-1] == "--force" and forced.job_name != step.job_name
    assert _plan(make_spec, {"export": None, "draftModel": {"path": "/models/d"}}).export is None
    long = plan_deployment("x" * 60, "ns", parse_spec(make_spec()), master_host="h").export
    assert len(long.job_name) <= 63


def test_template_hash_changes_only_with_what_pods_run(make_spec):
    base = _plan(make_spec).template_hash
    assert _plan(make_spec).template_hash == base
    assert _plan(make_spec, {"service": {"type": "NodePort"}}).template_hash == base
    assert _plan(make_spec, {"speculative": {"minAcceptanceRate": 0.5}}).template_hash == base
    for changes in ({"image": "other:2"}, {"nnodes": 3}, {"extraArgs": ["--x"]}, {"engine": "xllm"},
                    {"runtime": {"blockSize": 64}}, {"model": {"path": "/models/other"}}):
        assert _plan(make_spec, changes).template_hash != base, changes


def test_single_node_builtin_has_no_rendezvous_flags(make_spec):
    plan = _plan(make_spec, {"nnodes": 1})
    assert not any(a.startswith("--master_node_addr") for a in plan.pod_argv)
