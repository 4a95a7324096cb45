"""Paged KV cache access and causal attention over it.

A step processes a flattened batch: the new tokens of several sequences, one
after another. Each cache is a tensor [num_blocks, block_size, *per_token_shape];
a sequence's tokens live in the blocks of its block table, in position order.

Two ways to attend: sequence by sequence (`AttentionMetadata.sequences`, for
prefill chunks), or, when every sequence brings only a few new tokens (decode
and verify steps), all sequences at once as a padded batch (`DecodeBatch`):
one gather of every context's keys, one pair of matmuls and one softmax for
the whole step, whatever the number of sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.nn.functional as F

from mtp_runtime.kernels import cpu_gemm


@dataclass
class AttentionMetadata:
    query_start_loc: list[int]  # B+1; tokens of seq i are [qsl[i], qsl[i+1])
    context_lens: list[int]  # B; tokens of seq i in the cache AFTER this step
    block_tables: list[list[int]]  # B; block ids of seq i
    slot_mapping: torch.Tensor  # [T]; block_id * block_size + offset of each new token
    block_size: int
    _sequences: list | None = field(default=None, init=False, repr=False, compare=False)
    _decode_batch: "DecodeBatch | None | bool" = field(default=False, init=False, repr=False, compare=False)
    _prompt_batch: "PromptBatch | None | bool" = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        num_seqs = len(self.context_lens)
        if len(self.query_start_loc) != num_seqs + 1 or len(self.block_tables) != num_seqs:
            raise ValueError(f"AttentionMetadata: {num_seqs} context_lens need {num_seqs + 1} query_start_loc "
                             f"entries and {num_seqs} block_tables, got {len(self.query_start_loc)} and "
                             f"{len(self.block_tables)}")
        if self.slot_mapping.numel() != self.query_start_loc[-1]:
            raise ValueError(f"AttentionMetadata: slot_mapping has {self.slot_mapping.numel()} entries for "
                             f"{self.query_start_loc[-1]} new tokens")
        for i, (ctx, table) in enumerate(zip(self.context_lens, self.block_tables)):
            new = self.query_start_loc[i + 1] - self.query_start_loc[i]
            if new < 0 or new > ctx:
                raise ValueError(f"AttentionMetadata: sequence {i} has {new} new tokens but context_len {ctx}")
            if len(table) * self.block_size < ctx:
                raise ValueError(f"AttentionMetadata: sequence {i} needs {ctx} slots but its block table "
                                 f"holds {len(table)} blocks of {self.block_size}")

    @classmethod
    def for_sequence(cls, num_cached: int, num_new: int, block_size: int = 16,
                     device: torch.device | str = "cpu") -> "AttentionMetadata":
        """One sequence in blocks 0, 1, 2, ...: the plain incremental forward (tests, reference loop)."""
        total = num_cached + num_new
        blocks = list(range(-(-total // block_size)))
        slots = torch.arange(num_cached, total, dtype=torch.long, device=device)
        return cls([0, num_new], [total], [blocks], slots, block_size)

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    def sequences(self, skip: "PromptBatch | None" = None) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor]]:
        """For each sequence (but those of `skip`): (its rows in the flattened batch, positions of its
        new tokens [n], cache slots of its whole context [context_len])."""
        # Built once per forward and shared by every layer (the metadata does not change in between).
        if self._sequences is None:
            self._sequences = list(self._build_sequences())
        skipped = skip.seqs if skip is not None else ()
        return (item for i, *item in self._sequences if i not in skipped)

    def _build_sequences(self) -> Iterator[tuple[int, slice, torch.Tensor, torch.Tensor]]:
        device = self.slot_mapping.device
        for i, ctx in enumerate(self.context_lens):
            start, end = self.query_start_loc[i], self.query_start_loc[i + 1]
            if start == end:
                continue
            positions = torch.arange(ctx - (end - start), ctx, device=device)
            yield i, slice(start, end), positions, self.context_slots(i, device)

    def prompt_batch(self) -> "PromptBatch | None":
        """The sequences that bring their whole context in this step, as one padded batch
        (PromptBatch.build says which), else None. Built once per forward and shared by every layer."""
        if self._prompt_batch is False:
            self._prompt_batch = PromptBatch.build(self)
        return self._prompt_batch

    def decode_batch(self) -> "DecodeBatch | None":
        """The step as a padded batch (DecodeBatch.build says when), else None. Built once per forward
        and shared by every layer."""
        if self._decode_batch is False:
            self._decode_batch = DecodeBatch.build(self)
        return self._decode_batch

    def select(self, rows: list[int]) -> "AttentionMetadata":
        """The metadata of the given rows (of this step's flattened new tokens) alone: each row a
        sequence of one new token, which sees its own sequence's keys up to its position."""
        qsl, num_tokens = self.query_start_loc, self.query_start_loc[-1]
        context_lens, tables = [], []
        seq = 0
        for r in rows:
            if not 0 <= r < num_tokens:
                raise ValueError(f"AttentionMetadata.select: row {r} is not one of the step's {num_tokens} tokens")
            if r < qsl[seq]:
                seq = 0
            while r >= qsl[seq + 1]:
                seq += 1
            context_lens.append(self.context_lens[seq] - (qsl[seq + 1] - r) + 1)
            tables.append(self.block_tables[seq])
        slots = self.slot_mapping.index_select(0, torch.tensor(rows, dtype=torch.long, device=self.slot_mapping.device))
        return AttentionMetadata(list(range(len(rows) + 1)), context_lens, tables, slots, self.block_size)

    def context_slots(self, i: int, device: torch.device | str = "cpu") -> torch.Tensor:
        ctx = self.context_lens[i]
        blocks = torch.tensor(self.block_tables[i][: -(-ctx // self.block_size)], dtype=torch.long, device=device)
        offsets = torch.arange(self.block_size, device=device)
        return (blocks[:, None] * self.block_size + offsets[None, :]).flatten()[:ctx]


@dataclass
class RowSelection:
    """The rows of a forward whose outputs are wanted. Every new token's keys and values are still
    written to the cache, but only these rows attend and go on through the layer (an MTP draft pass
    over the positions a step made final needs the hidden state of each sequence's last one only).
    rows: [R] indices into the forward's flattened tokens (R >= 1); meta: the attention metadata of
    those R tokens alone (their positions and contexts; its cache slots are not written)."""

    rows: torch.Tensor
    meta: "AttentionMetadata"

    @classmethod
    def of(cls, meta: AttentionMetadata, rows: list[int]) -> "RowSelection":
        """The rows `rows` of the step `meta` describes."""
        if not rows:
            raise ValueError("RowSelection: select at least one row")
        return cls(torch.tensor(rows, dtype=torch.long, device=meta.slot_mapping.device), meta.select(rows))


# A step whose sequences bring at most this many new tokens each (decode, verify, drafting) always
# attends as one padded batch; a step with longer chunks (prefill) does when padding at most
# doubles its attention work (PADDED_WORK_LIMIT) and it has at most PADDED_PREFILL_MAX_TOKENS new
# tokens (graph mode compiles for steps up to that size; a larger one would stall on a new graph),
# else sequence by sequence.
DECODE_MAX_NEW = 16
PADDED_WORK_LIMIT = 2.0
PADDED_PREFILL_MAX_TOKENS = 256


@dataclass
class DecodeBatch:
    """B sequences with at most n new tokens each, padded to n queries over L = W * block_size keys.

    Every field is always a tensor (padding and masks that happen to be trivial included), so a
    compiled graph sees one structure for every step and never recompiles for it.
    query_rows: [B * n] rows of the flattened batch to read, padding repeating a real row.
    out_index: [num tokens] position in the padded [B * n] of each flattened row.
    key_blocks: [B * W] cache blocks, each sequence's block table padded to W blocks (with any
        block: the keys past a sequence's context are masked). Keys are read a block at a time.
    blocked: [B, n, 1, L] True where a query must not see a key (padding, later positions).
    q_pos: [B, n] position of each query (padding queries: a real one's); query j of sequence i
        sees the keys at positions 0 .. q_pos[i, j] (what `blocked` says, for kernels that read the
        cache in place through the block tables: kernels/cpu_attention.cpp).
    """

    query_rows: torch.Tensor
    out_index: torch.Tensor
    key_blocks: torch.Tensor
    blocked: torch.Tensor
    q_pos: torch.Tensor

    # B, n and L are read off the mask's shape (not kept as ints) so that a compiled graph treats
    # them as dynamic sizes rather than constants to specialise on.
    @property
    def num_seqs(self) -> int:
        return self.blocked.shape[0]

    @property
    def n(self) -> int:
        return self.blocked.shape[1]

    @property
    def num_keys(self) -> int:
        return self.blocked.shape[3]

    @classmethod
    def build(cls, meta: AttentionMetadata) -> "DecodeBatch | None":
        qsl, ctx_lens = meta.query_start_loc, meta.context_lens
        news = [qsl[i + 1] - qsl[i] for i in range(len(ctx_lens))]
        if not news or min(news) == 0:
            return None
        bs = meta.block_size
        n, width = max(news), -(-max(ctx_lens) // bs)
        if n > DECODE_MAX_NEW and (sum(news) > PADDED_PREFILL_MAX_TOKENS or len(news) * n * width * bs > (
                PADDED_WORK_LIMIT * sum(new * ctx for new, ctx in zip(news, ctx_lens)))):
            return None  # e.g. a prompt chunk beside decodes: most of the padded batch would be padding
        device = meta.slot_mapping.device
        blocks: list[int] = []
        rows: list[int] = []
        index: list[int] = []
        for i, (ctx, new) in enumerate(zip(ctx_lens, news)):
            table = meta.block_tables[i][:-(-ctx // bs)]
            blocks += table + table[:1] * (width - len(table))
            rows += list(range(qsl[i], qsl[i + 1])) + [qsl[i]] * (n - new)
            index += range(i * n, i * n + new)
        key_pos = torch.arange(width * bs, device=device)
        ctx = torch.tensor(ctx_lens, device=device)
        new = torch.tensor(news, device=device)
        # query j of sequence i sits at position ctx_i - new_i + j (padding queries: clamped, unused)
        q_pos = torch.minimum((ctx - new)[:, None] + torch.arange(n, device=device)[None, :], (ctx - 1)[:, None])
        blocked = (key_pos[None, None, :] > q_pos[:, :, None]).unsqueeze(2)  # [B, n, 1, L]
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
        return cls(as_tensor(rows), as_tensor(index), as_tensor(blocks), blocked, q_pos)

    def queries(self, q: torch.Tensor) -> torch.Tensor:
        """Flattened [T, *shape] -> padded [B, n, *shape]."""
        return q.index_select(0, self.query_rows).view(self.num_seqs, self.n, *q.shape[1:])

    def outputs(self, out: torch.Tensor) -> torch.Tensor:
        """Padded [B, n, *shape] -> flattened [T, *shape] (padding rows dropped)."""
        return out.reshape(self.num_seqs * self.n, *out.shape[2:]).index_select(0, self.out_index)

    def keys(self, cache: torch.Tensor) -> torch.Tensor:
        """Every sequence's context from a paged cache: [B, L, *per_token_shape]."""
        return cache.index_select(0, self.key_blocks).view(self.num_seqs, self.num_keys, *cache.shape[2:])

    def softmax(self, scores: torch.Tensor, grouped: bool = False) -> torch.Tensor:
        """scores [B, n, heads, L] (grouped: [B, Hk, n, g, L]) -> probabilities, blocked keys at
        zero; float32 statistics whatever the working dtype."""
        blocked = self.blocked.view(self.num_seqs, 1, self.n, 1, self.num_keys) if grouped else self.blocked
        return _softmax(scores.masked_fill(blocked, float("-inf")))


@dataclass
class PromptBatch:
    """The sequences of a step that bring their whole context (a prompt prefilled in one chunk:
    nothing of it was cached before), padded to n queries each, for steps that attend sequence by
    sequence (prompt chunks too long for a DecodeBatch). Their keys are their own new tokens in order,
    so one causal mask serves all of them: the padding (a sequence's last row repeated) comes after
    every real query of its sequence, which therefore never sees it. Attending them together is one
    pair of matmuls and one softmax per layer instead of a masked attention per sequence.

    A sequence joins only if padding it to n at most doubles its attention work (n_i >= n / sqrt(2),
    PADDED_WORK_LIMIT); the others, and those with cached context, attend on their own.
    seqs: indices (in the step) of the sequences in the batch.
    query_rows: [B * n] rows of the flattened batch, per sequence, padding repeating its last row.
    out_rows: [R] rows of the flattened batch the batch computes; out_index: [R] their positions in
        the padded [B * n].
    blocked: [n, n] True where query i must not see key j (j > i).
    """

    seqs: frozenset[int]
    query_rows: torch.Tensor
    out_rows: torch.Tensor
    out_index: torch.Tensor
    blocked: torch.Tensor

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    @property
    def n(self) -> int:
        return self.blocked.shape[0]

    @classmethod
    def build(cls, meta: AttentionMetadata) -> "PromptBatch | None":
        qsl = meta.query_start_loc
        whole = {i: ctx for i, ctx in enumerate(meta.context_lens) if ctx > 1 and qsl[i + 1] - qsl[i] == ctx}
        if not whole:
            return None
        n = max(whole.values())
        joined = sorted(i for i, new in whole.items() if new * new * PADDED_WORK_LIMIT >= n * n)
        rows: list[int] = []
        out_rows: list[int] = []
        out_index: list[int] = []
        for b, i in enumerate(joined):
            start, new = qsl[i], whole[i]
            rows += list(range(start, start + new)) + [start + new - 1] * (n - new)
            out_rows += range(start, start + new)
            out_index += range(b * n, b * n + new)
        device = meta.slot_mapping.device
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
        blocked = torch.ones(n, n, dtype=torch.bool, device=device).triu_(1)
        return cls(frozenset(joined), as_tensor(rows), as_tensor(out_rows), as_tensor(out_index), blocked)

    def padded(self, x: torch.Tensor) -> torch.Tensor:
        """Flattened [T, *shape] -> [B, n, *shape]."""
        return x.index_select(0, self.query_rows).view(self.num_seqs, self.n, *x.shape[1:])

    def scatter(self, out: torch.Tensor, padded: torch.Tensor) -> None:
        """Write the real rows of padded [B, n, *shape] into the flattened `out` [T, *shape]."""
        flat = padded.reshape(self.num_seqs * self.n, *padded.shape[2:])
        out.index_copy_(0, self.out_rows, flat.index_select(0, self.out_index).to(out.dtype))


def attend_prompts_shared(batch: PromptBatch, q: torch.Tensor, kv: torch.Tensor, value_dim: int,
                          scale: float) -> torch.Tensor:
    """One key shared by every head (MLA's latent): q [T, H, D] and kv [T, D] (the step's rows,
    flattened) -> [B, n, H, value_dim] (padded; PromptBatch.scatter keeps the real rows)."""
    b, n, heads = batch.num_seqs, batch.n, q.shape[1]
    keys = batch.padded(kv)  # [B, n, D]
    scores = torch.bmm(batch.padded(q).view(b, n * heads, q.shape[-1]), keys.transpose(1, 2))
    scores = scores.mul_(scale).view(b, n, heads, n).masked_fill_(batch.blocked[None, :, None, :], float("-inf"))
    probs = _softmax(scores).view(b, n * heads, n)
    return torch.bmm(probs, keys[..., :value_dim]).view(b, n, heads, value_dim)


def attend_prompts(batch: PromptBatch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """q [T, H, D], k [T, Hk, D], v [T, Hk, Dv] (the step's rows, flattened; Hk divides H)
    -> [B, n, H, Dv] (padded)."""
    qp, kp, vp = (batch.padded(x).transpose(1, 2) for x in (q, k, v))  # [B, heads, n, D]
    out = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale,
                                         enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2)


def _softmax(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension with float32 statistics whatever the working dtype."""
    if scores.dtype == torch.float32:
        return torch.softmax(scores, dim=-1)
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)


def attend_decode_batch(batch: DecodeBatch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """q [T, H, D] (flattened), k [B, L, Hk, D], v [B, L, Hk, Dv] -> [T, H, Dv]. Hk divides H (GQA)."""
    b, n, heads, kv_heads, keys = batch.num_seqs, batch.n, q.shape[1], k.shape[2], batch.num_keys
    group = heads // kv_heads
    qp = batch.queries(q).view(b, n, kv_heads, group, q.shape[-1]).transpose(1, 2)  # [B, Hk, n, g, D]
    qp = qp.reshape(b * kv_heads, n * group, q.shape[-1])
    kt = k.permute(0, 2, 3, 1).reshape(b * kv_heads, k.shape[-1], keys)  # [B*Hk, D, L]
    scores = torch.bmm(qp, kt).mul_(scale).view(b, kv_heads, n, group, keys)
    probs = batch.softmax(scores, grouped=True).view(b * kv_heads, n * group, keys)
    vv = v.transpose(1, 2).reshape(b * kv_heads, keys, v.shape[-1])
    out = torch.bmm(probs, vv).view(b, kv_heads, n, group, v.shape[-1]).transpose(1, 2)  # [B, n, Hk, g, Dv]
    return batch.outputs(out.reshape(b, n, heads, v.shape[-1]))


def attend_decode_batch_cached(batch: DecodeBatch, q: torch.Tensor, cache: torch.Tensor, value_dim: int,
                               scale: float) -> torch.Tensor:
    """attend_decode_batch_shared over a paged cache [blocks, block_size, D]: on the fused CPU kernel
    (kernels/cpu_attention.cpp: each query reads its own keys in place, online softmax) where it runs,
    else by gathering every sequence's context first."""
    if cpu_gemm.fused_attention(q, cache):
        tables = batch.key_blocks.view(batch.num_seqs, -1)
        out = cpu_gemm.mla_decode_attention(batch.queries(q), cache, tables, batch.q_pos, value_dim, scale)
        return batch.outputs(out)
    return attend_decode_batch_shared(batch, q, batch.keys(cache), value_dim, scale)


def attend_decode_batch_shared(batch: DecodeBatch, q: torch.Tensor, kv: torch.Tensor, value_dim: int,
                               scale: float) -> torch.Tensor:
    """One key shared by every head (MLA's latent, MQA): q [T, H, D], kv [B, L, D] whose first
    value_dim values are the value -> [T, H, value_dim]."""
    b, n, heads = batch.num_seqs, batch.n, q.shape[1]
    qp = batch.queries(q).reshape(b, n * heads, q.shape[-1])
    scores = torch.bmm(qp, kv.transpose(1, 2)).mul_(scale).view(b, n, heads, batch.num_keys)
    probs = batch.softmax(scores).view(b, n * heads, batch.num_keys)
    out = torch.bmm(probs, kv[..., :value_dim])  # [B, n*H, Dv]
    return batch.outputs(out.view(b, n, heads, value_dim))


def write_cache(cache: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store each new token's values at its slot. cache [num_blocks, block_size, *shape], values [T, *shape]."""
    flat = cache.view(-1, *cache.shape[2:])
    flat.index_copy_(0, slot_mapping, values.to(cache.dtype))


def gather_cache(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Values of the given slots, in order: [len(slots), *shape]."""
    return cache.view(-1, *cache.shape[2:]).index_select(0, slots)


def causal_mask(query_positions: torch.Tensor, num_keys: int) -> torch.Tensor:
    """[n, num_keys] bool: the key at position j is visible to a query at position p when j <= p."""
    keys = torch.arange(num_keys, device=query_positions.device)
    return keys[None, :] <= query_positions[:, None]


def query_rows(q: torch.Tensor, mask: torch.Tensor | None, first: int, num_keys: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Training attention for the query rows from `first` on, over all `num_keys` keys:
    q [B, S, heads, d] -> [B, S - first, heads, d]; mask [..., S, S] -> [..., S - first, S]
    (None, causal: made explicit, since a causal flag would align the rows from the top)."""
    if not first:
        return q, mask
    if mask is None:
        mask = causal_mask(torch.arange(first, num_keys, device=device), num_keys)
    else:
        mask = mask[..., first:, :]
    return q[:, first:], mask


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None,
           scale: float) -> torch.Tensor:
    """q [n, H, D], k [L, Hk, D], v [L, Hk, Dv], allowed [n, L] (None: every key) -> [n, H, Dv].
    Hk divides H (GQA/MQA)."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        attn_mask=allowed, scale=scale, enable_gqa=k.shape[1] != q.shape[1],
    )
    return out.transpose(0, 1)
