"""The packed float32 CPU kernels (runtime/mtp_runtime/kernels/cpu_gemm.cpp) against the alternatives.

    python hack/bench_cpu_gemm.py [--threads 1] [--iters 300] [--out FILE.json]

Linear: for the weight shapes of the bench preset's DeepSeek-V3 checkpoint (lm_head 4096x128, the
dense MLP's fused gate/up 640x128, a shared expert's fused gate/up 192x128, o_proj 128x128,
q_b_proj 192x64, the router 8x128; the runtime packs only weights of 64k elements or more, here
every one is packed to show why) and one DeepSeek-V3 sized projection (2048x7168, as one
tensor-parallel rank of 8 would hold), the median microseconds of F.linear and the packed kernel
at 1 to 256 rows (decode, verify of k + 1 tokens per sequence, batches) and their ratio.
MoE: the bench preset's routed experts (8 of hidden 128 and intermediate 96, 2 chosen per token),
the packed `moe_experts` kernel against the paths it replaced (host-routed loop, gathered weights,
dense over all experts), at 1 to 256 tokens.
Each set is measured side by side: the calls alternate, so machine load hits all of them alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from mtp_runtime.checkpoint.configs import build_config
from mtp_runtime.config import ModelConfig
from mtp_runtime.kernels import cpu_gemm
from mtp_runtime.layers.moe import RoutedExperts, TopkRouter

SHAPES = {"lm_head": (4096, 128), "dense gate_up": (640, 128), "shared gate_up": (192, 128),
          "o_proj": (128, 128), "q_b_proj": (192, 64), "router": (8, 128), "v3 tp8 proj": (2048, 7168)}
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
    cpu_gemm.MIN_PACKED_ELEMENTS = 0  # pack every shape, the small ones the runtime leaves unpacked too
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
    moe = bench_moe(args.iters)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"threads": args.threads, "results": results, "moe": moe}, f, indent=1)
    return 0


def bench_moe(iters: int) -> list[dict]:
    config = ModelConfig.from_dict(build_config("deepseek_v3", hidden_size=128, moe_intermediate_size=96,
                                                n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2))
    experts, router = RoutedExperts(config), TopkRouter(config)
    with torch.no_grad():
        for p in (experts.w13, experts.w2, router.weight):
            p.normal_(std=0.1)
    experts.fuse_weights()
    dense_w2 = experts.w2_stacked
    experts.pack_weights()
    kernel = (experts.w13_packed, experts.w2_packed)
    print(f"\n{'moe tokens':>10} {'kernel us':>10} {'host-routed':>12} {'gathered':>9} {'dense':>7}")
    results = []
    with torch.inference_mode():
        for tokens in ROWS:
            x = torch.randn(tokens, 128)
            weights, ids = router(x)
            experts.w2_stacked = dense_w2
            t = side_by_side({
                "kernel": lambda: cpu_gemm.moe_experts(x, weights, ids, *kernel, 0),
                "host_routed": lambda: experts._forward_host_routed(x, weights, ids),
                "gathered": lambda: experts._forward_gathered(x, weights, ids),
                "dense": lambda: experts._forward_dense(x, weights, ids)}, max(20, iters // 4))
            results.append({"tokens": tokens, **{f"{name}_us": us for name, us in t.items()}})
            print(f"{tokens:>10} {t['kernel']:>10.1f} {t['host_routed']:>12.1f} {t['gathered']:>9.1f} "
                  f"{t['dense']:>7.1f}", flush=True)
    return results


if __name__ == "__main__":
    raise SystemExit(main())
