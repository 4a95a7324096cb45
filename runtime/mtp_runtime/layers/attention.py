"""Paged KV cache access and causal attention over it.

A step processes a flattened batch: the new tokens of several sequences, one
after another. Each cache is a tensor [num_blocks, block_size, *per_token_shape];
a sequence's tokens live in the blocks of its block table, in position order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    query_start_loc: list[int]  # B+1; tokens of seq i are [qsl[i], qsl[i+1])
    context_lens: list[int]  # B; tokens of seq i in the cache AFTER this step
    block_tables: list[list[int]]  # B; block ids of seq i
    slot_mapping: torch.Tensor  # [T]; block_id * block_size + offset of each new token
    block_size: int
    _sequences: list | None = field(default=None, init=False, repr=False, compare=False)

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

    def sequences(self) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor]]:
        """For each sequence: (its rows in the flattened batch, positions of its new tokens [n],
        cache slots of its whole context [context_len])."""
        # Built once per forward and shared by every layer (the metadata does not change in between).
        if self._sequences is None:
            self._sequences = list(self._build_sequences())
        return iter(self._sequences)

    def _build_sequences(self) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor]]:
        device = self.slot_mapping.device
        for i, ctx in enumerate(self.context_lens):
            start, end = self.query_start_loc[i], self.query_start_loc[i + 1]
            if start == end:
                continue
            positions = torch.arange(ctx - (end - start), ctx, device=device)
            yield slice(start, end), positions, self.context_slots(i, device)

    def context_slots(self, i: int, device: torch.device | str = "cpu") -> torch.Tensor:
        ctx = self.context_lens[i]
        blocks = torch.tensor(self.block_tables[i][: -(-ctx // self.block_size)], dtype=torch.long, device=device)
        offsets = torch.arange(self.block_size, device=device)
        return (blocks[:, None] * self.block_size + offsets[None, :]).flatten()[:ctx]


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


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None,
           scale: float) -> torch.Tensor:
    """q [n, H, D], k [L, Hk, D], v [L, Hk, Dv], allowed [n, L] (None: every key) -> [n, H, Dv].
    Hk divides H (GQA/MQA)."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        attn_mask=allowed, scale=scale, enable_gqa=k.shape[1] != q.shape[1],
    )
    return out.transpose(0, 1)
