"""Graph mode's one-call decode step compiled ahead of time (engine/aot_step.py).

The package computes what the eager step computes (tokens, and the keys it writes into the caches)
at any batch size, block-table width and cache size; it is cached on disk under a key of what the
compiled code depends on, so a second engine loads it instead of compiling; a damaged entry is built
again; where it cannot be built the engine says so and runs the torch.compile step.

The packages the real compiles here produce are cached in the machine's directory, as a user's are
(the settings match test_lossless.py's graph-mode test, so one build serves both).
"""

import json
import logging
import os
import shutil
import tempfile

import pytest
import torch
from torch import nn

from mtp_runtime.engine import aot_step
from mtp_runtime.engine.aot_step import AotDecodeStep, AotUnavailable, _tensors_as_buffers, resolve_aot
from mtp_runtime.engine.config import EngineConfig
from mtp_runtime.engine.graph_step import GreedyDecodeStep
from mtp_runtime.models.graph import GraphError

# test_lossless.py's graph-mode settings
SETTINGS = dict(max_model_len=96, block_size=8, max_seqs_per_batch=8, max_tokens_per_batch=16)


@pytest.fixture(scope="module")
def eager_engine(kit, tiny_models):
    """An engine whose models and caches the steps below run on (graph mode off: nothing compiled)."""
    return kit.make_engine(tiny_models["deepseek_v3"], 2, enable_graph=False, **SETTINGS)


def hidden_store(runner):
    """The store of main hidden states an adaptive engine's steps take after the draft's caches."""
    return [{"hidden": torch.zeros(runner.num_blocks, runner.block_size, runner.model_config.hidden_size)}]


def random_caches(runner, seed, keep_hidden=False):
    gen = torch.Generator().manual_seed(seed)
    draft = runner.draft_caches + (hidden_store(runner) if keep_hidden else [])
    return [[{name: torch.randn(t.shape, generator=gen) for name, t in layer.items()} for layer in caches]
            for caches in (runner.main_caches, draft)]


def copies(caches):
    return [[{name: t.clone() for name, t in layer.items()} for layer in part] for part in caches]


def plan(k, batch, width, block_size=SETTINGS["block_size"]):
    """Sequences whose step writes up to the last slot their `width` blocks hold (the k + 1 verified
    positions, then the chain's k - 1: 2k slots past the cached length)."""
    rows = [GreedyDecodeStep.plan(width * block_size - 2 * k - 1 - i % 3, [5 + 7 * i + j for j in range(k + 1)],
                                  [i * width + j for j in range(width)], width) for i in range(batch)]
    return torch.tensor(rows, dtype=torch.long)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("k,keep_hidden", [(2, False), (0, True)])
def test_the_package_computes_what_the_eager_step_does(eager_engine, k, keep_hidden, tmp_path, monkeypatch):
    """Every batch size (1 included) and table width (1 included) from one package: the same tokens,
    and the same keys written into the main and draft caches (within float rounding). The directory
    torch's loader unpacks the package into is gone once it is loaded (torch leaves it behind)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where torch's loader would leave them
    runner = eager_engine.runner
    caches = random_caches(runner, seed=k, keep_hidden=keep_hidden)
    step = AotDecodeStep(runner.main, runner.draft, k, runner.block_size, keep_hidden=keep_hidden)
    eager = GreedyDecodeStep(runner.main, runner.draft, k, runner.block_size, compile_graph=False,
                             keep_hidden=keep_hidden)
    with torch.inference_mode():
        step.warm_up([1, 2], runner.num_blocks, *copies(caches), torch.device("cpu"))
        assert step.built + step.loaded == 1 and list(step._runners) == [1]
        left = [p.name for p in tmp_path.iterdir() if p.name.startswith(("aotinductor_", "mtp-aot-load-"))]
        assert not left, f"the package's unpacked files were left behind: {left}"
        assert os.environ["TMPDIR"] == str(tmp_path)
        for batch, width in [(1, 1), (1, 3), (2, 2), (3, 5), (7, 2)]:
            want_caches, got_caches = copies(caches), copies(caches)
            want = eager(plan(k, batch, width), *want_caches)
            got = step(plan(k, batch, width), *got_caches)
            for w, g in zip(want, got):
                assert (w is None and g is None) or torch.equal(w, g), (batch, width)
            written = 0
            for w_part, g_part, before in zip(want_caches, got_caches, caches):
                for w_layer, g_layer, b_layer in zip(w_part, g_part, before):
                    for name in w_layer:
                        torch.testing.assert_close(g_layer[name], w_layer[name], atol=1e-5, rtol=1e-5)
                        written += int(not torch.equal(g_layer[name], b_layer[name]))
            # every main layer; the draft's cache with drafts, the hidden store when kept (k = 0: nothing else)
            assert written == len(runner.main_caches) + (1 if k else 0) + (1 if keep_hidden else 0)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_second_step_loads_the_package_whatever_the_cache_size(kit, tiny_models, eager_engine):
    """The key leaves out what the graph takes as dynamic sizes (the KV budget's block count) and the
    weights' values (handed over at load): an engine with another budget loads the package."""
    runner = eager_engine.runner
    first = AotDecodeStep(runner.main, runner.draft, 2, runner.block_size)
    with torch.inference_mode():
        first.warm_up([1], runner.num_blocks, runner.main_caches, runner.draft_caches, torch.device("cpu"))
    other = kit.make_engine(tiny_models["deepseek_v3"], 2, enable_graph=False, **{**SETTINGS, "num_kv_blocks": 40})
    assert other.runner.num_blocks != runner.num_blocks
    second = AotDecodeStep(other.runner.main, other.runner.draft, 2, other.runner.block_size)
    with torch.inference_mode():
        second.warm_up([1, 4], other.runner.num_blocks, other.runner.main_caches, other.runner.draft_caches,
                       torch.device("cpu"))
    assert second.built == 0 and second.loaded == 1


def test_the_key_follows_what_the_compiled_code_depends_on(eager_engine, kit, tiny_models):
    runner = eager_engine.runner
    caches = (runner.main_caches, runner.draft_caches)

    def key(k=2, block_size=runner.block_size, threads=1, keep_hidden=False, model=runner):
        step = AotDecodeStep(model.main, model.draft, k, block_size, keep_hidden=keep_hidden)
        return step.key(threads, model.main_caches, model.draft_caches + (hidden_store(model) if keep_hidden else []))

    base = key()
    assert key() == base  # stable
    assert len({base, key(k=1), key(threads=2), key(block_size=16), key(k=0, keep_hidden=True), key(k=0)}) == 6
    # the weights' values are not part of it; a config value the graph bakes in is
    with torch.no_grad():
        runner.main.lm_head.weight.add_(1.0)
    try:
        assert key() == base
    finally:
        with torch.no_grad():
            runner.main.lm_head.weight.sub_(1.0)
    eps = runner.main.config.rms_norm_eps
    runner.main.config.rms_norm_eps = eps * 2
    try:
        assert key() != base
    finally:
        runner.main.config.rms_norm_eps = eps
    assert caches == (runner.main_caches, runner.draft_caches)


def test_plain_tensor_attributes_are_buffers_only_while_exporting():
    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(2))
            self.packed = torch.zeros(3)
            self.nothing = None

    outer = nn.Sequential(Inner())
    packed = outer[0].packed
    with _tensors_as_buffers(outer):
        assert dict(outer.named_buffers()) == {"0.packed": packed}
        assert "packed" not in vars(outer[0]) and outer[0].packed is packed
    assert vars(outer[0])["packed"] is packed and not dict(outer.named_buffers())
    assert outer[0].weight is dict(outer.named_parameters())["0.weight"]

    class Shadowed(Inner):
        packed = None  # a class default would hide the buffer: the trace would read None

    bad = nn.Sequential(Inner(), Shadowed())
    first = bad[0].packed
    with pytest.raises(AotUnavailable, match="Shadowed.packed is also a class attribute"):
        with _tensors_as_buffers(bad):
            pass
    assert vars(bad[0])["packed"] is first and not dict(bad.named_buffers()), "a failed move was not undone"


def test_a_damaged_cache_entry_is_built_again(eager_engine, tmp_path, monkeypatch, caplog):
    """A package that does not load (a torn copy, another torch's file) is replaced, not trusted."""
    runner = eager_engine.runner
    step = AotDecodeStep(runner.main, runner.draft, 2, runner.block_size, cache_dir=tmp_path)
    entry = tmp_path / step.key(1, runner.main_caches, runner.draft_caches)
    entry.mkdir()
    (entry / aot_step.PACKAGE).write_bytes(b"not a package")
    (entry / aot_step.MANIFEST).write_text(json.dumps({"threads": 1, "constants": []}))
    built = []

    def build(self, where, *args):
        built.append(where)
        raise AotUnavailable("stopped before compiling")

    monkeypatch.setattr(AotDecodeStep, "_build", build)
    with caplog.at_level(logging.WARNING, logger="mtp_runtime.engine"), pytest.raises(AotUnavailable):
        step._load_or_build(1, runner.main_caches, runner.draft_caches, runner.num_blocks, torch.device("cpu"))
    assert built == [entry] and not entry.exists()
    assert "did not load" in caplog.text and "building it again" in caplog.text


def test_the_warm_up_builds_a_package_per_thread_count_and_a_late_count_gets_one(eager_engine, monkeypatch,
                                                                               caplog):
    """One package for each thread count the warm-up's batch sizes run on (`threads_for`), each built
    on that count; a call on another count (a caller that changed it) builds its package then, with
    a warning, instead of failing."""
    runner = eager_engine.runner
    step = AotDecodeStep(runner.main, runner.draft, 1, runner.block_size)
    built = []

    class Package:
        def __init__(self, threads):
            self.threads = threads

        def run(self, inputs):
            batch = inputs[0].shape[0]
            return [torch.zeros(batch, 2, dtype=torch.long), torch.zeros(batch, dtype=torch.long),
                    torch.zeros(batch, 1, dtype=torch.long)]

    def load_or_build(self, threads, *args):
        assert torch.get_num_threads() == threads
        built.append(threads)
        return Package(threads)

    monkeypatch.setattr(AotDecodeStep, "_load_or_build", load_or_build)
    own = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        step.warm_up([1, 2, 3, 4, 6, 8], runner.num_blocks, runner.main_caches, runner.draft_caches,
                     torch.device("cpu"), threads_for=lambda tokens: 1 if tokens < 8 else 2)
        assert built == [1, 2] and torch.get_num_threads() == 2
        torch.set_num_threads(3)
        with caplog.at_level(logging.WARNING, logger="mtp_runtime.engine"):
            targets, accepted, drafts = step(plan(1, 2, 2), runner.main_caches, runner.draft_caches)
        assert built == [1, 2, 3] and "no package from the warm-up runs on 3 thread(s)" in caplog.text
        assert targets.shape == (2, 2) and drafts.shape == (2, 1)
    finally:
        torch.set_num_threads(own)


def test_the_setting_and_its_environment_default(monkeypatch, tiny_models):
    monkeypatch.delenv(aot_step.AOT_ENV, raising=False)
    assert resolve_aot(None) is None and resolve_aot(False) is False and resolve_aot(True) is True
    monkeypatch.setenv(aot_step.AOT_ENV, "false")
    assert resolve_aot(None) is False and resolve_aot(True) is True
    monkeypatch.setenv(aot_step.AOT_ENV, "maybe")
    with pytest.raises(ValueError, match=f"\\${aot_step.AOT_ENV}='maybe'"):
        resolve_aot(None)
    with pytest.raises(ValueError, match="EngineConfig.aot_step='yes'"):
        EngineConfig(model=tiny_models["deepseek_v3"], aot_step="yes")


def test_asking_for_it_where_there_is_no_one_call_step_is_an_error(kit, tiny_models):
    with pytest.raises(GraphError, match="aot_step: the one-call decode step runs only in graph mode"):
        kit.make_engine(tiny_models["deepseek_v3"], 1, enable_graph=False, aot_step=True)
    with pytest.raises(GraphError, match="glm4_moe"):
        kit.make_engine(tiny_models["glm4_moe"], 1, enable_graph=False, aot_step=True)
    engine = kit.make_engine(tiny_models["deepseek_v3"], 1, enable_graph=False)  # unset: nothing to say
    assert engine.runner.aot_reason == "off (graph mode is off)"


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("requested", [None, True])
def test_where_the_step_cannot_be_built_the_engine_says_so(kit, tiny_models, monkeypatch, caplog, requested):
    """Unset: a warning, and the torch.compile step answers as plain decoding does. Asked for: an
    error that names the setting."""
    def cannot(self, *args):
        raise AotUnavailable("the exported graph depends on the batch size")

    monkeypatch.setattr(AotDecodeStep, "_build", cannot)
    # a key no other test builds (block_size 4), so the patched build is reached
    settings = dict(SETTINGS, block_size=4, max_seqs_per_batch=1)
    if requested:
        with pytest.raises(GraphError, match="aot_step: the decode step \\(k=1\\) cannot be compiled ahead of "
                                             "time here \\(the exported graph depends on the batch size\\)"):
            kit.make_engine(tiny_models["deepseek_v3"], 1, enable_graph=True, aot_step=True, **settings)
        return
    with caplog.at_level(logging.WARNING, logger="mtp_runtime.engine"):
        engine = kit.make_engine(tiny_models["deepseek_v3"], 1, enable_graph=True, **settings)
    runner = engine.runner
    assert type(runner.decode_step) is GreedyDecodeStep and runner.decode_steps[1] is runner.decode_step
    assert "cannot be compiled ahead of time here" in caplog.text and "torch.compile" in runner.aot_reason
    plain = kit.make_engine(tiny_models["deepseek_v3"], 0, enable_graph=False, enable_prefix_cache=False)
    request = {"r0": ([5, 9, 33, 7, 12], kit.greedy(10))}
    assert kit.run_requests(engine, request) == kit.run_requests(plain, request)


@pytest.fixture(scope="module")
def other_seed(tiny_models, tmp_path_factory):
    """A checkpoint like tiny_models' deepseek_v3 (the sizes of engine/conftest.py's), other weights."""
    from mtp_runtime.cli import main as mtp_main

    out = tmp_path_factory.mktemp("other-seed") / "deepseek_v3"
    assert mtp_main(["make-tiny", "--arch", "deepseek_v3", "--out", str(out), "--vocab-size", "512",
                     "--num-hidden-layers", "2", "--shards", "1", "--seed", "1"]) == 0
    return str(out)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_swapped_draft_reaches_the_packages_without_a_compile(kit, tiny_models, other_seed):
    """ModelRunner.swap_draft hands the loaded packages the new draft's tensors: the step drafts as the
    new draft does (not as the old one), nothing is compiled, and the output stays plain decoding's."""
    from mtp_runtime.models.loader import load_draft

    engine = kit.make_engine(tiny_models["deepseek_v3"], 2, enable_graph=True, **SETTINGS)
    runner = engine.runner
    step, old = runner.decode_step, runner.draft
    assert isinstance(step, AotDecodeStep)
    compiled = step.built
    new = load_draft(other_seed, main=runner.main, dtype=runner.dtype, device="cpu")
    caches = random_caches(runner, seed=5)
    with torch.inference_mode():
        want_old = GreedyDecodeStep(runner.main, old, 2, runner.block_size, compile_graph=False)(
            plan(2, 3, 2), *copies(caches))
        want_new = GreedyDecodeStep(runner.main, new, 2, runner.block_size, compile_graph=False)(
            plan(2, 3, 2), *copies(caches))
    assert not torch.equal(want_old[2], want_new[2]), "the two drafts propose alike: no test"
    runner.swap_draft(new)
    assert runner.draft is new and runner.decode_step is step and step.built == compiled
    with torch.inference_mode():
        got = step(plan(2, 3, 2), *copies(caches))
    assert all(torch.equal(g, w) for g, w in zip(got, want_new))
    plain = kit.make_engine(tiny_models["deepseek_v3"], 0, enable_graph=False, enable_prefix_cache=False)
    request = {"r0": ([5, 9, 33, 7, 12], kit.greedy(12))}
    assert kit.run_requests(engine, request) == kit.run_requests(plain, request)
    with pytest.raises(ValueError, match="swap_draft: this engine drafts nothing"):
        plain.runner.swap_draft(new)


def test_the_cache_directory_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(aot_step.AOT_CACHE_ENV, raising=False)
    monkeypatch.setenv("MTP_CACHE_DIR", str(tmp_path / "root"))
    assert aot_step.aot_cache_dir() == tmp_path / "root" / "aot"
    monkeypatch.setenv(aot_step.AOT_CACHE_ENV, str(tmp_path / "mine"))
    assert aot_step.aot_cache_dir() == tmp_path / "mine"
    shutil.rmtree(tmp_path, ignore_errors=True)
