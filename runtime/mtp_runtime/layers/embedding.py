"""Vocabulary-parallel token embedding and LM head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtp_runtime.distributed import ParallelState, get_parallel_state
from mtp_runtime.kernels import cpu_gemm
from mtp_runtime.layers.linear import load_full


class VocabParallelEmbedding(nn.Module):
    """Each tp rank holds a contiguous slice of the vocabulary rows."""

    def __init__(self, vocab_size: int, hidden_size: int, parallel: ParallelState | None = None):
        super().__init__()
        self.parallel = parallel or get_parallel_state()
        self.vocab_size = vocab_size
        self.vocab_start, local = self.parallel.shard(vocab_size, "vocab_size")
        self.weight = nn.Parameter(torch.empty(local, hidden_size))
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "") -> None:
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(f"tensor {name}: checkpoint has {loaded.shape[0]} vocabulary rows, config.json "
                             f"says vocab_size {self.vocab_size}")
        load_full(param, loaded.narrow(0, self.vocab_start, param.shape[0]), name)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local_ids = input_ids - self.vocab_start
        outside = (local_ids < 0) | (local_ids >= self.weight.shape[0])
        out = F.embedding(local_ids.masked_fill(outside, 0), self.weight)
        # Rows owned by another rank are zero here and arrive through the sum.
        return self.parallel.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0.0))


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to the vocabulary; logits are gathered from all ranks, in float32."""

    def __init__(self, vocab_size: int, hidden_size: int, parallel: ParallelState | None = None):
        super().__init__(vocab_size, hidden_size, parallel)
        self.weight_packed: torch.Tensor | None = None  # set by pack_weights() (kernels/cpu_gemm.py)

    def pack_weights(self) -> None:
        self.weight_packed = cpu_gemm.pack(self.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = cpu_gemm.linear(hidden, self.weight, None, self.weight_packed).float()
        return self.parallel.all_gather(logits, dim=-1)
