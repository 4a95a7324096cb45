"""Planning for each engine and accelerator kind (pure; no cluster)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time

import pytest

from mtp_operator import constants as c
from mtp_operator.engines import kubernetes_escaped
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
    # One runtime process per NPU: 2 pods x 8 devices form a group of 16 ranks.
    assert plan.pod_argv[3:10] == ["per-device", "8", "16", "$(MTP_NODE_RANK)", "8000", "npu", "0"]
    assert plan.pod_argv[10:12] == ["mtp", "serve"]
    assert plan.pod_field_env[c.ENV_HCCL_IF_IP] == "status.podIP"
    assert plan.pod_env[c.ENV_HCCL_CONNECT_TIMEOUT] == c.HCCL_CONNECT_TIMEOUT_SECONDS
    assert plan.resources["limits"]["huawei.com/Ascend910"] == "8"
    assert plan.ranks[1].env[c.ENV_HCCL_IF_IP] == "127.0.0.1"


def test_builtin_gpu_devices_and_resources(make_spec):
    plan = _plan(make_spec, GPU)
    assert plan.accelerator_kind == "cuda"
    assert plan.pod_argv[3:10] == ["per-device", "4", "8", "$(MTP_NODE_RANK)", "8000", "cuda", "0"]
    assert plan.resources == {"requests": {"nvidia.com/gpu": "4"}, "limits": {"nvidia.com/gpu": "4"}}
    assert c.ENV_HCCL_IF_IP not in plan.pod_field_env and c.ENV_HCCL_CONNECT_TIMEOUT not in plan.pod_env


def test_every_per_device_process_is_a_valid_mtp_serve(make_spec, tmp_path):
    """The pod script's command lines, as the runtime itself parses them."""
    from mtp_runtime.server.args import add_serve_arguments, validate_serve_args

    plan = _plan(make_spec, {**NPU, "runtime": {"epSize": 16}})
    env = _fake_program(tmp_path, "mtp", 'for a in "$@"; do case "$a" in --node_rank=*) r=${a#*=};; esac; done\n'
                                         'printf "%s\\n" "$@" > "$OUT/args-$r.tmp"\n'
                                         'mv "$OUT/args-$r.tmp" "$OUT/args-$r"\nexec sleep 60\n')
    argv = [_kubernetes_expand(a, {"MTP_NODE_RANK": "1"}) for a in plan.pod_argv]
    script = subprocess.Popen(argv, env=env, start_new_session=True)
    deadline = time.monotonic() + 20
    while len(list(tmp_path.glob("args-*[0-9]"))) < 8 and time.monotonic() < deadline:
        time.sleep(0.05)
    script.terminate()
    script.wait(timeout=10)
    for model in ("ds", "ds-mtp"):
        (tmp_path / model).mkdir()
        (tmp_path / model / "config.json").write_text("{}")
    for device in range(8):
        args = (tmp_path / f"args-{8 + device}").read_text().splitlines()
        assert args[0] == "serve"
        args = [a.replace("/models/", f"{tmp_path}/") for a in args[1:]]
        parser = argparse.ArgumentParser()
        add_serve_arguments(parser)
        served = validate_serve_args(parser.parse_args(args), env={}, check_devices=False)
        assert served.devices == [f"npu:{device}"] and served.port == 8000 + device
        assert (served.nnodes, served.node_rank, served.ep_size) == (16, 8 + device, 16)
        assert served.master_node_addr == "ds-0.ds-ranks.team.svc:29500"


def test_default_image_depends_on_accelerator(make_spec):
    settings = OperatorSettings(runtime_image="cpu-img:1", npu_runtime_image="npu-img:1")
    assert _plan(make_spec, {"image": None}, settings=settings).image == "cpu-img:1"
    assert _plan(make_spec, {"image": None, **NPU}, settings=settings).image == "npu-img:1"


def test_xllm_uses_its_launch_flags(make_spec):
    plan = _plan(make_spec, {"engine": "xllm", **NPU, "speculative": {"numSpeculativeTokens": 2},
                             "runtime": {"epSize": 16, "blockSize": 128}})
    argv = plan.ranks[1].argv
    # One xLLM process per NPU, as in its launch script: 2 pods x 8 devices = 16 processes.
    assert argv[:2] == ["/bin/sh", "-c"]
    assert argv[3:10] == ["per-device", "8", "16", "1", "8000", "npu", "0"]
    assert argv[10] == "xllm"
    for flag in ("--model=/models/ds", "--master_node_addr=ds-0.ds-ranks.team.svc:29500",
                 "--draft_model=/models/ds-mtp", "--num_speculative_tokens=2",
                 "--communication_backend=hccl", "--ep_size=16", "--block_size=128"):
        assert flag in argv, flag
    assert not any(a.startswith(("--devices", "--nnodes", "--node_rank", "--port")) for a in argv[10:])
    assert plan.pod_argv[6] == "$(MTP_NODE_RANK)" and plan.pod_argv[10] == "xllm"
    assert plan.pod_argv[2] == kubernetes_escaped(plan.ranks[1].argv[2])
    assert plan.metrics_path == "/vars"


def test_xllm_on_one_device_is_one_plain_process(make_spec):
    plan = _plan(make_spec, {"engine": "xllm", "accelerator": {"resourceName": "huawei.com/Ascend910",
                                                               "count": 1}})
    argv = plan.ranks[1].argv
    assert argv[0] == "xllm"
    for flag in ("--devices=npu:0", "--draft_devices=npu:0", "--port=8000", "--nnodes=2", "--node_rank=1"):
        assert flag in argv, flag


def _kubernetes_expand(arg: str, env: dict[str, str]) -> str:
    """What the kubelet does to a container arg: $(VAR) -> value, $$ -> $."""
    out, i = [], 0
    while i < len(arg):
        if arg.startswith("$$", i):
            out.append("$")
            i += 2
        elif arg.startswith("$(", i) and ")" in arg[i:]:
            name = arg[i + 2:arg.index(")", i)]
            out.append(env[name] if name in env else arg[i:arg.index(")", i) + 1])
            i = arg.index(")", i) + 1
        else:
            out.append(arg[i])
            i += 1
    return "".join(out)


def _fake_program(tmp_path, name: str, body: str):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / name
    fake.write_text("#!/bin/sh\n" + body)
    fake.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(tmp_path)}


def test_xllm_pod_script_starts_one_process_per_device(make_spec, tmp_path):
    plan = _plan(make_spec, {"engine": "xllm", "accelerator": {"resourceName": "huawei.com/Ascend910",
                                                               "count": 3}})
    env = _fake_program(tmp_path, "xllm", 'for a in "$@"; do case "$a" in --node_rank=*) r=${a#*=};; esac; done\n'
                               'printf "%s\\n" "$@" > "$OUT/args-$r.tmp"\nmv "$OUT/args-$r.tmp" "$OUT/args-$r"\n'
                               # process 3 exits once all three have started (else the others could be
                               # stopped before they record their arguments)
                               'if [ "$r" = 3 ]; then while [ "$(ls "$OUT" | grep -c "^args-[0-9]*$")" -lt 3 ]; '
                               'do sleep 0.05; done; exit 7; fi\nexec sleep 60\n')
    argv = [_kubernetes_expand(a, {"MTP_NODE_RANK": "1"}) for a in plan.pod_argv]
    started = time.monotonic()
    done = subprocess.run(argv, env=env, timeout=30, capture_output=True, text=True, start_new_session=True)
    # Process 3 (pod 1's first device) exited: the script stopped its siblings and failed.
    assert done.returncode != 0 and time.monotonic() - started < 20
    for device, rank in enumerate((3, 4, 5)):
        args = (tmp_path / f"args-{rank}").read_text().splitlines()
        assert f"--devices=npu:{device}" in args and f"--draft_devices=npu:{device}" in args
        assert f"--port={8000 + device}" in args and "--nnodes=6" in args
        assert "--master_node_addr=ds-0.ds-ranks.team.svc:29500" in args


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
    for changes in ({"image": "other:2"}, {"nnodes": 3}, {"extraArgs": ["--served_model_name=x"]}, {"engine": "xllm"},
                    {"runtime": {"blockSize": 64}}, {"model": {"path": "/models/other"}}):
        assert _plan(make_spec, changes).template_hash != base, changes


def test_single_node_builtin_has_no_rendezvous_flags(make_spec):
    plan = _plan(make_spec, {"nnodes": 1})
    assert not any(a.startswith("--master_node_addr") for a in plan.pod_argv)


def test_xllm_pod_script_passes_sigterm_to_every_process(make_spec, tmp_path):
    plan = _plan(make_spec, {"engine": "xllm", "accelerator": {"resourceName": "huawei.com/Ascend910",
                                                               "count": 2}})
    env = _fake_program(tmp_path, "xllm", 'echo $$ > "$OUT/pid-$$"\nexec sleep 60\n')
    argv = [_kubernetes_expand(a, {"MTP_NODE_RANK": "0"}) for a in plan.pod_argv]
    script = subprocess.Popen(argv, env=env, start_new_session=True)
    deadline = time.monotonic() + 10
    while len(list(tmp_path.glob("pid-*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = [int(p.read_text()) for p in tmp_path.glob("pid-*")]
    assert len(pids) == 2
    script.terminate()  # what the kubelet does when the pod is deleted
    assert script.wait(timeout=10) != 0
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_adaptive_speculation_is_a_builtin_flag_and_refused_for_other_engines(make_spec):
    adaptive = {"speculative": {"numSpeculativeTokens": 3, "adaptive": True}}
    argv = _plan(make_spec, adaptive).ranks[1].argv
    assert "--num_speculative_tokens=3" in argv and "--speculative_adaptive=true" in argv
    assert not any("speculative_adaptive" in a for a in _plan(make_spec).ranks[1].argv)
    for engine, accelerator in (("vllm", GPU), ("xllm", NPU)):
        with pytest.raises(PlanError, match=f"spec.speculative.adaptive=true: {engine} has no adaptive"):
            _plan(make_spec, {"engine": engine, **accelerator, **adaptive})
        _plan(make_spec, {"engine": engine, **accelerator, "speculative": {"adaptive": False}})
