"""What every rank runs next: one model call, planned on rank 0, broadcast.

Rank 0 owns the scheduler, the block manager and all sampling/acceptance
decisions. Before each model call (main-model prefill/decode/verify, or one
draft step) it broadcasts a StepPlan; every rank then makes the same call,
so the tensor/expert-parallel collectives inside the model line up. Tokens
sampled on rank 0 reach the workers as the input_ids of the next plan, so
ranks never diverge.

The plan goes over the wire as one int64 tensor (a header of sizes, then the
arrays), in two broadcasts: its length, then the payload.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mtp_runtime.layers.attention import AttentionMetadata

# Plan kinds.
FORWARD = 1  # run `target` on the batch below
ALLOCATE_CACHE = 2  # allocate `num_blocks` KV-cache blocks (rank 0 sized them)
STOP = 3  # leave the worker loop
KINDS = (FORWARD, ALLOCATE_CACHE, STOP)

# Model call targets.
MAIN = 0  # the main model: prefill, decode, or verify of k drafts
DRAFT = 1  # the MTP draft module
# Where a draft call takes its hidden states from.
HIDDEN_FROM_MAIN = 0  # the last main call's output rows
HIDDEN_FROM_DRAFT = 1  # the last draft call's output rows (draft position 2, 3, ...)

_VERSION = 1
_HEADER = 11  # version, kind, target, hidden_source, num_blocks, B, T, block_size, table entries, hidden rows, logits rows


@dataclass
class StepPlan:
    kind: int = FORWARD
    target: int = MAIN
    seq_ids: list[int] = field(default_factory=list)  # B; for logs and checks only
    input_ids: list[int] = field(default_factory=list)  # T
    positions: list[int] = field(default_factory=list)  # T
    query_start_loc: list[int] = field(default_factory=lambda: [0])  # B+1
    context_lens: list[int] = field(default_factory=list)  # B
    block_tables: list[list[int]] = field(default_factory=list)  # B
    slot_mapping: list[int] = field(default_factory=list)  # T
    block_size: int = 16
    hidden_source: int = HIDDEN_FROM_MAIN
    hidden_rows: list[int] = field(default_factory=list)  # draft only: T rows of the source hidden
    logits_rows: list[int] = field(default_factory=list)  # rows of the output to compute logits for
    num_blocks: int = 0  # ALLOCATE_CACHE only

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"StepPlan.kind {self.kind}: expected one of {KINDS}")
        if self.target not in (MAIN, DRAFT) or self.hidden_source not in (HIDDEN_FROM_MAIN, HIDDEN_FROM_DRAFT):
            raise ValueError(f"StepPlan.target {self.target} / hidden_source {self.hidden_source}: expected 0 or 1")
        if self.kind == ALLOCATE_CACHE and self.num_blocks <= 0:
            raise ValueError(f"StepPlan.num_blocks {self.num_blocks}: an ALLOCATE_CACHE plan needs > 0 blocks")
        if self.kind != FORWARD:
            return
        num_seqs, num_tokens = len(self.seq_ids), len(self.input_ids)
        _expect("positions", self.positions, num_tokens)
        _expect("slot_mapping", self.slot_mapping, num_tokens)
        _expect("query_start_loc", self.query_start_loc, num_seqs + 1)
        _expect("context_lens", self.context_lens, num_seqs)
        _expect("block_tables", self.block_tables, num_seqs)
        if self.query_start_loc[0] != 0 or self.query_start_loc[-1] != num_tokens:
            raise ValueError(f"StepPlan.query_start_loc {self.query_start_loc}: must run from 0 to {num_tokens}")
        if self.target == DRAFT:
            _expect("hidden_rows", self.hidden_rows, num_tokens)
        elif self.hidden_rows:
            raise ValueError("StepPlan.hidden_rows: only a DRAFT call takes hidden rows")
        if any(not 0 <= r < num_tokens for r in self.logits_rows):
            raise ValueError(f"StepPlan.logits_rows {self.logits_rows}: rows must be in 0..{num_tokens - 1}")

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def attention_metadata(self, device: torch.device | str = "cpu") -> AttentionMetadata:
        slots = torch.tensor(self.slot_mapping, dtype=torch.long, device=device)
        return AttentionMetadata(list(self.query_start_loc), list(self.context_lens),
                                 [list(t) for t in self.block_tables], slots, self.block_size)

    def encode(self) -> torch.Tensor:
        """The plan as one int64 tensor."""
        table_lens = [len(t) for t in self.block_tables]
        header = [_VERSION, self.kind, self.target, self.hidden_source, self.num_blocks,
                  len(self.seq_ids), len(self.input_ids), self.block_size, sum(table_lens),
                  len(self.hidden_rows), len(self.logits_rows)]
        flat: list[int] = header + self.seq_ids + self.input_ids + self.positions + self.query_start_loc
        flat += self.context_lens + table_lens + [b for t in self.block_tables for b in t]
        flat += self.slot_mapping + self.hidden_rows + self.logits_rows
        return torch.tensor(flat, dtype=torch.long)

    @classmethod
    def decode(cls, payload: torch.Tensor) -> "StepPlan":
        values = payload.tolist()
        if len(values) < _HEADER or values[0] != _VERSION:
            raise ValueError(f"StepPlan payload: not a version-{_VERSION} plan (ranks running different builds?)")
        _, kind, target, hidden_source, num_blocks, num_seqs, num_tokens, block_size, entries, hidden, logits = \
            values[:_HEADER]
        reader = _Reader(values, _HEADER)
        seq_ids, input_ids, positions = reader.take(num_seqs), reader.take(num_tokens), reader.take(num_tokens)
        query_start_loc, context_lens = reader.take(num_seqs + 1), reader.take(num_seqs)
        table_lens, flat_tables = reader.take(num_seqs), reader.take(entries)
        block_tables, start = [], 0
        for n in table_lens:
            block_tables.append(flat_tables[start:start + n])
            start += n
        plan = cls(kind, target, seq_ids, input_ids, positions, query_start_loc, context_lens, block_tables,
                   reader.take(num_tokens), block_size, hidden_source, reader.take(hidden),
                   reader.take(logits), num_blocks)
        reader.finish()
        return plan


class _Reader:
    def __init__(self, values: list[int], start: int) -> None:
        self.values, self.pos = values, start

    def take(self, n: int) -> list[int]:
        if n < 0 or self.pos + n > len(self.values):
            raise ValueError(f"StepPlan payload: truncated ({len(self.values)} values, need {self.pos + n})")
        out = self.values[self.pos:self.pos + n]
        self.pos += n
        return out

    def finish(self) -> None:
        if self.pos != len(self.values):
            raise ValueError(f"StepPlan payload: {len(self.values) - self.pos} trailing values")


def _expect(name: str, values: list, n: int) -> None:
    if len(values) != n:
        raise ValueError(f"StepPlan.{name}: {len(values)} entries, expected {n}")


def broadcast_plan(plan: StepPlan | None, src: int = 0, group=None) -> StepPlan:
    """On `src` send `plan`; elsewhere pass None and receive it."""
    is_src = dist.get_rank() == src
    if is_src:
        if plan is None:
            raise ValueError("broadcast_plan: the source rank must pass a plan")
        payload = plan.encode()
        length = torch.tensor([payload.numel()], dtype=torch.long)
    else:
        length = torch.zeros(1, dtype=torch.long)
    dist.broadcast(length, src=src, group=group)
    if not is_src:
        payload = torch.empty(int(length.item()), dtype=torch.long)
    dist.broadcast(payload, src=src, group=group)
    return plan if is_src else StepPlan.decode(payload)
