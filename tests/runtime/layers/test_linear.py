"""Tensor-parallel shards: each rank's weight_loader keeps its slice; the slices recombine to the full layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mtp_runtime.config import ModelConfig
from mtp_runtime.distributed import ParallelState
from mtp_runtime.layers.embedding import VocabParallelEmbedding
from mtp_runtime.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, fuse_linears
from mtp_runtime.layers.moe import MoE, RoutedExperts


def ranks(tp: int = 1, ep: int = 1) -> list[ParallelState]:
    return [ParallelState(tp_rank=r % tp, tp_size=tp, ep_rank=r % ep, ep_size=ep) for r in range(max(tp, ep))]


def test_column_and_row_shards_recombine():
    w, x = torch.randn(8, 6), torch.randn(3, 6)
    cols = []
    for state in ranks(tp=2):
        layer = ColumnParallelLinear(6, 8, parallel=state)
        layer.weight.weight_loader(layer.weight, w, "w")
        cols.append(layer(x))
    assert torch.allclose(torch.cat(cols, -1), x @ w.T)
    w2, h = torch.randn(5, 8), torch.randn(3, 8)
    partial = []
    for state in ranks(tp=2):
        layer = RowParallelLinear(8, 5, parallel=state)
        layer.weight.weight_loader(layer.weight, w2, "w2")
        partial.append(F.linear(h[:, state.tp_rank * 4:(state.tp_rank + 1) * 4], layer.weight))
    assert torch.allclose(sum(partial), h @ w2.T, atol=1e-6)  # what the all-reduce sums


def test_loaders_reject_wrong_shapes_naming_the_tensor():
    layer = ReplicatedLinear(6, 8)
    with pytest.raises(ValueError, match="tensor model.x.weight: checkpoint shape"):
        layer.weight.weight_loader(layer.weight, torch.zeros(8, 5), "model.x.weight")
    col = ColumnParallelLinear(6, 8, parallel=ranks(tp=2)[1])
    with pytest.raises(ValueError, match="tensor q.weight: checkpoint has 6 output rows"):
        col.weight.weight_loader(col.weight, torch.zeros(6, 6), "q.weight")
    emb = VocabParallelEmbedding(10, 4, parallel=ranks(tp=2)[1])
    with pytest.raises(ValueError, match="vocab_size 10"):
        emb.weight.weight_loader(emb.weight, torch.zeros(12, 4), "model.embed_tokens.weight")
    with pytest.raises(ValueError, match="not divisible by tp_size"):
        ColumnParallelLinear(6, 7, parallel=ranks(tp=2)[0])


def test_vocab_shards_hold_their_rows():
    w = torch.randn(10, 4)
    for state in ranks(tp=2):
        emb = VocabParallelEmbedding(10, 4, parallel=state)
        emb.weight.weight_loader(emb.weight, w, "e")
        assert torch.equal(emb.weight, w[state.tp_rank * 5:(state.tp_rank + 1) * 5])


def moe_config() -> ModelConfig:
    return ModelConfig(arch="glm4_moe", vocab_size=16, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=16, n_routed_experts=4, n_shared_experts=0, moe_intermediate_size=6,
                       num_experts_per_tok=2, n_group=2, topk_group=1)


def test_expert_parallel_ranks_split_experts_and_sum_to_the_whole():
    config = moe_config()
    torch.manual_seed(0)
    experts = {e: (torch.randn(6, 8), torch.randn(6, 8), torch.randn(8, 6)) for e in range(4)}
    x = torch.randn(5, 8)
    full = MoE(config, ranks()[0])
    router = {"weight": torch.randn(4, 8), "bias": torch.zeros(4)}

    def load(moe: MoE) -> None:
        with torch.no_grad():
            moe.gate.weight.copy_(router["weight"])
        for e, (g, u, d) in experts.items():
            moe.experts.w13.weight_loader(moe.experts.w13, g, f"experts.{e}.gate_proj.weight", e, "gate")
            moe.experts.w13.weight_loader(moe.experts.w13, u, f"experts.{e}.up_proj.weight", e, "up")
            moe.experts.w2.weight_loader(moe.experts.w2, d, f"experts.{e}.down_proj.weight", e, "down")

    load(full)
    parts = []
    for state in ranks(ep=2):
        moe = MoE(config, state)
        assert list(moe.experts.local) == [2 * state.ep_rank, 2 * state.ep_rank + 1]
        assert moe.experts.w13.shape == (2, 12, 8)
        load(moe)
        with torch.no_grad():  # this rank's partial sum, before the all-reduce
            parts.append(moe.experts(x, *moe.gate(x)))
    with torch.no_grad():
        assert torch.allclose(parts[0] + parts[1], full(x), atol=1e-6)
        # and by hand: each token's two routed experts, weighted
        weights, ids = full.gate(x)
        by_hand = torch.stack([sum(w * (F.silu(x[t] @ experts[e][0].T) * (x[t] @ experts[e][1].T)) @ experts[e][2].T
                                   for w, e in zip(weights[t], ids[t].tolist())) for t in range(5)])
        assert torch.allclose(full(x), by_hand, atol=1e-5)


def test_expert_loader_rejects_unknown_expert():
    experts = RoutedExperts(moe_config(), ranks()[0])
    with pytest.raises(ValueError, match="expert 9 does not exist"):
        experts.weight_loader(experts.w2, torch.zeros(8, 6), "mlp.experts.9.down_proj.weight", 9, "down")


def test_fused_linears_compute_the_separate_projections_and_share_storage():
    gen = torch.Generator().manual_seed(3)
    a, b = ReplicatedLinear(8, 5, bias=True), ReplicatedLinear(8, 3)
    with torch.no_grad():
        for p in (a.weight, a.bias, b.weight):
            p.copy_(torch.randn(p.shape, generator=gen))
    x = torch.randn(4, 8, generator=gen)
    expected = torch.cat([a(x), b(x)], dim=-1)
    weight, bias = fuse_linears(a, b)
    assert torch.allclose(F.linear(x, weight, bias), expected, atol=1e-6)
    assert bias[5:].abs().sum() == 0  # b has no bias: zeros in its rows
    with torch.no_grad():
        b.weight.add_(1.0)  # the layers' parameters are views: writing them writes the fused weight
    assert torch.equal(weight[5:], b.weight) and a.weight.data_ptr() == weight.data_ptr()
