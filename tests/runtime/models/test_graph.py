"""models/graph.py: compile_method gives each instance's compiled method graphs of its own."""

from __future__ import annotations

import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from mtp_runtime.models.graph import compile_method


class Scaled:
    def __init__(self, factor: float):
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor + 1


def test_each_instance_compiles_into_its_own_code_object():
    a, b = Scaled(2.0), Scaled(3.0)
    fa, fb = compile_method(a.forward, backend="eager"), compile_method(b.forward, backend="eager")
    x = torch.arange(4.0)
    assert torch.equal(fa(x), x * 2 + 1) and torch.equal(fb(x), x * 3 + 1)
    code_a, code_b = fa._torchdynamo_orig_callable.__code__, fb._torchdynamo_orig_callable.__code__
    assert code_a is not code_b and code_a is not Scaled.forward.__code__
    # one graph each: neither call had to look through (or guard against) the other instance's graph
    assert len(_debug_get_cache_entry_list(code_a)) == 1 and len(_debug_get_cache_entry_list(code_b)) == 1
    assert len(_debug_get_cache_entry_list(Scaled.forward.__code__)) == 0
