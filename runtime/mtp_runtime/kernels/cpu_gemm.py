"""Packed float32 linear and MoE experts (cpu_gemm.cpp), and decode attention over a paged latent
cache (cpu_attention.cpp), for AVX2 CPUs; built on first use, with a fallback.

Panels are stored in bfloat16 when that loses nothing (every weight is a bfloat16 value, as when a
bfloat16 checkpoint is loaded as float32): the kernel widens them exactly, so results are the same
bits as from float32 panels, and a step reads half the bytes.

`pack(weight)` returns the packed copy of a float32 CPU weight, or None where the kernel cannot run
(another device or dtype, a CPU without AVX2/FMA, no C++ compiler, MTP_CPU_GEMM=0); `linear(x,
weight, bias, packed)` uses the packed copy when there is one and `F.linear` otherwise, so callers
never branch. The kernel is built once per machine with torch's extension builder (cached under
TORCH_EXTENSIONS_DIR); a failed build logs why and leaves every layer on `F.linear`.
"""

from __future__ import annotations

import logging
import os
import platform
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

PANEL = 16  # output features per packed panel (cpu_gemm.cpp kPanel)
BF16_ORDER = [f for j in range(PANEL // 2) for f in (j, j + PANEL // 2)]  # a bfloat16 panel row
_BF16_INVERSE = [BF16_ORDER.index(f) for f in range(PANEL)]
# Called from Python (eager steps), smaller weights stay on F.linear: their product costs less than
# calling a custom op from Python (a few us).
MIN_PACKED_ELEMENTS = 65536
# Weights from this size are packed at load: inside a compiled graph (torch.compile, the ahead-of-time
# decode step) every packed weight takes the kernel, where the library's GEMM copies (packs) a small
# weight on every call of a few rows (a verify step's k + 1): 11% of a batch-1 k = 3 step of the
# bench model went to those copies.
MIN_PACKED_ELEMENTS_IN_GRAPH = 4096
ENV = "MTP_CPU_GEMM"  # "0" turns the kernels off
SOURCES = ("cpu_gemm.cpp", "cpu_attention.cpp")  # one extension

_built: bool | None = None  # None: not tried yet


def in_graph() -> bool:
    """Traced into a graph: by torch.compile, or by torch.export (the ahead-of-time decode step)."""
    return torch.compiler.is_compiling() or torch.compiler.is_exporting()


def _cpu_supported() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def available() -> bool:
    """Whether the packed kernel is on, building it the first time it is asked."""
    global _built
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if _built is None:
        _built = _build()
    return _built


def _build() -> bool:
    if not _cpu_supported():
        log.info("packed CPU linear off: needs an x86-64 CPU with AVX2 and FMA (torch reports %s)",
                 torch.backends.cpu.get_cpu_capability())
        return False
    try:
        from torch.utils.cpp_extension import load

        load(name="mtp_runtime_cpu_gemm", sources=[str(Path(__file__).with_name(name)) for name in SOURCES],
             extra_cflags=["-O3", "-mavx2", "-mfma"], is_python_module=False, verbose=False)
    except Exception as exc:  # no compiler, no ninja, a read-only cache: run on F.linear instead
        log.warning("packed CPU linear off, its build failed (%s: %s); layers use F.linear",
                    type(exc).__name__, str(exc).strip().splitlines()[-1] if str(exc).strip() else "")
        return False
    _register_fake()
    return True


def _register_fake() -> None:
    @torch.library.register_fake("mtp_runtime::packed_linear")
    def _(x, weight, packed, bias=None):
        return x.new_empty(*x.shape[:-1], weight.shape[0])

    @torch.library.register_fake("mtp_runtime::moe_experts")
    def _(x, weights, ids, w13, w2, first, shared_w13=None, shared_w2=None):
        return x.new_empty(x.shape)

    @torch.library.register_fake("mtp_runtime::mla_decode_attention")
    def _(q, cache, tables, q_pos, value_dim, scale):
        return q.new_empty(*q.shape[:-1], value_dim)


def pack(weight: torch.Tensor | None) -> torch.Tensor | None:
    """[O, I] float32 CPU weight -> [ceil(O/16), I, 16] panels (zero-padded), or None where the
    kernel does not apply (or there is no weight: an unfused layer's fused tensor)."""
    smallest = min(MIN_PACKED_ELEMENTS, MIN_PACKED_ELEMENTS_IN_GRAPH)
    if weight is None or weight.dim() != 2 or weight.numel() < smallest or not _packable(weight):
        return None
    return _panels(weight)


def pack_experts(weight: torch.Tensor) -> torch.Tensor | None:
    """[E, O, I] float32 CPU expert weights -> [E, ceil(O/16), I, 16], each expert packed on its own,
    or None where the kernel does not apply. No size floor: `moe_experts` replaces a whole routed-
    expert block (routing on the host or weight copies), not one small product."""
    if weight.dim() != 3 or not _packable(weight):
        return None
    return _panels(weight)


def _packable(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and available()


def _panels(weight: torch.Tensor) -> torch.Tensor:
    """[..., O, I] -> [..., ceil(O/16), I, 16] (output features zero-padded to whole panels), in
    bfloat16 when every weight is exactly a bfloat16 value, else float32."""
    *lead, out_features, in_features = weight.shape
    panels = -(-out_features // PANEL)
    padded = weight.new_zeros(*lead, panels * PANEL, in_features)
    padded[..., :out_features, :] = weight.detach()
    packed = padded.view(*lead, panels, PANEL, in_features).transpose(-1, -2).contiguous()
    narrow = packed.to(torch.bfloat16)
    if not torch.equal(narrow.float(), packed):
        return packed
    # Each panel row's 16 bfloat16 values go in the order of BF16_ORDER: as 8 32-bit words, word j
    # holds features j and j + 8, so the kernel widens a row with a shift and a mask (cpu_gemm.cpp load16).
    return narrow[..., BF16_ORDER].contiguous()


def matching(first: torch.Tensor | None, second: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Two packed weights one expert uses together (gate/up and down), in one dtype: float32 unless
    both could be bfloat16."""
    if first is None or second is None or first.dtype == second.dtype:
        return first, second
    return widen(first), widen(second)


def widen(packed: torch.Tensor) -> torch.Tensor:
    """Packed panels as float32 panels of the same weight (bfloat16 panels are stored interleaved)."""
    if packed.dtype != torch.bfloat16:
        return packed
    return packed.float()[..., _BF16_INVERSE].contiguous()


def moe_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                first: int, shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [N, H] float32, routing weights/ids [N, k] -> sum of each token's chosen local experts [N, H]
    (plus the shared expert's output, if given); w13/w2 from `pack_experts` (gate+up [E, 2I, H], down
    [E, H, I]; the shared expert's as E = 1), `first` the id of local expert 0."""
    shared_w13, shared_w2 = shared if shared is not None else (None, None)
    return torch.ops.mtp_runtime.moe_experts(x, weights.float(), ids, w13, w2, first, shared_w13, shared_w2)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), on the packed kernel when `packed` is given and x is float32 (called
    eagerly, only for weights of MIN_PACKED_ELEMENTS or more)."""
    if packed is None or x.dtype != torch.float32 or (weight.numel() < MIN_PACKED_ELEMENTS and not in_graph()):
        return F.linear(x, weight, bias)
    return torch.ops.mtp_runtime.packed_linear(x, weight, packed, bias)


def fused_attention(q: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether `mla_decode_attention` serves these: float32 CPU queries and cache, kernels built."""
    return q.dtype == torch.float32 and cache.dtype == torch.float32 and q.device.type == "cpu" \
        and cache.device.type == "cpu" and available()


def mla_decode_attention(q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor, q_pos: torch.Tensor,
                         value_dim: int, scale: float) -> torch.Tensor:
    """q [B, n, H, D] float32, a paged cache [blocks, block_size, D] whose one key per token every head
    shares, block tables [B, W], query positions [B, n] (query j of sequence b sees positions
    0..q_pos[b, j]) -> [B, n, H, value_dim]: softmax(scale q . k) over those keys times their first
    value_dim values (cpu_attention.cpp)."""
    return torch.ops.mtp_runtime.mla_decode_attention(q, cache, tables, q_pos, value_dim, scale)
