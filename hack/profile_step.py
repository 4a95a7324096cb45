"""Step time of the main model and the MTP draft at small token counts (batch 1), on CPU.

    python hack/profile_step.py --model DIR [--context 200] [--iters 200] [--threads 1]

Prints the median milliseconds per forward for the main model at T = 1, 2, 4 new tokens (a decode step and
verify steps of k = 1, 3) and for the draft at T = 1, all on one sequence with `--context`
tokens already cached, measured in one run.

Then how a matmul's time grows with its rows (1, 2, 4 tokens) for the model's lm_head weight and
for a weight too large for the CPU's caches: where it grows with the rows, the step is bound by
arithmetic and verifying k+1 tokens costs about k+1 decode steps of it; where it stays flat, the step
is bound by reading weights, the regime speculative decoding is built for.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mtp_runtime.layers.attention import AttentionMetadata
from mtp_runtime.models.loader import load_draft, load_model
from mtp_runtime.reference_generate import allocate_caches

BLOCK_SIZE = 16


def step_ms(module, context: int, num_new: int, iters: int, hidden_size: int | None = None) -> float:
    caches = allocate_caches(module.kv_cache_spec(), context + num_new, torch.float32, "cpu")
    meta = AttentionMetadata.for_sequence(context, num_new, BLOCK_SIZE)
    ids = torch.randint(3, 100, (num_new,))
    positions = torch.arange(context, context + num_new)
    args = (ids, positions) if hidden_size is None else (ids, torch.randn(num_new, hidden_size), positions)
    with torch.inference_mode():
        for _ in range(max(3, iters // 10)):
            module(*args, caches, meta)
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            module(*args, caches, meta)
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3  # the median: a shared machine's load spikes do not move it


def matmul_ms(weight: torch.Tensor, rows: int, iters: int) -> float:
    x = torch.randn(rows, weight.shape[1])
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        torch.nn.functional.linear(x, weight)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def matmul_scaling(lm_head: torch.Tensor, iters: int) -> None:
    large = torch.randn(16384, 2048)  # 128 MiB of float32: streamed from memory on every call
    for name, weight in (("lm_head", lm_head), ("16384x2048", large)):
        times = {rows: min(matmul_ms(weight, rows, iters) for _ in range(3)) for rows in (1, 2, 4)}
        print(f"linear {name:>10} {tuple(weight.shape)}: " +
              ", ".join(f"{rows} rows {ms:.3f} ms" for rows, ms in times.items()) +
              f"; 2 rows / 1 = {times[2] / times[1]:.2f}, 4 rows / 1 = {times[4] / times[1]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.model)
    draft = load_draft(args.model, main=model)
    print(f"threads {torch.get_num_threads()}, context {args.context}")
    for t in (1, 2, 4):
        print(f"main   T={t}: {step_ms(model, args.context, t, args.iters):7.3f} ms")
    print(f"draft  T=1: {step_ms(draft, args.context, 1, args.iters, model.config.hidden_size):7.3f} ms")
    with torch.inference_mode():
        matmul_scaling(model.lm_head.weight.detach().float(), args.iters)


if __name__ == "__main__":
    main()
