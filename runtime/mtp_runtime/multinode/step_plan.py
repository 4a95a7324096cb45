"""What every rank runs next: one model call, planned on rank 0, broadcast.

Rank 0 owns the scheduler, the block manager and all sampling/acceptance
decisions. Before each model call (main-model prefill/decode/verify, or one
draft step) it broadcasts a StepPlan; every rank then makes the same call,
so the tensor/expert-parallel collectives inside the model line up. Tokens
sampled on rank 0 reach the workers as the input_ids of the next plan, so
ranks never diverge.

The plan goes over the wire as one int64 tensor (a header of sizes, then the
arrays) in one fixed-size broadcast that also carries its length; a plan too
big for it sends the remainder in a second one. A hidden-state
input the workers do not already hold (rows rank 0 gathered itself) follows
as a third broadcast; rows of the last main or draft output are named by
index instead, since every rank holds the same output after the all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mtp_runtime.layers.attention import AttentionMetadata

# Plan kinds.
FORWARD = 1  # run `target` on the batch below
LOGITS = 2  # compute `target`'s logits for some hidden rows
ALLOCATE_CACHE = 3  # (re)allocate `target`'s KV cache with `num_blocks` blocks (rank 0 sized it)
STOP = 4  # leave the worker loop
KINDS = (FORWARD, LOGITS, ALLOCATE_CACHE, STOP)

# Model call targets.
MAIN = 0  # the main model: prefill, decode, or verify of k drafts
DRAFT = 1  # the MTP draft module
# Where a draft forward or a logits call takes its hidden states from.
HIDDEN_FROM_MAIN = 0  # rows `hidden_rows` of the last main forward's output (workers hold it)
HIDDEN_FROM_DRAFT = 1  # rows of the last draft forward's output (draft position 2, 3, ...)
HIDDEN_SENT = 2  # a float32 [hidden_count, hidden_size] tensor follows the plan
HIDDEN_SOURCES = (HIDDEN_FROM_MAIN, HIDDEN_FROM_DRAFT, HIDDEN_SENT)

# Dtypes a plan can name (hidden tensors sent, caches allocated).
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_VERSION = 4
PLAN_CAPACITY = 4096  # int64 slots in a plan's first broadcast (32 KiB)
_HEADER = 14  # version, kind, target, hidden_source, num_blocks, B, T, block_size, table entries,
#               hidden rows, hidden size, selected rows, the step's k, keys only


@dataclass
class StepPlan:
    kind: int = FORWARD
    target: int = MAIN
    input_ids: list[int] = field(default_factory=list)  # T
    positions: list[int] = field(default_factory=list)  # T
    query_start_loc: list[int] = field(default_factory=lambda: [0])  # B+1
    context_lens: list[int] = field(default_factory=list)  # B
    block_tables: list[list[int]] = field(default_factory=list)  # B
    slot_mapping: list[int] = field(default_factory=list)  # T
    block_size: int = 16
    hidden_source: int = HIDDEN_FROM_MAIN
    hidden_rows: list[int] = field(default_factory=list)  # FROM_MAIN/FROM_DRAFT: rows of that output
    hidden_count: int = 0  # SENT: rows of the tensor that follows
    hidden_size: int = 0  # SENT: its width
    num_blocks: int = 0  # ALLOCATE_CACHE only
    dtype: torch.dtype = torch.float32  # SENT hidden's working dtype; ALLOCATE_CACHE's cache dtype
    # A draft FORWARD whose output is these rows only (MtpDraft.forward_selected); empty: every row.
    select_rows: list[int] = field(default_factory=list)
    # The k rank 0 chose for the step this call belongs to (adaptive depth picks it every step; the
    # shapes of the calls follow from it); -1 for calls outside a step (cache plans, STOP).
    num_speculative_tokens: int = -1
    keys_only: bool = False  # a draft FORWARD that only writes its keys (MtpDraft.write_keys: keys left out at k = 0)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"StepPlan.dtype {self.dtype}: expected one of {DTYPES}")
        if self.kind not in KINDS:
            raise ValueError(f"StepPlan.kind {self.kind}: expected one of {KINDS}")
        if self.target not in (MAIN, DRAFT):
            raise ValueError(f"StepPlan.target {self.target}: expected {MAIN} (main) or {DRAFT} (draft)")
        if self.hidden_source not in HIDDEN_SOURCES:
            raise ValueError(f"StepPlan.hidden_source {self.hidden_source}: expected one of {HIDDEN_SOURCES}")
        if self.kind == ALLOCATE_CACHE and (self.num_blocks <= 0 or self.block_size <= 0):
            raise ValueError(f"StepPlan.num_blocks {self.num_blocks} / block_size {self.block_size}: an "
                             f"ALLOCATE_CACHE plan needs both > 0")
        if self.kind == FORWARD:
            self._validate_batch()
        if self.keys_only and (self.kind != FORWARD or self.target != DRAFT or self.select_rows):
            raise ValueError("StepPlan.keys_only: only a draft forward over every row writes keys only")
        if self.num_speculative_tokens < -1:
            raise ValueError(f"StepPlan.num_speculative_tokens {self.num_speculative_tokens}: expected -1 or k >= 0")
        if self.select_rows:
            if self.kind != FORWARD or self.target != DRAFT:
                raise ValueError("StepPlan.select_rows: only a draft forward selects rows")
            bad = [r for r in self.select_rows if not 0 <= r < self.num_tokens]
            if bad:
                raise ValueError(f"StepPlan.select_rows {bad}: not rows of the forward's {self.num_tokens} tokens")
        if self.takes_hidden:
            self._validate_hidden()

    def _validate_batch(self) -> None:
        num_seqs, num_tokens = len(self.context_lens), len(self.input_ids)
        _expect("positions", self.positions, num_tokens)
        _expect("slot_mapping", self.slot_mapping, num_tokens)
        _expect("query_start_loc", self.query_start_loc, num_seqs + 1)
        _expect("block_tables", self.block_tables, num_seqs)
        if self.query_start_loc[0] != 0 or self.query_start_loc[-1] != num_tokens:
            raise ValueError(f"StepPlan.query_start_loc {self.query_start_loc}: must run from 0 to {num_tokens}")

    def _validate_hidden(self) -> None:
        rows = self.num_tokens if self.kind == FORWARD else None
        if self.hidden_source == HIDDEN_SENT:
            if self.hidden_rows or self.hidden_count < 0 or self.hidden_size <= 0:
                raise ValueError(f"StepPlan.hidden_count {self.hidden_count} / hidden_size {self.hidden_size}: a "
                                 f"sent hidden tensor needs a size > 0 and no hidden_rows")
            if rows is not None and self.hidden_count != rows:
                raise ValueError(f"StepPlan.hidden_count {self.hidden_count}: the draft forward has {rows} tokens")
        elif rows is not None:
            _expect("hidden_rows", self.hidden_rows, rows)
        if any(r < 0 for r in self.hidden_rows):
            raise ValueError(f"StepPlan.hidden_rows {self.hidden_rows}: rows must be >= 0")

    @property
    def takes_hidden(self) -> bool:
        """A draft forward and a logits call both read hidden rows; a main forward does not."""
        return self.kind == LOGITS or (self.kind == FORWARD and self.target == DRAFT)

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
                  len(self.context_lens), len(self.input_ids), self.block_size, sum(table_lens),
                  len(self.hidden_rows), self.hidden_size, len(self.select_rows), self.num_speculative_tokens,
                  int(self.keys_only)]
        flat: list[int] = header + [self.hidden_count, DTYPES.index(self.dtype)] + self.input_ids + self.positions + self.query_start_loc
        flat += self.context_lens + table_lens + [b for t in self.block_tables for b in t]
        flat += self.slot_mapping + self.hidden_rows + self.select_rows
        return torch.tensor(flat, dtype=torch.long)

    @classmethod
    def decode(cls, payload: torch.Tensor) -> "StepPlan":
        values = payload.tolist()
        if len(values) < _HEADER + 1 or values[0] != _VERSION:
            raise ValueError(f"StepPlan payload: not a version-{_VERSION} plan (ranks running different builds?)")
        _, kind, target, hidden_source, num_blocks, num_seqs, num_tokens, block_size, entries, rows, width, \
            selected, step_k, keys_only = values[:_HEADER]
        reader = _Reader(values, _HEADER)
        hidden_count, dtype_code = reader.take(2)
        if not 0 <= dtype_code < len(DTYPES):
            raise ValueError(f"StepPlan payload: unknown dtype code {dtype_code}")
        input_ids, positions = reader.take(num_tokens), reader.take(num_tokens)
        query_start_loc, context_lens = reader.take(num_seqs + 1), reader.take(num_seqs)
        table_lens, flat_tables = reader.take(num_seqs), reader.take(entries)
        block_tables, start = [], 0
        for n in table_lens:
            block_tables.append(flat_tables[start:start + n])
            start += n
        plan = cls(kind, target, input_ids, positions, query_start_loc, context_lens, block_tables,
                   reader.take(num_tokens), block_size, hidden_source, reader.take(rows), hidden_count,
                   width, num_blocks, DTYPES[dtype_code], reader.take(selected), step_k, bool(keys_only))
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


def broadcast_plan(plan: StepPlan | None, hidden: torch.Tensor | None = None, src: int = 0,
                   group=None) -> tuple[StepPlan, torch.Tensor | None]:
    """On `src` send `plan` (and `hidden` when plan.hidden_source is SENT); elsewhere pass
    None and receive them. Returns (plan, sent hidden as float32 or None)."""
    is_src = dist.get_rank() == src
    # One fixed-size broadcast carries the length and, for all but huge batches, the whole plan.
    first = torch.zeros(PLAN_CAPACITY, dtype=torch.long)
    if is_src:
        if plan is None:
            raise ValueError("broadcast_plan: the source rank must pass a plan")
        payload = plan.encode()
        first[0] = payload.numel()
        head = payload[: PLAN_CAPACITY - 1]
        first[1:1 + head.numel()] = head
    dist.broadcast(first, src=src, group=group)
    length = int(first[0])
    if length > PLAN_CAPACITY - 1:
        rest = payload[PLAN_CAPACITY - 1:] if is_src else torch.empty(length - PLAN_CAPACITY + 1, dtype=torch.long)
        dist.broadcast(rest, src=src, group=group)
        if not is_src:
            payload = torch.cat([first[1:], rest])
    elif not is_src:
        payload = first[1:1 + length]
    if not is_src:
        plan = StepPlan.decode(payload)
    if plan.takes_hidden and plan.hidden_source == HIDDEN_SENT:
        shape = (plan.hidden_count, plan.hidden_size)
        if is_src:
            if hidden is None or tuple(hidden.shape) != shape:
                raise ValueError(f"broadcast_plan: the plan announces hidden {shape}, got "
                                 f"{None if hidden is None else tuple(hidden.shape)}")
            # On the host: on accelerators plans travel through a gloo side group (serve_group.py).
            hidden = hidden.detach().float().cpu().contiguous()
        else:
            hidden = torch.empty(shape, dtype=torch.float32)
        dist.broadcast(hidden, src=src, group=group)
        return plan, hidden
    return plan, None
