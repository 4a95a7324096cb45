"""RoPE tables (plain and YaRN) against transformers' own rope parameter functions."""

from __future__ import annotations

import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from mtp_runtime.layers.rotary_embedding import RotaryEmbedding, apply_rope_halves, apply_rope_interleaved

YARN = dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
            mscale=1.0, mscale_all_dim=1.0, rope_theta=10000.0)


def test_yarn_matches_transformers():
    config = transformers.DeepseekV3Config(qk_rope_head_dim=64, max_position_embeddings=163840,
                                           rope_parameters=dict(YARN))
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    ours = RotaryEmbedding(64, 10000.0, {k: v for k, v in YARN.items() if k not in ("rope_type", "rope_theta")})
    assert torch.allclose(ours.inv_freq, inv_freq, rtol=1e-6, atol=0)
    assert abs(ours.attention_factor - factor) < 1e-9
    # mscale != mscale_all_dim changes the cos/sin factor
    scaled = RotaryEmbedding(64, 10000.0, dict(YARN, mscale=0.707))
    config.rope_parameters = dict(YARN, mscale=0.707)
    assert abs(scaled.attention_factor - ROPE_INIT_FUNCTIONS["yarn"](config)[1]) < 1e-9


def test_rotations_preserve_norm_and_relative_position():
    rope = RotaryEmbedding(16, 10000.0)
    q, k = torch.randn(1, 2, 16), torch.randn(1, 2, 16)
    for apply in (apply_rope_interleaved, apply_rope_halves):
        def score(pq: int, pk: int) -> torch.Tensor:
            cq, sq = rope(torch.tensor([pq]))
            ck, sk = rope(torch.tensor([pk]))
            return (apply(q, cq, sq) * apply(k, ck, sk)).sum(-1)

        cos, sin = rope(torch.tensor([7]))
        assert torch.allclose(apply(q, cos, sin).norm(dim=-1), q.norm(dim=-1), atol=1e-5)
        assert torch.allclose(score(3, 1), score(12, 10), atol=1e-5)  # depends on pq - pk only
        assert not torch.allclose(score(3, 1), score(3, 2), atol=1e-3)


def test_partial_rotation_leaves_the_rest():
    rope = RotaryEmbedding(8, 10000.0)
    x = torch.randn(3, 2, 16)
    cos, sin = rope(torch.arange(3))
    out = apply_rope_halves(x, cos, sin)
    assert torch.equal(out[..., 8:], x[..., 8:]) and not torch.allclose(out[1:, :, :8], x[1:, :, :8])
