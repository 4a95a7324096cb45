#!/usr/bin/env python
"""A draft that goes bad mid-run: adaptive speculative depth must fall back to about k = 0 within
seconds and speculate again once the good draft is back.

One engine at a time, a steady load of --batch requests in flight (a finished request is replaced at
once), for three phases of --phase-seconds each: the checkpoint's own MTP draft, then the MTP layer
of another checkpoint (BAD_DRAFT_DIR: same sizes, another seed, so it almost never agrees; on the
main model's embedding and head, as the good draft is), then the good draft again
(`ModelRunner.swap_draft`: graph mode's compiled steps follow it, an ahead-of-time package by being
handed the new draft's tensors; the draft cache keeps the keys the bad draft wrote, as a real swap
would). Systems: k = 0, fixed k = K, adaptive with K. Per 0.5 s: output tokens/s and
the mean k of the steps. Writes drift.json, drift.md and drift.png to OUT.

    python hack/bench_adaptive_drift.py MODEL_DIR BAD_DRAFT_DIR OUT [--batch 4] [--k 3] [--phase-seconds 10]
        [--eager] [--output-spread 0]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from mtp_runtime.bench.prompts import build_prompts, load_tokenizer
from mtp_runtime.engine.config import EngineConfig
from mtp_runtime.engine.llm_engine import LLMEngine
from mtp_runtime.models.loader import load_draft
from mtp_runtime.sampling_params import SamplingParams

BIN_S = 0.5


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir")
    p.add_argument("bad_draft_dir")
    p.add_argument("out", type=Path)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--phase-seconds", type=float, default=10.0)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--output-spread", type=int, default=0,
                   help="each request's output length is drawn (seeded) from OUTPUT_LEN +- this. With equal "
                        "lengths a batch at k = 0 stays in lockstep and prefills its replacements together, "
                        "which no depth above 0 keeps up (the note in runtime/README.md)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--eager", action="store_true", help="eager steps (default: the engine's default, graph mode "
                   "where it can run, its one-call step compiled ahead of time)")
    args = p.parse_args()
    if not 0 <= args.output_spread < args.output_len:
        p.error(f"--output-spread {args.output_spread} must lie in [0, --output-len {args.output_len})")
    return args


def run_system(args, k: int, adaptive: bool, prompts: list[list[int]]) -> list[tuple[float, int, int]]:
    """(seconds since start, the step's k, tokens it produced) for every step of the three phases."""
    engine = LLMEngine(EngineConfig(model=args.model_dir, num_speculative_tokens=k, speculative_adaptive=adaptive,
                                    max_model_len=args.input_len + args.output_len + args.output_spread + 16,
                                    max_seqs_per_batch=args.batch, enable_prefix_cache=False,
                                    enable_graph=False if args.eager else None))
    runner = engine.runner
    drafts = [runner.draft, None, runner.draft]
    if k:
        bad = load_draft(args.bad_draft_dir, main=runner.main, dtype=runner.dtype, device=str(runner.device))
        # Only the other checkpoint's MTP layer: its embedding and head (another seed's, so not shared with
        # the main model by the loader) are the main model's, as they are for the good draft; a draft that
        # held its own would not fit the ahead-of-time packages, which know which tensors are one.
        bad.use_main_head(runner.main.lm_head)
        bad.use_main_embedding(runner.main.model.embed_tokens)
        drafts[1] = bad
    spread = random.Random(5)
    params = [SamplingParams(temperature=0, ignore_eos=True,
                             max_tokens=args.output_len + spread.randint(-args.output_spread, args.output_spread))
              for _ in range(997)]
    served, in_flight, steps = 0, set(), []

    def top_up():
        nonlocal served
        while len(in_flight) < args.batch:
            rid = f"r{served}"
            engine.add_request(rid, prompts[served % len(prompts)], params[served % len(params)])
            in_flight.add(rid)
            served += 1

    if k:  # each draft once before the clock starts: in graph mode, the bad draft's own graphs compile here
        runner.swap_draft(drafts[1])
        runner.swap_draft(drafts[0])
    top_up()
    for _ in range(20):  # warm-up steps, not recorded
        for out in engine.step():
            if out.finished:
                in_flight.discard(out.request_id)
        top_up()
    start = time.perf_counter()
    for phase, draft in enumerate(drafts):
        if k:
            runner.swap_draft(draft)
        phase_end = start + (phase + 1) * args.phase_seconds
        while time.perf_counter() < phase_end:
            produced = 0
            for out in engine.step():
                produced += len(out.new_token_ids)
                if out.finished:
                    in_flight.discard(out.request_id)
            top_up()
            step = engine.last_step
            steps.append((time.perf_counter() - start, step.num_speculative_tokens if step else k, produced))
    return steps


def bins(steps, total_s: float) -> tuple[list[float], list[float]]:
    n = int(total_s / BIN_S)
    tokens, ks = [0.0] * n, [[] for _ in range(n)]
    for t, k, produced in steps:
        i = min(int(t / BIN_S), n - 1)
        tokens[i] += produced
        ks[i].append(k)
    return [x / BIN_S for x in tokens], [statistics.mean(v) if v else float("nan") for v in ks]


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    prompts = build_prompts(load_tokenizer(args.model_dir), 64, args.input_len, seed=3)
    systems = {"k=0": (0, False), f"k={args.k}": (args.k, False), f"adaptive K={args.k}": (args.k, True)}
    total = 3 * args.phase_seconds
    results = {}
    for name, (k, adaptive) in systems.items():
        steps = run_system(args, k, adaptive, prompts)
        tok_s, mean_k = bins(steps, total)
        per_phase = []
        for phase in range(3):
            lo, hi = phase * args.phase_seconds, (phase + 1) * args.phase_seconds
            inside = [s for s in steps if lo <= s[0] < hi]
            per_phase.append({"tokens_per_s": sum(s[2] for s in inside) / args.phase_seconds,
                              "mean_k": statistics.mean(s[1] for s in inside) if inside else None})
        results[name] = {"tokens_per_s": tok_s, "mean_k": mean_k, "phases": per_phase}
        print(name, per_phase, flush=True)
    adaptive = results[f"adaptive K={args.k}"]["mean_k"]
    good_level = statistics.mean(x for x in adaptive[: int(args.phase_seconds / BIN_S)] if x == x)

    def first_bin_after(t0: float, test) -> float | None:
        for i in range(int(t0 / BIN_S), len(adaptive)):
            if adaptive[i] == adaptive[i] and test(adaptive[i]):
                return (i + 1) * BIN_S - t0  # the end of the first bin that passes
        return None

    fall_s = first_bin_after(args.phase_seconds, lambda m: m <= 0.25)
    back_s = first_bin_after(2 * args.phase_seconds, lambda m: m >= 0.75 * good_level)
    summary = {"adaptive_mean_k_good_phase": good_level, "seconds_to_fall_to_k0": fall_s,
               "seconds_to_return": back_s}
    (args.out / "drift.json").write_text(json.dumps({"settings": vars(args) | {"out": str(args.out)},
                                                      "bin_s": BIN_S, "results": results, "summary": summary},
                                                     indent=2))
    lines = ["| system | good draft tok/s (mean k) | bad draft tok/s (mean k) | good again tok/s (mean k) |",
             "|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | " + " | ".join(
            f"{p['tokens_per_s']:.1f} ({p['mean_k']:.2f})" for p in r["phases"]) + " |")
    lines.append(f"\nadaptive: mean k {good_level:.2f} with the good draft; fell to mean k <= 0.25 within "
                 f"{fall_s} s of the swap to the bad draft; back to >= 75% of that within {back_s} s of the "
                 f"good draft's return ({BIN_S} s bins)")
    (args.out / "drift.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(results, args, args.out / "drift.png")


def plot(results: dict, args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for name, r in results.items():
        t = [(i + 0.5) * BIN_S for i in range(len(r["tokens_per_s"]))]
        top.plot(t, r["tokens_per_s"], label=name, lw=2 if name.startswith("adaptive") else 1)
        if name.startswith("adaptive"):
            bottom.plot(t, r["mean_k"], label=name, color="C2", lw=2)
    for ax in (top, bottom):
        for edge in (args.phase_seconds, 2 * args.phase_seconds):
            ax.axvline(edge, color="grey", ls="--", lw=0.8)
    top.set(ylabel="output tokens/s", title=f"draft swapped for another seed's at {args.phase_seconds:.0f} s, "
                                             f"back at {2 * args.phase_seconds:.0f} s (batch {args.batch})")
    top.legend()
    bottom.set(xlabel="seconds", ylabel="mean k per step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
