"""Greedy output with MTP (k = 1, 2, 3) is token-for-token the output of k = 0.

For every architecture and scenario: single requests, mixed batches where
requests arrive and finish at different steps, chunked prefill on and off,
prefix caching, and preemption forced by a tiny KV budget. V3.2 runs with index_topk
below the contexts, so its sparse key selection is part of every scenario.
"""

import random

import pytest

from mtp_runtime.engine.aot_step import AotDecodeStep
from mtp_runtime.engine.graph_step import ONE_CALL_ARCHS
from mtp_runtime.engine.spec_policy import AdaptivePolicy
from mtp_runtime.sampling_params import SamplingParams

ARCHS = ("deepseek_v3", "deepseek_v32", "glm4_moe")

SHARED = [random.Random(7).randrange(3, 500) for _ in range(12)]


def greedy(max_tokens):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def build_requests(n, seed):
    rng = random.Random(seed)
    requests = {}
    for i in range(n):
        prefix = SHARED[:rng.choice([0, 8, 12])]
        prompt = prefix + [rng.randrange(3, 500) for _ in range(rng.randrange(2, 22))]
        requests[f"r{i}"] = (prompt, greedy(rng.randrange(4, 20)))
    return requests


SCENARIOS = {
    "single": dict(requests=lambda: {"r0": (SHARED + [5, 9, 33, 7, 120, 64, 2, 8, 17], greedy(24))},
                   arrivals={0: ["r0"]}, options={}),
    "mixed-chunked-prefix": dict(requests=lambda: build_requests(6, 1),
                                 arrivals={0: ["r0", "r1"], 2: ["r2"], 3: ["r3"], 5: ["r4"], 9: ["r5"]},
                                 options=dict(max_tokens_per_batch=16, enable_prefix_cache=True)),
    "mixed-no-chunking": dict(requests=lambda: build_requests(6, 2),
                              arrivals={0: ["r0"], 1: ["r1", "r2"], 4: ["r3", "r4"], 6: ["r5"]},
                              options=dict(enable_chunked_prefill=False, enable_prefix_cache=False)),
    "preemption": dict(requests=lambda: build_requests(6, 3), arrivals={0: ["r0", "r1", "r2", "r3", "r4", "r5"]},
                       options=dict(num_kv_blocks=26, max_tokens_per_batch=24, enable_prefix_cache=True)),
}

_reference_cache = {}


def reference(kit, tiny_models, arch, scenario):
    """k = 0 outputs, each request decoded alone (no batching, no chunking, no cache reuse)."""
    key = (arch, scenario)
    if key not in _reference_cache:
        requests = SCENARIOS[scenario]["requests"]()
        engine = kit.make_engine(tiny_models[arch], 0, enable_prefix_cache=False)
        _reference_cache[key] = {rid: kit.run_requests(engine, {rid: req})[rid] for rid, req in requests.items()}
    return _reference_cache[key]


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("k", [0, 1, 2, 3])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_output_is_identical_to_plain_decoding(kit, tiny_models, arch, k, scenario):
    spec = SCENARIOS[scenario]
    expected = reference(kit, tiny_models, arch, scenario)
    engine = kit.make_engine(tiny_models[arch], k, **spec["options"])
    if k:
        kit.OracleDrafts(engine, expected, hit_rate=0.7, seed=k)
    got = kit.run_requests(engine, spec["requests"](), spec["arrivals"])
    assert got == expected
    stats = engine.stats()
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "KV blocks leaked"
    if scenario == "preemption":
        assert stats.num_preemptions > 0
    if scenario == "mixed-chunked-prefix":
        assert stats.prefix_cache_hit_tokens > 0
    if k:
        assert 0 < stats.accepted_tokens < stats.draft_tokens
        assert stats.accepted_per_position[k - 1] > 0, "no step accepted all k drafts (bonus token path)"



@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("arch,aot_step", [("deepseek_v3", None), ("deepseek_v3", False), ("glm4_moe", None)])
def test_graph_mode_output_is_identical_to_plain_decoding(kit, tiny_models, arch, aot_step, caplog):
    """--enable_graph: decode, verify and draft steps run compiled; the output does not change. The
    one-call decode step is compiled ahead of time by default (aot_step unset), by torch.compile
    with aot_step=false."""
    spec = SCENARIOS["mixed-chunked-prefix"]
    expected = reference(kit, tiny_models, arch, "mixed-chunked-prefix")
    # 8-token blocks: the short prompts below decode their first tokens with one-block tables
    engine = kit.make_engine(tiny_models[arch], 2, enable_graph=True, block_size=8, aot_step=aot_step,
                             **spec["options"])
    assert engine.runner.main.graph_enabled and engine.runner.draft.graph_enabled
    assert engine.runner.graph_warm_up_s > 0
    compiled_step, one_call_batches = engine.runner.decode_step, []
    one_call = arch in ONE_CALL_ARCHS
    assert (compiled_step is not None) == one_call
    if one_call:
        assert isinstance(compiled_step, AotDecodeStep) == (aot_step is None), engine.runner.aot_reason

    def counted(tokens, *args):
        one_call_batches.append(tokens.shape[0])
        return compiled_step(tokens, *args)

    if one_call:
        engine.runner.decode_step = counted
    kit.OracleDrafts(engine, expected, hit_rate=0.7, seed=2)
    assert kit.run_requests(engine, spec["requests"](), spec["arrivals"]) == expected
    if one_call:
        assert len(one_call_batches) > 5 and max(one_call_batches) > 1, "no greedy decode step ran as one call"
    # A prompt of a token or two, alone in the engine: its steps' block tables are one block wide
    short = {"s0": ([7, 9], greedy(10)), "s1": ([11], greedy(6))}
    plain = kit.make_engine(tiny_models[arch], 0, enable_prefix_cache=False)
    for rid, request in short.items():
        assert kit.run_requests(engine, {rid: request}) == kit.run_requests(plain, {rid: request})
    assert "no decode-step graph from the warm-up fits" not in caplog.text, "the warm-up missed a step shape"
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "KV blocks leaked"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_graph_mode_defers_a_prompt_s_first_drafts_to_its_one_call_step(kit, tiny_models):
    """In graph mode a greedy prompt's step writes its draft keys only and leaves filler: its first
    decode step, one call, verifies the filler and drafts. The output is plain decoding's, the filler
    is not counted as drafts, and in eager mode (no one-call step) a prompt's step drafts as before."""
    arch = "deepseek_v3"
    spec = SCENARIOS["mixed-chunked-prefix"]
    expected = reference(kit, tiny_models, arch, "mixed-chunked-prefix")
    for graph in (True, False):
        engine = kit.make_engine(tiny_models[arch], 2, enable_graph=graph, block_size=8, **spec["options"])
        execute, reals = engine.runner.execute, {}

        def observed(batch, execute=execute):
            # drafts the draft model made, per verifying row (the engine's snapshot before the step)
            for seq, nd, real in zip(batch.seqs, batch.num_draft_tokens, batch.num_real_drafts):
                if nd:
                    reals.setdefault(seq.request_id, []).append(real)
            return execute(batch)

        engine.runner.execute = observed
        assert kit.run_requests(engine, spec["requests"](), spec["arrivals"]) == expected
        assert len(reals) == 6 and all(len(r) > 1 for r in reals.values())
        first = [r[0] for r in reals.values()]
        assert first == [0 if graph else 2] * 6, graph
        assert all(real == 2 for r in reals.values() for real in r[1:])
        # the metrics count real drafts only
        scheduler = engine.scheduler
        assert scheduler.draft_tokens == sum(map(sum, reals.values()))
        assert scheduler.verify_steps == sum(1 for r in reals.values() for real in r if real)


def test_graph_mode_is_refused_for_v32(kit, tiny_models):
    with pytest.raises(ValueError, match="enable_graph: not supported for deepseek_v32"):
        kit.make_engine(tiny_models["deepseek_v32"], 1, enable_graph=True)


class RandomDepth(AdaptivePolicy):
    """The adaptive policy, its evidence kept as usual, but k in 0..max_k is picked at random every step."""

    def __init__(self, max_k: int, seed: int):
        super().__init__(max_k)
        self.rng, self.chosen = random.Random(seed), []

    def choose(self, batch_size: int, draining=None) -> int:
        self.chosen.append(self.rng.randint(0, self.max_k))
        return self.chosen[-1]


@pytest.mark.parametrize("scenario", ["mixed-chunked-prefix", "preemption"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_output_is_identical_whatever_k_each_step_takes(kit, tiny_models, arch, scenario):
    """Adaptive depth: k in 0..3 drawn at random every step (filler verified after a step at a lower k,
    drafts cut after one at a higher k) gives the k = 0 output."""
    from mtp_runtime.engine.config import EngineConfig
    from mtp_runtime.engine.llm_engine import LLMEngine

    spec = SCENARIOS[scenario]
    expected = reference(kit, tiny_models, arch, scenario)
    settings = dict(max_model_len=96, block_size=4, max_seqs_per_batch=8, max_tokens_per_batch=64)
    settings.update(spec["options"])
    policy = RandomDepth(3, seed=len(scenario))
    engine = LLMEngine(EngineConfig(model=tiny_models[arch], num_speculative_tokens=3, speculative_adaptive=True,
                                    **settings), policy=policy)
    kit.OracleDrafts(engine, expected, hit_rate=0.7, seed=3)
    assert kit.run_requests(engine, spec["requests"](), spec["arrivals"]) == expected
    assert set(policy.chosen) == {0, 1, 2, 3}
    stats = engine.stats()
    assert 0 < stats.accepted_tokens < stats.draft_tokens
    assert stats.accepted_per_position[2] > 0
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "KV blocks leaked"


class ScriptedDepth(RandomDepth):
    def __init__(self, ks):
        super().__init__(max(ks), 0)
        self.script = list(ks)

    def choose(self, batch_size: int, draining=None) -> int:
        self.chosen.append(self.script[len(self.chosen) % len(self.script)])
        return self.chosen[-1]


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_steps_at_k0_keep_the_draft_cache_complete(kit, tiny_models, arch):
    """Steps that draft nothing leave the draft's keys out, and the next step that drafts writes them
    first (ModelRunner._fill_draft_keys): its draft is the one a fixed-k engine (which drafts every
    step) proposes."""
    from mtp_runtime.engine.config import EngineConfig
    from mtp_runtime.engine.llm_engine import LLMEngine

    def proposals(engine):
        seen = {}
        execute = engine.runner.execute

        def record(batch):
            new_tokens, accepted = execute(batch)
            for seq, tokens in zip(batch.seqs, new_tokens):
                if tokens and seq.num_real_drafts:
                    seen[(seq.request_id, len(seq) + len(tokens))] = seq.draft_token_ids[0]
            return new_tokens, accepted
        engine.runner.execute = record
        return seen

    settings = dict(max_model_len=96, block_size=4, max_seqs_per_batch=8, max_tokens_per_batch=64)
    requests = {"a": (SHARED + [5, 9], greedy(20)), "b": ([7, 3, 11], greedy(16))}
    fixed = kit.make_engine(tiny_models[arch], 1)
    fixed_seen = proposals(fixed)
    kit.run_requests(fixed, requests)
    adaptive = LLMEngine(EngineConfig(model=tiny_models[arch], num_speculative_tokens=1, speculative_adaptive=True,
                                      **settings), policy=ScriptedDepth([1, 0, 0, 0, 1, 1, 0]))
    adaptive_seen = proposals(adaptive)
    kit.run_requests(adaptive, requests)
    after_k0 = [key for i, key in enumerate(adaptive_seen) if key in fixed_seen]
    assert len(after_k0) > 8
    assert {key: adaptive_seen[key] for key in after_k0} == {key: fixed_seen[key] for key in after_k0}


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_graph_mode_with_adaptive_depth_has_a_one_call_step_for_every_k(kit, tiny_models, caplog):
    """--enable_graph with adaptive depth: start-up compiles the one-call decode step for each k in 0..K,
    and with k drawn at random every step the output is plain decoding's, with no graph compiled late."""
    from mtp_runtime.engine.config import EngineConfig
    from mtp_runtime.engine.llm_engine import LLMEngine

    arch = "deepseek_v3"
    spec = SCENARIOS["mixed-chunked-prefix"]
    expected = reference(kit, tiny_models, arch, "mixed-chunked-prefix")
    settings = dict(max_model_len=96, block_size=8, max_seqs_per_batch=8, max_tokens_per_batch=64)
    settings.update(spec["options"])
    policy = RandomDepth(2, seed=4)
    engine = LLMEngine(EngineConfig(model=tiny_models[arch], num_speculative_tokens=2, speculative_adaptive=True,
                                    enable_graph=True, **settings), policy=policy)
    runner = engine.runner
    assert sorted(runner.decode_steps) == [0, 1, 2] and sorted(runner.graph_warm_up_by_k) == [0, 1, 2]
    assert all(isinstance(step, AotDecodeStep) for step in runner.decode_steps.values()), runner.aot_reason
    assert all(step.keep_hidden for step in runner.decode_steps.values())
    ran, too_wide = [], []
    for k, step in runner.decode_steps.items():
        def counted(plan, *args, k=k, step=step):
            ran.append(k)
            # the block tables reach this step's positions, not the K drafts the scheduler allocated for
            reach = max(k + 1, 2 * k)
            width = plan.shape[1] - (k + 2)
            if width != max(-(-(int(cached) + reach) // 8) for cached in plan[:, 0]):
                too_wide.append((k, plan[:, 0].tolist(), width))
            return step(plan, *args)
        runner.decode_steps[k] = counted
    runner.decode_step = runner.decode_steps[2]
    # a step whose decodes ran as one call beside prompt chunks times that call as a decode step of its rows
    splits, timed = [], []
    execute, record_step = runner.execute, policy.record_step

    def executed(batch):
        out = execute(batch)
        if runner.last_decode_part is not None:
            splits.append((batch.num_speculative_tokens, *runner.last_decode_part, len(batch)))
        return out
    runner.execute = executed
    policy.record_step = lambda k, b, seconds: (timed.append((k, b, seconds)), record_step(k, b, seconds))
    hosted, record_overhead = [], policy.record_overhead  # ... and its host time around the whole model call
    policy.record_overhead = lambda k, b, seconds: (hosted.append((k, b)), record_overhead(k, b, seconds))
    kit.OracleDrafts(engine, expected, hit_rate=0.7, seed=2)
    assert kit.run_requests(engine, spec["requests"](), spec["arrivals"]) == expected
    assert set(ran) == {0, 1, 2}, "some k never took its one-call step"
    assert not too_wide, too_wide
    assert splits and all(0 < rows < size and seconds > 0 for _, rows, seconds, size in splits)
    assert all((k, rows, seconds) in timed for k, rows, seconds, _ in splits)
    assert {(k, rows) for k, rows, *_ in splits} & set(hosted)
    assert "no decode-step graph from the warm-up fits" not in caplog.text, "the warm-up missed a step shape"


def test_sampled_and_greedy_requests_together_with_k_drawn_at_random(kit, tiny_models):
    """Sampled sequences verify filler with a one-hot q after a step at a lower k; beside greedy ones,
    whose output stays plain decoding's, seeded sampling repeats exactly."""
    from mtp_runtime.engine.config import EngineConfig
    from mtp_runtime.engine.llm_engine import LLMEngine

    model = tiny_models["deepseek_v3"]
    sampled = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=14, seed=11, ignore_eos=True)
    requests = {"g0": (SHARED + [5, 9], greedy(14)), "s0": ([7, 3, 11, 40], sampled),
                "g1": ([21, 8, 99], greedy(10)), "s1": (SHARED[:5], SamplingParams(temperature=1.0, max_tokens=12,
                                                                                  seed=3, ignore_eos=True))}
    plain = kit.make_engine(model, 0, enable_prefix_cache=False)
    expected = {rid: kit.run_requests(plain, {rid: requests[rid]})[rid] for rid in ("g0", "g1")}

    def run(seed):
        engine = LLMEngine(EngineConfig(model=model, num_speculative_tokens=3, speculative_adaptive=True,
                                        max_model_len=96, block_size=4, max_seqs_per_batch=8,
                                        max_tokens_per_batch=64), policy=RandomDepth(3, seed))
        out = kit.run_requests(engine, requests)
        assert engine.stats().draft_tokens > 0
        return out

    first, second = run(1), run(1)
    assert {rid: first[rid] for rid in expected} == expected
    assert first == second
    assert all(len(first[rid]) == requests[rid][1].max_tokens for rid in requests)
