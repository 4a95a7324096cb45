"""The packed float32 CPU linear (runtime/mtp_runtime/kernels/cpu_gemm.cpp) against F.linear.

    python hack/bench_cpu_gemm.py [--threads 1] [--iters 300] [--out FILE.json]

For the weight shapes of the bench preset's DeepSeek-V3 checkpoint (lm_head 4096x128, the dense
MLP's fused gate/up 640x128, the MoE dense path's 1536x128 and 128x768) and for one DeepSeek-V3
sized projection (2048x7168, as one tensor-parallel rank of 8 would hold), prints the median
microseconds of both at 1 to 256 rows (decode, verify of k + 1 tokens per sequence, batches) and
their ratio, measured side by side: the two alternate call by call, so machine load hits both alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from mtp_runtime.kernels import cpu_gemm

SHAPES = {"lm_head": (4096, 128), "dense gate_up": (640, 128), "moe w13": (1536, 128),
          "moe w2": (128, 768), "v3 tp8 proj": (2048, 7168)}
ROWS = (1, 2, 4, 8, 16, 32, 64, 256)


def side_by_side(fns: dict, iters: int) -> dict:
    times = {name: [] for name in fns}
    for fn in fns.values():
        for _ in range(10):
            fn()
    for _ in range(iters):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--out", help="also write the figures as JSON here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_gemm.available():
        raise SystemExit("the packed kernel is not available on this machine (see the log above)")
    results = []
    print(f"{'weight':>14} {'rows':>5} {'F.linear us':>12} {'packed us':>10} {'speed-up':>9}")
    for name, (out_features, in_features) in SHAPES.items():
        weight = torch.randn(out_features, in_features)
        packed = cpu_gemm.pack(weight)
        for rows in ROWS:
            x = torch.randn(rows, in_features)
            iters = max(20, args.iters // max(1, out_features * in_features // 1_000_000))
            t = side_by_side({"f_linear": lambda: F.linear(x, weight),
                              "packed": lambda: cpu_gemm.linear(x, weight, None, packed)}, iters)
            results.append({"weight": name, "shape": [out_features, in_features], "rows": rows,
                            "f_linear_us": t["f_linear"], "packed_us": t["packed"],
                            "speedup": t["f_linear"] / t["packed"]})
            print(f"{name:>14} {rows:>5} {t['f_linear']:>12.1f} {t['packed']:>10.1f} "
                  f"{t['f_linear'] / t['packed']:>8.2f}x", flush=True)
    for name in SHAPES:
        mine = {r["rows"]: r for r in results if r["weight"] == name}
        print(f"{name}: time at 4 rows / time at 1 row: F.linear "
              f"{mine[4]['f_linear_us'] / mine[1]['f_linear_us']:.2f}, packed "
              f"{mine[4]['packed_us'] / mine[1]['packed_us']:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"threads": args.threads, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
