"""Find the master, form the torch.distributed group.

Each node rank is one process (one pod of the StatefulSet). Rank 0 hosts the
TCPStore on --master_node_addr's port; the others resolve the master's name
and connect, retrying with exponential backoff because pods start in any
order and minutes apart (image pulls), and the headless Service publishes
rank 0's DNS name only once its pod exists.
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from mtp_runtime.multinode.node_rank import resolve_node_rank
from mtp_runtime.multinode.node_state import NodeState

log = logging.getLogger("mtp_runtime.multinode")

# Store keys, under one prefix so they never meet torch's own.
ARRIVED_KEY = "mtp/arrived"
LOADED_KEY = "mtp/loaded"

Resolver = Callable[[str], str]

__all__ = [
    "GroupHandle",
    "RendezvousConfig",
    "RendezvousError",
    "backend_for_device",
    "leave_group",
    "mark_group_ready",
    "parse_master_addr",
    "rendezvous",
    "resolve_node_rank",
    "wait_for_all_ranks",
]


class RendezvousError(RuntimeError):
    """The group could not be formed; the message says what to fix."""


def backend_for_device(device: str) -> str:
    """Collective backend for --devices: hccl on Ascend, nccl on CUDA, gloo on CPU."""
    kind = device.split(",")[0].split(":")[0].strip().lower()
    backends = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}
    if kind not in backends:
        raise RendezvousError(f"--devices {device!r}: expected cpu, cuda:N or npu:N")
    return backends[kind]


def parse_master_addr(addr: str) -> tuple[str, int]:
    """'HOST:PORT' or '[IPv6]:PORT' -> (host, port)."""
    host, sep, port_text = addr.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port_text.isdigit():
        raise RendezvousError(f"--master_node_addr {addr!r}: expected HOST:PORT, e.g. mtp-0.mtp:29500")
    port = int(port_text)
    if not 0 < port < 65536:
        raise RendezvousError(f"--master_node_addr {addr!r}: port {port} is outside 1..65535")
    return host, port


def resolve_host(host: str) -> str:
    """DNS lookup -> one address; raises OSError while the name does not resolve yet."""
    return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]


@dataclass
class RendezvousConfig:
    master_node_addr: str
    nnodes: int
    node_rank: int | str = "auto"
    device: str = "cpu"
    startup_timeout_s: float = 900.0  # image pulls on big nodes take minutes
    collective_timeout_s: float = 600.0
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 10.0
    master_host: str = field(init=False)
    master_port: int = field(init=False)

    def __post_init__(self) -> None:
        if self.nnodes < 1:
            raise RendezvousError(f"--nnodes {self.nnodes}: must be >= 1")
        self.master_host, self.master_port = parse_master_addr(self.master_node_addr)
        self.node_rank = resolve_node_rank(self.node_rank, self.nnodes)
        for name in ("startup_timeout_s", "collective_timeout_s", "backoff_initial_s", "backoff_max_s"):
            if getattr(self, name) <= 0:
                raise RendezvousError(f"rendezvous {name}={getattr(self, name)}: must be > 0")


@dataclass
class GroupHandle:
    """A formed group: this rank, the shared store, the default process group's backend."""

    rank: int
    world_size: int
    backend: str
    store: dist.Store
    master_host: str
    master_port: int

    @property
    def is_master(self) -> bool:
        return self.rank == 0


class _Backoff:
    """Exponential delays that never sleep past the startup deadline."""

    def __init__(self, cfg: RendezvousConfig, deadline: float) -> None:
        self.delay = cfg.backoff_initial_s
        self.max_delay = cfg.backoff_max_s
        self.deadline = deadline

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def sleep(self) -> None:
        time.sleep(max(0.0, min(self.delay, self.remaining())))
        self.delay = min(self.delay * 2, self.max_delay)


def rendezvous(cfg: RendezvousConfig, state: NodeState | None = None, resolve: Resolver = resolve_host) -> GroupHandle:
    """Form the group (blocks until every rank arrived) and init torch.distributed."""
    rank = int(cfg.node_rank)
    state = state or NodeState(rank, cfg.nnodes)
    state.rank, state.nnodes = rank, cfg.nnodes
    deadline = time.monotonic() + cfg.startup_timeout_s
    backend = backend_for_device(cfg.device)
    if rank == 0:
        store = _host_store(cfg)
    else:
        store = _connect_store(cfg, state, resolve, _Backoff(cfg, deadline))
    store.set_timeout(timedelta(seconds=cfg.collective_timeout_s))
    wait_for_all_ranks(store, ARRIVED_KEY, rank, cfg.nnodes, deadline, "connect to the master", state)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=cfg.nnodes,
        timeout=timedelta(seconds=cfg.collective_timeout_s),
    )
    log.info("rank %d/%d joined the %s group via %s", rank, cfg.nnodes, backend, cfg.master_node_addr)
    return GroupHandle(rank, cfg.nnodes, backend, store, cfg.master_host, cfg.master_port)


def _host_store(cfg: RendezvousConfig) -> dist.TCPStore:
    # The server listens on every interface; rank 0's own client goes through
    # loopback because its own DNS name may not be published yet.
    try:
        return dist.TCPStore(
            "127.0.0.1", cfg.master_port, cfg.nnodes, is_master=True,
            timeout=timedelta(seconds=cfg.startup_timeout_s), wait_for_workers=False,
        )
    except Exception as exc:
        raise RendezvousError(
            f"rank 0 could not listen on port {cfg.master_port} of --master_node_addr "
            f"{cfg.master_node_addr!r}: {exc}; is another process using it?"
        ) from exc


def _connect_store(cfg: RendezvousConfig, state: NodeState, resolve: Resolver, backoff: _Backoff) -> dist.TCPStore:
    rank, host, port = cfg.node_rank, cfg.master_host, cfg.master_port
    address = _retry(
        lambda: resolve(host), backoff, state,
        f"rank {rank} waiting for master address {host!r} to resolve",
        f"--master_node_addr host {host!r} did not resolve",
    )
    _retry(
        lambda: socket.create_connection((address, port), timeout=min(5.0, max(0.1, backoff.remaining()))).close(),
        backoff, state,
        f"rank {rank} waiting for master {host}:{port} ({address}) to accept connections",
        f"master {host}:{port} ({address}) did not accept connections",
    )
    timeout = timedelta(seconds=max(1.0, backoff.remaining()))
    return dist.TCPStore(address, port, cfg.nnodes, is_master=False, timeout=timeout)


def _retry(attempt: Callable, backoff: _Backoff, state: NodeState, waiting: str, gave_up: str):
    tries = 0
    while True:
        try:
            result = attempt()
            if tries:
                log.info("%s: done after %d retries", waiting, tries)
            return result
        except OSError as exc:
            tries += 1
            if backoff.remaining() <= 0:
                raise RendezvousError(
                    f"{gave_up} within the startup timeout (last error: {exc}); check "
                    f"--master_node_addr and that rank 0 is running, or raise the startup timeout"
                ) from exc
            state.waiting_for_master(f"{waiting} (try {tries}: {exc})")
            log.info("%s (try %d: %s); retrying in %.1fs", waiting, tries, exc, backoff.delay)
            backoff.sleep()


def wait_for_all_ranks(
    store: dist.Store, key: str, rank: int, nnodes: int, deadline: float, what: str,
    state: NodeState | None = None, log_every_s: float = 10.0,
) -> None:
    """Store-based barrier that logs which ranks are still missing."""
    store.set(f"{key}/{rank}", "1")
    keys = [f"{key}/{r}" for r in range(nnodes)]
    last_log = 0.0
    while True:
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        if not missing:
            return
        now = time.monotonic()
        if now >= deadline:
            raise RendezvousError(
                f"rank {rank}: ranks {missing} did not {what} within the startup timeout; "
                f"check those pods' logs, or raise the startup timeout"
            )
        if state is not None and state.state != "ready":
            state.set(state.state, f"waiting for ranks {missing} to {what}")
        if now - last_log >= log_every_s:
            log.info("rank %d waiting for ranks %s to %s", rank, missing, what)
            last_log = now
        time.sleep(0.1)


def mark_group_ready(group: GroupHandle, state: NodeState, timeout_s: float,
                     before_ready: Callable[[], None] | None = None) -> None:
    """Call once this rank's weights are loaded: waits for every rank, runs `before_ready` (work that
    needs the whole group, such as rank 0's warm-up steps), then `ready`."""
    deadline = time.monotonic() + timeout_s
    wait_for_all_ranks(group.store, LOADED_KEY, group.rank, group.world_size, deadline, "finish loading", state)
    if before_ready is not None:
        before_ready()
    state.ready()
    log.info("rank %d: all %d ranks loaded; group ready", group.rank, group.world_size)


def leave_group() -> None:
    """Tear the process group down before the interpreter exits, so no collective
    backend thread is left running while static destructors run."""
    if dist.is_initialized():
        dist.destroy_process_group()
