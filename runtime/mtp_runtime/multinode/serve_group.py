"""`mtp serve` with --nnodes > 1.

Rank 0 runs the usual server (HTTP API, scheduler, sampling); its engine
build first joins the group, then loads rank 0's shard, and its model runner's
main model and draft are wrapped so every call is broadcast (leader.py).
Every other rank runs `serve_worker`: /health and /metrics, its own shard,
and the worker loop until rank 0 stops the group. Either side leaves with a
non-zero exit when a rank is lost (liveness.py).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Mapping

import torch.distributed as dist

from mtp_runtime.config import ModelConfig
from mtp_runtime.distributed import set_parallel_state
from mtp_runtime.multinode.health_server import WorkerHealthServer
from mtp_runtime.multinode.leader import LockstepLeader
from mtp_runtime.multinode.liveness import DEFAULT_TIMEOUT_S, Heartbeat
from mtp_runtime.multinode.node_state import NodeState
from mtp_runtime.multinode.parallel_setup import build_parallel_state, check_model_fits
from mtp_runtime.multinode.plan_executor import PlanExecutor, run_worker
from mtp_runtime.multinode.rendezvous import (
    GroupHandle,
    RendezvousConfig,
    leave_group,
    mark_group_ready,
    rendezvous,
)
from mtp_runtime.multinode.step_plan import DRAFT, MAIN

log = logging.getLogger("mtp_runtime.multinode")

# Seconds a rank waits for the whole group to form and to load (image pulls, big checkpoints).
STARTUP_TIMEOUT_ENV = "MTP_STARTUP_TIMEOUT_S"
DEFAULT_STARTUP_TIMEOUT_S = 1800.0
# Seconds without a heartbeat after which a rank counts as lost.
HEARTBEAT_TIMEOUT_ENV = "MTP_HEARTBEAT_TIMEOUT_S"


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ValueError(f"{name}={text!r}: expected a number of seconds > 0")
    return value


class GroupMember:
    """This rank's place in the group: rendezvous, ParallelState, heartbeat."""

    def __init__(self, args: Any) -> None:
        self.args = args
        env = {**os.environ, **getattr(args, "env", {})}
        self.startup_timeout_s = _seconds(env, STARTUP_TIMEOUT_ENV, DEFAULT_STARTUP_TIMEOUT_S)
        self.heartbeat_timeout_s = _seconds(env, HEARTBEAT_TIMEOUT_ENV, DEFAULT_TIMEOUT_S)
        self.state = NodeState(args.node_rank, args.nnodes)
        self.group: GroupHandle | None = None
        self.heartbeat: Heartbeat | None = None
        self.plan_group = None
        self.leader: LockstepLeader | None = None
        self._failure_hooks: list[Callable[[str], None]] = []

    def join(self) -> None:
        """Form the group, shard by it, and start failing together."""
        cfg = RendezvousConfig(self.args.master_node_addr, self.args.nnodes, node_rank=self.args.node_rank,
                               device=self.args.devices[0], startup_timeout_s=self.startup_timeout_s)
        self.group = rendezvous(cfg, self.state)
        self.heartbeat = Heartbeat(self.group.store, self.group.rank, self.group.world_size,
                                   timeout_s=self.heartbeat_timeout_s, state=self.state)
        for hook in self._failure_hooks:
            self.heartbeat.add_failure_hook(hook)
        self.heartbeat.start()
        # Plans are small host-side integers: on accelerators they go through a gloo side group.
        if self.group.backend != "gloo":
            self.plan_group = dist.new_group(backend="gloo")
        parallel = build_parallel_state(self.group.rank, self.group.world_size, self.args.ep_size, self.args.dp_size)
        check_model_fits(ModelConfig.from_dir(self.args.model), parallel, f"{self.args.model}/config.json")
        set_parallel_state(parallel)
        self.state.loading(f"loading shard {self.group.rank} of {self.group.world_size}")

    def on_failure(self, hook: Callable[[str], None]) -> None:
        """hook(reason) runs before this rank exits because another was lost."""
        self._failure_hooks.append(hook)
        if self.heartbeat is not None:
            self.heartbeat.add_failure_hook(hook)

    def ready(self, before_ready: Callable[[], None] | None = None) -> None:
        mark_group_ready(self.group, self.state, self.startup_timeout_s, before_ready)

    def leader_build(self, build_engine: Callable[[], Any]) -> Callable[[], Any]:
        """Rank 0's engine build: join, load the shard, wrap the model calls, wait for all ranks."""
        def build() -> Any:
            self.join()
            engine = build_engine()
            self.leader = LockstepLeader(self.plan_group)
            runner = engine.runner
            runner.main = self.leader.wrap(runner.main, MAIN)
            if runner.draft is not None:
                runner.draft = self.leader.wrap(runner.draft, DRAFT)
            runner.on_step = self.leader.begin_step  # each step's k goes into its plans
            # Adaptive depth's warm-up steps: once every rank has loaded (the workers are then in their
            # loop, following the warm-up's plans), before this rank reports ready.
            self.ready(engine.seed_policy if engine.policy.adaptive else None)
            return engine
        return build

    def leave(self) -> None:
        """Rank 0 after its engine thread stopped: stop the workers, then the group."""
        if self.leader is not None:
            try:
                self.leader.stop_workers()
            except Exception as exc:  # workers already gone: nothing left to stop
                log.warning("could not stop the workers cleanly: %s", exc)
        if self.heartbeat is not None:
            self.heartbeat.announce_shutdown()
        leave_group()


def fail_requests_hook(abort_all: Callable[[str], None], flush_s: float = 1.0) -> Callable[[str], None]:
    """Rank 0's failure hook: answer in-flight requests with an error, give the
    responses a moment to go out, then let the process exit."""
    def hook(reason: str) -> None:
        abort_all(f"the serving group lost a rank and is restarting: {reason}")
        time.sleep(flush_s)
    return hook


def serve_worker(args: Any, log_level: str = "info") -> int:
    """A rank other than 0: /health, its shard, the worker loop."""
    from mtp_runtime.engine.model_runner import TORCH_DTYPES
    from mtp_runtime.models.loader import load_draft, load_model
    from mtp_runtime.server.args import resolve_dtype

    member = GroupMember(args)
    executor: PlanExecutor | None = None
    health = WorkerHealthServer(args.host, args.port, member.state,
                                model_calls=lambda: executor.calls if executor else 0,
                                steps_by_k=lambda: executor.steps_by_k if executor else {}).start()
    try:
        member.join()
        device = args.devices[0]
        dtype = TORCH_DTYPES[resolve_dtype(args.dtype, device)]
        main = load_model(args.model, dtype, device)
        draft = None
        if args.num_speculative_tokens:
            draft = load_draft(args.draft_model or args.model, main=main, dtype=dtype, device=device)
        executor = PlanExecutor(main, draft, device)
        member.ready()
        code = run_worker(executor, member.plan_group, member.heartbeat.on_collective_error)
        member.heartbeat.leave()
        leave_group()
        return code
    except Exception as exc:
        member.state.failed(f"{type(exc).__name__}: {exc}")
        raise
    finally:
        health.stop()
