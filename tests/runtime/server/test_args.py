"""`mtp serve` flags: both syntaxes, booleans, and start-time rejections naming the flag."""

import argparse
import json

import pytest

from mtp_runtime.server.args import API_KEY_ENV, ServeArgsError, add_serve_arguments, validate_serve_args


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "main").mkdir()
    (tmp_path / "main" / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    (tmp_path / "draft").mkdir()
    (tmp_path / "draft" / "config.json").write_text(json.dumps({"model_type": "deepseek_v3_mtp"}))
    return tmp_path


def parse(argv, env=None, hostname="box"):
    parser = argparse.ArgumentParser(prog="mtp serve")
    add_serve_arguments(parser)
    return validate_serve_args(parser.parse_args(argv), env=env or {}, hostname=hostname)


def reject(argv, flag, env=None, hostname="box"):
    with pytest.raises(ServeArgsError) as info:
        parse(argv, env, hostname)
    assert str(info.value).startswith(flag), str(info.value)
    return str(info.value)


def test_equals_and_space_forms_agree(model_dir):
    m, d = str(model_dir / "main"), str(model_dir / "draft")
    a = parse([f"--model={m}", f"--draft_model={d}", "--num_speculative_tokens=2", "--port=9001",
               "--enable_prefix_cache=true", "--enable_chunked_prefill=false", "--block_size=32"])
    b = parse(["--model", m, "--draft_model", d, "--num_speculative_tokens", "2", "--port", "9001",
               "--enable_prefix_cache", "true", "--enable_chunked_prefill", "false", "--block_size", "32"])
    assert a == b
    assert a.num_speculative_tokens == 2 and a.port == 9001 and a.block_size == 32
    assert a.enable_prefix_cache is True and a.enable_chunked_prefill is False
    assert a.served_model_name == "main" and a.devices == ["cpu"] and a.node_rank == 0


def test_defaults_and_draft_implies_one_token(model_dir):
    m, d = str(model_dir / "main"), str(model_dir / "draft")
    assert parse(["--model", m]).num_speculative_tokens == 0
    assert parse(["--model", m]).single_thread_tokens == 8
    assert parse(["--model", m, "--single_thread_tokens", "0"]).single_thread_tokens == 0
    assert parse(["--model", m, "--draft_model", d]).num_speculative_tokens == 1
    assert parse(["--model", m, "--enable_prefix_cache=false"]).enable_prefix_cache is False
    assert parse(["--model", m, "--enable_prefix_cache=false", "--enable_prefix_cache"]).enable_prefix_cache is True


def test_api_key_from_flag_or_env(model_dir):
    m = str(model_dir / "main")
    assert parse(["--model", m]).api_key is None
    assert parse(["--model", m], env={API_KEY_ENV: "k1"}).api_key == "k1"
    assert parse(["--model", m, "--api_key", "k2"], env={API_KEY_ENV: "k1"}).api_key == "k2"


@pytest.mark.parametrize("argv", [["--bogus", "1"], ["--draft", "x"], ["--enable_prefix_cache=maybe"],
                                  ["--port", "eighty"], ["--dtype", "int3"]])
def test_argparse_rejects_unknown_and_malformed(model_dir, argv, capsys):
    with pytest.raises(SystemExit) as info:
        parse(["--model", str(model_dir / "main"), *argv])
    assert info.value.code == 2
    flag = argv[0].split("=")[0]
    assert flag in capsys.readouterr().err


def test_out_of_range_and_unsupported_values_name_the_flag(model_dir):
    m, d = str(model_dir / "main"), str(model_dir / "draft")
    reject(["--model", str(model_dir)], "--model")
    reject(["--model", m, "--draft_model", str(model_dir)], "--draft_model")
    reject(["--model", m, "--num_speculative_tokens", "1"], "--num_speculative_tokens")
    reject(["--model", m, "--draft_model", d, "--num_speculative_tokens", "-1"], "--num_speculative_tokens")
    reject(["--model", m, "--port", "70000"], "--port")
    reject(["--model", m, "--max_memory_utilization", "0"], "--max_memory_utilization")
    reject(["--model", m, "--max_memory_utilization", "1.5"], "--max_memory_utilization")
    reject(["--model", m, "--block_size", "0"], "--block_size")
    reject(["--model", m, "--single_thread_tokens", "-1"], "--single_thread_tokens")
    reject(["--model", m, "--max_seqs_per_batch", "0"], "--max_seqs_per_batch")
    reject(["--model", m, "--max_tokens_per_batch", "0"], "--max_tokens_per_batch")
    reject(["--model", m, "--draft_model", d, "--num_speculative_tokens", "2", "--max_tokens_per_batch", "2"],
           "--max_tokens_per_batch")
    reject(["--model", m, "--max_model_len", "1"], "--max_model_len")
    reject(["--model", m, "--devices", "gpu0"], "--devices")
    reject(["--model", m, "--devices", "cpu,cuda:0"], "--devices")
    reject(["--model", m, "--draft_devices", "cuda:1"], "--draft_devices")
    reject(["--model", m, "--devices", "cuda:0"], "--devices")  # no CUDA device here
    reject(["--model", m, "--ep_size", "4"], "--ep_size")
    assert "not supported" in reject(["--model", m, "--dp_size", "2"], "--dp_size")
    reject(["--model", m, "--api_key", " "], "--api_key")


def test_npu_device_says_torch_npu_is_missing(model_dir):
    pytest.importorskip("torch")
    try:
        import torch_npu  # noqa: F401
        pytest.skip("torch_npu is installed here")
    except ImportError:
        pass
    message = reject(["--model", str(model_dir / "main"), "--devices", "npu:0"], "--devices")
    assert "torch_npu" in message


def test_multi_node_flags_are_validated(model_dir):
    m = str(model_dir / "main")
    reject(["--model", m, "--nnodes", "2"], "--master_node_addr")
    reject(["--model", m, "--nnodes", "2", "--master_node_addr", "nohost"], "--master_node_addr")
    reject(["--model", m, "--nnodes", "2", "--node_rank", "2", "--master_node_addr", "h:1"], "--node_rank")
    reject(["--model", m, "--node_rank", "x"], "--node_rank")
    reject(["--model", m, "--nnodes", "0"], "--nnodes")
    reject(["--model", m, "--nnodes", "4", "--ep_size", "3", "--master_node_addr", "h:1"], "--ep_size")
    args = parse(["--model", m, "--nnodes", "2", "--node_rank", "auto", "--master_node_addr", "h-0.h:29500"],
                 hostname="mtp-ds-1")
    assert (args.nnodes, args.node_rank, args.master_node_addr) == (2, 1, "h-0.h:29500")


def test_node_rank_auto_single_node(model_dir):
    m = str(model_dir / "main")
    assert parse(["--model", m, "--node_rank", "auto"], env={"MTP_POD_INDEX": "0"}).node_rank == 0
    assert parse(["--model", m, "--node_rank", "auto"], hostname="mtp-ds-0.mtp-ds").node_rank == 0
    reject(["--model", m, "--node_rank", "auto"], "--node_rank", hostname="nohyphen")


def test_enable_graph_flag(model_dir):
    """Unset or auto: the engine decides (graph mode where it can run); a group of ranks runs eager."""
    m = str(model_dir / "main")
    assert parse(["--model", m]).enable_graph is None
    assert parse(["--model", m, "--enable_graph=auto"]).enable_graph is None
    assert parse(["--model", m, "--enable_graph=false"]).enable_graph is False
    assert parse(["--model", m, "--enable_graph=true"]).enable_graph is True
    assert parse(["--model", m, "--enable_graph"]).enable_graph is True
    group = ["--model", m, "--nnodes", "2", "--master_node_addr", "mtp-0.mtp:23456", "--node_rank", "0"]
    assert parse(group).enable_graph is False
    assert parse(group + ["--enable_graph=auto"]).enable_graph is False
    reject(group + ["--enable_graph"], "--enable_graph")
    with pytest.raises(SystemExit):
        parse(["--model", m, "--enable_graph=maybe"])


def test_aot_step_flag(model_dir, monkeypatch):
    """Unset or auto: the one-call step ahead of time where it can be; the engine gets the setting."""
    from mtp_runtime.engine import llm_engine
    from mtp_runtime.server.launch import engine_factory

    m = str(model_dir / "main")
    assert parse(["--model", m]).aot_step is None
    assert parse(["--model", m, "--aot_step=auto"]).aot_step is None
    assert parse(["--model", m, "--aot-step", "false"]).aot_step is False
    assert parse(["--model", m, "--aot_step"]).aot_step is True
    with pytest.raises(SystemExit):
        parse(["--model", m, "--aot_step=sometimes"])
    monkeypatch.setattr(llm_engine, "LLMEngine", lambda config: config)
    assert engine_factory(parse(["--model", m, "--aot_step=false"]), 64)().aot_step is False


def test_flags_parse_and_validate_without_files_or_devices():
    """What the operator runs on a spec's flags before any pod exists: argparse
    errors raise instead of exiting, and no model directory is needed."""
    from mtp_runtime.server.args import parse_serve_argv

    with pytest.raises(ServeArgsError, match="unrecognized arguments: --no_such_flag"):
        parse_serve_argv(["--model", "/absent", "--no_such_flag=1"])
    with pytest.raises(ServeArgsError, match="--block_size: invalid int value"):
        parse_serve_argv(["--model", "/absent", "--block_size=big"])
    ns = parse_serve_argv(["--model", "/absent", "--draft_model", "/absent-mtp", "--block_size=16"])
    with pytest.raises(ServeArgsError, match="--model: /absent has no config.json"):
        validate_serve_args(ns, env={}, check_devices=False)
    assert validate_serve_args(ns, env={}, check_devices=False, check_files=False).block_size == 16
    ns = parse_serve_argv(["--model", "/absent", "--block-size=4096"])  # the spelling `mtp serve` also takes
    with pytest.raises(ServeArgsError, match="--block_size: 4096 is out of range"):
        validate_serve_args(ns, env={}, check_devices=False, check_files=False)


def test_max_request_bytes(model_dir):
    m = str(model_dir / "main")
    assert parse(["--model", m]).max_request_bytes == 8 * 1024 * 1024
    assert parse(["--model", m, "--max-request-bytes", "65536"]).max_request_bytes == 65536
    reject(["--model", m, "--max_request_bytes", "100"], "--max_request_bytes")


def test_speculative_adaptive_flag(model_dir):
    m, d = str(model_dir / "main"), str(model_dir / "draft")
    assert parse(["--model", m]).speculative_adaptive is False
    args = parse(["--model", m, "--draft_model", d, "--num_speculative_tokens", "3", "--speculative_adaptive=true"])
    assert args.speculative_adaptive is True and args.num_speculative_tokens == 3
    reject(["--model", m, "--speculative_adaptive=true"], "--speculative_adaptive")  # no draft: k = 0
