"""Step time of the main model and the MTP draft at small token counts (batch 1), on CPU.

    python hack/profile_step.py --model DIR [--context 200] [--iters 200] [--threads 1]

Prints the median milliseconds per forward for the main model at T = 1, 2, 4 new tokens (a decode step and
verify steps of k = 1, 3) and for the draft at T = 1, all on one sequence with `--context`
tokens already cached, measured in one run.
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


if __name__ == "__main__":
    main()
