import pytest
import torch

from mtp_runtime.checkpoint import fp8


def naive_dequantize(w_fp8, scale_inv):
    """Reference: one block at a time."""
    out = torch.empty(w_fp8.shape, dtype=torch.float32)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            rows, cols = slice(i * 128, (i + 1) * 128), slice(j * 128, (j + 1) * 128)
            out[rows, cols] = w_fp8[rows, cols].float() * scale_inv[i, j]
    return out


@pytest.mark.parametrize("shape", [(128, 128), (300, 200), (1, 5), (129, 257), (256, 64)])
def test_round_trip_within_fp8_precision(shape):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.02
    q, s = fp8.quantize_fp8_blocks(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.dtype == torch.float32 and tuple(s.shape) == (-(-shape[0] // 128), -(-shape[1] // 128))
    back = fp8.dequantize_fp8_blocks(q, s, torch.float32)
    # e4m3 has 3 mantissa bits: relative error <= 2^-4 of the block max, per element
    block_max = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[: shape[0], : shape[1]] * fp8.FP8_MAX
    assert ((back - w).abs() <= block_max * 2**-4 + 1e-12).all()
    assert torch.equal(back, naive_dequantize(q, s))


def test_blocks_have_their_own_scale():
    w = torch.ones(256, 256)
    w[:128, :128] *= 100.0
    _, s = fp8.quantize_fp8_blocks(w)
    assert s[0, 0] == pytest.approx(100.0 / 448.0) and s[1, 1] == pytest.approx(1.0 / 448.0)


def test_zero_block_is_exact():
    w = torch.zeros(130, 10)
    q, s = fp8.quantize_fp8_blocks(w)
    assert torch.equal(fp8.dequantize_fp8_blocks(q, s, torch.bfloat16), torch.zeros(130, 10, dtype=torch.bfloat16))


def test_chunked_dequantisation_matches(monkeypatch):
    w = torch.randn(700, 300)
    q, s = fp8.quantize_fp8_blocks(w)
    whole = fp8.dequantize_fp8_blocks(q, s, torch.bfloat16)
    monkeypatch.setattr(fp8, "_CHUNK_ELEMS", 1)  # one block row per step
    assert torch.equal(fp8.dequantize_fp8_blocks(q, s, torch.bfloat16), whole)


def test_bad_scale_shape_names_tensor():
    q, _ = fp8.quantize_fp8_blocks(torch.randn(256, 256))
    with pytest.raises(ValueError, match="model.layers.3.eh_proj.weight: weight_scale_inv has shape"):
        fp8.dequantize_fp8_blocks(q, torch.ones(1, 1), name="model.layers.3.eh_proj.weight")
