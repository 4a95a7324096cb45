"""Linear layers that know their tensor-parallel shard.

Every weight carries a `weight_loader(param, full_tensor)` that receives the
whole checkpoint tensor and copies in only this rank's slice, so sharding is
decided once, where weights are loaded.
"""

from __future__ import annotations

import torch
from torch import nn

from mtp_runtime.distributed import ParallelState, get_parallel_state
from mtp_runtime.kernels import cpu_gemm


def check_shape(param: nn.Parameter, loaded: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"tensor {name}: checkpoint shape {tuple(loaded.shape)} does not match the model's "
                         f"{tuple(param.shape)} (is config.json from the same checkpoint?)")


def load_full(param: nn.Parameter, loaded: torch.Tensor, name: str = "") -> None:
    check_shape(param, loaded, name)
    param.data.copy_(loaded)


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, parallel: ParallelState | None):
        super().__init__()
        self.parallel = parallel or get_parallel_state()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.weight.weight_loader = self.weight_loader
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.bias_loader
        self.fused = False  # set by fuse_linears: the fused weight is the one used
        self.weight_packed: torch.Tensor | None = None  # set by pack_weights() (kernels/cpu_gemm.py)

    def pack_weights(self) -> None:
        self.weight_packed = None if self.fused else cpu_gemm.pack(self.weight)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "") -> None:
        load_full(param, loaded, name)

    def bias_loader(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "") -> None:
        load_full(param, loaded, name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_gemm.linear(x, self.weight, self.bias, self.weight_packed)


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight (small projections such as q_a_proj)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, parallel: ParallelState | None = None):
        super().__init__(in_features, out_features, bias, parallel)


class ColumnParallelLinear(LinearBase):
    """Output features split across tp ranks; each rank returns its slice."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, parallel: ParallelState | None = None):
        parallel = parallel or get_parallel_state()
        self.full_out = out_features
        _, local = parallel.shard(out_features, "ColumnParallelLinear output features")
        super().__init__(in_features, local, bias, parallel)

    def _slice(self, loaded: torch.Tensor, name: str) -> torch.Tensor:
        if loaded.shape[0] != self.full_out:
            raise ValueError(f"tensor {name}: checkpoint has {loaded.shape[0]} output rows, the model expects "
                             f"{self.full_out}")
        start, size = self.parallel.shard(self.full_out, name)
        return loaded.narrow(0, start, size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "") -> None:
        load_full(param, self._slice(loaded, name), name)

    def bias_loader(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "") -> None:
        load_full(param, self._slice(loaded, name), name)


class RowParallelLinear(LinearBase):
    """Input features split across tp ranks; partial products are summed (all-reduce)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, parallel: ParallelState | None = None):
        parallel = parallel or get_parallel_state()
        self.full_in = in_features
        _, local = parallel.shard(in_features, "RowParallelLinear input features")
        super().__init__(local, out_features, bias, parallel)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "") -> None:
        if loaded.dim() != 2 or loaded.shape[1] != self.full_in:
            raise ValueError(f"tensor {name}: checkpoint shape {tuple(loaded.shape)}, the model expects "
                             f"{self.out_features} x {self.full_in}")
        start, size = self.parallel.shard(self.full_in, name)
        load_full(param, loaded.narrow(1, start, size), name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.parallel.all_reduce(cpu_gemm.linear(x, self.weight, None, self.weight_packed))
        # The bias is added once, after the sum, not on every rank's partial.
        return out if self.bias is None else out + self.bias


def fuse_linears(*linears: LinearBase) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several projections of the same input, so a decode step runs one
    matmul instead of several. The layers' own parameters become views into it: no second copy is
    kept, and anything that writes them later (loading, training) writes the fused tensor too."""
    weight = torch.cat([lin.weight.data for lin in linears])
    biases = [lin.bias for lin in linears]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b.data if b is not None else lin.weight.new_zeros(lin.weight.shape[0])
                          for b, lin in zip(biases, linears)])
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight.data = weight[start:start + rows]
        lin.fused = True
        if lin.bias is not None:
            lin.bias.data = bias[start:start + rows]
        start += rows
    return weight, bias


def prepare_for_inference(module: nn.Module) -> nn.Module:
    """After loading, on the final device and dtype: let every submodule that can fuse its weights
    do so (see `fuse_linears`), then pack the weights its matmuls read (kernels/cpu_gemm.py; a no-op
    off float32 CPUs). Packing runs children first, so a block sees what its parts packed."""
    for step, subs in (("fuse_weights", list(module.modules())), ("pack_weights", reversed(list(module.modules())))):
        for sub in subs:
            method = getattr(sub, step, None)
            if method is not None:
                method()
    return module

