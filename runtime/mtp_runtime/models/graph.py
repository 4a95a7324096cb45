"""Graph mode (`--enable_graph`): decode and verify forwards run as a compiled graph.

A decode step of a small MoE model is a few hundred tiny ops per layer; run
one by one from Python, launching them costs more than computing them.
`torch.compile` (inductor) turns the step into a few fused kernels. Only
steps whose attention is one padded batch (layers.attention.DecodeBatch:
decode, verify, MTP drafting, and prompt chunks of similar lengths, such as a
prompt prefilled alone) take the graph; other steps stay eager, since their
per-sequence attention would unroll into a new graph for every batch shape.
Shapes are dynamic, so batch size, tokens per sequence and context length do
not each compile a graph of their own.

The first steps of each kind pay the compile time; `warm_up` runs them at
start-up so a server is ready only once its graphs exist.
"""

from __future__ import annotations

import logging
import types
from typing import Any, Callable

import torch

from mtp_runtime.layers.attention import AttentionMetadata

log = logging.getLogger("mtp_runtime.engine")

# Distinct graphs a model may compile (batch and token-count shapes that specialise, guard changes)
# before further variants run eagerly.
RECOMPILE_LIMIT = 64


class GraphError(RuntimeError):
    """Graph mode cannot run here (no C++ compiler for inductor, unsupported model)."""


class GraphMode:
    """Mixin for a model class that defines `_forward_eager(..., caches, meta)` (CausalLM, MtpDraft)
    and routes its `forward` through `GraphMode.forward`."""

    _graph_forward: Callable[..., torch.Tensor] | None = None

    def enable_graph(self) -> None:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        # One graph for every batch size, sizes of 1 included (otherwise 1 compiles a graph of its own).
        torch.fx.experimental._config.backed_size_oblivious = True
        torch.fx.experimental._config.use_duck_shape = False  # equal sizes in one step need not stay equal
        self._graph_forward = compile_method(self._forward_eager, dynamic=True)

    @property
    def graph_enabled(self) -> bool:
        return self._graph_forward is not None

    def forward(self, *args: Any) -> torch.Tensor:
        meta: AttentionMetadata = args[-1]
        if self._graph_forward is not None and meta.decode_batch() is not None:
            return self._graph_forward(*args)
        return self._forward_eager(*args)


def compile_method(method: Callable[..., Any], dynamic: bool = False, cpp_wrapper: bool = False,
                   backend: str = "inductor") -> Callable[..., Any]:
    """torch.compile of a bound method, through a private copy of its function.

    Dynamo keeps the graphs it compiles, and checks their guards, per code object. Without the copy,
    every instance of a class (the engines of a benchmark or a test, in one process) would add its
    graphs to one shared list, and each call would look through the graphs of all of them.
    `cpp_wrapper`: inductor writes the code that calls the graph's kernels in C++ instead of Python
    (for graphs with few dynamic sizes; with many, it compiles for minutes)."""
    fn = method.__func__
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    own.__kwdefaults__ = fn.__kwdefaults__
    options = {"cpp_wrapper": cpp_wrapper} if backend == "inductor" else None
    return torch.compile(types.MethodType(own, method.__self__), dynamic=dynamic, backend=backend, options=options)


def warm_up_shapes(k: int) -> list[tuple[list[int], list[int]]]:
    """(new tokens per sequence, context length per sequence) of the step kinds an engine with k
    drafts runs: decode at equal and unequal lengths, verify, and a mix of both (a sequence just out
    of prefill verifies nothing yet), a batch large enough for the MoE's many-pairs path (a graph of
    its own), prompt chunks (a first chunk, a later one, two together); the draft's first pass has
    1..k+1 tokens per sequence."""
    shapes = [([1], [9]), ([1, 1], [9, 9]), ([1, 1, 1], [9, 10, 11]),
              ([1] * 9, list(range(9, 18))),  # enough tokens for the MoE's many-pairs path
              ([24], [24]), ([20], [44]), ([18, 20], [18, 20])]
    if k:
        shapes += [([k + 1], [9 + k]), ([k + 1, k + 1], [9 + k, 10 + k]), ([1, k + 1, 2], [9, 10 + k, 12]),
                   ([2], [10])]
    return shapes


def warm_up(module: torch.nn.Module, call: Callable[[list[int], list[int]], None], k: int) -> float:
    """Run `call(news, context_lens)` on every warm-up shape; returns the seconds it took. Turns a
    compiler failure into a GraphError that says what to do."""
    import time

    start = time.perf_counter()
    try:
        for news, context_lens in warm_up_shapes(k):
            call(news, context_lens)
    except Exception as exc:
        raise compile_failure(f"the {type(module).__name__} forward", exc) from exc
    return time.perf_counter() - start


def compile_failure(what: str, exc: Exception) -> GraphError:
    """The error for a graph that failed to compile, saying what to do."""
    first_line = str(exc).splitlines()[0] if str(exc) else repr(exc)
    return GraphError(f"enable_graph: compiling {what} failed ({type(exc).__name__}: {first_line}); graph mode "
                      f"needs a C++ compiler for torch.compile on CPU; run without --enable_graph")
