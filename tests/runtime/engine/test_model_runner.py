"""ModelRunner: cache sizing, and the draft cache staying consistent through rollbacks.

After every step, each sequence's proposals must equal what the MTP module
computes from scratch over the accepted tokens (fresh caches, one sequence):
main over all tokens, draft over positions 0..L-2 fed t_1..t_{L-1}, then k-1
chained steps. So no stale draft entry from a rejected position, a preempted
run or a reused prefix block can leak into a proposal. The same holds when
greedy decode steps run as one call (graph mode's GreedyDecodeStep, run here
without compiling: the compiled graph is the same code, covered by the slow
graph-mode test).
"""

import pytest
import torch

from mtp_runtime.sampling_params import SamplingParams

from mtp_runtime.engine.graph_step import GreedyDecodeStep, StepMetadata, warm_up_batch_sizes
from mtp_runtime.engine.model_runner import allocate_caches, cache_bytes_per_block
from mtp_runtime.layers.attention import AttentionMetadata

ARCHS = ("deepseek_v3", "deepseek_v32", "glm4_moe")


@torch.inference_mode()
def drafts_from_scratch(runner, tokens, k):
    bs = runner.block_size
    n = len(tokens)
    blocks = -(-(n + k) // bs)
    main_caches = allocate_caches(runner.main.kv_cache_spec(), blocks, bs, runner.dtype, runner.device)
    draft_caches = allocate_caches(runner.draft.kv_cache_spec(), blocks, bs, runner.dtype, runner.device)
    ids = torch.tensor(tokens)
    hidden = runner.main(ids, torch.arange(n), main_caches, AttentionMetadata.for_sequence(0, n, bs))
    out = runner.draft(ids[1:], hidden[:-1], torch.arange(n - 1), draft_caches,
                       AttentionMetadata.for_sequence(0, n - 1, bs))
    h = out[-1:]
    drafts = []
    for j in range(k):
        tok = runner.draft.compute_logits(h).argmax(-1)
        drafts.append(int(tok))
        if j + 1 < k:
            pos = n - 1 + j
            h = runner.draft(tok, h, torch.tensor([pos]), draft_caches, AttentionMetadata.for_sequence(pos, 1, bs))
    return drafts


def one_call_decode_steps(engine) -> list[int]:
    """Route the engine's greedy decode steps through an uncompiled GreedyDecodeStep; returns a list
    that grows by the batch size of each step it runs."""
    runner = engine.runner
    step = GreedyDecodeStep(runner.main, runner.draft, runner.k, runner.block_size, compile_graph=False)
    calls: list[int] = []

    def counted(tokens, *args):
        calls.append(tokens.shape[0])
        return step(tokens, *args)

    runner.decode_step = counted
    return calls


@pytest.mark.parametrize("arch,one_call", [(arch, False) for arch in ARCHS] +
                         [("deepseek_v3", True), ("glm4_moe", True)])
def test_proposals_match_a_from_scratch_draft(kit, tiny_models, arch, one_call):
    k = 3
    # Shared 16-token prefix (prefix-cache hits), distinct tails.
    requests = {f"r{i}": (list(range(10, 26)) + list(range(100 + 7 * i, 104 + 9 * i)), kit.greedy(16))
                for i in range(4)}
    reference = kit.run_requests(kit.make_engine(tiny_models[arch], 0), requests)
    # Tiny KV budget and a small token budget: preemption and chunked prefill happen too.
    engine = kit.make_engine(tiny_models[arch], k, num_kv_blocks=27, max_tokens_per_batch=16,
                             enable_prefix_cache=True)
    checked = []

    def check(batch, new_tokens):
        for seq, tokens in zip(batch.seqs, new_tokens):
            if tokens:
                expected = drafts_from_scratch(engine.runner, seq.token_ids + tokens, k)
                assert seq.draft_token_ids == expected, f"{seq.request_id} after {len(seq) + len(tokens)} tokens"
                checked.append(seq.request_id)

    one_call_steps = one_call_decode_steps(engine) if one_call else []
    kit.OracleDrafts(engine, reference, hit_rate=0.6, seed=5, check=check)
    assert kit.run_requests(engine, requests) == reference
    assert len(checked) > 10 and engine.stats().accepted_tokens > 0
    assert engine.stats().num_preemptions > 0 and engine.stats().prefix_cache_hit_tokens > 0
    if one_call:
        assert len(one_call_steps) > 5 and max(one_call_steps) > 1, "decode steps did not take the one-call path"


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
@pytest.mark.parametrize("k", [0, 1, 2])
def test_one_call_decode_step_output_is_plain_decoding(kit, tiny_models, arch, k):
    """Requests arriving and finishing at different steps, some sampling: greedy decode-only steps
    take the one-call path, every other step the step-by-step one, and greedy output does not change."""
    requests = {f"r{i}": ([7 + i, 40, 41 + 3 * i, 99, 5 * i + 3] * (i + 1), kit.greedy(6 + 3 * i)) for i in range(5)}
    arrivals = {0: ["r0", "r1"], 2: ["r2"], 5: ["r3", "r4"]}
    reference = {rid: kit.run_requests(kit.make_engine(tiny_models[arch], 0), {rid: req})[rid]
                 for rid, req in requests.items()}
    engine = kit.make_engine(tiny_models[arch], k)
    calls = one_call_decode_steps(engine)
    runner = engine.runner
    general, split = [], []  # batches of the general step; steps that ran in both parts

    def general_step(batch, run=runner._execute_eager):
        general.append(batch)
        return run(batch)

    def split_step(batch, decoding, run=runner._execute_split):
        split.append(len(batch))
        return run(batch, decoding)

    runner._execute_eager, runner._execute_split = general_step, split_step
    if k:
        kit.OracleDrafts(engine, reference, hit_rate=0.7, seed=k)
    sampled = {"s0": ([3, 4, 5], SamplingParams(temperature=0.8, max_tokens=12, seed=1))}
    got = kit.run_requests(engine, {**requests, **sampled}, {**arrivals, 1: ["s0"]})
    assert {rid: got[rid] for rid in requests} == reference and len(got["s0"]) == 12
    assert len(calls) > 3 and max(calls) > 1
    # A prompt arriving, or the sampled request, beside greedy decodes splits the step: the decodes
    # still take the one-call path, and the general step never sees a greedy decode.
    assert len(split) >= 3, "no step mixed greedy decodes with other sequences"
    assert general and not any(runner._is_greedy_decode_row(b, i) for b in general for i in range(len(b)))
    assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler.block_manager.num_blocks


def test_step_metadata_is_decode_only_and_warm_up_crosses_every_batch_threshold():
    meta = StepMetadata(torch.zeros(2, dtype=torch.long), None)
    with pytest.raises(RuntimeError, match="decode batch only"):
        meta.sequences()
    assert warm_up_batch_sizes(1) == [1]
    assert warm_up_batch_sizes(16) == [1, 2, 3, 4, 6, 8, 12, 16]
    sizes = warm_up_batch_sizes(100)
    assert sizes[-1] == 100 and sizes == sorted(set(sizes))
    # every size up to the limit has a warmed size at most 1.5x away, so no threshold is jumped far over
    assert all(any(b <= w <= 1.5 * b for w in sizes) for b in range(1, 101))


@pytest.mark.parametrize("k,block_size,one_block", [(0, 16, True), (2, 16, True), (3, 6, False), (3, 8, True), (1, 4, True),
                                                     (2, 4, False), (3, 128, True)])
def test_decode_step_warm_up_covers_one_block_tables_where_a_sequence_fits_one(k, block_size, one_block):
    step = GreedyDecodeStep(None, object() if k else None, k, block_size, compile_graph=False)
    tables = step._warm_up_tables()
    span = 2 * k if k else 1  # slots a decode step writes past the cached length (scheduler._slots_after_step)
    assert any(width == 1 for width, _ in tables) == one_block
    assert any(width > 1 for width, _ in tables)
    for width, cached in tables:
        assert cached and min(cached) >= 1
        assert max(cached) + span <= width * block_size, "a warm-up row writes past its block table"


def test_decode_step_compiles_a_shape_the_warm_up_missed_instead_of_failing(caplog):
    step = GreedyDecodeStep(None, None, 0, 16, compile_graph=False)
    calls = []

    def compiled(plan, main_caches, draft_caches):
        calls.append(plan.shape)
        if len(calls) == 1:
            raise RuntimeError("Recompilation triggered with skip_guard_eval_unsafe stance. This usually means ...")
        return "ran"

    step._fn, step._warm = compiled, True
    plan = torch.zeros(3, 4, dtype=torch.long)
    with caplog.at_level("WARNING", logger="mtp_runtime.engine"):
        assert step(plan, [], []) == "ran"
    assert len(calls) == 2 and "3 sequence(s) with block tables 2 wide" in caplog.text

    def broken(plan, main_caches, draft_caches):
        raise RuntimeError("shape mismatch in the graph")

    step._fn = broken
    with pytest.raises(RuntimeError, match="shape mismatch"):
        step(plan, [], [])


def test_cache_sizes_follow_the_model_spec(kit, tiny_models):
    engine = kit.make_engine(tiny_models["deepseek_v3"], 1, num_kv_blocks=40)
    runner = engine.runner
    cfg = runner.model_config
    latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    assert runner.main_block_bytes == cfg.num_hidden_layers * latent * runner.block_size * 4
    assert runner.draft_block_bytes == latent * runner.block_size * 4
    assert runner.main_caches[0]["latent"].shape == (40, runner.block_size, latent)
    assert len(runner.draft_caches) == 1
    spec = [{"k": (2, 16), "v": (2, 16)}]
    assert cache_bytes_per_block(spec, 8, torch.bfloat16) == 2 * 32 * 8 * 2


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_small_steps_run_on_one_thread_and_output_does_not_change(kit, tiny_models, two_threads):
    """EngineConfig.single_thread_tokens: a step of fewer tokens runs on one thread, a larger one on the
    engine's threads, and the caller's thread count is back after every step."""
    requests = {f"r{i}": (list(range(10 + i, 30 + i)), kit.greedy(12)) for i in range(3)}
    reference = kit.run_requests(kit.make_engine(tiny_models["deepseek_v3"], 1, single_thread_tokens=0), requests)
    engine = kit.make_engine(tiny_models["deepseek_v3"], 1, single_thread_tokens=8)  # decodes: 3 x 2 tokens
    assert engine.runner.threads == 2
    seen = []
    execute = engine.runner.execute

    def recorded(batch):
        out = execute(batch)
        tokens = sum(batch.num_chunk_tokens) + sum(batch.num_draft_tokens)
        seen.append((tokens, engine.runner.last_step_threads, torch.get_num_threads()))
        return out

    engine.runner.execute = recorded
    assert kit.run_requests(engine, requests) == reference
    assert {threads for tokens, threads, _ in seen if tokens < 8} == {1}
    assert {threads for tokens, threads, _ in seen if tokens >= 8} == {2}
    assert all(after == 2 for _, _, after in seen), "a step left the caller on another thread count"


def test_graph_mode_runs_only_its_one_call_steps_on_one_thread(kit, tiny_models, two_threads):
    """In graph mode the one-call decode steps were compiled for `threads_for` (the warm-up below), the
    per-forward graphs for every thread: the one-call part of any step (a step that mixes decodes with
    a prompt included) runs on `threads_for` its tokens, the rest on every thread."""
    engine = kit.make_engine(tiny_models["deepseek_v3"], 1, single_thread_tokens=8)
    runner = engine.runner
    runner.graph_enabled = True
    step = GreedyDecodeStep(runner.main, runner.draft, 1, runner.block_size, compile_graph=False)
    one_call, eager = [], []

    def decode_step(plan, *args):
        one_call.append((plan.shape[0], torch.get_num_threads()))
        return step(plan, *args)

    def general_step(batch, run=runner._execute_eager):
        eager.append(torch.get_num_threads())
        return run(batch)

    runner.decode_step, runner._execute_eager = decode_step, general_step
    # "b" arrives while "a" decodes: its prompt's step also decodes "a" (the split path); the
    # 3-token prompt's own step is small too, but runs step by step
    requests = {"a": ([11, 12, 13], kit.greedy(8)), "b": (list(range(20, 40)), kit.greedy(4))}
    kit.run_requests(engine, requests, arrivals={0: ["a"], 3: ["b"]})
    assert one_call and {threads for _, threads in one_call} == {1}  # at most 2 x 2 tokens a step
    assert len(eager) >= 2 and set(eager) == {2}
    assert torch.get_num_threads() == 2


def test_decode_step_warm_up_compiles_each_batch_size_for_its_thread_count(two_threads):
    step = GreedyDecodeStep(None, object(), 1, 16, compile_graph=False)
    seen = []

    def compiled(plan, main_caches, draft_caches):
        seen.append((plan.shape[0], torch.get_num_threads()))

    step._fn = compiled
    step.warm_up([1, 2, 3, 4, 6, 8], 64, [], [], torch.device("cpu"),
                 threads_for=lambda tokens: 1 if tokens < 8 else 2)
    assert {b: t for b, t in seen} == {1: 1, 2: 1, 3: 1, 4: 2, 6: 2, 8: 2}  # k = 1: 2 tokens a sequence
    assert torch.get_num_threads() == 2
