"""ModelRunner: cache sizing, and the draft cache staying consistent through rollbacks.

After every step, each sequence's proposals must equal what the MTP module
computes from scratch over the accepted tokens (fresh caches, one sequence):
main over all tokens, draft over positions 0..L-2 fed t_1..t_{L-1}, then k-1
chained steps. So no stale draft entry from a rejected position, a preempted
run or a reused prefix block can leak into a proposal.
"""

import pytest
import torch

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


@pytest.mark.parametrize("arch", ARCHS)
def test_proposals_match_a_from_scratch_draft(kit, tiny_models, arch):
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

    kit.OracleDrafts(engine, reference, hit_rate=0.6, seed=5, check=check)
    assert kit.run_requests(engine, requests) == reference
    assert len(checked) > 10 and engine.stats().accepted_tokens > 0
    assert engine.stats().num_preemptions > 0 and engine.stats().prefix_cache_hit_tokens > 0


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
