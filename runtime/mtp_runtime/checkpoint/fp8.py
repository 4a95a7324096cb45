"""DeepSeek-style FP8 e4m3 weights with one float32 scale per 128x128 block.

`weight_scale_inv[i, j]` multiplies block (i, j) back to real values:
w[128i:128i+128, 128j:128j+128] ~= w_fp8[...] * scale_inv[i, j]. Edge blocks of
shapes that are not multiples of 128 are simply smaller.
"""

from __future__ import annotations

import torch

BLOCK = 128
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0

# Rows dequantised per step: bounds the float32 temporaries to ~64 MiB each.
_CHUNK_ELEMS = 16 * 1024 * 1024

QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [BLOCK, BLOCK],
}


def scale_shape(weight_shape: tuple[int, ...]) -> tuple[int, int]:
    out_features, in_features = weight_shape
    return (-(-out_features // BLOCK), -(-in_features // BLOCK))


def quantize_fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """2-D weight -> (e4m3fn weight, float32 scale_inv [ceil(out/128), ceil(in/128)])."""
    if w.dim() != 2:
        raise ValueError(f"FP8 block quantisation needs a 2-D weight, got shape {tuple(w.shape)}")
    rows, cols = w.shape
    sr, sc = scale_shape((rows, cols))
    padded = torch.zeros(sr * BLOCK, sc * BLOCK, dtype=torch.float32)
    padded[:rows, :cols] = w.float()
    blocks = padded.view(sr, BLOCK, sc, BLOCK)  # [block_row, r, block_col, c]
    amax = blocks.abs().amax(dim=(1, 3))  # [sr, sc]
    # An all-zero block keeps scale 1 so dequantisation stays exact (0 * 1).
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(sr * BLOCK, sc * BLOCK)[:rows, :cols].contiguous(), scale_inv


def dequantize_fp8_blocks(
    w_fp8: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.bfloat16, name: str = "weight"
) -> torch.Tensor:
    """e4m3 weight + block scales -> `dtype` weight, vectorised per chunk of block rows."""
    if w_fp8.dim() != 2:
        raise ValueError(f"{name}: FP8 weight must be 2-D, got shape {tuple(w_fp8.shape)}")
    rows, cols = w_fp8.shape
    want = scale_shape((rows, cols))
    if tuple(scale_inv.shape) != want:
        raise ValueError(
            f"{name}: weight_scale_inv has shape {tuple(scale_inv.shape)}, expected {want} "
            f"for a {rows}x{cols} weight with {BLOCK}x{BLOCK} blocks"
        )
    # Column-expanded scales, one row per block row: [sr, cols] (small).
    col_scale = scale_inv.float().repeat_interleave(BLOCK, dim=1)[:, :cols]
    out = torch.empty(rows, cols, dtype=dtype)
    block_rows_per_chunk = max(1, _CHUNK_ELEMS // (BLOCK * max(cols, 1)))
    step = block_rows_per_chunk * BLOCK
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        row_scale = col_scale[start // BLOCK : -(-stop // BLOCK)].repeat_interleave(BLOCK, dim=0)
        out[start:stop] = (w_fp8[start:stop].float() * row_scale[: stop - start]).to(dtype)
    return out
