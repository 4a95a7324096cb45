"""The operator's plan, made local: loopback master, free ports, local paths,
the same interpreter for `mtp` commands."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest
import yaml

from mtp_operator import constants as c
from mtp_operator.local.launch import (
    LOOPBACK,
    choose_ports,
    export_process,
    local_command,
    plan_local,
    rank_processes,
)
from mtp_operator.local.paths import LocalPaths
from mtp_operator.plan import PlanError, plan_deployment
from mtp_operator.spec import parse_spec

REPO = Path(__file__).resolve().parents[3]
SAMPLE = REPO / "crds" / "samples" / "tiny-cpu.yaml"


def sample_spec(**changes):
    data = yaml.safe_load(SAMPLE.read_text())["spec"]
    data.update(changes)
    return parse_spec(data)


def test_sample_becomes_export_and_rank_processes(tmp_path):
    spec = sample_spec()
    plan = plan_local("tiny-cpu", spec, 18100, 18199)
    paths = LocalPaths.for_spec(spec, tmp_path)
    export = export_process(plan, paths)
    assert export.argv[:4] == [sys.executable, "-m", "mtp_runtime", "export"]
    assert export.argv[export.argv.index("--input-dir") + 1] == str(tmp_path / "tiny-deepseek-v3")
    assert export.argv[export.argv.index("--output-dir") + 1] == str(tmp_path / "tiny-deepseek-v3-mtp")
    (rank0,) = rank_processes(plan, paths)
    assert rank0.name == "rank-0" and rank0.http_port == 18100
    assert rank0.argv[:4] == [sys.executable, "-m", "mtp_runtime", "serve"]
    assert f"--model={tmp_path}/tiny-deepseek-v3" in rank0.argv
    assert f"--draft_model={tmp_path}/tiny-deepseek-v3-mtp" in rank0.argv
    assert f"--host={LOOPBACK}" in rank0.argv and "--port=18100" in rank0.argv
    assert rank0.env[c.ENV_MASTER_ADDR] == f"{LOOPBACK}:18199"
    assert rank0.env[c.ENV_NODE_RANK] == "0"


def test_same_plan_as_the_operator_apart_from_addresses(tmp_path):
    # The local plan is the operator's plan: same engine argv shape, same
    # export step, only master host and ports differ.
    spec = sample_spec(nnodes=2)
    local = plan_local("tiny-cpu", spec, 18100, 18199)
    cluster = plan_deployment("tiny-cpu", "default", spec, master_host="tiny-cpu-0.tiny-cpu-ranks.default.svc")
    assert local.export.argv == cluster.export.argv
    assert [r.rank for r in local.ranks] == [0, 1]
    assert [r.http_port for r in local.ranks] == [18100, 18101]
    assert local.master_address == f"{LOOPBACK}:18199"
    for mine, theirs in zip(local.ranks, cluster.ranks):
        strip = lambda argv: [a for a in argv if not a.startswith(("--port=", "--master_node_addr="))]  # noqa: E731
        assert strip(mine.argv) == strip(theirs.argv)
    ranks = rank_processes(local, LocalPaths.for_spec(spec, tmp_path))
    assert "--node_rank=1" in ranks[1].argv and "--nnodes=2" in ranks[1].argv
    assert f"--master_node_addr={LOOPBACK}:18199" in ranks[1].argv


def test_draft_model_given_means_no_export(tmp_path):
    data = yaml.safe_load(SAMPLE.read_text())["spec"]
    data.pop("export")
    data["draftModel"] = {"path": "/models/ready-mtp"}
    spec = parse_spec(data)
    plan = plan_local("tiny-cpu", spec, 18100, 18199)
    assert export_process(plan, LocalPaths.for_spec(spec, tmp_path)) is None


def test_ports_from_the_spec_when_free_else_free_ones():
    spec = sample_spec(nnodes=2)
    with socket.socket() as busy:
        busy.bind((LOOPBACK, 0))
        busy.listen()
        taken = busy.getsockname()[1]
        data = yaml.safe_load(SAMPLE.read_text())["spec"]
        data.update(nnodes=2, ports={"http": taken, "master": taken + 10})
        ((http, master),) = choose_ports(parse_spec(data), None, None)
        assert http != taken and master not in (http, http + 1)
        assert choose_ports(spec, 18500, 18600) == [(18500, 18600)]
    with pytest.raises(PlanError, match="collides"):
        choose_ports(spec, 18500, 18501)


def test_foreign_engine_needs_its_command():
    with pytest.raises(PlanError, match=r"spec\.engine: `xllm-not-installed` is not on PATH"):
        local_command(["xllm-not-installed", "--model=/m"], "spec.engine")


def test_several_devices_per_rank_get_their_own_ports_and_devices(tmp_path):
    # Two ranks of two NPUs on one machine: four processes, four ports, four devices.
    spec = sample_spec(nnodes=2, accelerator={"resourceName": "huawei.com/Ascend910", "count": 2})
    plan = plan_local("tiny-npu", spec, 18100, 18199)
    rank0, rank1 = rank_processes(plan, LocalPaths.for_spec(spec, tmp_path))
    assert rank1.argv[:2] == ["/bin/sh", "-c"]
    # processes, group size, rank, first port, device kind, first device
    assert rank1.argv[4:10] == ["2", "4", "1", "18102", "npu", "2"]
    assert rank1.argv[10:14] == [sys.executable, "-m", "mtp_runtime", "serve"]
    assert rank0.argv[4:10] == ["2", "4", "0", "18100", "npu", "0"]
    assert (rank0.http_port, rank1.http_port) == (18100, 18102)
    assert f"--model={tmp_path}/tiny-deepseek-v3" in rank1.argv
    ((http, master),) = choose_ports(spec, None, None)
    assert master not in range(http, http + 4)


def _prepare(tmp_path, spec_changes=None, *flags):
    """`mtp up --dry-run`'s LocalDeployment for the sample with `spec_changes`."""
    import argparse

    from mtp_operator.commands import up

    resource = yaml.safe_load(SAMPLE.read_text())
    resource["spec"].update(spec_changes or {})
    cr = tmp_path / "cr.yaml"
    cr.write_text(yaml.safe_dump(resource))
    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    args = parser.parse_args([str(cr), "--models-dir", str(tmp_path / "models"), "--dry-run", "--port", "18500",
                              "--master-port", "18599", *flags])
    return up.prepare(args)


def test_up_waits_as_long_as_the_pods_grace_period(tmp_path):
    assert _prepare(tmp_path).options.grace_seconds == 45  # the server's 30 s drain + 15 s
    deployment = _prepare(tmp_path, {"runtime": {"shutdownTimeout": 5}})
    assert deployment.options.grace_seconds == deployment.plan.termination_grace_seconds == 20
    assert "--shutdown_timeout=5" in deployment.groups[0].ranks[0].argv
    assert _prepare(tmp_path, {"runtime": {"shutdownTimeout": 5}}, "--grace-period", "3").options.grace_seconds == 3


def test_up_applies_the_operators_host_path_setting(tmp_path, monkeypatch):
    from mtp_operator.spec import SpecError

    monkeypatch.setenv("MTP_OPERATOR_ALLOWED_HOST_PATH_PREFIXES", "/mnt/models")
    with pytest.raises(SpecError, match="spec.model.volume.hostPath: /tmp/mtp-models is outside"):
        _prepare(tmp_path)
    monkeypatch.setenv("MTP_OPERATOR_ALLOWED_HOST_PATH_PREFIXES", "/tmp")
    _prepare(tmp_path)


def test_secret_and_config_map_env_must_be_set_locally():
    from mtp_operator.local.launch import require_reference_env

    spec = sample_spec(apiKeySecret={"name": "api", "key": "token"},
                       env=[{"name": "A", "value": "1"},
                            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "t"}}}])
    plan = plan_local("tiny-cpu", spec, 18100, 18199)
    with pytest.raises(PlanError) as err:
        require_reference_env(spec, plan, {})
    assert "spec.env[1].valueFrom (HF_TOKEN), spec.apiKeySecret (MTP_API_KEY): mtp up cannot read" in str(err.value)
    require_reference_env(spec, plan, {"HF_TOKEN": "x", c.ENV_API_KEY: "k"})  # inherited by the ranks


def test_smoke_requests_send_the_api_key(serve_http, monkeypatch):
    import http.server
    import json

    from mtp_operator.local.client import smoke_requests

    seen = []

    class Rank0(http.server.BaseHTTPRequestHandler):
        def answer(self, body):
            seen.append(self.headers.get("Authorization"))
            data = json.dumps(body).encode()
            self.send_response(200 if seen[-1] == "Bearer k-1" else 401)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self.answer({"data": [{"id": "tiny"}]})

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.answer({"choices": [{"text": "x"}], "usage": {"completion_tokens": 1}})

    monkeypatch.setenv(c.ENV_API_KEY, "k-1")
    with serve_http(Rank0) as port:
        done = smoke_requests(f"http://127.0.0.1:{port}", 2)
    assert [d.text for d in done] == ["x", "x"] and seen == ["Bearer k-1"] * 3


def test_each_group_gets_its_own_ports_master_and_names(tmp_path):
    # Explicit ports: group g from PORT + g * nnodes and MASTER_PORT + g.
    from mtp_operator.local.launch import plan_groups

    spec = sample_spec(nnodes=2, replicas=3)
    ports = choose_ports(spec, 18500, 18600, groups=3)
    assert ports == [(18500, 18600), (18502, 18601), (18504, 18602)]
    groups = plan_groups("tiny-cpu", spec, LocalPaths.for_spec(spec, tmp_path), ports)
    assert [g.index for g in groups] == [0, 1, 2]
    assert [[r.name for r in g.ranks] for g in groups] == [
        ["rank-0", "rank-1"], ["g1-rank-0", "g1-rank-1"], ["g2-rank-0", "g2-rank-1"]]
    assert [[r.http_port for r in g.ranks] for g in groups] == [[18500, 18501], [18502, 18503], [18504, 18505]]
    assert [g.endpoint for g in groups] == [f"http://{LOOPBACK}:{p}" for p in (18500, 18502, 18504)]
    second = groups[1].ranks[1]
    assert second.env[c.ENV_MASTER_ADDR] == f"{LOOPBACK}:18601" and second.env[c.ENV_NODE_RANK] == "1"
    assert f"--master_node_addr={LOOPBACK}:18601" in second.argv and "--port=18503" in second.argv
    assert groups[2].plan.master_address == f"{LOOPBACK}:18602"


def test_group_ports_fall_back_to_free_ones_that_no_other_group_uses():
    from mtp_operator.local.launch import free_port_block

    for _ in range(20):  # (another process may take a port of the block before this test binds it)
        base = free_port_block(8)
        data = yaml.safe_load(SAMPLE.read_text())["spec"]
        # Group 2's master would land in group 2's HTTP block (base+4, base+5); group 1's block is busy.
        data.update(nnodes=2, replicas=3, ports={"http": base, "master": base + 3})
        spec = parse_spec(data)
        with socket.socket() as busy:
            # as a server binds: a port whose last connection lingers in TIME_WAIT counts as free
            busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                busy.bind((LOOPBACK, base + 2))
            except OSError:
                continue
            busy.listen()
            ports = choose_ports(spec, None, None, groups=3)
            break
    else:
        pytest.fail("no block of 8 free ports stayed free long enough to bind one of them")
    http = [port for first, _ in ports for port in (first, first + 1)]
    masters = [master for _, master in ports]
    assert ports[0][0] == base and base + 2 not in http
    assert len(set(http + masters)) == 9  # no port serves two processes
    assert ports[2][0] == base + 4 and masters[0] == base + 3  # the spec's layout where it is free
    assert base + 4 not in masters and base + 5 not in masters  # ... and none where group 2 listens


def test_explicit_ports_that_collide_across_groups_are_refused():
    spec = sample_spec(replicas=2)
    with pytest.raises(PlanError, match="--master-port 18501: group 0's master port 18501 collides with group 1's "
                                        "HTTP ports 18501"):
        choose_ports(spec, 18500, 18501, groups=2)
    with pytest.raises(PlanError, match="--port 65535: group 1's 1 HTTP port"):
        choose_ports(spec, 65535, 18600, groups=2)
    assert choose_ports(spec, 18500, 18600, groups=0) == []


def test_each_group_gets_its_own_devices(tmp_path):
    # Two groups of two ranks of two NPUs: group 1 starts at device 4, past group 0's four.
    from mtp_operator.local.launch import plan_groups

    spec = sample_spec(nnodes=2, replicas=2, accelerator={"resourceName": "huawei.com/Ascend910", "count": 2})
    ports = choose_ports(spec, 18100, 18199, groups=2)
    assert ports == [(18100, 18199), (18104, 18200)]
    _, second = plan_groups("tiny-npu", spec, LocalPaths.for_spec(spec, tmp_path), ports)
    rank0, rank1 = second.ranks
    assert rank0.argv[4:10] == ["2", "4", "0", "18104", "npu", "4"]
    assert rank1.argv[4:10] == ["2", "4", "1", "18106", "npu", "6"]
