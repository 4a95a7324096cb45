"""Step time of the main model and the MTP draft at small token counts (batch 1), on CPU.

    python hack/profile_step.py --model DIR [--context 200] [--iters 200] [--threads 1]
    python hack/profile_step.py --model DIR --graph [--ks 0,1,3] [--context 200] [--threads 1]

Prints the median milliseconds per forward for the main model at T = 1, 2, 4 new tokens (a decode step and
verify steps of k = 1, 3) and for the draft at T = 1, all on one sequence with `--context`
tokens already cached, measured in one run.

Then how a matmul's time grows with its rows (1, 2, 4 tokens) for the model's lm_head weight and
for a weight too large for the CPU's caches: where it grows with the rows, the step is bound by
arithmetic and verifying k+1 tokens costs about k+1 decode steps of it; where it stays flat, the step
is bound by reading weights, the regime speculative decoding is built for.

--graph times graph mode's one-call decode step instead (engine/graph_step.py, compiled as the engine
does: minutes per k): for each k, the whole step and its verify half alone (the main forward over
k + 1 rows, its logits and argmax), so the draft's share is the difference. The steps take turns
within each round and every guard is evaluated (several engines share a process), so the figures
sit a fixed guard-check cost above the engine's; compare them as ratios to k = 0.

The caches are zeros and every token is the same, so every row routes to the same experts: a
verify step's real extra cost (its rows reading more experts) is understated. For steps on real
text, time the engine on held-out prompts (hack/bench_engine.py, or `mtp bench` for serving).
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


class VerifyTokens:
    """A step's verify half returning the tokens only (returning its metadata object would rebuild
    that object in Python on every call)."""

    def __init__(self, step):
        self.step = step

    def __call__(self, plan: torch.Tensor, main_caches: list) -> torch.Tensor:
        return self.step._verify(plan, main_caches)[0]


def graph_steps(model_dir: str, ks: list[int], context: int, iters: int, rounds: int = 9) -> None:
    from mtp_runtime.engine.graph_step import GreedyDecodeStep
    from mtp_runtime.engine.llm import LLM
    from mtp_runtime.models.graph import compile_method

    width = -(-(context + 2 * max(ks) + 2) // BLOCK_SIZE)
    calls = {}
    for k in ks:
        runner = LLM(model_dir, num_speculative_tokens=k, max_model_len=width * BLOCK_SIZE, max_seqs_per_batch=1,
                     block_size=BLOCK_SIZE, enable_prefix_cache=False, enable_graph=True).engine.runner
        step = runner.decode_step
        step._warm = False  # evaluate every guard: the steps of several engines share this process
        with torch.inference_mode():  # as the engine builds it: an inference tensor, so no guard fails on it
            plan = torch.tensor([GreedyDecodeStep.plan(context, [7] * (k + 1), list(range(width)), width)])
        verify = compile_method(VerifyTokens(step).__call__, cpp_wrapper=True)
        calls[f"k={k}"] = lambda step=step, plan=plan, r=runner: step(plan, r.main_caches, r.draft_caches)
        if k:
            calls[f"k={k} verify only"] = lambda verify=verify, plan=plan, r=runner: (verify(plan, r.main_caches),)
    times: dict[str, list[float]] = {name: [] for name in calls}
    with torch.inference_mode():
        for fn in calls.values():  # compiles the verify halves
            fn()[0].tolist()
        for _ in range(rounds):
            for name, fn in calls.items():
                samples = []
                for _ in range(iters):
                    start = time.perf_counter()
                    fn()[0].tolist()
                    samples.append(time.perf_counter() - start)
                times[name].append(statistics.median(samples) * 1e3)
    base = times[f"k={ks[0]}"]
    for name, ms in times.items():
        ratio = statistics.median(a / b for a, b in zip(ms, base))
        print(f"{name:>16}: {statistics.median(ms):7.3f} ms, {ratio:.2f}x k={ks[0]} (medians of {rounds} rounds)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--graph", action="store_true", help="time graph mode's one-call decode step per k")
    parser.add_argument("--ks", default="0,1,3", help="with --graph: the k values, k = 0 first")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.graph:
        ks = [int(k) for k in args.ks.split(",")]
        if ks[0] != 0:
            parser.error("--ks: start with 0, the baseline of the ratios")
        print(f"threads {torch.get_num_threads()}, context {args.context}, batch 1")
        graph_steps(args.model, ks, args.context, args.iters)
        return
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
