"""Graph mode is the default: where it can run, an engine whose setting is unset compiles its decode
steps (the one-call step ahead of time), and a second start of the same model and settings loads them
from the disk cache, compiling nothing. Where it cannot run (no C++ compiler, a model or device it does not support), the engine
runs eager: with one warning where the user can fix it, with an error where graph mode was asked for."""

import json
import logging
import os
import subprocess
import sys

import pytest
import torch._inductor.config as inductor_config

from mtp_runtime.models.graph import (CACHE_ENV, GRAPH_ENV, GraphError, compile_cache_dir, compile_failure,
                                      resolve_graph)


@pytest.fixture
def auto(monkeypatch):
    """The product's default: $MTP_ENABLE_GRAPH unset (the suite sets it to false)."""
    monkeypatch.delenv(GRAPH_ENV, raising=False)


@pytest.fixture
def no_compiler():
    with inductor_config.patch({"cpp.cxx": (None, "no-such-c++-compiler")}):
        yield


def test_unset_means_graph_mode_on_a_cpu_with_a_compiler(auto):
    decision = resolve_graph(None, "deepseek_v3", "cpu")
    assert decision.enabled and decision.reason == "graph (default)"


def test_cuda_devices_run_eager_unless_graph_mode_is_asked_for(auto, caplog):
    """An H200 failed the compiled decode step's start-up (models/graph.py): the default there is eager,
    with no warning; asking for graph mode tries it after one."""
    with caplog.at_level(logging.WARNING, logger="mtp_runtime.engine"):
        default = resolve_graph(None, "glm4_moe", "cuda:0")
    assert not default.enabled and "cuda" in default.reason and "enable_graph=true" in default.reason
    assert not caplog.records
    with caplog.at_level(logging.WARNING, logger="mtp_runtime.engine"):
        asked = resolve_graph(True, "deepseek_v3", "cuda")
    assert asked.enabled and asked.reason == "graph (enable_graph=true)"
    assert len(caplog.records) == 1 and "experimental" in caplog.records[0].getMessage()


def test_a_compile_failure_names_the_device_and_the_c_compiler_only_on_cpu():
    cpu = compile_failure("the decode step", RuntimeError("boom\ndetails"))
    cuda = compile_failure("the decode step", RuntimeError("device-side assert triggered"), "cuda:0")
    assert "on cpu failed (RuntimeError: boom)" in str(cpu) and "C++ compiler" in str(cpu)
    assert "on cuda:0 failed (RuntimeError: device-side assert triggered)" in str(cuda)
    assert "C++" not in str(cuda) and "--enable_graph=false" in str(cuda)


def test_without_a_compiler_the_default_runs_eager_after_one_warning(auto, no_compiler, caplog):
    with caplog.at_level(logging.WARNING, logger="mtp_runtime.engine"):
        decision = resolve_graph(None, "deepseek_v3", "cpu")
    assert not decision.enabled and decision.reason == "eager (no C++ compiler found)"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "no C++ compiler" in warnings[0].getMessage()
    assert "--enable_graph=false" in warnings[0].getMessage()


def test_an_engine_on_a_machine_without_a_compiler_runs_eager(auto, no_compiler, kit, tiny_models, caplog):
    """The default on such a machine: the engine starts, runs eager, answers as it would compiled,
    and says once why (the start-up log, /health's graph_mode)."""
    with caplog.at_level(logging.WARNING, logger="mtp_runtime.engine"):
        engine = kit.make_engine(tiny_models["deepseek_v3"], 1)
    runner = engine.runner
    assert not runner.graph_enabled and runner.graph.reason == "eager (no C++ compiler found)"
    assert not runner.main.graph_enabled and not runner.decode_steps and runner.graph_warm_up_s == 0
    assert sum("no C++ compiler" in r.getMessage() for r in caplog.records) == 1
    plain = kit.make_engine(tiny_models["deepseek_v3"], 0, enable_graph=False)
    request = {"r0": ([5, 9, 33, 7], kit.greedy(8))}
    assert kit.run_requests(engine, request) == kit.run_requests(plain, request)


def test_asking_for_graph_mode_without_a_compiler_is_an_error(auto, no_compiler):
    with pytest.raises(GraphError, match="needs a C\\+\\+ compiler"):
        resolve_graph(True, "deepseek_v3", "cpu")
    assert resolve_graph(False, "deepseek_v3", "cpu").reason == "eager (enable_graph=false)"


def test_models_and_devices_graph_mode_does_not_support(auto, caplog):
    with caplog.at_level(logging.WARNING, logger="mtp_runtime.engine"):
        v32 = resolve_graph(None, "deepseek_v32", "cpu")
        npu = resolve_graph(None, "deepseek_v3", "npu:0")
    assert not v32.enabled and "deepseek_v32" in v32.reason
    assert not npu.enabled and "npu" in npu.reason
    assert not caplog.records  # nothing for the user to fix: no warning
    with pytest.raises(ValueError, match="not supported for deepseek_v32"):
        resolve_graph(True, "deepseek_v32", "cpu")
    with pytest.raises(ValueError, match="npu"):
        resolve_graph(True, "deepseek_v3", "npu:0")


def test_the_environment_sets_the_default_and_an_explicit_setting_wins(monkeypatch):
    monkeypatch.setenv(GRAPH_ENV, "false")
    assert resolve_graph(None, "deepseek_v3", "cpu").reason == f"eager (${GRAPH_ENV}=false)"
    assert resolve_graph(True, "deepseek_v3", "cpu").enabled
    monkeypatch.setenv(GRAPH_ENV, "True")
    assert resolve_graph(None, "deepseek_v3", "cpu").reason == f"graph (${GRAPH_ENV}=true)"
    monkeypatch.setenv(GRAPH_ENV, "sometimes")
    with pytest.raises(ValueError, match=f"\\${GRAPH_ENV}='sometimes'"):
        resolve_graph(None, "deepseek_v3", "cpu")


def test_the_compile_cache_outlives_tmp_even_after_inductor_set_its_own_default(monkeypatch, tmp_path):
    """Importing inductor sets $TORCHINDUCTOR_CACHE_DIR to its default under /tmp where it is unset;
    that default counts as unset, a directory the user chose does not."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("MTP_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(CACHE_ENV, default_cache_dir())
    assert compile_cache_dir() == tmp_path / "inductor"
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "mine"))
    assert compile_cache_dir() == tmp_path / "mine"


# The settings of test_lossless.py's graph-mode test (k = 2, 8-token blocks, its scenario's options):
# both compile the same graphs, so whichever runs first fills the disk cache for the other.
START = """
import json, sys
from mtp_runtime import LLM, SamplingParams
llm = LLM(sys.argv[1], num_speculative_tokens=2, max_model_len=96, block_size=8, max_seqs_per_batch=8,
          max_tokens_per_batch=16, enable_prefix_cache=True)
runner = llm.engine.runner
out = llm.generate([[5, 6, 7, 8, 9, 10]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
print(json.dumps({"graph": runner.graph.reason, "compiled": runner.graph_compile_counts.compiled,
                  "cached": runner.graph_compile_counts.cached, "tokens": out[0].token_ids,
                  "aot": [runner.decode_step.built, runner.decode_step.loaded], "aot_reason": runner.aot_reason}))
"""


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_second_start_loads_every_graph_from_the_disk_cache(tiny_models):
    """`LLM` with nothing said about graph mode compiles its decode steps (or loads them: the cache is
    the machine's, as a user's is) and prints what start-up cost; a second process with the same
    model and settings compiles nothing."""
    env = {k: v for k, v in os.environ.items() if k != GRAPH_ENV}
    env["OMP_NUM_THREADS"] = "1"  # as the suite's engines run (engine/conftest.py), so their graphs match
    cache = compile_cache_dir()

    def start():
        done = subprocess.run([sys.executable, "-c", START, tiny_models["deepseek_v3"]], env=env,
                              capture_output=True, text=True, timeout=1500)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr

    first, first_err = start()
    second, second_err = start()
    assert first["graph"] == second["graph"] == "graph (default)"
    graphs = first["compiled"] + first["cached"]
    assert graphs > 0
    assert second["compiled"] == 0 and second["cached"] == graphs, (first, second)
    # the one-call decode step, compiled ahead of time: built (or loaded) once, then loaded
    assert sum(first["aot"]) == 1 and second["aot"] == [0, 1], (first, second)
    assert first["tokens"] == second["tokens"]
    for err in (first_err, second_err):  # the start-up cost is printed, where nothing configures logging
        assert "graph mode: start-up took" in err and str(cache) in err
    assert "0 package(s) compiled, 1 loaded from" in second_err
