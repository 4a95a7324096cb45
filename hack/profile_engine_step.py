"""Where a graph-mode engine step's time goes, part by part: the compiled call against the host's work.

    python hack/profile_engine_step.py --model DIR [--ks 0,3] [--batch 1] [--threads 1] [--rounds 5]
                                       [--aot-step auto|true|false]

For each k an `LLM` in graph mode (one process, the engines take turns within each round, so a change
in the machine's load hits every k alike) generates greedily for `--batch` prompts of `--prompt-len`
tokens, `--max-tokens` each. Two passes a round, each over the same prompts:

- plain: no instrumentation; the step time and tokens/s a user gets;
- parts: timing wrappers around the engine's parts (schedule, execute, the one-call step, update,
  RequestOutput creation), so each part's share of a step is measured in place, and around the two
  calls of torch's AOTI bindings that inductor's C++ wrapper makes just before and just after its
  C++ entry (`unsafe_alloc_void_ptrs_from_tensors`, `alloc_tensors_by_stealing_from_void_ptrs`):
  the time between them is the compiled graph's own, apart from the Python of dynamo, AOT
  autograd and inductor's wrapper around it. With the step compiled ahead of time (the default,
  engine/aot_step.py) the kernel part is the package's one C++ call instead.

Printed: median microseconds per step of each part (medians over rounds), and the shares. The
parts that are differences: "graph call overhead" = one-call step - kernel (guards, stance, the
wrappers' argument lists), "plan + readback" = execute - one-call step (building the plan tensor,
.tolist(), the drafts' bookkeeping), "engine other" = step - its timed parts, "generate loop" = the
time per step outside LLMEngine.step (LLM.generate's loop). The wrappers cost about a microsecond
each; compare "plain" with the parts' sum.

`--clock cpu` (the default) times the parts in this thread's CPU time: on a machine whose cores
other work shares, the time this thread waited for a core does not land in whichever part it
waited in. With more than one torch thread the kernels' other threads are not counted: use
`--clock wall` to compare thread counts.

On a briefly trained or untrained model, k > 0 accepts fewer drafts than on the bench preset, but a
step's cost does not depend on its acceptance: a step is a fixed-shape graph.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections import defaultdict

import torch

from mtp_runtime import LLM, SamplingParams
from mtp_runtime.engine import llm_engine
from mtp_runtime.engine.aot_step import AotDecodeStep
from mtp_runtime.engine.graph_step import GreedyDecodeStep


class PartTimer:
    """Seconds spent in each wrapped callable while `active`."""

    def __init__(self, clock):
        self.clock = clock
        self.active = False
        self.seconds: dict[str, float] = defaultdict(float)
        self._kernel_start = 0.0

    def wrap(self, name: str, fn):
        clock = self.clock

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if not self.active:
                return fn(*args, **kwargs)
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += clock() - start
        return timed

    def kernel_entered(self, fn):
        """Wraps the binding inductor's wrapper calls just before its C++ entry."""
        def before(*args):
            out = fn(*args)
            self._kernel_start = self.clock()
            return out
        return before

    def kernel_returned(self, fn):
        """Wraps the binding inductor's wrapper calls just after its C++ entry."""
        def after(*args):
            if self.active:
                self.seconds["kernel"] += self.clock() - self._kernel_start
            return fn(*args)
        return after

    def take(self) -> dict[str, float]:
        seconds, self.seconds = dict(self.seconds), defaultdict(float)
        return seconds


def instrument(timer: PartTimer) -> None:
    """Wrap the parts at class level, so every engine of the process is timed alike."""
    engine_cls, scheduler_cls = llm_engine.LLMEngine, llm_engine.Scheduler
    engine_cls.step = timer.wrap("step", engine_cls.step)
    scheduler_cls.schedule = timer.wrap("schedule", scheduler_cls.schedule)
    scheduler_cls.update = timer.wrap("update", scheduler_cls.update)
    llm_engine.ModelRunner.execute = timer.wrap("execute", llm_engine.ModelRunner.execute)
    GreedyDecodeStep.__call__ = timer.wrap("one-call step", GreedyDecodeStep.__call__)
    AotDecodeStep.__call__ = timer.wrap("one-call step", AotDecodeStep.__call__)
    llm_engine.RequestOutput.__init__ = timer.wrap("RequestOutput", llm_engine.RequestOutput.__init__)
    # inductor's generated wrapper looks these up on every call (torch._C._aoti.<name>)
    aoti = torch._C._aoti
    aoti.unsafe_alloc_void_ptrs_from_tensors = timer.kernel_entered(aoti.unsafe_alloc_void_ptrs_from_tensors)
    aoti.alloc_tensors_by_stealing_from_void_ptrs = timer.kernel_returned(
        aoti.alloc_tensors_by_stealing_from_void_ptrs)


class TimedPackage:
    """An ahead-of-time step's package (AotDecodeStep._runners): its one C++ call is the kernel part."""

    def __init__(self, timer: PartTimer, runner):
        self.timer, self.runner = timer, runner

    def run(self, inputs):
        timer = self.timer
        if not timer.active:
            return self.runner.run(inputs)
        start = timer.clock()
        try:
            return self.runner.run(inputs)
        finally:
            timer.seconds["kernel"] += timer.clock() - start


def instrument_packages(timer: PartTimer, llm) -> None:
    for step in llm.engine.runner.decode_steps.values():
        if isinstance(step, AotDecodeStep):
            step._runners = {threads: TimedPackage(timer, r) for threads, r in step._runners.items()}


def breakdown(parts: dict[str, float], total: float, steps: int) -> dict[str, float]:
    """Microseconds per step of each part (see the module docstring for the differences)."""
    us = {name: 1e6 * s / steps for name, s in parts.items()}
    kernel_us = us.get("kernel", 0.0)
    step, execute, call = us.get("step", 0.0), us.get("execute", 0.0), us.get("one-call step", 0.0)
    return {
        "compiled graph (kernel)": kernel_us,
        "graph call overhead": call - kernel_us,
        "plan + readback": execute - call,
        "schedule": us.get("schedule", 0.0),
        "update": us.get("update", 0.0),
        "RequestOutput": us.get("RequestOutput", 0.0),
        "engine other": step - execute - us.get("schedule", 0.0) - us.get("update", 0.0)
        - us.get("RequestOutput", 0.0),
        "generate loop": 1e6 * total / steps - step,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--ks", default="0,3")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--aot-step", choices=("auto", "true", "false"), default="auto",
                   help="the one-call step compiled ahead of time (the default) or by torch.compile (false)")
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                   help="cpu: this thread's CPU time (module docstring); wall: perf_counter")
    args = p.parse_args()
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    ks = [int(k) for k in args.ks.split(",")]
    llms = {}
    for k in ks:
        start = time.perf_counter()
        llms[k] = LLM(args.model, num_speculative_tokens=k, max_model_len=args.prompt_len + args.max_tokens + 8,
                      max_seqs_per_batch=args.batch, enable_prefix_cache=False, enable_graph=True,
                      aot_step={"auto": None, "true": True, "false": False}[args.aot_step])
        print(f"k={k}: start-up {time.perf_counter() - start:.1f}s; one-call step "
              f"{llms[k].engine.runner.aot_reason}", flush=True)
    vocab = llms[ks[0]].engine.runner.vocab_size
    prompts = [[(7 + 31 * (i + 1) * j) % (vocab - 3) + 3 for j in range(args.prompt_len)] for i in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    timer = PartTimer(clock)
    instrument(timer)
    for llm in llms.values():
        instrument_packages(timer, llm)
    for llm in llms.values():
        llm.generate(prompts, params)  # warm-up

    def run(llm) -> tuple[float, int]:
        engine = llm.engine
        steps_before = engine._num_steps
        start = clock()
        llm.generate(prompts, params)
        return clock() - start, engine._num_steps - steps_before

    plain = defaultdict(list)
    rows = defaultdict(lambda: defaultdict(list))
    for _ in range(args.rounds):
        for k, llm in llms.items():
            wall, steps = run(llm)
            plain[k].append((wall, steps))
            timer.active = True
            total, steps = run(llm)
            timer.active = False
            for name, us in breakdown(timer.take(), total, steps).items():
                rows[k][name].append(us)
    print(f"\nthreads {args.threads}, batch {args.batch}, prompt {args.prompt_len}, {args.max_tokens} tokens, "
          f"medians of {args.rounds} rounds; microseconds per step")
    names = list(next(iter(rows.values())))
    print(f"{'part':>26} " + " ".join(f"{f'k={k}':>16}" for k in ks))
    for name in names:
        cells = []
        for k in ks:
            us = statistics.median(rows[k][name])
            total = sum(statistics.median(v) for v in rows[k].values())
            cells.append(f"{us:8.1f} ({100 * us / total:4.1f}%)")
        print(f"{name:>26} " + " ".join(f"{c:>16}" for c in cells))
    print(f"{'sum of parts':>26} " + " ".join(
        f"{sum(statistics.median(v) for v in rows[k].values()):8.1f}{'':8}" for k in ks))
    for k in ks:
        walls = [w / s for w, s in plain[k]]
        tokens = args.batch * args.max_tokens
        print(f"k={k} plain ({args.clock} clock): {1e6 * statistics.median(walls):.1f} us per step, "
              f"{statistics.median(tokens / w for w, _ in plain[k]):.0f} tokens/s, "
              f"{statistics.median(s for _, s in plain[k])} steps")


if __name__ == "__main__":
    main()
