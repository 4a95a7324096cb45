"""Routed experts: the gathered small-batch path (accelerators), the host-routed path (CPU), the dense
path and the packed CPU kernel compute what the per-expert loop computes."""

import pytest
import torch

from mtp_runtime.checkpoint.configs import build_config
from mtp_runtime.config import ModelConfig
from mtp_runtime.distributed import ParallelState
from mtp_runtime.kernels import cpu_gemm
from mtp_runtime.layers import moe
from mtp_runtime.layers.linear import prepare_for_inference
from mtp_runtime.layers.moe import RoutedExperts, TopkRouter


def experts_and_routing(num_tokens, parallel=None, seed=0):
    config = ModelConfig.from_dict(build_config("deepseek_v3", hidden_size=32, moe_intermediate_size=16,
                                                n_routed_experts=8, num_experts_per_tok=3, n_group=4,
                                                topk_group=2))
    gen = torch.Generator().manual_seed(seed)
    experts = RoutedExperts(config, parallel)
    router = TopkRouter(config)
    with torch.no_grad():
        for p in (experts.w13, experts.w2, router.weight):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    x = torch.randn(num_tokens, 32, generator=gen)
    weights, ids = router(x)
    return experts, x, weights, ids


@pytest.mark.parametrize("num_tokens", [1, 2, 5])
def test_gathered_path_matches_per_expert_loop(num_tokens):
    experts, x, weights, ids = experts_and_routing(num_tokens)
    gathered = experts._forward_gathered(x, weights, ids)
    looped = experts._forward_per_expert(x, weights, ids)
    assert torch.allclose(gathered, looped, atol=1e-6)
    assert gathered.abs().max() > 0


@pytest.mark.parametrize("num_tokens", [1, 2, 5])
def test_host_routed_path_matches_per_expert_loop(num_tokens):
    experts, x, weights, ids = experts_and_routing(num_tokens)
    host = experts._forward_host_routed(x, weights, ids)
    assert torch.allclose(host, experts._forward_per_expert(x, weights, ids), atol=1e-6)
    assert host.abs().max() > 0


@pytest.mark.parametrize("num_tokens", [1, 4])
def test_host_routed_path_skips_other_ranks_experts(num_tokens):
    experts, x, weights, ids = experts_and_routing(num_tokens, ParallelState(ep_rank=1, ep_size=2), seed=1)
    assert torch.allclose(experts._forward_host_routed(x, weights, ids),
                          experts._forward_per_expert(x, weights, ids), atol=1e-6)


def test_host_routed_token_with_no_local_expert_gets_zeros():
    experts, x, weights, ids = experts_and_routing(1, ParallelState(ep_rank=1, ep_size=2), seed=1)
    ids = torch.tensor([[0, 1, 2]])  # all on rank 0
    assert torch.equal(experts._forward_host_routed(x, weights, ids), torch.zeros_like(x))


@pytest.mark.parametrize("num_tokens,ep_rank", [(1, None), (5, None), (4, 1)])
def test_dense_path_matches_per_expert_loop(num_tokens, ep_rank):
    parallel = None if ep_rank is None else ParallelState(ep_rank=ep_rank, ep_size=2)
    experts, x, weights, ids = experts_and_routing(num_tokens, parallel, seed=2)
    experts.fuse_weights()
    assert torch.allclose(experts._forward_dense(x, weights, ids),
                          experts._forward_per_expert(x, weights, ids), atol=1e-5)


@pytest.fixture
def kernel():
    assert cpu_gemm.available(), "the packed kernel did not build on this x86-64 AVX2 machine"


@pytest.mark.parametrize("num_tokens,ep_rank", [(1, None), (2, None), (5, None), (70, None), (4, 1)])
def test_packed_kernel_matches_per_expert_loop(kernel, num_tokens, ep_rank):
    parallel = None if ep_rank is None else ParallelState(ep_rank=ep_rank, ep_size=2)
    experts, x, weights, ids = experts_and_routing(num_tokens, parallel, seed=2)
    looped = experts._forward_per_expert(x, weights, ids)
    experts.fuse_weights()
    experts.pack_weights()
    assert experts.w13_packed is not None and experts.w2_stacked is None  # the kernel replaces the dense path
    out = experts(x, weights, ids)
    assert torch.allclose(out, looped, atol=1e-5)
    assert looped.abs().max() > 0
    # a token's result does not depend on the other tokens of its step (verify rows == decode rows)
    assert torch.equal(experts(x[:1], weights[:1], ids[:1]), out[:1])


@pytest.mark.parametrize("num_tokens", [1, 3])
def test_packed_kernel_on_bfloat16_valued_experts_reads_bfloat16_panels(kernel, num_tokens):
    """Experts of a bfloat16 checkpoint: bfloat16 panels (half the bytes), the same bits as float32 panels."""
    experts, x, weights, ids = experts_and_routing(num_tokens, seed=3)
    with torch.no_grad():
        experts.w13.copy_(experts.w13.to(torch.bfloat16).float())
        experts.w2.copy_(experts.w2.to(torch.bfloat16).float())
    looped = experts._forward_per_expert(x, weights, ids)
    experts.pack_weights()
    assert experts.w13_packed.dtype == experts.w2_packed.dtype == torch.bfloat16
    out = experts(x, weights, ids)
    wide = cpu_gemm.moe_experts(x, weights, ids, cpu_gemm.widen(experts.w13_packed), cpu_gemm.widen(experts.w2_packed), 0)
    assert torch.equal(out, wide)
    assert torch.allclose(out, looped, atol=1e-5) and looped.abs().max() > 0


def test_packed_kernel_gives_zeros_to_tokens_with_no_local_expert(kernel):
    experts, x, weights, ids = experts_and_routing(2, ParallelState(ep_rank=1, ep_size=2), seed=1)
    experts.pack_weights()
    ids = torch.tensor([[0, 1, 2], [4, 1, 2]])  # token 0: all on rank 0
    out = experts(x, weights, ids)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and out[1].abs().max() > 0


def test_packed_kernel_rejects_mismatched_shapes(kernel):
    experts, x, weights, ids = experts_and_routing(2)
    experts.pack_weights()
    with pytest.raises(RuntimeError, match="hidden size"):
        cpu_gemm.moe_experts(x[:, :16], weights, ids, experts.w13_packed, experts.w2_packed, 0)
    with pytest.raises(RuntimeError, match="ids must be int64"):
        cpu_gemm.moe_experts(x, weights, ids[:1], experts.w13_packed, experts.w2_packed, 0)


def test_gathered_path_skips_other_ranks_experts():
    # Rank 1 of 2 holds experts 4..7; tokens routed to 0..3 get nothing from it.
    experts, x, weights, ids = experts_and_routing(4, ParallelState(ep_rank=1, ep_size=2), seed=1)
    assert (ids < 4).any() and (ids >= 4).any()
    assert torch.allclose(experts._forward_gathered(x, weights, ids),
                          experts._forward_per_expert(x, weights, ids), atol=1e-6)


def test_forward_picks_the_path_by_device_and_size(monkeypatch):
    experts, x, weights, ids = experts_and_routing(2)
    calls = []
    monkeypatch.setattr(RoutedExperts, "_forward_per_expert", lambda self, *a: calls.append("loop"))
    monkeypatch.setattr(RoutedExperts, "_forward_gathered", lambda self, *a: calls.append("gathered"))
    monkeypatch.setattr(RoutedExperts, "_forward_host_routed", lambda self, *a: calls.append("host"))
    experts(x, weights, ids)  # CPU, few tokens
    monkeypatch.setattr(moe, "HOST_ROUTED_MAX_TOKENS", x.shape[0] - 1)
    experts(x, weights, ids)  # as on an accelerator: few pairs
    monkeypatch.setattr(moe, "GATHERED_MAX_PAIRS", ids.numel() - 1)
    experts(x, weights, ids)
    assert calls == ["host", "gathered", "loop"]


def test_forward_takes_the_packed_kernel_eager_and_compiled(kernel, monkeypatch):
    experts, x, weights, ids = experts_and_routing(3)
    experts.pack_weights()
    calls = []
    for path in ("_forward_per_expert", "_forward_gathered", "_forward_host_routed", "_forward_dense"):
        monkeypatch.setattr(RoutedExperts, path, lambda self, *a, path=path: calls.append(path))
    with torch.no_grad():  # an inference kernel (no autograd formula), as loaded models run it
        eager = experts(x, weights, ids)
        compiled = torch.compile(experts, backend="aot_eager", fullgraph=True)(x, weights, ids)
        assert calls == [] and torch.equal(eager, compiled)
        monkeypatch.setattr(moe, "PACKED_MAX_TOKENS", x.shape[0] - 1)  # a long prefill chunk, eager
        experts(x, weights, ids)
        assert calls == ["_forward_host_routed"]  # the eager CPU path without the kernel


@pytest.mark.parametrize("num_tokens", [1, 5])
def test_moe_block_runs_its_shared_expert_in_the_kernel_call(kernel, num_tokens):
    config = ModelConfig.from_dict(build_config("deepseek_v3", hidden_size=32, moe_intermediate_size=16,
                                                n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
                                                n_shared_experts=2))
    block = moe.MoE(config)
    gen = torch.Generator().manual_seed(num_tokens)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        x = torch.randn(num_tokens, 32, generator=gen)
        unpacked = block(x)
        prepare_for_inference(block)
        assert block.shared_packed is not None and block.experts.w13_packed is not None
        calls = []
        block.shared_experts.register_forward_hook(lambda *a: calls.append("shared MLP"))
        packed = block(x)
    assert calls == []  # the shared expert ran inside the kernel, not as its own MLP
    assert torch.allclose(packed, unpacked, atol=1e-5) and unpacked.abs().max() > 0


def test_kernel_wants_both_shared_weights_or_neither(kernel):
    experts, x, weights, ids = experts_and_routing(2)
    experts.pack_weights()
    with pytest.raises(RuntimeError, match="both shared_w13 and shared_w2"):
        torch.ops.mtp_runtime.moe_experts(x, weights, ids, experts.w13_packed, experts.w2_packed, 0,
                                          experts.w13_packed[:1], None)
