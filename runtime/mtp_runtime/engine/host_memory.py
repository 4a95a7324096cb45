"""Keep freed host memory for reuse instead of handing it back to the kernel after every step.

glibc's malloc serves a request above its mmap threshold (dynamic, at most 32 MiB) with a fresh
mapping and unmaps it on free, and gives the top of its heap back to the kernel once more than the
trim threshold of it is free. The activations of a step are freed at its end and asked for again by
the next one, so each step paid to fault their pages in afresh (and to zero them): on the bench
model a 32 x 64-token prefill spent about a sixth of its time there (runtime/README.md). An engine
keeps the memory of its largest step anyway; holding on to it costs no more than that.

`keep_freed_host_memory()` (called once by the engine) raises both thresholds. Where the C library
is not glibc, or with MTP_MALLOC_TUNING=0, it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 256 << 20  # a request at least this large still gets a mapping of its own (the KV cache)
TRIM_THRESHOLD = 1 << 30  # free memory at the top of the heap kept for reuse
_applied: bool | None = None


def keep_freed_host_memory() -> bool:
    """Set glibc's thresholds once per process; True if they are set (now or before)."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get("MTP_MALLOC_TUNING", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt), or no C library to load
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not _applied:
        log.warning("host memory: the C library refused the malloc thresholds; each step's buffers are "
                    "mapped afresh")
    return _applied
