"""Our models against transformers' implementations on tiny checkpoints (float32, max abs diff <= 1e-4)."""

from __future__ import annotations

import pytest
import torch

from mtp_runtime.kernels import cpu_gemm
from mtp_runtime.layers.attention import AttentionMetadata
from mtp_runtime.models.loader import load_model

TOL = 1e-4
PROMPT_LEN = 30  # > index_topk (12) of the V3.2 checkpoint, so the indexer really selects
CASES = ["deepseek_v3", "deepseek_v32", "glm4_moe", "deepseek_v3_fp8"]


def prompt(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed))


def empty_caches(model, num_blocks: int = 16, block_size: int = 4):
    return [{k: torch.zeros(num_blocks, block_size, *s) for k, s in spec.items()} for spec in model.kv_cache_spec()]


@pytest.fixture(scope="module")
def pairs(tiny_dirs, reference_model):
    return {case: (load_model(tiny_dirs[case]), reference_model(tiny_dirs[case])) for case in CASES}


def paged_logits(ours, ids: torch.Tensor) -> torch.Tensor:
    """Prefill the first 10 tokens, then decode one token at a time through the paged cache."""
    with torch.no_grad():
        caches = empty_caches(ours)
        hidden = ours(ids[:10], torch.arange(10), caches, AttentionMetadata.for_sequence(0, 10, block_size=4))
        got = [ours.compute_logits(hidden)]
        for pos in range(10, len(ids)):
            meta = AttentionMetadata.for_sequence(pos, 1, block_size=4)
            got.append(ours.compute_logits(ours(ids[pos:pos + 1], torch.tensor([pos]), caches, meta)))
    return torch.cat(got)


@pytest.mark.parametrize("case", CASES)
def test_prompt_and_decode_logits_match_transformers(pairs, case):
    ours, ref = pairs[case]
    ids = prompt(PROMPT_LEN)
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]  # [S, V]
    got = paged_logits(ours, ids)
    assert got.dtype == torch.float32 and expected.abs().max() > 1.0  # logits are not trivially small
    assert (got - expected).abs().max().item() <= TOL
    # and against transformers' own incremental decode with its KV cache
    with torch.no_grad():
        out = ref(ids[None, :10], use_cache=True)
        ref_steps, cache = [out.logits[0]], out.cache
        for pos in range(10, PROMPT_LEN):
            out = ref(ids[None, pos:pos + 1], cache=cache, use_cache=True)
            ref_steps.append(out.logits[0])
            cache = out.cache
    assert (got - torch.cat(ref_steps)).abs().max().item() <= TOL


@pytest.mark.parametrize("case", ["deepseek_v3", "glm4_moe"])
def test_packed_cpu_linears_keep_the_logits_exact(pairs, tiny_dirs, case, monkeypatch):
    """Every linear on the packed CPU kernel (kernels/cpu_gemm.py; the tiny weights are below the size
    the runtime packs, so the test lowers it) still matches transformers."""
    monkeypatch.setattr(cpu_gemm, "MIN_PACKED_ELEMENTS", 0)
    packed = load_model(tiny_dirs[case])
    assert packed.lm_head.weight_packed is not None
    attn = packed.model.layers[0].self_attn
    assert (attn.qkv_a_packed if case == "deepseek_v3" else attn.qkv_packed) is not None
    assert packed.model.layers[0].mlp.gate_up_packed is not None
    ids = prompt(PROMPT_LEN)
    with torch.no_grad():
        expected = pairs[case][1](ids[None]).logits[0]
    assert (paged_logits(packed, ids) - expected).abs().max().item() <= TOL


@pytest.mark.parametrize("case", CASES)
def test_batched_training_path_matches_transformers(pairs, case):
    ours, ref = pairs[case]
    ids = torch.stack([prompt(PROMPT_LEN, 1), prompt(PROMPT_LEN, 2)])
    with torch.no_grad():
        expected = ref(ids).logits
        got = ours.compute_logits(ours.forward_batched(ids))
    assert (got - expected).abs().max().item() <= TOL


def test_v32_indexer_really_selects(pairs):
    """Past index_topk keys the sparse selection changes the result; disabling it would not match."""
    ours, ref = pairs["deepseek_v32"]
    ids = prompt(PROMPT_LEN)
    with torch.no_grad():
        sparse = ours.compute_logits(ours.forward_batched(ids[None]))[0]
        topks = [layer.self_attn.indexer.topk for layer in ours.model.layers]
        for layer in ours.model.layers:
            layer.self_attn.indexer.topk = 10**6
        try:
            dense = ours.compute_logits(ours.forward_batched(ids[None]))[0]
        finally:
            for layer, k in zip(ours.model.layers, topks):
                layer.self_attn.indexer.topk = k
    topk = topks[0]
    assert torch.allclose(sparse[:topk], dense[:topk], atol=TOL)  # short contexts: all keys selected
    assert (sparse[topk:] - dense[topk:]).abs().max() > 1e-2


@pytest.mark.parametrize("case", CASES)
def test_grouped_routing_changes_expert_choice(pairs, case):
    """On the hidden states of the prompt the exactness test compares, grouped top-k (n_group,
    topk_group) excludes experts a flat top-k would pick, in every MoE layer: a router that ignored
    the groups would not match transformers."""
    ours, _ = pairs[case]
    routed = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda mod, inp, out: routed.append((mod, inp[0], out[1])))
             for layer in ours.model.layers if hasattr(layer.mlp, "gate")]
    try:
        with torch.no_grad():
            ours.forward_batched(prompt(PROMPT_LEN)[None])
    finally:
        for hook in hooks:
            hook.remove()
    assert routed and all(router.config.topk_group < router.config.n_group for router, _, _ in routed)
    for router, x, grouped in routed:
        k = router.config.num_experts_per_tok
        x = x.reshape(-1, x.shape[-1]).float()
        flat = (torch.sigmoid(x @ router.weight.float().T) + router.e_score_correction_bias).topk(k, dim=-1)[1]
        differs = [set(a.tolist()) != set(b.tolist()) for a, b in zip(grouped.reshape(-1, k), flat)]
        assert sum(differs) >= 3, f"{case}: grouping changed the choice of only {sum(differs)} tokens"
