"""Paged cache writes/gathers and causal attention over them."""

from __future__ import annotations

import torch

from mtp_runtime.layers.attention import AttentionMetadata, attend, causal_mask, gather_cache, write_cache


def test_write_then_gather_follows_block_tables():
    cache = torch.zeros(6, 4, 3)  # 6 blocks of 4 slots, 3 values per token
    meta = AttentionMetadata([0, 5, 7], [5, 7], [[4, 1], [0, 5]], torch.tensor([16, 17, 18, 19, 4, 0, 1]), 4)
    # seq 0: 5 new tokens in blocks 4, 1; seq 1: 2 new tokens at positions 5, 6 of blocks 0, 5 ... offsets
    values = torch.arange(7 * 3, dtype=torch.float32).view(7, 3)
    write_cache(cache, values, meta.slot_mapping)
    seqs = list(meta.sequences())
    rows, positions, slots = seqs[0]
    assert rows == slice(0, 5) and positions.tolist() == [0, 1, 2, 3, 4]
    assert slots.tolist() == [16, 17, 18, 19, 4]
    assert torch.equal(gather_cache(cache, slots), values[:5])
    rows, positions, slots = seqs[1]
    assert positions.tolist() == [5, 6] and slots.tolist() == [0, 1, 2, 3, 20, 21, 22]


def test_for_sequence_places_new_tokens_after_the_cached_ones():
    meta = AttentionMetadata.for_sequence(num_cached=6, num_new=3, block_size=4)
    assert meta.slot_mapping.tolist() == [6, 7, 8] and meta.block_tables == [[0, 1, 2]]
    assert meta.context_lens == [9]


def test_attend_is_causal_and_supports_gqa():
    q, k, v = torch.randn(3, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 6)
    allowed = causal_mask(torch.tensor([2, 3, 4]), 5)
    out = attend(q, k, v, allowed, 0.5)
    assert out.shape == (3, 4, 6)
    # query at position 2 (row 0), head 3 uses kv head 1 and keys 0..2 only
    w = torch.softmax((q[0, 3] @ k[:3, 1].T) * 0.5, -1)
    assert torch.allclose(out[0, 3], w @ v[:3, 1], atol=1e-6)
