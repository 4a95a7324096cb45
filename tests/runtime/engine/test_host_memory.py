"""engine/host_memory.py: freed buffers are kept for the next step instead of mapped afresh."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mtp_runtime.engine import host_memory

# A 48 MiB buffer (above glibc's largest dynamic mmap threshold, 32 MiB), filled and freed over and
# over, as a step's activations are: the minor page faults of 20 rounds, once the heap has settled
# (the aligned allocations land a little higher in the heap for the first few rounds).
FAULTS = """
import resource, sys, torch
from mtp_runtime.engine.host_memory import keep_freed_host_memory
print(keep_freed_host_memory() if sys.argv[1] == "1" else False)
for _ in range(12):
    torch.empty(12 << 20).fill_(1.0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    torch.empty(12 << 20).fill_(1.0)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(tuned: bool, env: dict | None = None) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", FAULTS, "1" if tuned else "0"], capture_output=True, text=True,
                         check=True, env=env).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_step_s_buffers_are_reused_not_faulted_in_again():
    applied, tuned = faults(True)
    if applied != "True":
        pytest.skip("the C library is not glibc")
    _, untuned = faults(False)
    pages = 20 * (48 << 20) // 4096
    assert untuned > pages // 2, untuned  # every round maps and faults in its buffer afresh
    assert tuned < pages // 50, (tuned, untuned)  # the freed buffer is taken again


def test_it_can_be_turned_off(monkeypatch):
    monkeypatch.setattr(host_memory, "_applied", None)
    monkeypatch.setenv("MTP_MALLOC_TUNING", "0")
    assert host_memory.keep_freed_host_memory() is False
