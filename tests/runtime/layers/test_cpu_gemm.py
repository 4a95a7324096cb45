"""The packed float32 CPU linear (kernels/cpu_gemm.cpp) against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mtp_runtime.kernels import cpu_gemm


@pytest.fixture
def pack_all(monkeypatch):
    """Pack weights of any size (the runtime leaves small ones on F.linear)."""
    monkeypatch.setattr(cpu_gemm, "MIN_PACKED_ELEMENTS", 0)
    assert cpu_gemm.available(), "the packed kernel did not build on this x86-64 AVX2 machine"
    return cpu_gemm.pack


@pytest.mark.parametrize("out_features,in_features", [(64, 32), (200, 72), (17, 5), (1, 128), (4096, 128)])
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 9, 256, 300])
def test_matches_f_linear(pack_all, out_features, in_features, rows):
    gen = torch.Generator().manual_seed(out_features * 1000 + rows)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    packed = pack_all(weight)
    assert packed.shape == (-(-out_features // 16), in_features, 16)
    x = torch.randn(rows, in_features, generator=gen)
    for b in (None, bias):
        got = cpu_gemm.linear(x, weight, b, packed)
        assert got.shape == (rows, out_features)
        torch.testing.assert_close(got, F.linear(x, weight, b), rtol=1e-5, atol=1e-4)


def test_one_row_by_a_large_weight_takes_the_library_path(pack_all):
    weight = torch.randn(8192, 1024)  # 8M elements: cpu_gemm.cpp kGemvElements
    packed = pack_all(weight)
    for rows in (1, 2):
        x = torch.randn(rows, 1024)
        torch.testing.assert_close(cpu_gemm.linear(x, weight, None, packed), F.linear(x, weight), rtol=1e-5, atol=1e-3)


def test_keeps_leading_dimensions_and_reads_strided_inputs(pack_all):
    weight = torch.randn(48, 40)
    packed = pack_all(weight)
    x = torch.randn(3, 5, 80)[..., ::2]  # not contiguous
    got = cpu_gemm.linear(x, weight, None, packed)
    assert got.shape == (3, 5, 48)
    torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-5, atol=1e-4)


def test_packs_a_transposed_view(pack_all):
    stacked = torch.randn(96, 32)
    packed = pack_all(stacked.t())
    act = torch.randn(4, 96)
    torch.testing.assert_close(cpu_gemm.linear(act, stacked.t(), None, packed), act @ stacked, rtol=1e-5, atol=1e-4)


def test_a_row_does_not_depend_on_its_batch(pack_all):
    """Every row's sums run in the same order for any batch up to the packed path's limit, so a
    token's logits are the same alone or verified with others."""
    weight = torch.randn(320, 128)
    packed = pack_all(weight)
    x = torch.randn(256, 128)
    alone = torch.cat([cpu_gemm.linear(x[i:i + 1], weight, None, packed) for i in range(0, 256, 37)])
    for rows in (37 * 6 + 1, 256):
        together = cpu_gemm.linear(x[:rows], weight, None, packed)[::37]
        assert torch.equal(together[:len(alone)], alone[:len(together)])


def test_runs_inside_a_compiled_graph_with_dynamic_rows(pack_all):
    weight, bias = torch.randn(40, 24), torch.randn(40)
    packed = pack_all(weight)

    def fn(x):
        return cpu_gemm.linear(torch.relu(x), weight, bias, packed).sum(-1)

    compiled = torch.compile(fn, dynamic=True, fullgraph=True)
    for rows in (1, 3, 7):
        x = torch.randn(rows, 24)
        torch.testing.assert_close(compiled(x), F.linear(torch.relu(x), weight, bias).sum(-1), rtol=1e-5, atol=1e-4)


def test_declines_what_it_cannot_run(pack_all, monkeypatch):
    assert pack_all(torch.randn(64, 32, dtype=torch.bfloat16)) is None
    assert pack_all(torch.randn(2, 64, 32)) is None
    monkeypatch.setattr(cpu_gemm, "MIN_PACKED_ELEMENTS", 65536)
    assert cpu_gemm.pack(torch.randn(64, 32)) is None  # too small to be worth a custom op call
    assert cpu_gemm.pack(torch.randn(1024, 64)) is not None
    monkeypatch.setenv(cpu_gemm.ENV, "0")
    assert not cpu_gemm.available() and cpu_gemm.pack(torch.randn(1024, 64)) is None
    # bfloat16 activations (a bf16 model never packs, but the call must not misread them)
    weight = torch.randn(1024, 64)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    monkeypatch.delenv(cpu_gemm.ENV)
    packed = cpu_gemm.pack(weight)
    assert torch.equal(cpu_gemm.linear(x, weight.bfloat16(), None, packed), F.linear(x, weight.bfloat16()))


def test_mismatched_shapes_are_errors_that_name_the_op(pack_all):
    weight = torch.randn(32, 16)
    packed = pack_all(weight)
    with pytest.raises(RuntimeError, match="packed_linear: input has 8 features, the weight expects 16"):
        cpu_gemm.linear(torch.randn(2, 8), weight, None, packed)
    with pytest.raises(RuntimeError, match="packed_linear: weight .* does not match"):
        torch.ops.mtp_runtime.packed_linear(torch.randn(2, 16), torch.randn(64, 16), packed, None)
    with pytest.raises(RuntimeError, match="packed_linear: bias must be float32 with 32 values"):
        cpu_gemm.linear(torch.randn(2, 16), weight, torch.randn(31), packed)


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_bfloat16_valued_weights_pack_to_bfloat16_with_the_same_bits(pack_all, rows):
    """A bfloat16 checkpoint loaded as float32: half the bytes, the float32 panels' exact results."""
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(200, 72, generator=gen).to(torch.bfloat16).float()
    bias, x = torch.randn(200, generator=gen), torch.randn(rows, 72, generator=gen)
    packed = pack_all(weight)
    assert packed.dtype == torch.bfloat16 and packed.shape == (13, 72, 16)
    got = cpu_gemm.linear(x, weight, bias, packed)
    assert torch.equal(got, cpu_gemm.linear(x, weight, bias, cpu_gemm.widen(packed)))
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    # one weight off the bfloat16 grid keeps the whole weight in float32
    weight[3, 5] += 1e-4
    assert pack_all(weight).dtype == torch.float32


def test_expert_weights_pack_in_one_dtype_per_pair(pack_all):
    w13, w2 = torch.randn(2, 32, 16).to(torch.bfloat16).float(), torch.randn(2, 16, 16)
    narrow, wide = cpu_gemm.pack_experts(w13), cpu_gemm.pack_experts(w2)
    assert (narrow.dtype, wide.dtype) == (torch.bfloat16, torch.float32)
    assert [t.dtype for t in cpu_gemm.matching(narrow, wide)] == [torch.float32, torch.float32]
    assert cpu_gemm.matching(narrow, narrow) == (narrow, narrow)
    x, weights, ids = torch.randn(3, 16), torch.rand(3, 1), torch.tensor([[0], [1], [0]])
    # the widened panels are the same weight's (bfloat16 panels are stored interleaved)
    got = cpu_gemm.moe_experts(x, weights, ids, *cpu_gemm.matching(narrow, wide), 0)
    gate, up = (x.unsqueeze(1) @ w13[ids[:, 0]].transpose(1, 2)).squeeze(1).chunk(2, dim=-1)
    want = weights * (w2[ids[:, 0]] @ (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="w13 is BFloat16 but w2 is Float"):
        cpu_gemm.moe_experts(x, weights, ids, narrow, wide, 0)
