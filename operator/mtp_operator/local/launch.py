"""DeploymentPlan -> local processes: the same plan the operator turns into a
Job and a StatefulSet, with loopback addresses, free ports and local paths.

    paths = LocalPaths.for_spec(spec, models_dir)
    ports = choose_ports(spec, http_port, master_port, groups=spec.replicas)  # [(http, master)] per group
    plan = plan_local(name, spec, *ports[g], group=g)
    export = export_process(plan, paths)          # None with spec.draftModel
    ranks = rank_processes(plan, paths, group=g)
    require_reference_env(spec, plan, os.environ)   # Secrets/ConfigMaps: set here instead

Each of the spec.replicas groups is its own set of processes: its own block of
HTTP ports, its own master (rendezvous) port and its own devices, since all
groups share this machine where, on Kubernetes, each pod has its own address.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from typing import Collection, Mapping

from mtp_operator.local.paths import LocalPaths
from mtp_operator.local.ports import free_ports, port_is_free
from mtp_operator.local.processes import LocalProcess
from mtp_operator.engines import PER_DEVICE_PROGRAM, is_per_device
from mtp_operator.plan import DeploymentPlan, PlanError, plan_deployment, processes_per_rank
from mtp_operator.spec import MtpDeploymentSpec, Ports

LOOPBACK = "127.0.0.1"
LOCAL_NAMESPACE = "local"
# Pods listen on every interface; local ranks only on loopback.
ALL_INTERFACES = "0.0.0.0"
MAX_PORT = 65535


def port_block_is_free(first: int, count: int, host: str = LOOPBACK) -> bool:
    return all(port_is_free(port, host) for port in range(first, first + count))


def free_port_block(count: int, avoid: Collection[int] = ()) -> int:
    """First port of `count` consecutive free ports outside `avoid`."""
    for _ in range(100):
        first = free_ports(1)[0]
        block = range(first, first + count)
        if not set(block) & set(avoid) and port_block_is_free(first, count):
            return first
    raise PlanError(f"found no {count} consecutive free TCP ports on {LOOPBACK}")


def _port_range(ports: range) -> str:
    return f"{ports.start}" if len(ports) == 1 else f"{ports.start}..{ports.stop - 1}"


def choose_ports(spec: MtpDeploymentSpec, http_port: int | None, master_port: int | None,
                 groups: int = 1) -> list[tuple[int, int]]:
    """(HTTP base port, rendezvous port) of each group: process p of group g
    listens on base_g + p, and no port serves two groups.

    Explicit ports are used as given, group g from PORT + g * (processes per
    group) and MASTER_PORT + g; otherwise the spec's ports laid out the same
    way when free on this machine, else free ones.
    """
    block = spec.nnodes * processes_per_rank(spec)
    http_blocks: list[range] = []
    taken: set[int] = set()
    for g in range(groups):
        if http_port is not None:
            base = http_port + g * block
            if base + block - 1 > MAX_PORT:
                raise PlanError(f"--port {http_port}: group {g}'s {block} HTTP port(s) would end at "
                                f"{base + block - 1}, past {MAX_PORT}; pass a lower --port")
        else:
            base = spec.ports.http + g * block
            if base + block - 1 > MAX_PORT or set(range(base, base + block)) & taken \
                    or not port_block_is_free(base, block):
                base = free_port_block(block, avoid=taken)
        http_blocks.append(range(base, base + block))
        taken.update(http_blocks[-1])
    masters: list[int] = []
    for g in range(groups):
        if master_port is not None:
            master = master_port + g
            if master > MAX_PORT:
                raise PlanError(f"--master-port {master_port}: group {g}'s master port {master} is past {MAX_PORT}")
            clash = next((h for h, ports in enumerate(http_blocks) if master in ports), None)
            if clash is not None:
                ports = _port_range(http_blocks[clash])
                raise PlanError(f"--master-port {master_port} collides with the ranks' HTTP ports {ports}"
                                if groups == 1 else f"--master-port {master_port}: group {g}'s master port "
                                f"{master} collides with group {clash}'s HTTP ports {ports}")
        else:
            master = spec.ports.master + g
            if master > MAX_PORT or master in taken or not port_is_free(master):
                master = free_port_block(1, avoid=taken)
        masters.append(master)
        taken.add(master)
    return [(ports.start, master) for ports, master in zip(http_blocks, masters)]


def plan_local(name: str, spec: MtpDeploymentSpec, http_port: int, master_port: int,
               group: int = 0) -> DeploymentPlan:
    """The operator's plan for one group, its ranks on this machine (master on
    loopback), past the devices of the groups before it."""
    local_spec = spec.model_copy(update={"ports": Ports(http=http_port, master=master_port)})
    stride = spec.accelerator.count
    return plan_deployment(name, LOCAL_NAMESPACE, local_spec, master_host=LOOPBACK,
                           port_stride=processes_per_rank(spec), device_stride=stride,
                           rank_ip=LOOPBACK, first_device=group * spec.nnodes * stride)


def require_reference_env(spec: MtpDeploymentSpec, plan: DeploymentPlan, environ: Mapping[str, str]) -> None:
    """Secrets, ConfigMaps and pod fields have no local source: a variable the
    pods would read from one must already be set here (the ranks inherit it)."""
    fields = {e.name: f"spec.env[{i}].valueFrom" for i, e in enumerate(spec.env) if e.value_from is not None}
    missing = [(fields.get(name, "spec.apiKeySecret"), name) for name in plan.pod_ref_env if name not in environ]
    if missing:
        where = ", ".join(f"{field} ({name})" for field, name in missing)
        raise PlanError(f"{where}: mtp up cannot read Secrets, ConfigMaps or pod fields; set "
                        f"{', '.join(name for _, name in missing)} in its environment (the ranks inherit it)")


def local_command(argv: list[str], field: str) -> list[str]:
    """The plan's program, as this machine runs it (inside the per-device
    script too)."""
    if is_per_device(argv):
        head, engine = argv[:PER_DEVICE_PROGRAM], argv[PER_DEVICE_PROGRAM:]
        return head + local_command(engine, field)
    program, rest = argv[0], argv[1:]
    if program == "mtp":
        # The same interpreter and package as this `mtp up`.
        return [sys.executable, "-m", "mtp_runtime", *rest]
    found = shutil.which(program)
    if found is None:
        raise PlanError(f"{field}: `{program}` is not on PATH; mtp up runs the engine's own command locally "
                        "(use engine: builtin, or install it)")
    return [found, *rest]


def bind_loopback(argv: list[str]) -> list[str]:
    out = []
    for i, arg in enumerate(argv):
        if arg == f"--host={ALL_INTERFACES}":
            arg = f"--host={LOOPBACK}"
        elif arg == ALL_INTERFACES and i > 0 and argv[i - 1] == "--host":
            arg = LOOPBACK
        out.append(arg)
    return out


def export_process(plan: DeploymentPlan, paths: LocalPaths) -> LocalProcess | None:
    if plan.export is None:
        return None
    argv = local_command(paths.rewrite_argv(plan.export.argv), "spec.export")
    return LocalProcess("export", argv, dict(plan.export.env))


def process_name(group: int, rank: int) -> str:
    """Group 0 keeps the one-group names (and log files), as its pods do on Kubernetes."""
    return f"rank-{rank}" if group == 0 else f"g{group}-rank-{rank}"


def rank_processes(plan: DeploymentPlan, paths: LocalPaths, group: int = 0) -> list[LocalProcess]:
    processes = []
    for rank in plan.ranks:
        argv = local_command(bind_loopback(paths.rewrite_argv(rank.argv)), "spec.engine")
        processes.append(LocalProcess(process_name(group, rank.rank), argv, dict(rank.env), rank.http_port))
    return processes


@dataclass(frozen=True)
class LocalGroup:
    """One of the spec.replicas groups, planned for this machine."""

    index: int
    plan: DeploymentPlan  # its own HTTP ports, master port and devices
    ranks: list[LocalProcess]

    @property
    def endpoint(self) -> str:
        """Rank 0's OpenAI API: where this group serves."""
        return f"http://{LOOPBACK}:{self.plan.http_port}"


def plan_groups(name: str, spec: MtpDeploymentSpec, paths: LocalPaths,
                ports: list[tuple[int, int]]) -> list[LocalGroup]:
    """One LocalGroup per (HTTP base port, master port) from `choose_ports`."""
    groups = []
    for index, (http_port, master_port) in enumerate(ports):
        plan = plan_local(name, spec, http_port, master_port, group=index)
        groups.append(LocalGroup(index, plan, rank_processes(plan, paths, group=index)))
    return groups
