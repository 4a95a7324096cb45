"""Randomly initialised weights for a config, generated lazily one tensor at a time.

Each tensor has its own generator seeded from (seed, tensor name), so a tensor's
values do not depend on which others were generated first, and a multi-GB
checkpoint never has to sit in memory at once.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping

import torch

from . import naming

INIT_STD = 0.02
# Small bias on the router's expert scores, as in trained checkpoints (never exactly zero).
CORRECTION_BIAS_STD = 0.01


class RandomTensors(Mapping):
    """name -> freshly generated float32 tensor; `spec` gives (dtype, shape) without generating."""

    def __init__(self, config: dict, seed: int = 0):
        self.config = config
        self.seed = seed
        self.spec = {name: (torch.float32, shape) for name, shape in naming.expected_tensors(config).items()}

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = self.spec[name][1]
        return init_tensor(name, shape, self.seed)

    def __contains__(self, name: object) -> bool:  # Mapping's default would generate the tensor
        return name in self.spec

    def __iter__(self) -> Iterator[str]:
        return iter(self.spec)

    def __len__(self) -> int:
        return len(self.spec)


def init_tensor(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    if _is_norm_weight(name):
        return torch.ones(shape)
    if name.endswith("norm.bias"):
        return torch.zeros(shape)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    std = CORRECTION_BIAS_STD if name.endswith("e_score_correction_bias") else INIT_STD
    return torch.randn(shape, generator=gen).mul_(std)


def _is_norm_weight(name: str) -> bool:
    # input_layernorm, q_a_layernorm, enorm, hnorm, shared_head.norm, model.norm, k_norm ...
    return name.endswith("norm.weight")
