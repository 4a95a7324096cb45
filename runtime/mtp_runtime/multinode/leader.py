"""Rank 0's side of lockstep: model wrappers that broadcast each call first.

The engine on rank 0 keeps calling `model(...)`, `draft(...)` and
`.compute_logits(...)` exactly as in a single process; the wrappers turn each
call into a StepPlan, broadcast it, then run the real module, so the workers
(`run_worker`) make the same call with the same shapes and the collectives
inside the model line up. The engine needs no multi-node code of its own.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from mtp_runtime.layers.attention import AttentionMetadata, RowSelection
from mtp_runtime.multinode.step_plan import (
    ALLOCATE_CACHE,
    DRAFT,
    FORWARD,
    HIDDEN_FROM_DRAFT,
    HIDDEN_FROM_MAIN,
    HIDDEN_SENT,
    LOGITS,
    MAIN,
    STOP,
    StepPlan,
    broadcast_plan,
)


class TrackedOutput(torch.Tensor):
    """A main/draft output as rank 0's engine sees it: indexing it with a row
    tensor (`hidden[rows]`, a copy) returns a plain tensor that remembers which
    rows of which output it holds, so the workers can take those rows from
    their own copy instead of receiving them. Other ops give plain tensors."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __getitem__(self, index: Any) -> torch.Tensor:
        out = super().__getitem__(index).as_subclass(torch.Tensor)
        if isinstance(index, torch.Tensor) and index.dim() == 1 and index.dtype == torch.long and out.dim() == 2:
            out._mtp_rows = (self._mtp_target, self, index.tolist())
        return out


class LockstepLeader:
    """What rank 0 shares between its main-model and draft wrappers."""

    def __init__(self, group=None) -> None:
        self.group = group
        self.last_output: dict[int, torch.Tensor | None] = {MAIN: None, DRAFT: None}
        self.cache_ids: dict[int, tuple | None] = {MAIN: None, DRAFT: None}
        self.plans_sent = 0
        self.hidden_rows_sent = 0  # rows rank 0 had to send because workers could not name them
        self.step_k = -1  # the k of the step in progress, written into its main forward's plan

    def begin_step(self, k: int) -> None:
        """The engine's runner starts a step at depth k (ModelRunner.on_step)."""
        self.step_k = k

    def send(self, plan: StepPlan, hidden: torch.Tensor | None = None) -> None:
        broadcast_plan(plan, hidden, group=self.group)
        self.plans_sent += 1

    def stop_workers(self) -> None:
        self.send(StepPlan(kind=STOP))

    def hidden_source(self, hidden: torch.Tensor) -> tuple[int, list[int]]:
        """(source, rows) when `hidden` holds rows of the last main/draft output, so the
        workers can take them from their own copy; else (HIDDEN_SENT, [])."""
        sources = {MAIN: HIDDEN_FROM_MAIN, DRAFT: HIDDEN_FROM_DRAFT}
        tracked = getattr(hidden, "_mtp_rows", None)
        if tracked is not None:
            target, base, rows = tracked
            # Only rows of the LATEST output of that module: that is the copy the workers hold.
            if base is self.last_output[target] and rows and min(rows) >= 0 and max(rows) < base.shape[0]:
                return sources[target], rows
        for target, source in sources.items():
            rows = _row_range_of(hidden, self.last_output[target])
            if rows is not None:
                return source, rows
        return HIDDEN_SENT, []

    def wrap(self, module: nn.Module, target: int) -> "BroadcastingModule":
        return BroadcastingModule(module, target, self)


def _row_range_of(view: torch.Tensor, base: torch.Tensor | None) -> list[int] | None:
    if base is None or view.dim() != 2 or base.dim() != 2 or view.shape[1] != base.shape[1]:
        return None
    if view.dtype != base.dtype or view.untyped_storage().data_ptr() != base.untyped_storage().data_ptr():
        return None
    if view.shape[0] > 1 and view.stride() != base.stride():
        return None
    offset = view.storage_offset() - base.storage_offset()
    if offset % base.stride(0) or view.stride(1) != base.stride(1):
        return None
    start = offset // base.stride(0)
    if start < 0 or start + view.shape[0] > base.shape[0]:
        return None
    return list(range(start, start + view.shape[0]))


class BroadcastingModule:
    """Stands in for rank 0's main model or draft; everything not a model call
    (kv_cache_spec, config, parameters, ...) goes straight to the module."""

    def __init__(self, module: nn.Module, target: int, leader: LockstepLeader) -> None:
        self._module, self._target, self._leader = module, target, leader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    @property
    def wrapped(self) -> nn.Module:
        return self._module

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self._target == MAIN:
            input_ids, positions, caches, meta = _bind(args, kwargs, ("input_ids", "positions", "caches", "meta"))
            hidden = None
        else:
            input_ids, hidden, positions, caches, meta = _bind(
                args, kwargs, ("input_ids", "hidden", "positions", "caches", "meta"))
        return self._forward(input_ids, hidden, positions, caches, meta, None,
                             lambda: self._module(*args, **kwargs))

    def forward_selected(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                         caches: list, meta: AttentionMetadata, select: RowSelection) -> torch.Tensor:
        """The draft's forward whose output is the selected rows only: the plan names them."""
        return self._forward(input_ids, hidden, positions, caches, meta, select.rows.tolist(),
                             lambda: self._module.forward_selected(input_ids, hidden, positions, caches, meta, select))

    def write_keys(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                   caches: list, meta: AttentionMetadata) -> None:
        """The draft's keys-only pass (a prompt chunk's, or the keys steps at k = 0 left out): a plan of
        its own, so the workers write theirs."""
        self._sync_caches(caches)
        fields, sent = self._hidden_fields(hidden)
        self._leader.send(_forward_plan(self._target, input_ids, positions, meta, keys_only=True, **fields), sent)
        self._module.write_keys(input_ids, hidden, positions, caches, meta)

    def _forward(self, input_ids, hidden, positions, caches, meta, select_rows: list[int] | None,
                 run: Callable[[], torch.Tensor]) -> torch.Tensor:
        self._sync_caches(caches)
        fields, sent = self._hidden_fields(hidden) if hidden is not None else ({}, None)
        if select_rows:
            fields["select_rows"] = select_rows
        if self._target == MAIN:
            fields["num_speculative_tokens"] = self._leader.step_k
        self._leader.send(_forward_plan(self._target, input_ids, positions, meta, **fields), sent)
        out = run().as_subclass(TrackedOutput)
        out._mtp_target = self._target
        self._leader.last_output[self._target] = out
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        fields, sent = self._hidden_fields(hidden)
        self._leader.send(StepPlan(kind=LOGITS, target=self._target, **fields), sent)
        return self._module.compute_logits(hidden)

    def _hidden_fields(self, hidden: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor | None]:
        """Plan fields naming `hidden` for the workers, and the tensor to send if they can't have it."""
        source, rows = self._leader.hidden_source(hidden)
        if source != HIDDEN_SENT:
            return {"hidden_source": source, "hidden_rows": rows}, None
        self._leader.hidden_rows_sent += hidden.shape[0]
        fields = {"hidden_source": source, "hidden_count": hidden.shape[0], "hidden_size": hidden.shape[-1],
                  "dtype": hidden.dtype}
        return fields, hidden.reshape(hidden.shape[0], hidden.shape[-1])

    def _sync_caches(self, caches: list[dict[str, torch.Tensor]]) -> None:
        """Tell the workers to (re)allocate when rank 0's caches are new."""
        first = next(iter(caches[0].values()))
        ident = tuple(t.data_ptr() for layer in caches for t in layer.values())
        if ident == self._leader.cache_ids[self._target]:
            return
        self._leader.send(StepPlan(kind=ALLOCATE_CACHE, target=self._target, num_blocks=first.shape[0],
                                   block_size=first.shape[1], dtype=first.dtype))
        self._leader.cache_ids[self._target] = ident


def _bind(args: tuple, kwargs: dict, names: tuple[str, ...]) -> list:
    values = list(args) + [kwargs[n] for n in names[len(args):]]
    if len(values) != len(names):
        raise TypeError(f"model call expects ({', '.join(names)}), got {len(args)} positional and {sorted(kwargs)}")
    return values


def _forward_plan(target: int, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                  **fields: Any) -> StepPlan:
    return StepPlan(
        kind=FORWARD, target=target, input_ids=input_ids.tolist(), positions=positions.tolist(),
        query_start_loc=list(meta.query_start_loc), context_lens=list(meta.context_lens),
        block_tables=[list(t) for t in meta.block_tables], slot_mapping=meta.slot_mapping.tolist(),
        block_size=meta.block_size, **fields,
    )
