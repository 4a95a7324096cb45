"""BlockManager: allocation, reference counts, prefix cache hits and eviction."""

import pytest

from mtp_runtime.engine.block_manager import BlockManager
from mtp_runtime.engine.sequence import Sequence
from mtp_runtime.sampling_params import SamplingParams


def make_seq(tokens, max_tokens=4):
    return Sequence("r", list(tokens), SamplingParams(max_tokens=max_tokens), max_model_len=1000)


def test_reserve_and_free_return_every_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(range(10))
    assert bm.can_reserve(seq, 10)
    bm.reserve(seq, 10)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    bm.reserve(seq, 12)  # still fits in 3 blocks
    assert len(seq.block_table) == 3
    bm.reserve(seq, 13)
    assert len(seq.block_table) == 4
    bm.free(seq)
    assert bm.num_free_blocks == 8 and seq.block_table == []
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_reserve_beyond_capacity_raises_clearly():
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = make_seq(range(3))
    assert not bm.can_reserve(seq, 9)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.reserve(seq, 9)


def test_bad_sizes_are_rejected():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(num_blocks=0, block_size=4)


def finish_and_register(bm, seq, num_tokens):
    bm.reserve(seq, num_tokens)
    seq.num_cached_tokens = num_tokens
    bm.register_full_blocks(seq, num_tokens)


def test_prefix_hit_shares_blocks_and_keeps_one_token_uncached():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_cache=True)
    a = make_seq(range(12))
    finish_and_register(bm, a, 12)
    b = make_seq(list(range(12)))  # identical prompt: the last token must still be computed
    hits = bm.prefix_hits(b)
    assert hits == a.block_table[:2]
    bm.take_prefix(b, hits)
    assert b.num_cached_tokens == 8
    assert all(bm.blocks[i].ref_count == 2 for i in hits)
    c = make_seq(list(range(9)) + [99, 98, 97, 96])  # diverges inside block 2
    assert bm.prefix_hits(c) == a.block_table[:2]
    d = make_seq([5] + list(range(1, 12)))  # diverges in block 0
    assert bm.prefix_hits(d) == []


def test_freed_blocks_stay_hittable_until_reused():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_cache=True)
    a = make_seq(range(9))
    finish_and_register(bm, a, 8)
    table = list(a.block_table)
    bm.free(a)
    b = make_seq(range(9))
    hits = bm.prefix_hits(b)
    assert hits == table[:2]
    # Reviving a freed block consumes a free-list entry.
    assert bm.free_blocks_needed(b, 9, hits) == 1 + 2
    bm.take_prefix(b, hits)
    bm.reserve(b, 9)
    assert bm.num_free_blocks == 1
    bm.free(b)
    # Hand every block out fresh: the old hashes are gone.
    c = make_seq([7] * 16)
    bm.reserve(c, 16)
    assert bm.hash_to_block_id == {}
    bm.free(c)
    assert bm.prefix_hits(make_seq(range(9))) == []


def test_mtp_keys_cover_the_next_token():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_cache=True, lookahead=1)
    a = make_seq(range(12))
    finish_and_register(bm, a, 12)
    # Block 2 ends the sequence: its next token is unknown, so it is not published.
    assert [bm.blocks[i].hash != -1 for i in a.block_table] == [True, True, False]
    assert bm.prefix_hits(make_seq(range(13))) == a.block_table[:2]
    # Same block 1 tokens but a different token after it: the draft entry at
    # position 7 would be stale, so block 1 must not hit.
    assert bm.prefix_hits(make_seq(list(range(8)) + [50, 51, 52])) == a.block_table[:1]


def test_register_only_final_blocks_and_no_duplicates():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_cache=True)
    a = make_seq(range(10))
    bm.reserve(a, 10)
    bm.register_full_blocks(a, 7)  # only block 0 is final
    assert [bm.blocks[i].hash != -1 for i in a.block_table] == [True, False, False]
    b = make_seq(range(10))
    bm.reserve(b, 10)  # computed the same prefix without a hit
    bm.register_full_blocks(b, 8)
    assert bm.blocks[b.block_table[0]].hash == -1  # a's block keeps the entry
    assert bm.blocks[b.block_table[1]].hash != -1


def test_prefix_cache_off_never_hits():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_cache=False)
    a = make_seq(range(10))
    finish_and_register(bm, a, 8)
    assert bm.prefix_hits(make_seq(range(10))) == []
