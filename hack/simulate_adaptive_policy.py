#!/usr/bin/env python
"""Adaptive depth's policy (engine/spec_policy.py) against fixed k, without a model: closed batches of
prompts whose drafts agree more or less often, on step costs measured from an engine.

What the engine benchmark (hack/bench_engine.py) runs is a closed batch: `generate` on b prompts,
then the next b. With speculation the sequences of a batch finish at different steps (acceptance
differs from prompt to prompt), and the batch drains to its slowest sequence: the last steps run
with a few sequences at nearly the cost of a full one. This script replays that workload, step by
step, with the real policy class:

- step cost c(k, b): COSTS_MS (the bench preset's eager step times at k = 0..3 and batch buckets
  1..32, from `LLMEngine.seed_policy` on 2 CPU cores), linear in b between buckets, times a
  machine load that drifts (a random walk) and a per-step noise;
- acceptance: draft j of a sequence is accepted with probability P[j] x q (given the drafts before
  it were), where each prompt draws its q from QUALITY (some continuations are hard for a draft);
- every system sees the same machine (its own random stream) and the same prompts' qualities;
  a step at a higher k than the one before verifies filler for the drafts it did not make, as the
  engine does.

Prints tokens/s over k = 0 for every fixed k and the policy, and the policy over the best fixed k,
per batch size (medians over --seeds), for the current policy and any --switch-margin given.

    python hack/simulate_adaptive_policy.py [--batches 1,4,16,32] [--seeds 8] [--uniform]
                                            [--switch-margin 0.1,0.2] [--json OUT]

With --serve 4,16,32 it replays `mtp bench`'s open system instead (`serve`): closed-loop clients
whose requests all have the same length. A level of few requests per client is mostly its start and
its drain, where, as in a closed batch, speculation leaves a ragged tail that k = 0 does not.

    python hack/simulate_adaptive_policy.py --serve 4,16,32 [--requests-per-client 2,8]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

from mtp_runtime.engine.spec_policy import AdaptivePolicy, bucket_sizes  # noqa: E402

BUCKETS = (1, 2, 4, 8, 16, 32)
COSTS_MS = {  # k -> step milliseconds at each bucket of BUCKETS
    0: (9.90, 8.25, 8.90, 10.67, 12.69, 17.72),
    1: (10.91, 10.03, 11.09, 13.60, 17.49, 26.58),
    2: (12.90, 12.27, 13.57, 16.96, 23.44, 36.24),
    3: (14.02, 14.06, 16.12, 20.70, 28.39, 44.69),
}
P = (0.77, 0.55, 0.38)  # per-position acceptance on the bench preset (hack/bench_engine.py, k = 3)
# A prompt's multiplier of P: the deciles of the first draft's acceptance per sequence on the bench
# preset (128 held-out prompts, k = 3, 64 tokens: 0.0, 0.62, 0.74, ... 1.0), over P[0].
# A 128-token prompt's share of a step, estimated (no prefill was timed): the marginal cost of a
# token at batch 32 (k = 3 over k = 0 in COSTS_MS: 96 more tokens), times 128.
PROMPT_MS = (44.69 - 17.72) / 96 * 128
QUALITY = tuple(p1 / P[0] for p1 in (0.0, 0.62, 0.74, 0.82, 0.85, 0.87, 0.89, 0.94, 0.95, 1.0))


def step_seconds(k: int, batch: int) -> float:
    """c(k, b) of the cost table, linear in the batch size between buckets."""
    costs = COSTS_MS[k]
    if batch <= BUCKETS[0]:
        return costs[0] / 1e3
    for i in range(len(BUCKETS) - 1):
        lo, hi = BUCKETS[i], BUCKETS[i + 1]
        if batch <= hi:
            f = (batch - lo) / (hi - lo)
            return (costs[i] * (1 - f) + costs[i + 1] * f) / 1e3
    return costs[-1] * batch / BUCKETS[-1] / 1e3


class Machine:
    """The step times a run sees: the cost table times a drifting load and per-step noise."""

    def __init__(self, seed: int, noise: float, drift: float):
        self.rng, self.noise, self.drift, self.load = random.Random(seed), noise, drift, 1.0

    def time(self, k: int, batch: int) -> float:
        self.load = min(1.6, max(0.6, self.load * math.exp(self.rng.gauss(0, self.drift))))
        return step_seconds(k, batch) * self.load * math.exp(self.rng.gauss(0, self.noise))


def seed_policy(policy: AdaptivePolicy, machine: Machine, max_batch: int, reps: int = 5) -> None:
    """As LLMEngine.seed_policy: every k at every bucket, the depths taking turns."""
    for b in bucket_sizes(max_batch):
        for _ in range(reps):
            for k in range(policy.max_k + 1):
                policy.record_step(k, b, machine.time(k, b))


def run(batch: int, seed: int, fixed: int | None = None, policy: AdaptivePolicy | None = None,
        waves: int = 4, tokens: int = 64, noise: float = 0.1, drift: float = 0.02,
        quality: tuple[float, ...] = QUALITY, drain: bool = True) -> tuple[float, float]:
    """One closed-batch run: `waves` batches of `batch` prompts, `tokens` each, one after another, at a
    fixed k or with `policy`; `drain`: the policy is told the batch is closed, with every sequence's
    tokens left and verifies, as LLM.generate's engine tells it. Returns (tokens/s, mean k per step)."""
    machine = Machine(seed + 7919, noise, drift)
    luck = random.Random(seed)  # the drafts' accept/reject draws
    if policy is not None:
        seed_policy(policy, Machine(seed + 104729, noise, drift), batch)
    seconds, ks = 0.0, []
    for wave in range(waves):
        left = [tokens] * batch
        drafted = [0] * batch  # drafts the sequence's previous step made for this one
        prompts = random.Random(seed * 1009 + wave)  # the wave's prompts: the same for every system
        q = [prompts.choice(quality) for _ in range(batch)]
        tried = [[0] * len(P) for _ in range(batch)]
        hits = [[0] * len(P) for _ in range(batch)]
        while any(n > 0 for n in left):
            live = [i for i in range(batch) if left[i] > 0]
            if policy is None:
                k = fixed
            else:
                k = policy.choose(len(live), [(left[i], tried[i], hits[i]) for i in live] if drain else None)
            for i in live:
                real, accepted = min(k, drafted[i]), 0
                while accepted < real and luck.random() < min(0.98, P[accepted] * q[i]):
                    accepted += 1
                for j in range(min(accepted + 1, real)):
                    tried[i][j] += 1
                    hits[i][j] += j < accepted
                if policy is not None and real:
                    policy.record_verify(real, accepted)
                left[i] -= 1 + accepted
                drafted[i] = k
            t = machine.time(k, len(live))
            if policy is not None:
                policy.record_step(k, len(live), t)
                policy.end_step()
            seconds += t
            ks.append(k)
    return batch * tokens * waves / seconds, sum(ks) / len(ks)


def serve(clients: int, seed: int, fixed: int | None = None, policy: AdaptivePolicy | None = None,
          requests_per_client: int = 2, tokens: int = 64, prompt_ms: float = PROMPT_MS, noise: float = 0.1,
          drift: float = 0.02, quality: tuple[float, ...] = QUALITY) -> tuple[float, float]:
    """An open system, as `mtp bench` drives a server: `clients` closed-loop clients, each sending
    `requests_per_client` requests of `tokens` output tokens one after another (the next one joins the
    step after its last one finished; its prompt costs `prompt_ms` in that step and yields its first
    token). The policy is never told the batch is closed (a server cannot know), and a step that
    carries a prompt is no cost evidence, as in the engine. Returns (tokens/s, mean k per step)."""
    machine = Machine(seed + 7919, noise, drift)
    luck = random.Random(seed)
    prompts = random.Random(seed * 1009)
    if policy is not None:
        seed_policy(policy, Machine(seed + 104729, noise, drift), clients)
    sent = [0] * clients
    left: dict[int, int] = {}  # client -> tokens its running request still needs
    drafted: dict[int, int] = {}
    q: dict[int, float] = {}
    seconds, ks = 0.0, []
    while left or any(n < requests_per_client for n in sent):
        joining = [i for i in range(clients) if i not in left and sent[i] < requests_per_client]
        decoding = list(left)
        k = fixed if policy is None else policy.choose(len(decoding) + len(joining))
        for i in decoding:
            real, accepted = min(k, drafted[i]), 0
            while accepted < real and luck.random() < min(0.98, P[accepted] * q[i]):
                accepted += 1
            if policy is not None and real:
                policy.record_verify(real, accepted)
            left[i] -= 1 + accepted
            drafted[i] = k
        t = (machine.time(k, len(decoding)) if decoding else 0.0) + len(joining) * prompt_ms / 1e3
        if policy is not None:
            if decoding and not joining:
                policy.record_step(k, len(decoding), t)
            policy.end_step()
        for i in joining:
            sent[i] += 1
            left[i], drafted[i], q[i] = tokens - 1, k, prompts.choice(quality)
        for i in [i for i, n in left.items() if n <= 0]:
            del left[i]
        seconds += t
        ks.append(k)
    return clients * requests_per_client * tokens / seconds, sum(ks) / len(ks)


def compare(batches: list[int], seeds: int, policies: dict, **workload) -> dict:
    """Per batch size: every fixed k's and every policy's tokens/s over k = 0 (medians over seeds), and
    each policy over the best fixed k and its mean k."""
    out = {}
    for b in batches:
        fixed = [statistics.median(run(b, s, fixed=k, **workload)[0] for s in range(seeds)) for k in COSTS_MS]
        row = {f"k={k}": fixed[k] / fixed[0] for k in COSTS_MS}
        for name, (make, drain) in policies.items():
            results = [run(b, s, policy=make(), drain=drain, **workload) for s in range(seeds)]
            speed = statistics.median(r[0] for r in results)
            row[name] = speed / fixed[0]
            row[f"{name} / best fixed"] = speed / max(fixed)
            row[f"{name} mean k"] = statistics.mean(r[1] for r in results)
        out[b] = row
    return out


def compare_serving(levels: list[int], seeds: int, per_client: list[int], **workload) -> dict:
    """Per concurrency and requests per client: as compare, for the open system of `serve`."""
    out = {}
    for c in levels:
        for n in per_client:
            fixed = [statistics.median(serve(c, s, fixed=k, requests_per_client=n, **workload)[0] for s in range(seeds))
                     for k in COSTS_MS]
            results = [serve(c, s, policy=AdaptivePolicy(3), requests_per_client=n, **workload) for s in range(seeds)]
            speed = statistics.median(r[0] for r in results)
            row = {f"k={k}": fixed[k] / fixed[0] for k in COSTS_MS}
            row |= {"adaptive": speed / fixed[0], "adaptive / best fixed": speed / max(fixed),
                    "adaptive mean k": statistics.mean(r[1] for r in results)}
            out[f"c={c}, {n} per client"] = row
    return out


def print_table(first: str, table: dict) -> None:
    columns = list(next(iter(table.values())))
    print(f"| {first} | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for key, row in table.items():
        print(f"| {key} | " + " | ".join(f"{row[c]:.3f}" for c in columns) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,4,16,32")
    p.add_argument("--seeds", type=int, default=8)
    p.add_argument("--waves", type=int, default=4)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--noise", type=float, default=0.1, help="per-step log-normal noise of the step time")
    p.add_argument("--uniform", action="store_true", help="every prompt's drafts agree alike (q = 1)")
    p.add_argument("--switch-margin", default="", help="also run the policy with these switch margins")
    p.add_argument("--serve", default="", help="instead: the open system of `serve` at these concurrencies")
    p.add_argument("--requests-per-client", default="2,8",
                   help="with --serve: each client's requests in a turn (mtp bench's default level: 4 per "
                        "client in 2 turns, so 2)")
    p.add_argument("--prompt-ms", type=float, default=PROMPT_MS,
                   help="with --serve: a prompt's cost in the step it joins (default: an estimate, PROMPT_MS)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    policies = {"adaptive": (lambda: AdaptivePolicy(3), True),
                "adaptive per step": (lambda: AdaptivePolicy(3), False)}  # not told the batch is closed
    for m in filter(None, args.switch_margin.split(",")):
        policies[f"adaptive margin {m}"] = (lambda m=float(m): AdaptivePolicy(3, switch_margin=m), True)
    quality = (1.0,) if args.uniform else QUALITY
    if args.serve:
        table = compare_serving([int(c) for c in args.serve.split(",")], args.seeds,
                                [int(n) for n in args.requests_per_client.split(",")], tokens=args.tokens,
                                noise=args.noise, quality=quality, prompt_ms=args.prompt_ms)
        print_table("clients", table)
    else:
        workload = dict(waves=args.waves, tokens=args.tokens, noise=args.noise, quality=quality)
        table = compare([int(b) for b in args.batches.split(",")], args.seeds, policies, **workload)
        print_table("batch", table)
    if args.json:
        args.json.write_text(json.dumps({"settings": vars(args) | {"json": str(args.json)}, "table": table},
                                        indent=2))


if __name__ == "__main__":
    main()
