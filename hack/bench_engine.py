#!/usr/bin/env python
"""Engine benchmark: transformers generate() vs our engine with k = 0..3 MTP drafts.

On the trained `mtp make-tiny --preset bench` checkpoints, the same held-out
prompts (as many as the largest batch; a smaller batch size runs them all, one
batch after another), greedy, measured side by side in one run: tokens/s and
time per output token at each batch size, per-position acceptance, mean tokens per
verify step, efficiency = (speed-up over k=0) / (tokens per verify step), and
the target ratios. Every k's output is checked token-for-token against k=0.
Writes results.json, results.md and speedup.png into OUT_DIR.

    python hack/bench_engine.py OUT_DIR [--archs deepseek_v3,glm4_moe] [--train-steps N] [--enable-graph]
                                        [--adaptive K] [--model DIR]

With --adaptive K an engine with adaptive speculative depth (k chosen every step in 0..K) runs beside
the fixed ks; the summary gives its speed-up over k=0 and over the best fixed k at each batch size,
and the mean k it chose.

With --device (cuda, npu) and --dtype our engine runs on that device and dtype (transformers
stays on the CPU); on CUDA, --enable-graph is experimental (models/graph.py, resolve_graph).

With --enable-graph our engine runs in graph mode (decode steps compiled, as
`mtp serve --enable_graph`), and an eager k=0 runs alongside for reference;
the compile time at start-up is reported, not counted in tokens/s.

Each system runs in a process of its own, as a deployment runs one engine per
process (engines sharing one process share the compiler's caches, the
allocator and the CPU caches, and their timings drifted with the order they
were built in). The processes start together and then take turns: one
measures while the others wait, idle, for their next turn. With
--in-process every system is built in this process instead: with the decode
steps compiled ahead of time (the default of graph mode) no compiler state is
left to drift, two engines of the same settings ran within 0.1% of each
other (k = 3, batch 1, 4 rounds), and the ratios' spread over the repeats
narrowed (adaptive over k = 0 at batch 1: 1.08-1.09 within a run, where runs
with a process per system spread 0.85-1.28). The turns are one
batch long: each batch of prompts is run by every system before the next
batch (the system that goes first rotates), so a slow spell of the machine,
which on shared cores comes and goes within a second, lands on every system
alike instead of on whichever one was running a whole pass of the prompts
then. A repeat is one pass of every system over the prompts; its time per
system is the sum of that system's batches. Figures are medians over the
repeats; a speed-up is the median of the ratios within each repeat, and the
adaptive rows of the targets show the lowest and highest of those ratios beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import multiprocessing
import pstats
import statistics
import time
from pathlib import Path

import torch

from mtp_runtime import LLM, SamplingParams
from mtp_runtime.bench.prompts import build_prompts, load_tokenizer
from mtp_runtime.cli import main as mtp_main

TARGETS = {  # name -> (description, minimum)
    "k1_over_k0_batch1": ("k=1 / k=0 tokens/s at batch 1", 1.45),
    "best_k_over_k0_batch1": ("best k / k=0 tokens/s at batch 1", 1.8),
    "k1_over_k0_batch16": ("k=1 / k=0 tokens/s at batch 16", 1.2),
    "min_efficiency": ("lowest efficiency over k, batch 1", 0.8),
    "k0_over_transformers_batch1": ("our k=0 / transformers tokens/s at batch 1", 2.0),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", type=Path)
    p.add_argument("--archs", default="deepseek_v3,glm4_moe")
    p.add_argument("--model", default=None,
                   help="an existing checkpoint (a bench preset built earlier) instead of building one; its "
                        "config's model_type is the arch, and --archs and the training flags are not used")
    p.add_argument("--no-profile", action="store_true",
                   help="skip the cProfile of a k=1 batch-1 run that follows missed targets")
    p.add_argument("--train-steps", type=int, default=None, help="default: the bench preset's")
    p.add_argument("--train-batch", type=int, default=None, help="default: make-tiny's")
    p.add_argument("--train-seq-len", type=int, default=None, help="default: make-tiny's")
    p.add_argument("--train-threads", type=int, default=None,
                   help="default: make-tiny's (part of its cache key: match an earlier build to reuse it)")
    p.add_argument("--distill-steps", type=int, default=None, help="MTP self-distillation; default: the preset's")
    p.add_argument("--distill-chain", type=int, default=None,
                   help="draft positions the distillation trains; default: the preset's")
    p.add_argument("--ks", default="0,1,2,3")
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--waves", type=int, default=1,
                   help="each batch size runs at least this many batches one after another (default 1: the "
                        "largest batch runs once); more makes the large batches' runs long enough to time")
    p.add_argument("--repeats", type=int, default=9,
                   help="runs per point: medians of the figures, and of the ratios within each run")
    p.add_argument("--threads", type=int, default=1, help="torch threads, the same for every system")
    p.add_argument("--device", default="cpu", help="our engine's device (cpu, cuda[:i], npu[:i]); transformers "
                                                   "runs on the CPU")
    p.add_argument("--dtype", default="float32", help="our engine's dtype (float32, bfloat16, float16)")
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--in-process", action="store_true",
                   help="every system in this process, built one after another (module docstring); the "
                        "turns are the same")
    p.add_argument("--enable-graph", action="store_true", help="our engine in graph mode (torch.compile)")
    p.add_argument("--adaptive", type=int, default=0, metavar="K",
                   help="also run adaptive speculative depth with k in 0..K (0: not)")
    return p.parse_args()


def build_model(arch: str, out_dir: Path, train: dict) -> str:
    """The bench preset checkpoint (make-tiny caches the trained weights by their arguments)."""
    model_dir = out_dir / "models" / arch
    args = ["make-tiny", "--arch", arch, "--preset", "bench", "--out", str(model_dir), "--force"]
    for flag, value in train.items():
        if value is not None:
            args += [flag, str(value)]
    if mtp_main(args) != 0:
        raise SystemExit(f"mtp make-tiny failed for {arch}")
    return str(model_dir)


def model_arch(model_dir: str) -> str:
    """The arch of an existing checkpoint (`--model`): its config's model_type."""
    config = Path(model_dir, "config.json")
    try:
        return json.loads(config.read_text())["model_type"]
    except (OSError, ValueError, KeyError) as exc:
        raise SystemExit(f"--model: {config} gives no model_type ({exc})") from None


class EngineSystem:
    """Our engine with k drafts per step (k = 0: plain decoding)."""

    def __init__(self, model_dir: str, k: int, max_model_len: int, max_batch: int, enable_graph: bool = False,
                 adaptive: bool = False, device: str = "cpu", dtype: str = "float32"):
        self.k = k
        self.llm = LLM(model_dir, num_speculative_tokens=k, max_model_len=max_model_len,
                       max_seqs_per_batch=max_batch, enable_prefix_cache=False, enable_graph=enable_graph,
                       speculative_adaptive=adaptive, device=device, dtype=dtype)
        self.compile_s = self.llm.engine.runner.graph_warm_up_s + self.llm.engine.policy_warm_up_s
        self.chosen: list[int] = []  # each step's k
        engine_step = self.llm.engine.step

        def step():
            outs = engine_step()
            if self.llm.engine.last_step is not None:
                self.chosen.append(self.llm.engine.last_step.num_speculative_tokens)
            return outs
        self.llm.engine.step = step

    def run(self, prompts, max_tokens: int):
        return self.llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))

    def point(self, outs, seconds: float, max_tokens: int) -> dict:
        drafted = sum(o.draft_tokens for o in outs)
        steps = sum(o.verify_steps for o in outs)
        # (with adaptive depth a request's list stops at the deepest k it verified)
        per_pos = [sum(o.accepted_per_position[j] for o in outs if j < len(o.accepted_per_position))
                   for j in range(self.k)]
        chosen, self.chosen = self.chosen, []
        return {"mean_k": sum(chosen) / len(chosen) if chosen else None,
                "acceptance_rate": sum(per_pos) / drafted if drafted else None,
                "acceptance_per_position": [n / steps for n in per_pos] if steps else [],
                "tokens_per_verify_step": (sum(per_pos) + steps) / steps if steps else 1.0,
                "token_ids": [o.token_ids for o in outs]}


class TransformersSystem:
    """Hugging Face transformers generate() on the same checkpoint (greedy, equal-length prompts)."""

    def __init__(self, model_dir: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def run(self, prompts, max_tokens: int):
        ids = torch.tensor(prompts)  # equal-length prompts: no padding
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=0)
        return out[:, ids.shape[1]:].tolist()

    def point(self, outs, seconds: float, max_tokens: int) -> dict:
        return {"token_ids": outs}


def build_system(kind: str, args: tuple):
    return TransformersSystem(*args) if kind == "transformers" else EngineSystem(*args)


class LocalSystem:
    """A system in this process (--in-process), with IsolatedSystem's calls."""

    def __init__(self, name: str, kind: str, args: tuple):
        self.name = name
        self.system = build_system(kind, args)
        self.compile_s = getattr(self.system, "compile_s", 0.0)
        self.outs: list = []

    def wait_ready(self) -> None:
        pass

    def run(self, groups: list, max_tokens: int) -> float:
        start = time.perf_counter()
        for prompts in groups:
            self.outs += self.system.run(prompts, max_tokens)
        return time.perf_counter() - start

    def take_point(self, seconds: float, max_tokens: int) -> dict:
        outs, self.outs = self.outs, []
        return self.system.point(outs, seconds, max_tokens)

    def timed_run(self, groups: list, max_tokens: int) -> tuple[float, dict]:
        seconds = self.run(groups, max_tokens)
        return seconds, self.take_point(seconds, max_tokens)

    def close(self) -> None:
        pass


def _serve_system(conn, kind: str, args: tuple, threads: int) -> None:
    """Worker process: build one system, then run what the driver sends until it sends None."""
    torch.set_num_threads(threads)
    try:
        system = build_system(kind, args)
    except BaseException as exc:  # reported by the driver, which stops the run
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ok", getattr(system, "compile_s", 0.0)))
    outs: list = []  # the outputs since the last point
    while (job := conn.recv()) is not None:
        try:
            if job[0] == "run":  # ("run", groups, max_tokens) -> the seconds they took
                _, groups, max_tokens = job
                start = time.perf_counter()
                for prompts in groups:  # one batch after the other, as a client with this many slots sends them
                    outs += system.run(prompts, max_tokens)
                conn.send(("ok", time.perf_counter() - start))
            else:  # ("point", seconds, max_tokens) -> the figures of the runs since the last point
                _, seconds, max_tokens = job
                conn.send(("ok", system.point(outs, seconds, max_tokens)))
                outs = []
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
            return


class IsolatedSystem:
    """A system in a process of its own (module docstring)."""

    def __init__(self, name: str, kind: str, args: tuple, threads: int):
        ctx = multiprocessing.get_context("spawn")
        self.name = name
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve_system, args=(child, kind, args, threads), daemon=True)
        self.process.start()
        child.close()  # the worker holds its end now: if it dies, a receive here ends instead of waiting
        self.compile_s = 0.0

    def _receive(self, doing: str):
        try:
            status, value = self.conn.recv()
        except EOFError:
            self.process.join(5)
            raise SystemExit(f"{self.name}: its process exited while {doing} "
                             f"(exit code {self.process.exitcode})") from None
        if status == "error":
            raise SystemExit(f"{self.name}: failed while {doing}: {value}")
        return value

    def wait_ready(self) -> None:
        self.compile_s = self._receive("starting")

    def run(self, groups: list, max_tokens: int) -> float:
        """Generate for each group of prompts in turn (each group one batch); the seconds of all."""
        self.conn.send(("run", groups, max_tokens))
        return self._receive(f"generating for {sum(len(g) for g in groups)} prompt(s) in batches of "
                             f"{max(len(g) for g in groups)}")

    def take_point(self, seconds: float, max_tokens: int) -> dict:
        """The figures (acceptance, chosen k, outputs) of every run since the last point, which took
        `seconds` in all."""
        self.conn.send(("point", seconds, max_tokens))
        return self._receive("reporting its figures")

    def timed_run(self, groups: list, max_tokens: int) -> tuple[float, dict]:
        """`run`, then the point of that run alone."""
        seconds = self.run(groups, max_tokens)
        return seconds, self.take_point(seconds, max_tokens)

    def close(self) -> None:
        with contextlib.suppress(OSError):  # a worker that already exited has closed its end
            self.conn.send(None)
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()


def batch_groups(prompts: list, batch: int) -> list[list]:
    """The prompts in consecutive batches of `batch` (the last one may be smaller): every batch size
    runs every prompt, so its acceptance and speed-up are not those of the first few prompts."""
    return [prompts[i:i + batch] for i in range(0, len(prompts), batch)]


def measure(systems: dict, prompts, batches, max_tokens: int, repeats: int, waves: int = 1) -> dict:
    """Median of `repeats` wall times per system and batch size, each time over the prompts in
    batches of that size: all of them, or at least `waves` batches' worth for every size. Within a
    repeat the systems take turns batch by batch, the first of each turn rotating (module
    docstring), so load changes on the machine hit all of them alike."""
    for system in systems.values():
        system.timed_run([prompts[:2]], 8)  # warm-up
    names = list(systems)
    results = {name: {} for name in systems}
    for b in batches:
        used = prompts[:max(max(batches), waves * b)]
        groups = batch_groups(used, b)
        samples = {name: [] for name in systems}
        for repeat in range(repeats):
            seconds = dict.fromkeys(names, 0.0)
            for i, group in enumerate(groups):
                first = (repeat * len(groups) + i) % len(names)
                for name in names[first:] + names[:first]:
                    seconds[name] += systems[name].run([group], max_tokens)
            for name, system in systems.items():
                samples[name].append(seconds[name])
                results[name][b] = system.take_point(seconds[name], max_tokens)
        for name in systems:
            seconds = statistics.median(samples[name])
            # ms / output token: the time a sequence waits for each of its tokens, batch after batch
            results[name][b].update(seconds=seconds, seconds_samples=samples[name],
                                    tokens_per_s=len(used) * max_tokens / seconds,
                                    tpot_ms=1e3 * seconds / (len(groups) * max_tokens))
        print(b, {name: round(results[name][b]["tokens_per_s"], 1) for name in systems}, flush=True)
    return results


def paired_ratios(point: dict, base: dict) -> list[float]:
    """tokens/s of `point` over `base` within each repeat (the two ran back to back, so a slow spell
    of the machine hits both), else the one ratio of the two figures."""
    a, b = point.get("seconds_samples"), base.get("seconds_samples")
    if a and b and len(a) == len(b):
        return [sb / sa for sa, sb in zip(a, b)]
    return [point["tokens_per_s"] / base["tokens_per_s"]]


def speedup_over(point: dict, base: dict) -> float:
    """tokens/s of `point` over `base`: the median of `paired_ratios`."""
    return statistics.median(paired_ratios(point, base))


def summarize(systems: dict, ks, batches) -> dict:
    k0 = systems["k=0"]
    speedup = {f"k={k}": {b: speedup_over(systems[f"k={k}"][b], k0[b]) for b in batches} for k in ks}
    efficiency = {f"k={k}": {b: speedup[f"k={k}"][b] / systems[f"k={k}"][b]["tokens_per_verify_step"]
                             for b in batches} for k in ks if k}
    lossless = {f"k={k}": all(systems[f"k={k}"][b]["token_ids"] == k0[b]["token_ids"] for b in batches) for k in ks}
    adaptive = [name for name in systems if name.startswith("adaptive")]
    for name in adaptive:
        speedup[name] = {b: speedup_over(systems[name][b], k0[b]) for b in batches}
        lossless[name] = all(systems[name][b]["token_ids"] == k0[b]["token_ids"] for b in batches)
    b1, b16 = batches[0], batches[-1]
    ratios = {}
    if 1 in ks:
        ratios["k1_over_k0_batch1"] = speedup["k=1"][b1]
        ratios["k1_over_k0_batch16"] = speedup["k=1"][b16]
    spec_ks = [k for k in ks if k]
    if spec_ks:
        ratios["best_k_over_k0_batch1"] = max(speedup[f"k={k}"][b1] for k in spec_ks)
        ratios["min_efficiency"] = min(efficiency[f"k={k}"][b1] for k in spec_ks)
    if "transformers" in systems:
        tf = systems["transformers"]
        ratios["k0_over_transformers_batch1"] = speedup_over(k0[b1], tf[b1])
        ratios["k0_over_transformers_by_batch"] = {b: speedup_over(k0[b], tf[b]) for b in batches}
        ratios["transformers_output_matches_k0"] = all(tf[b]["token_ids"] == k0[b]["token_ids"] for b in batches)
    spread = {}  # the lowest and highest ratio within a repeat behind each adaptive median
    for name in adaptive:
        # over the best fixed setting (k = 0 included) at each batch size, each ratio within a repeat
        ratios[f"{name}_over_best_fixed"] = {}
        for b in batches:
            best = min(ks, key=lambda k: speedup_over(systems[name][b], systems[f"k={k}"][b]))
            pairs = paired_ratios(systems[name][b], systems[f"k={best}"][b])
            ratios[f"{name}_over_best_fixed"][b] = statistics.median(pairs)
            spread.setdefault(f"{name}_over_best_fixed", {})[b] = (min(pairs), max(pairs))
        ratios[f"{name}_over_k0"] = speedup[name]
        spread[f"{name}_over_k0"] = {b: (min(pairs), max(pairs)) for b in batches
                                     for pairs in [paired_ratios(systems[name][b], k0[b])]}
    met = {name: ratios[name] >= minimum for name, (_, minimum) in TARGETS.items() if name in ratios}
    for name in adaptive:
        met[f"{name}_over_best_fixed"] = min(ratios[f"{name}_over_best_fixed"].values()) >= 0.97
        met[f"{name}_over_k0"] = min(ratios[f"{name}_over_k0"].values()) >= 1.0
    return {"speedup": speedup, "efficiency": efficiency, "lossless": lossless, "ratios": ratios, "targets_met": met,
            "ratio_spread": spread}


def profile_step(model_dir: str, prompts, max_tokens: int) -> str:
    """Where a k=1, batch-1 run spends its time (top functions by own time)."""
    llm = LLM(model_dir, num_speculative_tokens=1, max_model_len=len(prompts[0]) + max_tokens + 8)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], params)
    prof = cProfile.Profile()
    prof.enable()
    llm.generate(prompts[:1], params)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(15)
    return text.getvalue()


def markdown(arch: str, systems: dict, summary: dict, ks, batches) -> str:
    lines = [f"## {arch}", "", "| system | batch | tokens/s | ms / output token | speed-up vs k=0 | accepted "
             "per position | tokens / verify step | efficiency | mean k |", "|---|---|---|---|---|---|---|---|---|"]
    for name, points in systems.items():
        for b in batches:
            p = points[b]
            sp = summary["speedup"].get(name, {}).get(b)
            eff = summary["efficiency"].get(name, {}).get(b)
            acc = ", ".join(f"{a:.2f}" for a in p.get("acceptance_per_position", []))
            tpv = p.get("tokens_per_verify_step")
            mean_k = p.get("mean_k")
            lines.append(f"| {name} | {b} | {p['tokens_per_s']:.1f} | {p['tpot_ms']:.2f} | "
                         f"{'' if sp is None else f'{sp:.2f}x'} | {acc} | {'' if tpv is None else f'{tpv:.2f}'} | "
                         f"{'' if eff is None else f'{eff:.2f}'} | {'' if mean_k is None else f'{mean_k:.2f}'} |")
    lines += ["", "| target | measured | minimum | met |", "|---|---|---|---|"]
    for name, (desc, minimum) in TARGETS.items():
        if name in summary["ratios"]:
            lines.append(f"| {desc} | {summary['ratios'][name]:.2f} | {minimum} | "
                         f"{'yes' if summary['targets_met'][name] else 'NO'} |")
    for name, by_batch in summary["ratios"].items():
        if name.startswith("adaptive"):
            spread = summary.get("ratio_spread", {}).get(name, {})
            lines.append(f"| {name} | " + ", ".join(
                f"b{b}: {v:.2f}" + (f" ({spread[b][0]:.2f}-{spread[b][1]:.2f})" if b in spread else "")
                for b, v in by_batch.items()) + " | "
                         f"{0.97 if name.endswith('best_fixed') else 1.0} | "
                         f"{'yes' if summary['targets_met'][name] else 'NO'} |")
    lines.append(f"\nlossless (greedy k>0 == k=0): {summary['lossless']}; transformers output == k=0: "
                 f"{summary['ratios'].get('transformers_output_matches_k0')}\n")
    return "\n".join(lines)


def plot(results: dict, batches, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    for ax, (arch, res) in zip(axes[0], results.items()):
        for name, by_batch in res["summary"]["speedup"].items():
            ax.plot(batches, [by_batch[b] for b in batches], marker="o", label=name)
        ax.set(title=arch, xlabel="batch size", ylabel="tokens/s speed-up over k=0", xscale="log")
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    ks = [int(k) for k in args.ks.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    results, md = {}, []
    archs = [model_arch(args.model)] if args.model else args.archs.split(",")
    for arch in archs:
        train = {"--train-steps": args.train_steps, "--train-batch": args.train_batch,
                 "--train-seq-len": args.train_seq_len, "--train-threads": args.train_threads,
                 "--distill-steps": args.distill_steps, "--distill-chain": args.distill_chain}
        model_dir = args.model or build_model(arch, args.out_dir, train)
        prompts = build_prompts(load_tokenizer(model_dir), max(batches) * max(1, args.waves), args.prompt_len,
                                seed=0)
        max_model_len = args.prompt_len + args.max_tokens + 8
        specs = {} if args.no_transformers else {"transformers": ("transformers", (model_dir,))}
        placed = (args.device, args.dtype)
        if args.enable_graph:
            specs["k=0 eager"] = ("engine", (model_dir, 0, max_model_len, max(batches), False, False, *placed))
        specs.update({f"k={k}": ("engine", (model_dir, k, max_model_len, max(batches), args.enable_graph, False,
                                            *placed))
                      for k in ks})
        if args.adaptive:
            specs[f"adaptive K={args.adaptive}"] = ("engine", (model_dir, args.adaptive, max_model_len, max(batches),
                                                               args.enable_graph, True, *placed))
        if args.in_process:
            runners = {name: LocalSystem(name, kind, sargs) for name, (kind, sargs) in specs.items()}
        else:
            runners = {name: IsolatedSystem(name, kind, sargs, args.threads) for name, (kind, sargs) in specs.items()}
        try:
            for runner in runners.values():
                runner.wait_ready()
            compile_s = {name: round(r.compile_s, 1) for name, r in runners.items() if r.compile_s}
            print(f"{arch}: graph compile seconds at start-up, processes starting together {compile_s}",
                  flush=True)
            systems = measure(runners, prompts, batches, args.max_tokens, args.repeats, args.waves)
        finally:
            for runner in runners.values():
                runner.close()
        summary = summarize(systems, ks, batches)
        if "k=0 eager" in systems:
            summary["ratios"]["k0_graph_over_eager_by_batch"] = {
                b: speedup_over(systems["k=0"][b], systems["k=0 eager"][b]) for b in batches}
            summary["graph_compile_s"] = compile_s
        if not all(summary["targets_met"].values()) and not args.no_profile:
            summary["profile_k1_batch1"] = profile_step(model_dir, prompts, args.max_tokens)
        for points in systems.values():
            for p in points.values():
                p.pop("token_ids")
        results[arch] = {"systems": systems, "summary": summary}
        md.append(markdown(arch, systems, summary, ks, batches))
        print(md[-1], flush=True)
    settings = {k: v for k, v in vars(args).items() if k != "out_dir"}
    (args.out_dir / "results.json").write_text(json.dumps({"settings": settings, "results": results}, indent=2))
    (args.out_dir / "results.md").write_text("# Engine benchmark\n\n" + json.dumps(settings) + "\n\n" + "\n".join(md))
    plot(results, batches, args.out_dir / "speedup.png")
    print(f"wrote {args.out_dir}/results.json, results.md, speedup.png")


if __name__ == "__main__":
    main()
