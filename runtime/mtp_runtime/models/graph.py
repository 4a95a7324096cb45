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

Graph mode is the default (`resolve_graph`): `--enable_graph` / `enable_graph`
unset means "where it can run": on CPU that takes a C++ compiler (without one,
the engine runs eager after one warning), and some models and multi-node
groups always run eager. CUDA devices run eager unless graph mode is asked
for: on an H200 (torch 2.11) the compiled decode step failed its start-up
with an index assert inside a generated kernel, where the same step run
eagerly passes (runtime/README.md); `enable_graph=true` still tries it. inductor's compiled code is cached on disk
(`compile_cache_dir`), so a second start of the same model and settings
compiles nothing; `CompileCounts` says how much each start compiled.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from mtp_runtime.layers.attention import AttentionMetadata

log = logging.getLogger("mtp_runtime.engine")

# Distinct graphs a model may compile (batch and token-count shapes that specialise, guard changes)
# before further variants run eagerly.
RECOMPILE_LIMIT = 64


# The default of graph mode where the setting is left unset: true, false or auto (the default).
GRAPH_ENV = "MTP_ENABLE_GRAPH"
# Where inductor keeps its compiled code between runs (inductor's own variable; ours sets its default).
CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
# Architectures whose forwards cannot take a graph: their step stays eager whatever the setting.
EAGER_ONLY_ARCHS = {"deepseek_v32": "its indexer picks keys sequence by sequence"}


class GraphError(RuntimeError):
    """Graph mode cannot run here (no C++ compiler for inductor, unsupported model)."""


@dataclass(frozen=True)
class GraphDecision:
    enabled: bool
    reason: str  # why, in words (start-up log, /health)


def cpp_compiler() -> str | None:
    """The C++ compiler inductor would use on CPU (its `cpp.cxx` search: $CXX, else g++), or None."""
    import torch._inductor.config as inductor_config

    search = inductor_config.cpp.cxx
    for name in search if isinstance(search, (list, tuple)) else (search,):
        found = shutil.which(name) if name else None
        if found:
            return found
    return None


def resolve_graph(requested: bool | None, arch: str, device: str) -> GraphDecision:
    """Whether an engine runs graph mode. `requested` True demands it (a model or machine that cannot
    is an error naming what to do), False turns it off, None (unset) takes $MTP_ENABLE_GRAPH
    (true, false or auto; default auto): graph mode wherever it can run, else eager with a reason
    (a warning for a missing compiler, the one case the user can fix)."""
    if requested is None:
        env = os.environ.get(GRAPH_ENV, "auto").strip().lower()
        if env not in ("true", "false", "auto"):
            raise ValueError(f"${GRAPH_ENV}={env!r} is invalid: expected true, false or auto")
        if env != "auto":
            requested = env == "true"
            source = f"${GRAPH_ENV}={env}"
    else:
        source = f"enable_graph={str(requested).lower()}"
    if requested is False:
        return GraphDecision(False, f"eager ({source})")
    if arch in EAGER_ONLY_ARCHS:
        if requested:
            raise ValueError(f"enable_graph: not supported for {arch} in this build ({EAGER_ONLY_ARCHS[arch]}); "
                             f"run it with enable_graph=false (--enable_graph=false)")
        return GraphDecision(False, f"eager ({arch}: {EAGER_ONLY_ARCHS[arch]})")
    if device.startswith("npu"):
        if requested:
            raise ValueError("enable_graph: not supported on npu devices in this build; run with "
                             "enable_graph=false (--enable_graph=false)")
        return GraphDecision(False, "eager (npu devices run eager in this build)")
    if device.startswith("cuda"):
        if not requested:
            return GraphDecision(False, "eager (cuda devices run eager unless enable_graph=true in this build)")
        log.warning("graph mode on %s is experimental in this build: its compiled decode step failed its "
                    "start-up on an H200; if it fails here, run with enable_graph=false", device)
    if device == "cpu" and cpp_compiler() is None:
        if requested:
            raise GraphError("enable_graph: graph mode on CPU needs a C++ compiler for torch.compile and none "
                             "was found ($CXX, g++); install one or run with enable_graph=false")
        log.warning("graph mode: no C++ compiler found ($CXX, g++), so decode steps run eager, several times "
                    "slower; install one (e.g. g++) for the compiled path, or set enable_graph=false "
                    "(--enable_graph=false) to run eager without this warning")
        return GraphDecision(False, "eager (no C++ compiler found)")
    return GraphDecision(True, f"graph ({source})" if requested else "graph (default)")


def announce(message: str) -> None:
    """A start-up line the user should see: logged at INFO where logging is set up (`mtp serve`),
    else printed to stderr (the offline `LLM` in a script that configures no logging)."""
    if logging.getLogger().handlers or log.handlers:
        log.info("%s", message)
    else:
        print(f"mtp_runtime: {message}", file=sys.stderr, flush=True)


def compile_cache_dir() -> Path:
    """The directory of inductor's on-disk cache: $TORCHINDUCTOR_CACHE_DIR, set (to
    $MTP_CACHE_DIR/inductor, default ~/.cache/mtp-operator/inductor) where unset, so compiled
    graphs outlive /tmp. Importing inductor sets the variable to its own default (under /tmp) when
    unset, so that default counts as unset too."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get(CACHE_ENV)
    if not current or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        root = Path(os.environ.get("MTP_CACHE_DIR") or Path.home() / ".cache" / "mtp-operator")
        os.environ[CACHE_ENV] = str(root / "inductor")
    return Path(os.environ[CACHE_ENV])


@dataclass
class CompileCounts:
    """How many graphs a start compiled and how many came from the disk cache (inductor's counters)."""
    compiled: int = 0
    cached: int = 0

    @staticmethod
    def now() -> "CompileCounts":
        from torch._dynamo.utils import counters

        inductor = counters["inductor"]
        return CompileCounts(inductor["fxgraph_cache_miss"] + inductor["fxgraph_cache_bypass"],
                             inductor["fxgraph_cache_hit"])

    def since(self, before: "CompileCounts") -> "CompileCounts":
        return CompileCounts(self.compiled - before.compiled, self.cached - before.cached)


class GraphMode:
    """Mixin for a model class that defines `_forward_eager(..., caches, meta)` (CausalLM, MtpDraft)
    and routes its `forward` through `GraphMode.forward`."""

    _graph_forward: Callable[..., torch.Tensor] | None = None

    def enable_graph(self) -> None:
        if self._graph_forward is not None:  # already compiled (or compiling on first use)
            return
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


def contiguous_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of `t` whatever its sizes. `Tensor.contiguous()` and `flatten()` of a strided
    tensor ask whether a size is 1 (then no copy is needed), and a graph traced with dynamic sizes
    would depend on the answer: the exported decode step (engine/aot_step.py) must not."""
    return t.clone(memory_format=torch.contiguous_format)


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


def warm_up(module: torch.nn.Module, call: Callable[[list[int], list[int]], None], k: int,
            device: str = "cpu") -> float:
    """Run `call(news, context_lens)` on every warm-up shape; returns the seconds it took. Turns a
    compiler failure into a GraphError that says what to do."""
    import time

    start = time.perf_counter()
    try:
        for news, context_lens in warm_up_shapes(k):
            call(news, context_lens)
    except Exception as exc:
        raise compile_failure(f"the {type(module).__name__} forward", exc, device) from exc
    return time.perf_counter() - start


def compile_failure(what: str, exc: Exception, device: str = "cpu") -> GraphError:
    """The error for a graph that failed to compile (or to run its first call), saying what to do."""
    first_line = str(exc).splitlines()[0] if str(exc) else repr(exc)
    needs = "graph mode needs a C++ compiler for torch.compile on CPU; " if device == "cpu" else ""
    return GraphError(f"enable_graph: compiling {what} on {device} failed ({type(exc).__name__}: {first_line}); "
                      f"{needs}run with --enable_graph=false")
