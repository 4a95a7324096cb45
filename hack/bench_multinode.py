#!/usr/bin/env python
"""Multi-node benchmark on one machine: decode tokens/s of 1, 2 and 4 ranks.

Each rank is a real process on loopback (gloo), rank 0 runs the real engine
(scheduler, MTP drafting, greedy acceptance) through the lockstep wrappers,
the others run the worker loop. Reported per group size: decode tokens/s,
step time, the share of rank 0's step spent in collectives (all-reduce,
all-gather, plan broadcasts, timed by wrapping torch.distributed), and the
checkpoint bytes each rank read while loading.

    python hack/bench_multinode.py                         # 1, 2, 4 ranks; bench-size tiny model
    python hack/bench_multinode.py --ranks 1,2 --tokens 32 --batch 2 --k 1
    python hack/bench_multinode.py --model DIR --ep-size auto

On a 2-core machine more ranks cannot be faster (they share the cores); the
point is the communication share and that every rank loads less.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Big enough that compute is not all Python overhead, small enough for a 2-core CPU.
BENCH_SIZES = ["--hidden-size", "256", "--intermediate-size", "512", "--moe-intermediate-size", "128",
               "--num-hidden-layers", "4", "--vocab-size", "4096"]
COLLECTIVES = ("all_reduce", "all_gather", "broadcast")
MAX_MODEL_LEN = 512


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="1,2,4", help="group sizes to measure (default 1,2,4)")
    p.add_argument("--model", help="checkpoint directory (default: a bench-size `mtp make-tiny` DeepSeek-V3)")
    p.add_argument("--k", type=int, default=1, help="num_speculative_tokens (default 1)")
    p.add_argument("--batch", type=int, default=4, help="concurrent requests (default 4)")
    p.add_argument("--tokens", type=int, default=48, help="tokens generated per request (default 48)")
    p.add_argument("--ep-size", default="1", help="1, or 'auto' for ep_size = ranks (experts split over ranks)")
    p.add_argument("--trained", action="store_true",
                   help="use `mtp make-tiny --preset bench` (trained, so drafts get accepted; takes minutes)")
    p.add_argument("--json", help="also write the results here")
    # Internal: one rank of one group.
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--nnodes", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    return p.parse_args(argv)


class CollectiveTimer:
    """Wall time inside torch.distributed collectives, per kind (the layers and the plan
    broadcast look them up at call time). It includes waiting for slower ranks."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.by_kind = {name: 0.0 for name in COLLECTIVES}
        for name in COLLECTIVES:
            setattr(dist, name, self._timed(name, getattr(dist, name)))

    def _timed(self, name, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.by_kind[name] += time.perf_counter() - start
        return timed

    @property
    def seconds(self) -> float:
        return sum(self.by_kind.values())

    def reset(self) -> None:
        self.by_kind = dict.fromkeys(self.by_kind, 0.0)


def run_rank(args: argparse.Namespace) -> dict:
    import torch

    from mtp_runtime.checkpoint.safetensors_io import READ_STATS
    from mtp_runtime.distributed import set_parallel_state
    from mtp_runtime.multinode.parallel_setup import build_parallel_state
    from mtp_runtime.multinode.rendezvous import RendezvousConfig, leave_group, rendezvous

    torch.set_num_threads(1)
    ep_size = args.nnodes if args.ep_size == "auto" else int(args.ep_size)
    timer = CollectiveTimer()
    if args.nnodes > 1:
        group = rendezvous(RendezvousConfig(f"127.0.0.1:{args.port}", args.nnodes, node_rank=args.rank,
                                            startup_timeout_s=300))
        set_parallel_state(build_parallel_state(group.rank, group.world_size, ep_size))
    READ_STATS.bytes_read = 0
    if args.rank == 0:
        result = lead(args, timer)
    else:
        result = follow(args, timer)
    leave_group()
    result.update(rank=args.rank, bytes_read=result.get("bytes_read", READ_STATS.bytes_read))
    return result


def lead(args: argparse.Namespace, timer: CollectiveTimer) -> dict:
    from mtp_runtime.checkpoint.safetensors_io import READ_STATS
    from mtp_runtime.engine.config import EngineConfig
    from mtp_runtime.engine.llm_engine import LLMEngine
    from mtp_runtime.multinode.leader import LockstepLeader
    from mtp_runtime.multinode.step_plan import DRAFT, MAIN
    from mtp_runtime.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=args.model, num_speculative_tokens=args.k, dtype="float32",
                                    max_seqs_per_batch=args.batch, max_model_len=MAX_MODEL_LEN,
                                    num_kv_blocks=args.batch * (MAX_MODEL_LEN // 16 + 2),
                                    enable_prefix_cache=False))
    bytes_read = READ_STATS.bytes_read
    leader = None
    if args.nnodes > 1:
        leader = LockstepLeader()
        engine.runner.main = leader.wrap(engine.runner.main, MAIN)
        if engine.runner.draft is not None:
            engine.runner.draft = leader.wrap(engine.runner.draft, DRAFT)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    generate(engine, params, args.batch, "warmup")
    timer.reset()
    decode_s, decode_tokens, steps, comm_s = generate(engine, params, args.batch, "run", timer)
    stats = engine.stats()
    if leader is not None:
        leader.stop_workers()
    return {"decode_tokens_per_s": decode_tokens / decode_s, "decode_steps": steps,
            "step_ms": 1000 * decode_s / steps, "comm_share": comm_s / decode_s,
            "plan_broadcast_ms_per_step": 1000 * timer.by_kind["broadcast"] / steps,
            "model_collective_ms_per_step": 1000 * (timer.by_kind["all_reduce"] + timer.by_kind["all_gather"]) / steps,
            "acceptance": stats.accepted_tokens / stats.draft_tokens if stats.draft_tokens else 0.0,
            "rows_sent": leader.hidden_rows_sent if leader else 0, "bytes_read": bytes_read}


def generate(engine, params, batch: int, tag: str, timer: CollectiveTimer | None = None):
    """Run `batch` requests to the end; time the decode phase (after every prompt's first token)."""
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", [5 + i, 17, 300, 42, 7, 99, 123, 8], params)
    started: dict[str, bool] = {}
    decode_start = None
    steps = tokens = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if decode_start is not None:
            steps += 1
            tokens += sum(len(out.new_token_ids) for out in outputs)
        for out in outputs:
            started[out.request_id] = True
        if decode_start is None and len(started) == batch:
            decode_start = time.perf_counter()
            if timer:
                timer.reset()  # from here on: decode only
    elapsed = time.perf_counter() - decode_start
    return elapsed, tokens, max(steps, 1), timer.seconds if timer else 0.0


def follow(args: argparse.Namespace, timer: CollectiveTimer) -> dict:
    from mtp_runtime.models.loader import load_draft, load_model
    from mtp_runtime.multinode.plan_executor import PlanExecutor, run_worker

    main = load_model(args.model)
    draft = load_draft(args.model, main=main) if args.k else None
    executor = PlanExecutor(main, draft)
    started = time.perf_counter()
    run_worker(executor)
    return {"calls": executor.calls, "comm_share_all_run": timer.seconds / (time.perf_counter() - started)}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure_group(args: argparse.Namespace, nnodes: int) -> list[dict]:
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
    procs = []
    for rank in range(nnodes):
        cmd = [sys.executable, __file__, "--rank", str(rank), "--nnodes", str(nnodes), "--port", str(port),
               "--model", args.model, "--k", str(args.k), "--batch", str(args.batch),
               "--tokens", str(args.tokens), "--ep-size", args.ep_size]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    results = []
    for rank, proc in enumerate(procs):
        out, err = proc.communicate(timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"rank {rank} of {nnodes} failed (exit {proc.returncode}):\n{err[-3000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def main() -> int:
    args = parse_args()
    if args.rank is not None:
        print(json.dumps(run_rank(args)), flush=True)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            args.model = str(Path(tmp, "bench-dsv3"))
            sizes = ["--preset", "bench"] if args.trained else BENCH_SIZES
            subprocess.run([sys.executable, "-m", "mtp_runtime", "make-tiny", "--arch", "deepseek_v3",
                            "--out", args.model, *sizes], check=True, capture_output=True)
        table = {}
        for nnodes in [int(n) for n in args.ranks.split(",")]:
            table[nnodes] = measure_group(args, nnodes)
            lead_result = table[nnodes][0]
            print(f"{nnodes} rank(s): decode {lead_result['decode_tokens_per_s']:.1f} tok/s, "
                  f"step {lead_result['step_ms']:.1f} ms, comm share {lead_result['comm_share']:.0%}, "
                  f"acceptance {lead_result['acceptance']:.0%}, bytes read per rank "
                  f"{[r['bytes_read'] for r in table[nnodes]]}", flush=True)
    base = table.get(1, next(iter(table.values())))[0]["decode_tokens_per_s"]
    print("\nranks | decode tok/s | vs 1 rank | step ms | comm share of step | plan bcast ms | model coll. ms "
          "| bytes read per rank (MiB)")
    for nnodes, results in table.items():
        lead_result = results[0]
        mib = ", ".join(f"{r['bytes_read'] / 2**20:.2f}" for r in results)
        print(f"{nnodes:5d} | {lead_result['decode_tokens_per_s']:12.1f} | "
              f"{lead_result['decode_tokens_per_s'] / base:8.2f}x | {lead_result['step_ms']:7.1f} | "
              f"{lead_result['comm_share']:18.0%} | {lead_result['plan_broadcast_ms_per_step']:13.1f} | "
              f"{lead_result['model_collective_ms_per_step']:14.1f} | {mib}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "model"},
                                               "results": table}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
