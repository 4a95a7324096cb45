"""DeploymentPlan -> local processes: the same plan the operator turns into a
Job and a StatefulSet, with loopback addresses, free ports and local paths.

    paths = LocalPaths.for_spec(spec, models_dir)
    plan = plan_local(name, spec, http_port=..., master_port=...)
    export = export_process(plan, paths)          # None with spec.draftModel
    ranks = rank_processes(plan, paths)
    require_reference_env(spec, plan, os.environ)   # Secrets/ConfigMaps: set here instead
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Mapping

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


def port_block_is_free(first: int, count: int, host: str = LOOPBACK) -> bool:
    return all(port_is_free(port, host) for port in range(first, first + count))


def free_port_block(count: int, avoid: range = range(0)) -> int:
    """First port of `count` consecutive free ports outside `avoid`."""
    for _ in range(100):
        first = free_ports(1)[0]
        block = range(first, first + count)
        if not set(block) & set(avoid) and port_block_is_free(first, count):
            return first
    raise PlanError(f"found no {count} consecutive free TCP ports on {LOOPBACK}")


def choose_ports(spec: MtpDeploymentSpec, http_port: int | None, master_port: int | None) -> tuple[int, int]:
    """HTTP base port (process p of the group listens on base + p) and the
    rendezvous port.

    Explicit ports are used as given; otherwise the spec's ports when free on
    this machine, else free ones.
    """
    nnodes = spec.nnodes * processes_per_rank(spec)
    if http_port is None:
        http_port = spec.ports.http
        if not port_block_is_free(http_port, nnodes):
            http_port = free_port_block(nnodes)
    http_ports = range(http_port, http_port + nnodes)
    if master_port is None:
        master_port = spec.ports.master
        if master_port in http_ports or not port_block_is_free(master_port, 1):
            master_port = free_port_block(1, avoid=http_ports)
    if master_port in http_ports:
        raise PlanError(f"--master-port {master_port} collides with the ranks' HTTP ports "
                        f"{http_port}..{http_port + nnodes - 1}")
    return http_port, master_port


def plan_local(name: str, spec: MtpDeploymentSpec, http_port: int, master_port: int) -> DeploymentPlan:
    """The operator's plan, for ranks on this machine (master on loopback)."""
    local_spec = spec.model_copy(update={"ports": Ports(http=http_port, master=master_port)})
    return plan_deployment(name, LOCAL_NAMESPACE, local_spec, master_host=LOOPBACK,
                           port_stride=processes_per_rank(spec), device_stride=spec.accelerator.count,
                           rank_ip=LOOPBACK)


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


def rank_processes(plan: DeploymentPlan, paths: LocalPaths) -> list[LocalProcess]:
    processes = []
    for rank in plan.ranks:
        argv = local_command(bind_loopback(paths.rewrite_argv(rank.argv)), "spec.engine")
        processes.append(LocalProcess(f"rank-{rank.rank}", argv, dict(rank.env), rank.http_port))
    return processes
