#!/usr/bin/env python
"""Serving benchmark of adaptive speculative depth: `mtp bench`'s client against five local
`mtp serve` processes at once, k = 0, fixed k = 1, 2, 3 and --speculative_adaptive=true with K = 3.

Every server is up for the whole run; at each concurrency level they take turns (mtp bench's
bench_servers: the order flips every turn), and the whole sweep repeats --repeats times. Figures are
medians over the repeats, and a speed-up is the median of the per-repeat ratios. The adaptive
server's mean chosen k per level comes from its mtp_spec_decode_num_speculative_tokens histogram
(_sum / _count scraped around the level). Writes results.json, results.md and speedup.png to OUT.

    python hack/bench_adaptive_serving.py MODEL_DIR OUT [--concurrency 1,2,4,8,16,32] [--repeats 3]
        [--output-spread N] [--settings k=0,k=1,k=3,adaptive K=3]

--settings runs a subset of the servers (k = 0 and the adaptive one always run). With
$MTP_SPEC_POLICY_TRACE naming a file, the adaptive server writes its policy's trace there
(engine/spec_policy.py: every full choice, probe and probe result, one JSON line each).

With --output-spread N each request asks for --output-len + a seeded offset in [-N, N] tokens (the same
on every server): with equal lengths, requests that start together at k = 0 also finish together and
their successors prefill as one batch, cheaper per token than the one-at-a-time prefills of a
speculating server, whose requests finish apart (runtime README, adaptive depth).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
from pathlib import Path

import httpx

from mtp_runtime.bench.local_server import LocalServer
from mtp_runtime.bench.prompts import load_tokenizer
from mtp_runtime.bench.suite import BenchPlan, bench_servers, output_spread_error

SETTINGS = {  # label -> serve flags beyond --model
    "k=0": [],
    "k=1": ["--num_speculative_tokens", "1"],
    "k=2": ["--num_speculative_tokens", "2"],
    "k=3": ["--num_speculative_tokens", "3"],
    "adaptive K=3": ["--num_speculative_tokens", "3", "--speculative_adaptive=true"],
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir")
    p.add_argument("out", type=Path)
    p.add_argument("--concurrency", default="1,2,4,8,16,32")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--output-spread", type=int, default=0,
                   help="output lengths drawn in --output-len +- N (seeded, the same on every server)")
    p.add_argument("--requests-per-level", type=int, default=0, help="0: max(8, --requests-per-client x concurrency)")
    p.add_argument("--requests-per-client", type=int, default=4,
                   help="each client's requests at a level (with --requests-per-level 0)")
    p.add_argument("--rounds", type=int, default=2, help="turns of the servers within a level")
    p.add_argument("--repeats", type=int, default=3, help="sweeps over all levels")
    p.add_argument("--settings", default=",".join(SETTINGS),
                   help="which servers run (k=0 and the adaptive one always do): a comma-separated subset of "
                        + ", ".join(SETTINGS))
    p.add_argument("--serve-args", default="--max_seqs_per_batch 32",
                   help="extra `mtp serve` flags for every server")
    return p.parse_args()


def histogram_totals(text: str, name: str) -> tuple[float, float]:
    def value(suffix: str) -> float:
        match = re.search(rf"^{name}_{suffix} (\S+)$", text, re.M)
        return float(match.group(1)) if match else 0.0
    return value("sum"), value("count")


def main() -> None:
    args = parse_args()
    if args.requests_per_client < 1 or args.requests_per_level < 0:
        raise SystemExit("--requests-per-client must be >= 1 and --requests-per-level >= 0")
    spread_error = output_spread_error(args.output_spread, args.output_len)
    if spread_error:
        raise SystemExit(spread_error)
    chosen = {label.strip() for label in args.settings.split(",") if label.strip()} | {"k=0", "adaptive K=3"}
    unknown = sorted(chosen - set(SETTINGS))
    if unknown:
        raise SystemExit(f"--settings: unknown setting(s) {', '.join(unknown)}; the settings are {', '.join(SETTINGS)}")
    settings = {label: flags for label, flags in SETTINGS.items() if label in chosen}
    args.out.mkdir(parents=True, exist_ok=True)
    levels = [int(c) for c in args.concurrency.split(",")]
    tokenizer = load_tokenizer(args.model_dir)
    extra = args.serve_args.split()
    servers = {}
    try:
        for label, flags in settings.items():
            draft = ["--draft_model", args.model_dir] if flags else []
            servers[label] = LocalServer(["--model", args.model_dir, *draft, *flags, *extra], 900.0)
        urls = {label: server.base_url for label, server in servers.items()}
        adaptive_url = urls["adaptive K=3"]
        samples = {label: {c: [] for c in levels} for label in urls}
        mean_k = {c: [] for c in levels}
        acceptance = {label: {c: [] for c in levels} for label in urls}
        for repeat in range(args.repeats):
            for c in levels:
                plan = BenchPlan(concurrency=[c], input_len=args.input_len, output_len=args.output_len,
                                 requests_per_level=args.requests_per_level, rounds=args.rounds,
                                 requests_per_client=args.requests_per_client, output_spread=args.output_spread,
                                 seed=repeat * 1000 + c, warmup_requests=2 if repeat == 0 and c == levels[0] else 1)
                before = histogram_totals(httpx.get(f"{adaptive_url}/metrics").text,
                                          "mtp_spec_decode_num_speculative_tokens")
                runs = asyncio.run(bench_servers(urls, tokenizer, plan))
                after = histogram_totals(httpx.get(f"{adaptive_url}/metrics").text,
                                         "mtp_spec_decode_num_speculative_tokens")
                steps = after[1] - before[1]
                mean_k[c].append((after[0] - before[0]) / steps if steps else None)
                for label, results in runs.items():
                    level = results[0]
                    if level.failed:
                        raise SystemExit(f"{label}: {level.failed} requests failed at concurrency {c}: "
                                         f"{level.first_error}\n{servers[label].log_tail()}")
                    samples[label][c].append(level.output_tokens_per_s)
                    acceptance[label][c].append(level.acceptance_rate)
                print(f"repeat {repeat} concurrency {c}: " + ", ".join(
                    f"{label} {samples[label][c][-1]:.1f}" for label in urls) + f"; adaptive mean k {mean_k[c][-1]}",
                      flush=True)
    finally:
        for server in servers.values():
            server.stop()

    def ratio(label: str, base: str, c: int) -> float:
        return statistics.median(a / b for a, b in zip(samples[label][c], samples[base][c]))

    fixed = [label for label in settings if not label.startswith("adaptive")]
    summary = {
        "tokens_per_s": {label: {c: statistics.median(samples[label][c]) for c in levels} for label in urls},
        "speedup_over_k0": {label: {c: ratio(label, "k=0", c) for c in levels} for label in urls},
        "adaptive_over_best_fixed": {c: min(ratio("adaptive K=3", f, c) for f in fixed) for c in levels},
        "adaptive_mean_k": {c: statistics.median([m for m in mean_k[c] if m is not None] or [0.0]) for c in levels},
        "acceptance_rate": {label: {c: statistics.median([a for a in acceptance[label][c] if a is not None] or [0.0])
                                    for c in levels} for label in urls if label != "k=0"},
    }
    (args.out / "results.json").write_text(json.dumps({"settings": vars(args) | {"out": str(args.out)},
                                                        "samples": samples, "summary": summary}, indent=2))
    lines = ["| setting | " + " | ".join(f"c={c}" for c in levels) + " |", "|---|" + "---|" * len(levels)]
    for label in urls:
        lines.append(f"| {label} tok/s | " + " | ".join(f"{summary['tokens_per_s'][label][c]:.1f}" for c in levels) + " |")
    for label in urls:
        lines.append(f"| {label} / k=0 | " + " | ".join(f"{summary['speedup_over_k0'][label][c]:.2f}x"
                                                        for c in levels) + " |")
    lines.append("| adaptive / best fixed | " + " | ".join(f"{summary['adaptive_over_best_fixed'][c]:.2f}x"
                                                         for c in levels) + " |")
    lines.append("| adaptive mean k | " + " | ".join(f"{summary['adaptive_mean_k'][c]:.2f}" for c in levels) + " |")
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(summary["speedup_over_k0"], levels, args.out / "speedup.png")


def plot(speedup: dict, levels: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, by_level in speedup.items():
        ax.plot(levels, [by_level[c] for c in levels], marker="o", label=label,
                lw=2.5 if label.startswith("adaptive") else 1.2)
    ax.set(xlabel="concurrency", ylabel="output tokens/s over k=0", xscale="log",
           title="mtp bench: speed-up over k=0 (medians)")
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
