"""One node rank, run as a real process by the multi-node tests.

    python rank_process.py MODE RANK NNODES PORT [--resolve-delay S] [--timeout S]

MODE rendezvous: join the group, all_reduce(rank + 1), print the sum, exit 0.
MODE lockstep:   join, start the heartbeat, then all_reduce forever (a stand-in
                 for lockstep forwards); rank 0's failure hook prints a line.
MODE shutdown:   join, start the heartbeat; rank 0 announces a clean shutdown.
MODE plans:      rank 0 broadcasts 20 random step plans (one of thousands of
                 tokens) and a STOP; every rank
                 prints a digest of each plan it holds.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import random
import sys
import time

import torch
import torch.distributed as dist

from mtp_runtime.multinode.liveness import Heartbeat
from mtp_runtime.multinode.node_state import NodeState
from mtp_runtime.multinode.rendezvous import RendezvousConfig, leave_group, mark_group_ready, rendezvous
from mtp_runtime.multinode.step_plan import STOP, StepPlan, broadcast_plan

# Name the master goes by in these tests; it only "resolves" through the
# injected resolver below, never through real DNS.
MASTER_NAME = "mtp-test-0.mtp-test"


def delayed_resolver(delay_s: float):
    """A resolver whose answer appears delay_s after the first lookup."""
    first_lookup: list[float] = []

    def resolve(host: str) -> str:
        first_lookup.append(time.monotonic())
        if host != MASTER_NAME or time.monotonic() - first_lookup[0] < delay_s:
            raise OSError(f"Name or service not known: {host}")
        return "127.0.0.1"

    return resolve


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["rendezvous", "lockstep", "shutdown", "plans"])
    parser.add_argument("rank", type=int)
    parser.add_argument("nnodes", type=int)
    parser.add_argument("port", type=int)
    parser.add_argument("--resolve-delay", type=float, default=0.0)
    parser.add_argument("--timeout", type=float, default=3.0)
    parser.add_argument("--startup-timeout", type=float, default=60.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s", force=True)

    cfg = RendezvousConfig(
        f"{MASTER_NAME}:{args.port}", args.nnodes, node_rank=str(args.rank),
        startup_timeout_s=args.startup_timeout, backoff_initial_s=0.2, backoff_max_s=1.0,
    )
    state = NodeState()
    group = rendezvous(cfg, state, resolve=delayed_resolver(args.resolve_delay))
    state.loading()
    mark_group_ready(group, state, timeout_s=args.startup_timeout)
    print(f"STATE {state.health()[1]['state']}", flush=True)

    if args.mode == "rendezvous":
        total = torch.tensor([float(args.rank + 1)])
        dist.all_reduce(total)
        print(f"SUM {int(total.item())}", flush=True)
        dist.destroy_process_group()
        return 0

    if args.mode == "plans":
        return run_plans(group.rank)

    heartbeat = Heartbeat(group.store, group.rank, group.world_size, timeout_s=args.timeout, state=state)
    if group.rank == 0:
        heartbeat.add_failure_hook(lambda reason: print(f"HOOK failing in-flight requests: {reason}", flush=True))
    heartbeat.start()
    if args.mode == "shutdown":
        if group.rank == 0:
            time.sleep(1.0)
            heartbeat.announce_shutdown()
            leave_group()
            return 0
        time.sleep(60)
        return 1  # never reached when the shutdown arrives
    print("LOCKSTEP", flush=True)
    step = torch.zeros(1)
    while True:
        try:
            dist.all_reduce(step)
        except Exception as exc:
            heartbeat.on_collective_error(exc)
        time.sleep(0.05)


def run_plans(rank: int, count: int = 20) -> int:
    from test_step_plan import random_plan  # this folder is sys.path[0] for the script

    rng = random.Random(7)
    for i in range(count + 1):
        plan = None
        if rank == 0:
            big = 4000 if i == count // 2 else 3  # one plan overflows the first broadcast
            plan = random_plan(rng, rng.randint(0, 1), max_new=big) if i < count else StepPlan(kind=STOP)
        plan, _ = broadcast_plan(plan)
        payload = plan.encode()
        print(f"PLAN {hashlib.sha256(payload.numpy().tobytes()).hexdigest()[:16]} {payload.numel()}", flush=True)
    # As `mtp serve` does: no collective backend thread may outlive the interpreter
    # (a process that skips this can abort at exit with "terminate called ...").
    leave_group()
    return 0 if plan.kind == STOP else 1

if __name__ == "__main__":
    sys.exit(main())
