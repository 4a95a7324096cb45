"""A worker rank: receive each step plan from rank 0 and make the same model call.

Workers hold their shard of the main model and of the MTP draft and their own
KV caches (same block count as rank 0, their shard's per-token shape). They
never sample: logits are computed only because the vocab-parallel LM head's
all-gather needs every rank, and are then dropped.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
from torch import nn

from mtp_runtime.layers.attention import RowSelection
from mtp_runtime.multinode.step_plan import (
    ALLOCATE_CACHE,
    DRAFT,
    FORWARD,
    HIDDEN_FROM_MAIN,
    HIDDEN_SENT,
    LOGITS,
    MAIN,
    STOP,
    StepPlan,
    broadcast_plan,
)

log = logging.getLogger("mtp_runtime.multinode")

Caches = list[dict[str, torch.Tensor]]


def allocate_caches(module: nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype,
                    device: torch.device | str = "cpu") -> Caches:
    """One [num_blocks, block_size, *shape] tensor per cache of each layer (this rank's shard)."""
    return [
        {name: torch.zeros(num_blocks, block_size, *shape, dtype=dtype, device=device)
         for name, shape in layer.items()}
        for layer in module.kv_cache_spec()
    ]


class PlanExecutor:
    def __init__(self, model: nn.Module, draft: nn.Module | None = None, device: torch.device | str = "cpu"):
        self.modules = {MAIN: model, DRAFT: draft}
        self.device = device
        self.caches: dict[int, Caches | None] = {MAIN: None, DRAFT: None}
        self.last_output: dict[int, torch.Tensor | None] = {MAIN: None, DRAFT: None}
        self.calls = 0
        # main forwards followed, by the k rank 0 chose for their step (its /health shows them)
        self.steps_by_k: dict[int, int] = {}

    def _module(self, plan: StepPlan) -> nn.Module:
        module = self.modules[plan.target]
        if module is None:
            raise RuntimeError("rank 0 planned a draft call but this rank has no --draft_model loaded; "
                               "start every rank with the same flags")
        return module

    def run(self, plan: StepPlan, sent_hidden: torch.Tensor | None = None) -> torch.Tensor | None:
        """Make the planned call; returns its output (hidden or logits), None for cache plans."""
        self.calls += 1
        module = self._module(plan)
        if plan.kind == ALLOCATE_CACHE:
            self.caches[plan.target] = allocate_caches(module, plan.num_blocks, plan.block_size, plan.dtype,
                                                       self.device)
            return None
        if plan.kind == LOGITS:
            return module.compute_logits(self._hidden(plan, sent_hidden))
        caches = self.caches[plan.target]
        if caches is None:
            raise RuntimeError(f"rank 0 planned a forward of target {plan.target} before allocating its cache")
        ids = torch.tensor(plan.input_ids, dtype=torch.long, device=self.device)
        positions = torch.tensor(plan.positions, dtype=torch.long, device=self.device)
        meta = plan.attention_metadata(self.device)
        if plan.target == MAIN:
            if plan.num_speculative_tokens >= 0:
                self.steps_by_k[plan.num_speculative_tokens] = self.steps_by_k.get(plan.num_speculative_tokens, 0) + 1
            out = module(ids, positions, caches, meta)
        elif plan.keys_only:
            module.write_keys(ids, self._hidden(plan, sent_hidden), positions, caches, meta)
            return None
        elif plan.select_rows:
            out = module.forward_selected(ids, self._hidden(plan, sent_hidden), positions, caches, meta,
                                          RowSelection.of(meta, plan.select_rows))
        else:
            out = module(ids, self._hidden(plan, sent_hidden), positions, caches, meta)
        self.last_output[plan.target] = out
        return out

    def _hidden(self, plan: StepPlan, sent_hidden: torch.Tensor | None) -> torch.Tensor:
        if plan.hidden_source == HIDDEN_SENT:
            if sent_hidden is None:
                raise RuntimeError("plan announces a sent hidden tensor but none arrived")
            return sent_hidden.to(device=self.device, dtype=plan.dtype)
        source = MAIN if plan.hidden_source == HIDDEN_FROM_MAIN else DRAFT
        last = self.last_output[source]
        if last is None or (plan.hidden_rows and max(plan.hidden_rows) >= last.shape[0]):
            raise RuntimeError(f"plan names rows {plan.hidden_rows} of the last {'main' if source == MAIN else 'draft'}"
                               f" output, which has {0 if last is None else last.shape[0]} rows")
        rows = torch.tensor(plan.hidden_rows, dtype=torch.long, device=last.device)
        return last.index_select(0, rows)


def run_worker(executor: PlanExecutor, group=None,
               on_collective_error: Callable[[BaseException], None] | None = None) -> int:
    """Follow rank 0's plans until STOP. A failed collective goes to on_collective_error
    (the heartbeat, which names the lost rank and exits) before being re-raised."""
    log.info("worker loop started; following rank 0's step plans")
    with torch.inference_mode():
        while True:
            try:
                plan, hidden = broadcast_plan(None, group=group)
                if plan.kind == STOP:
                    log.info("rank 0 stopped the group after %d model calls", executor.calls)
                    return 0
                executor.run(plan, hidden)
            except RuntimeError as exc:
                if on_collective_error is not None:
                    on_collective_error(exc)
                raise


__all__ = ["FORWARD", "PlanExecutor", "allocate_caches", "run_worker"]
