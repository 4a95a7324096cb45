#!/usr/bin/env python3
"""Benchmark `mtp export` on a synthetic >= 2 GB checkpoint whose MTP layer is ~10% of it.

Builds the checkpoint once with make-tiny size options (cached in --work-dir),
then, in one run and on the same disk, measures the export and a plain copy of
the same number of bytes, each in a fresh child process:

- bytes requested from checkpoint files (every read goes through one counted
  pread path) vs the bytes of the MTP tensors; the kernel's /proc read_bytes
  is printed too, but it is ~0 when the files sit in the page cache;
- peak RSS of the export process (ru_maxrss) vs the largest single tensor;
- wall time, and export throughput vs the plain copy (both fsync their output).

Usage: python hack/bench_export.py --work-dir /tmp/mtp-bench [--delete-after]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

# ~2.2 GB of bf16: 10 main layers of 64 experts + 1 MTP layer (~11%).
BENCH_SIZES = [
    "--hidden-size", "1024", "--intermediate-size", "2048", "--moe-intermediate-size", "512",
    "--num-hidden-layers", "10", "--first-k-dense-replace", "1", "--n-routed-experts", "64",
    "--n-group", "8", "--topk-group", "4", "--num-experts-per-tok", "4", "--num-attention-heads", "8",
    "--num-key-value-heads", "8", "--q-lora-rank", "256", "--kv-lora-rank", "128", "--qk-nope-head-dim", "64",
    "--qk-rope-head-dim", "32", "--v-head-dim", "64", "--vocab-size", "8192",
]
SHARDS = 12
REPEATS = 3

EXPORT_CHILD = r"""
import json, resource, sys, time
from mtp_runtime.checkpoint.safetensors_io import READ_STATS
from mtp_runtime.export import export_mtp
def proc_io():
    return dict(line.split(": ") for line in open("/proc/self/io").read().split("\n") if line)
before = proc_io()
start = time.perf_counter()
result = export_mtp(sys.argv[1], sys.argv[2], force=True)
wall = time.perf_counter() - start
after = proc_io()
print(json.dumps({
    "wall_s": wall, "bytes_requested": READ_STATS.bytes_read, "tensor_bytes": result.tensor_bytes,
    "shards_opened": result.shards_opened, "skipped": result.skipped,
    "proc_read_bytes": int(after["read_bytes"]) - int(before["read_bytes"]),
    "proc_rchar": int(after["rchar"]) - int(before["rchar"]),
    "maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
}))
"""

BASELINE_CHILD = r"""
import json, resource
import mtp_runtime.export
print(json.dumps({"maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""

COPY_CHILD = r"""
import json, os, sys, time
sources, dst, nbytes = sys.argv[1].split(","), sys.argv[2], int(sys.argv[3])
buf = bytearray(8 * 1024 * 1024)
start = time.perf_counter()
left = nbytes
with open(dst, "wb") as out:
    for src in sources:
        with open(src, "rb", buffering=0) as f:
            while left and (n := f.readinto(memoryview(buf)[: min(len(buf), left)])):
                out.write(memoryview(buf)[:n])
                left -= n
    out.flush()
    os.fsync(out.fileno())
print(json.dumps({"wall_s": time.perf_counter() - start, "bytes": nbytes - left}))
"""


def child(code: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *args], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def build(checkpoint: Path) -> float:
    if (checkpoint / "model.safetensors.index.json").exists():
        return 0.0
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "mtp_runtime", "make-tiny", "--arch", "deepseek_v3", "--out", str(checkpoint),
           "--shards", str(SHARDS), *BENCH_SIZES]
    subprocess.run(cmd, check=True)
    return time.perf_counter() - start


def mtp_figures(checkpoint: Path) -> tuple[int, int, int, int, list[str]]:
    """(checkpoint tensor bytes, MTP tensor bytes, MTP shards' header bytes, largest MTP tensor, MTP shards)."""
    from mtp_runtime.checkpoint import naming
    from mtp_runtime.checkpoint.index import CheckpointIndex

    index = CheckpointIndex(checkpoint)
    mtp = [n for n in index.names() if naming.is_mtp_tensor(n, index.config)]
    shards = sorted({index.weight_map[n] for n in mtp})
    in_shards = [n for n in index.names() if index.weight_map[n] in shards]
    headers = sum((checkpoint / s).stat().st_size for s in shards) - sum(index.info(n).nbytes for n in in_shards)
    total = sum(index.info(n).nbytes for n in index.names())
    return total, sum(index.info(n).nbytes for n in mtp), headers, max(index.info(n).nbytes for n in mtp), shards


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", required=True, type=Path, help="where the synthetic checkpoint is cached")
    parser.add_argument("--delete-after", action="store_true", help="remove the checkpoint and outputs at the end")
    args = parser.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    checkpoint, draft, copy = args.work_dir / "ckpt", args.work_dir / "draft", args.work_dir / "copy.bin"
    build_s = build(checkpoint)
    total, mtp_bytes, headers, largest, shards = mtp_figures(checkpoint)
    MB = 1e6
    print(f"checkpoint: {total / 1e9:.2f} GB of tensors in {SHARDS} shards (built in {build_s:.0f}s, 0 = cached); "
          f"MTP tensors {mtp_bytes / MB:.1f} MB = {mtp_bytes / total:.1%}, in {len(shards)} shard(s)")

    baseline = child(BASELINE_CHILD)
    exports, copies = [], []
    for _ in range(REPEATS):  # interleaved, so both see the same page-cache state
        shutil.rmtree(draft, ignore_errors=True)
        exports.append(child(EXPORT_CHILD, str(checkpoint), str(draft)))
        copies.append(child(COPY_CHILD, ",".join(str(checkpoint / s) for s in shards), str(copy), str(mtp_bytes)))
        copy.unlink()
    ex = min(exports, key=lambda r: r["wall_s"])
    cp = min(copies, key=lambda r: r["wall_s"])
    assert not ex["skipped"] and ex["tensor_bytes"] == mtp_bytes and cp["bytes"] == mtp_bytes

    read_limit = 1.05 * mtp_bytes + headers
    rss_limit = 2 * largest + 300 * 1024**2
    ex_tp, cp_tp = mtp_bytes / ex["wall_s"], mtp_bytes / cp["wall_s"]
    rows = [
        ("bytes requested", f"{ex['bytes_requested'] / MB:.1f} MB", f"MTP {mtp_bytes / MB:.1f} MB + headers "
         f"{headers / MB:.3f} MB", ex["bytes_requested"] / (mtp_bytes + headers),
         f"<= {read_limit / MB:.1f} MB", ex["bytes_requested"] <= read_limit),
        ("peak RSS", f"{ex['maxrss_bytes'] / MB:.0f} MB", f"largest tensor {largest / MB:.1f} MB; "
         f"import-only RSS {baseline['maxrss_bytes'] / MB:.0f} MB", ex["maxrss_bytes"] / rss_limit,
         f"<= {rss_limit / MB:.0f} MB", ex["maxrss_bytes"] <= rss_limit),
        ("throughput", f"{ex_tp / MB:.0f} MB/s ({ex['wall_s']:.2f}s)", f"plain copy {cp_tp / MB:.0f} MB/s "
         f"({cp['wall_s']:.2f}s)", ex_tp / cp_tp, ">= 0.70x copy", ex_tp >= 0.7 * cp_tp),
    ]
    print(f"export: {len(ex['shards_opened'])} of {SHARDS} shards opened; /proc read_bytes {ex['proc_read_bytes'] / MB:.1f}"
          f" MB (page-cache misses), rchar {ex['proc_rchar'] / MB:.1f} MB (all read calls incl. imports)")
    print(f"runs: export {[round(r['wall_s'], 2) for r in exports]} s, copy {[round(r['wall_s'], 2) for r in copies]} s")
    for name, value, against, ratio, target, ok in rows:
        print(f"{name:16s} {value:24s} vs {against:50s} ratio {ratio:6.3f}  target {target:16s} {'PASS' if ok else 'FAIL'}")
    if args.delete_after:
        shutil.rmtree(args.work_dir)
    return 0 if all(r[-1] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
