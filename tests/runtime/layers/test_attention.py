"""Paged cache writes/gathers and causal attention over them."""

from __future__ import annotations

import pytest
import torch

from mtp_runtime.kernels import cpu_gemm
from mtp_runtime.layers.attention import (DECODE_MAX_NEW, AttentionMetadata, RowSelection, attend,
                                         attend_decode_batch, attend_decode_batch_cached, attend_decode_batch_shared,
                                         attend_prompts, attend_prompts_shared, causal_mask, gather_cache, write_cache)

fused_kernel = pytest.mark.skipif(not cpu_gemm.available(), reason="the CPU kernels need x86-64 with AVX2 "
                                  "and a C++ compiler")


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


def _mixed_batch():
    """Three sequences: 1, 3 and 2 new tokens over contexts of 5, 9 and 4 tokens, blocks of 4."""
    tables = [[3, 0], [1, 4, 6], [2]]
    news, ctxs = [1, 3, 2], [5, 9, 4]
    qsl = [0, 1, 4, 6]
    slots = [tables[i][p // 4] * 4 + p % 4 for i in range(3) for p in range(ctxs[i] - news[i], ctxs[i])]
    return AttentionMetadata(qsl, ctxs, tables, torch.tensor(slots), 4)


def _per_sequence(meta, q, keys_cache, values_cache, scale=0.3):
    out = []
    for rows, positions, slots in meta.sequences():
        k, v = gather_cache(keys_cache, slots), gather_cache(values_cache, slots)
        out.append(attend(q[rows], k, v, causal_mask(positions, k.shape[0]), scale))
    return torch.cat(out)


def test_decode_batch_matches_per_sequence_attention_gqa():
    meta = _mixed_batch()
    batch = meta.decode_batch()
    # keys are read whole blocks at a time: the longest context (9) spans 3 blocks of 4
    assert batch.num_seqs == 3 and batch.n == 3 and batch.num_keys == 12
    assert batch.key_blocks.tolist() == [3, 0, 3, 1, 4, 6, 2, 2, 2]
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(7, 4, 2, 8, generator=gen), torch.randn(7, 4, 2, 6, generator=gen)
    q = torch.randn(6, 4, 8, generator=gen)  # 4 query heads over 2 kv heads
    got = attend_decode_batch(batch, q, batch.keys(k_cache), batch.keys(v_cache), 0.3)
    assert torch.allclose(got, _per_sequence(meta, q, k_cache, v_cache), atol=1e-6)


def test_decode_batch_matches_per_sequence_attention_shared_latent():
    meta = _mixed_batch()
    batch = meta.decode_batch()
    gen = torch.Generator().manual_seed(1)
    latent = torch.randn(7, 4, 10, generator=gen)  # value: the first 6 values of the shared key
    q = torch.randn(6, 4, 10, generator=gen)
    got = attend_decode_batch_shared(batch, q, batch.keys(latent), 6, 0.3)
    expected = _per_sequence(meta, q, latent.unsqueeze(2), latent[..., :6].unsqueeze(2))
    assert torch.allclose(got, expected, atol=1e-6)


def test_decode_batch_takes_prompt_chunks_only_where_padding_costs_little():
    assert AttentionMetadata.for_sequence(10, DECODE_MAX_NEW, 4).decode_batch() is not None
    alone = AttentionMetadata.for_sequence(0, 40, 4).decode_batch()  # a prompt prefilled alone: no padding
    assert alone is not None and alone.n == 40 and alone.num_keys == 40
    assert AttentionMetadata.for_sequence(20, 37, 4).decode_batch() is not None  # a later chunk of a prompt

    def step(news, ctx_lens):
        qsl = [0]
        for n in news:
            qsl.append(qsl[-1] + n)
        tables = [list(range(i * 20, i * 20 + -(-c // 4))) for i, c in enumerate(ctx_lens)]
        return AttentionMetadata(qsl, ctx_lens, tables, torch.zeros(qsl[-1], dtype=torch.long), 4)

    assert step([30, 28], [30, 32]).decode_batch() is not None  # two prompts of similar lengths
    # a prompt chunk beside decodes (4 x 40 padded queries for 40 + 3): sequence by sequence
    assert step([40, 1, 1, 1], [40, 60, 61, 62]).decode_batch() is None
    # a short chunk at the end of a long context next to a long one: the padding would more than double
    assert step([40, 17], [40, 100]).decode_batch() is None
    # many prompts at once (more new tokens than graph mode compiles for): sequence by sequence
    assert step([130, 130], [130, 130]).decode_batch() is None
    assert AttentionMetadata.for_sequence(0, 257, 4).decode_batch() is None
    # decode steps always batch, whatever their contexts
    assert step([1, 3, 2], [5, 200, 7]).decode_batch() is not None


def test_decode_batch_of_prompt_chunks_matches_per_sequence_attention():
    # two prompts prefilling together: 9 new tokens of 12 (3 cached), and 8 of 8, blocks of 4
    meta = AttentionMetadata([0, 9, 17], [12, 8], [[5, 1, 0], [3, 6]], torch.arange(17), 4)
    batch = meta.decode_batch()
    assert batch is not None and batch.num_seqs == 2 and batch.n == 9 and batch.num_keys == 12
    gen = torch.Generator().manual_seed(2)
    latent = torch.randn(7, 4, 10, generator=gen)
    q = torch.randn(17, 4, 10, generator=gen)
    got = attend_decode_batch_shared(batch, q, batch.keys(latent), 6, 0.3)
    expected = _per_sequence(meta, q, latent.unsqueeze(2), latent[..., :6].unsqueeze(2))
    assert torch.allclose(got, expected, atol=1e-6)


def test_select_gives_each_row_its_own_position_and_context():
    # sequence 0: 2 cached + 3 new tokens in blocks [7, 2]; sequence 1: 5 cached + 1 new in blocks [4, 9]
    meta = AttentionMetadata([0, 3, 4], [5, 6], [[7, 2], [4, 9]], torch.tensor([30, 31, 8, 37]), 4)
    picked = meta.select([3, 1, 2])  # any order
    assert picked.query_start_loc == [0, 1, 2, 3]
    assert picked.context_lens == [6, 4, 5]  # each row sees its sequence up to its own position
    assert picked.block_tables == [[4, 9], [7, 2], [7, 2]]
    assert picked.slot_mapping.tolist() == [37, 31, 8]
    assert [pos.tolist() for _, pos, _ in picked.sequences()] == [[5], [3], [4]]
    with pytest.raises(ValueError, match="row 4 is not one of the step's 4 tokens"):
        meta.select([4])
    with pytest.raises(ValueError, match="at least one row"):
        RowSelection.of(meta, [])


def _step(news, ctxs, block_size, blocks, seed):
    """Metadata of one step: sequence i brings news[i] tokens and ends at ctxs[i], in scattered blocks."""
    qsl = [0]
    for n in news:
        qsl.append(qsl[-1] + n)
    tables = [[(7 * i + 3 * j + seed) % blocks for j in range(-(-c // block_size))] for i, c in enumerate(ctxs)]
    slots = [t[p // block_size] * block_size + p % block_size for n, c, t in zip(news, ctxs, tables)
             for p in range(c - n, c)]
    return AttentionMetadata(qsl, ctxs, tables, torch.tensor(slots), block_size)


@fused_kernel
@pytest.mark.parametrize("news,ctxs", [([1], [1]), ([1], [9]), ([1, 1, 1], [3, 17, 40]), ([3, 2, 4], [10, 30, 7]),
                                       ([16, 1], [40, 64]), ([40], [40]), ([9, 8], [12, 8])])
def test_the_fused_kernel_matches_per_sequence_attention(news, ctxs):
    """Decode, verify and prompt-chunk steps: each query over its own keys, read in place."""
    meta = _step(news, ctxs, block_size=4, blocks=64, seed=len(news))
    batch = meta.decode_batch()
    gen = torch.Generator().manual_seed(sum(ctxs))
    latent = torch.randn(64, 4, 20, generator=gen)
    q = torch.randn(sum(news), 3, 20, generator=gen)
    got = attend_decode_batch_cached(batch, q, latent, 16, 0.3)
    expected = _per_sequence(meta, q, latent.unsqueeze(2), latent[..., :16].unsqueeze(2))
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(got, attend_decode_batch_shared(batch, q, batch.keys(latent), 16, 0.3),
                               atol=2e-6, rtol=1e-5)


@fused_kernel
@pytest.mark.parametrize("heads,dim,value_dim", [(1, 8, 8), (4, 80, 64), (5, 84, 75), (8, 144, 128)])
def test_the_fused_kernel_takes_any_head_count_and_width(heads, dim, value_dim):
    """Heads beyond whole groups of four, widths beyond whole vectors, values in tiles of 64, 32, 8 and
    a remainder: each against the general path, over several chunks of keys."""
    meta = _step([1, 2], [70, 33], block_size=8, blocks=32, seed=heads)
    gen = torch.Generator().manual_seed(dim)
    latent = torch.randn(32, 8, dim, generator=gen)
    q = torch.randn(3, heads, dim, generator=gen)
    got = attend_decode_batch_cached(meta.decode_batch(), q, latent, value_dim, dim**-0.5)
    expected = _per_sequence(meta, q, latent.unsqueeze(2), latent[..., :value_dim].unsqueeze(2), scale=dim**-0.5)
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=1e-5)


@fused_kernel
def test_a_querys_result_does_not_depend_on_the_rest_of_its_step():
    """The same token decoded alone, beside a longer sequence, or as one of a verify step's rows: the
    same bits (the general path's padded products may round differently with the padding)."""
    gen = torch.Generator().manual_seed(3)
    latent = torch.randn(32, 8, 24, generator=gen)
    q = torch.randn(4, 2, 24, generator=gen)
    alone = _step([1], [37], 8, 32, seed=0)
    table = alone.block_tables[0]
    slot = table[36 // 8] * 8 + 36 % 8
    beside = AttentionMetadata([0, 1, 2], [37, 200 // 8 * 8], [table, list(range(25))],
                               torch.tensor([slot, 199]), 8)
    verify = AttentionMetadata([0, 3], [39], [table + [31]], torch.tensor([slot, 31 * 8 + 5, 31 * 8 + 6]), 8)
    one = attend_decode_batch_cached(alone.decode_batch(), q[:1], latent, 16, 0.25)
    two = attend_decode_batch_cached(beside.decode_batch(), q[:2], latent, 16, 0.25)
    three = attend_decode_batch_cached(verify.decode_batch(), q[:3], latent, 16, 0.25)
    assert torch.equal(one[0], two[0]) and torch.equal(one[0], three[0])


@fused_kernel
def test_the_fused_kernel_refuses_indices_outside_its_tables_and_cache():
    cache = torch.zeros(4, 2, 8)
    q = torch.zeros(1, 1, 2, 8)
    call = cpu_gemm.mla_decode_attention
    with pytest.raises(RuntimeError, match="query 0 at position 4 lies outside its table of 2 blocks of 2"):
        call(q, cache, torch.tensor([[0, 1]]), torch.tensor([[4]]), 8, 1.0)
    with pytest.raises(RuntimeError, match="sequence 0 reads block 9 of 4"):
        call(q, cache, torch.tensor([[0, 9]]), torch.tensor([[3]]), 8, 1.0)
    with pytest.raises(RuntimeError, match="value_dim 9 must lie in 1..8"):
        call(q, cache, torch.tensor([[0, 1]]), torch.tensor([[3]]), 9, 1.0)
    with pytest.raises(RuntimeError, match="q must be a float32 CPU"):
        call(q.double(), cache, torch.tensor([[0, 1]]), torch.tensor([[3]]), 8, 1.0)
    # a block past the query's last position is never read, so it need not exist
    out = call(q, cache, torch.tensor([[0, 99]]), torch.tensor([[1]]), 8, 1.0)
    assert out.shape == (1, 1, 2, 8) and torch.equal(out, torch.zeros_like(out))


def _disjoint_step(news, ctxs, block_size=4):
    """A step of sequences with these new tokens and contexts, each in blocks of its own."""
    qsl, tables, slots = [0], [], []
    for i, (new, ctx) in enumerate(zip(news, ctxs)):
        qsl.append(qsl[-1] + new)
        tables.append(list(range(i * 50, i * 50 + -(-ctx // block_size))))
        slots += [tables[i][p // block_size] * block_size + p % block_size for p in range(ctx - new, ctx)]
    return AttentionMetadata(qsl, ctxs, tables, torch.tensor(slots), block_size)


def test_prompt_batch_takes_whole_prompts_whose_padding_at_most_doubles_their_work():
    # whole prompts of 40, 30 and 20 tokens, a later chunk (20 of 60), a decode, a one-token prompt
    meta = _disjoint_step([40, 20, 30, 1, 20, 1], [40, 60, 30, 70, 20, 1])
    batch = meta.prompt_batch()
    assert batch.seqs == {0, 2} and batch.n == 40  # 30 * 30 * 2 >= 40 * 40 > 20 * 20 * 2
    assert batch.query_rows.tolist() == list(range(40)) + list(range(60, 90)) + [89] * 10
    assert batch.out_rows.tolist() == list(range(40)) + list(range(60, 90))
    assert batch.out_index.tolist() == list(range(40)) + list(range(40, 70))
    assert meta.prompt_batch() is batch  # built once per forward
    rest = [rows for rows, _, _ in meta.sequences(skip=batch)]
    assert rest == [slice(40, 60), slice(90, 91), slice(91, 111), slice(111, 112)]
    assert _disjoint_step([3, 1], [9, 7]).prompt_batch() is None  # nothing prefilled whole: nothing to batch


@pytest.mark.parametrize("shared", [True, False])
def test_prompt_batch_attention_matches_per_sequence_attention(shared):
    meta = _disjoint_step([40, 20, 30, 1, 29, 33], [40, 60, 30, 70, 29, 33])
    batch = meta.prompt_batch()
    assert batch.seqs == {0, 2, 4, 5}  # unequal lengths: padded to 40
    gen = torch.Generator().manual_seed(3)
    tokens = meta.query_start_loc[-1]
    q = torch.randn(tokens, 4, 10, generator=gen)
    if shared:  # MLA: one latent per token, its first 6 values the value
        cache = torch.randn(300, 4, 1, 10, generator=gen)
        latent = torch.randn(tokens, 1, 10, generator=gen)
        write_cache(cache, latent, meta.slot_mapping)
        k_cache, v_cache = cache, cache[..., :6]
        got = attend_prompts_shared(batch, q, latent[:, 0], 6, 0.3)
    else:  # GQA: 4 query heads over 2 kv heads
        k_cache, v_cache = torch.randn(300, 4, 2, 10, generator=gen), torch.randn(300, 4, 2, 6, generator=gen)
        got = attend_prompts(batch, q, gather_cache(k_cache, meta.slot_mapping),
                             gather_cache(v_cache, meta.slot_mapping), 0.3)
    assert got.shape == (4, 40, 4, 6)
    expected = _per_sequence(meta, q, k_cache, v_cache)
    out = torch.full_like(expected, float("nan"))
    batch.scatter(out, got)
    rows = batch.out_rows
    torch.testing.assert_close(out[rows], expected[rows], atol=1e-6, rtol=1e-5)
    others = [r for r in range(tokens) if r not in set(rows.tolist())]
    assert torch.isnan(out[others]).all()  # the others are left for the per-sequence loop
