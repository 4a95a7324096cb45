"""ParallelState: who this process is in the tensor- and expert-parallel group.

Layers read it when they are built (to size their shard) and when they run
(to reduce partial results). With size 1 every collective returns its input
unchanged, so single-process code pays nothing. The multi-process runtime
installs a real state with `set_parallel_state` before building the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    group: Any = None  # torch.distributed process group shared by tp and ep; None = default group

    def __post_init__(self) -> None:
        for kind in ("tp", "ep"):
            rank, size = getattr(self, f"{kind}_rank"), getattr(self, f"{kind}_size")
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"ParallelState: {kind}_rank {rank} is outside 0..{kind}_size-1 ({size})")

    def shard(self, total: int, what: str) -> tuple[int, int]:
        """(start, size) of this tp rank's equal slice of `total` rows."""
        if total % self.tp_size:
            raise ValueError(f"{what}: size {total} is not divisible by tp_size {self.tp_size}")
        size = total // self.tp_size
        return self.tp_rank * size, size

    def local_experts(self, num_experts: int) -> range:
        if num_experts % self.ep_size:
            raise ValueError(f"n_routed_experts {num_experts} is not divisible by ep_size {self.ep_size}")
        per_rank = num_experts // self.ep_size
        return range(self.ep_rank * per_rank, (self.ep_rank + 1) * per_rank)

    @property
    def world_size(self) -> int:
        return max(self.tp_size, self.ep_size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum partial results across the group (row-parallel outputs, expert partial sums)."""
        if self.world_size == 1:
            return x
        torch.distributed.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate the tp shards of `x` along `dim` (vocab-parallel logits)."""
        if self.tp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


_STATE = ParallelState()


def get_parallel_state() -> ParallelState:
    return _STATE


def set_parallel_state(state: ParallelState) -> None:
    global _STATE
    _STATE = state
