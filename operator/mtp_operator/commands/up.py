"""`mtp up FILE.yaml`: run an MtpDeployment on this machine, no cluster needed.

The same validation and planning code as the operator; the plan is realised
as local processes (the export step, then one `mtp serve` per rank on
loopback) and the status the operator would write is printed as it changes.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

HELP = "run an MtpDeployment on this machine with no cluster (the embedded default)"
DESCRIPTION = """\
Run an MtpDeployment on this machine with no cluster: the operator's own
validation and plan, realised as local processes instead of a Job and a
StatefulSet. The export step runs first (`mtp export`; a no-op when the
draft's manifest says it is up to date), then spec.replicas groups of
spec.nnodes ranks start on 127.0.0.1, each its own processes: group g's rank
r serves HTTP on port P + g*nnodes + r, and its rank 0 is its master on port
M + g (P and M: spec.ports, or free ones when those are taken). The status
the operator would write (phase, conditions, acceptance rate, and per group
in status.groups) is printed as it changes, until Ctrl-C or SIGTERM stops
every rank cleanly. A rank that exits restarts its own group only, within
--restart-budget (per group). With spec.replicas 0 only the export runs.

The model volume's hostPath (or --models-dir) is where spec paths under
spec.model.mountPath live on this machine. If spec.model.path has no model
and the resource carries the annotation mtp.inference.dev/make-tiny, the
model is built first with `mtp make-tiny` and those arguments.

  mtp up crds/samples/tiny-cpu.yaml                        # until Ctrl-C
  mtp up crds/samples/tiny-cpu.yaml --once --requests 3    # Ready, 3 completions, status, exit
"""

EXIT_BAD_INPUT = 2
NAME_PATTERN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", type=Path, help="MtpDeployment YAML (one resource)")
    parser.add_argument("--models-dir", type=Path, default=None,
                        help="local folder holding spec.model.mountPath's content (default: the volume's hostPath)")
    parser.add_argument("--once", action="store_true",
                        help="exit 0 once every group is Ready (after --requests), printing the status")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds for every group to reach Ready before giving up with exit 1 "
                        "(default: none; 900 with --once)")
    parser.add_argument("--requests", type=int, default=0,
                        help="once a group is Ready, send N greedy completions to its rank 0 and show the "
                        "acceptance they gave")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per --requests completion (default 32)")
    parser.add_argument("--port", type=int, default=None,
                        help="HTTP port of group 0's rank 0; rank r of group g uses PORT + g*nnodes + r "
                        "(default: spec.ports.http if free, else a free one)")
    parser.add_argument("--master-port", type=int, default=None,
                        help="group 0's rendezvous port (rank 0's); group g uses MASTER_PORT + g "
                        "(default: spec.ports.master if free, else a free one)")
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="where each process's log goes (default: a folder under the system temp dir)")
    parser.add_argument("--status-file", type=Path, default=None,
                        help="keep the latest status in this JSON file (for scripts)")
    parser.add_argument("--metrics-interval", type=float, default=10.0,
                        help="seconds between scrapes of rank 0's /metrics (default 10)")
    parser.add_argument("--restart-budget", type=int, default=None,
                        help="whole-group restarts allowed to each group (default: the operator's gang restart "
                        "budget)")
    parser.add_argument("--restart-backoff", type=float, default=None,
                        help="seconds before the first group restart, doubling each time (default: the operator's)")
    parser.add_argument("--grace-period", type=float, default=None,
                        help="seconds a rank gets to exit after SIGTERM on shutdown before it is killed (default: "
                        "the pods' terminationGracePeriodSeconds, spec.runtime.shutdownTimeout + 15)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print each process's command line and environment, then exit without running")
    parser.add_argument("--make-model-only", action="store_true",
                        help="only build a missing model from the make-tiny annotation, then exit")


class UpInputError(ValueError):
    """FILE.yaml cannot be run; the message names the file and the field."""


def load_resource(path: Path) -> dict[str, Any]:
    import yaml

    from mtp_operator import constants as c

    try:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except OSError as exc:
        raise UpInputError(f"{path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise UpInputError(f"{path}: not valid YAML: {exc}") from None
    resources = [d for d in docs if isinstance(d, dict) and d.get("kind") == c.KIND]
    if len(resources) != 1:
        raise UpInputError(f"{path}: expected exactly one {c.KIND} resource, found {len(resources)}")
    resource = resources[0]
    if resource.get("apiVersion") != c.API_VERSION:
        raise UpInputError(f"{path}: apiVersion must be {c.API_VERSION}, got {resource.get('apiVersion')!r}")
    metadata = resource.get("metadata") or {}
    name = metadata.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.match(name) or len(name) > 63:
        raise UpInputError(f"{path}: metadata.name must be a DNS label (lower-case letters, digits, '-'), got {name!r}")
    return resource


def prepare(args: argparse.Namespace):
    """FILE.yaml -> a LocalDeployment ready to run (None with --make-model-only).

    Raises the input errors `run` reports: each names the file and the field.
    """
    from mtp_operator.local.launch import (choose_ports, export_process, plan_groups, plan_local,
                                           require_reference_env)
    from mtp_operator.local.model_prep import ensure_model
    from mtp_operator.local.paths import LocalPaths
    from mtp_operator.local.runner import LocalDeployment, UpOptions
    from mtp_operator.settings import OperatorSettings
    from mtp_operator.spec import parse_spec

    resource = load_resource(args.file)
    metadata = resource["metadata"]
    settings = OperatorSettings.from_env()
    spec = parse_spec(resource.get("spec"), settings=settings)
    paths = LocalPaths.for_spec(spec, args.models_dir)
    made = False
    if not args.dry_run:
        made = ensure_model(paths.to_local(spec.model.path), metadata.get("annotations") or {},
                            log=lambda line: print(f"mtp up: {line}", flush=True))
    if args.make_model_only:
        return None
    ports = choose_ports(spec, args.port, args.master_port, groups=spec.replicas)
    groups = plan_groups(metadata["name"], spec, paths, ports)
    # The export step and what every group shares; with no group, planned at the spec's ports (none is opened).
    plan = groups[0].plan if groups else plan_local(metadata["name"], spec, spec.ports.http, spec.ports.master)
    if not args.dry_run:
        require_reference_env(spec, plan, os.environ)
    options = UpOptions(
        log_dir=args.log_dir or Path(tempfile.gettempdir()) / "mtp-up" / metadata["name"],
        once=args.once, timeout=args.timeout if args.timeout or not args.once else 900.0,
        requests=args.requests, max_tokens=args.max_tokens, metrics_interval=args.metrics_interval,
        status_file=args.status_file,
        restart_budget=settings.gang_restart_budget if args.restart_budget is None else args.restart_budget,
        restart_backoff=settings.gang_restart_backoff if args.restart_backoff is None else args.restart_backoff,
        grace_seconds=plan.termination_grace_seconds if args.grace_period is None else args.grace_period,
        generation=int(metadata.get("generation") or 1),
    )
    export = export_process(plan, paths)
    if made and export is not None:
        # A new model with the old one's config.json and index: the old draft would look up to date.
        export = dataclasses.replace(export, argv=[*export.argv, "--force"])
    return LocalDeployment(metadata["name"], spec, plan, export, groups, options,
                           out=lambda line: print(line, flush=True))


def print_processes(deployment) -> None:
    """The processes `mtp up` would start, as shell-quoted lines (a fleet's under a line per group)."""
    import shlex

    def show(process) -> None:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(process.env.items()))
        print(f"# {process.name}" + (f" (HTTP port {process.http_port})" if process.http_port else ""))
        print(f"{env} {shlex.join(process.argv)}".strip())

    if deployment.export:
        show(deployment.export)
    if not deployment.groups:
        print("# spec.replicas is 0: no group would start")
    for group in deployment.groups:
        if deployment.fleet:
            print(f"# group {group.index}: endpoint {group.endpoint}, master {group.plan.master_address}")
        for process in group.ranks:
            show(process)


def run(args: argparse.Namespace) -> int:
    from mtp_operator.local.model_prep import ModelPrepError
    from mtp_operator.local.paths import LocalPathError
    from mtp_operator.local.report import status_document
    from mtp_operator.plan import PlanError
    from mtp_operator.settings import SettingsError
    from mtp_operator.spec import SpecError
    from mtp_runtime.signal_stop import SignalStop

    def fail(message: str) -> int:
        print(f"mtp up: {message}", file=sys.stderr)
        return EXIT_BAD_INPUT

    if args.requests < 0:
        return fail(f"--requests must be >= 0, got {args.requests}")
    if args.max_tokens < 1:
        return fail(f"--max-tokens must be >= 1, got {args.max_tokens}")
    try:
        deployment = prepare(args)
    except (UpInputError, SpecError, LocalPathError, ModelPrepError, PlanError, SettingsError) as exc:
        return fail(str(exc) if str(exc).startswith(str(args.file)) else f"{args.file}: {exc}")
    if deployment is None:
        return 0
    if args.dry_run:
        print_processes(deployment)
        return 0
    plan = deployment.plan
    if not deployment.groups:
        print(f"mtp up: {deployment.name}: spec.replicas is 0: no group will start, only the export; "
              f"logs in {deployment.options.log_dir}", flush=True)
    elif not deployment.fleet:
        print(f"mtp up: {deployment.name}: {plan.nnodes} rank(s) of {plan.engine} on 127.0.0.1, HTTP from port "
              f"{plan.http_port}, master {plan.master_address}; logs in {deployment.options.log_dir}", flush=True)
    else:
        print(f"mtp up: {deployment.name}: {len(deployment.groups)} groups of {plan.nnodes} rank(s) of "
              f"{plan.engine} on 127.0.0.1; logs in {deployment.options.log_dir}", flush=True)
        for group in deployment.groups:
            print(f"           group {group.index}: HTTP from port {group.plan.http_port}, "
                  f"master {group.plan.master_address}", flush=True)

    # Not a threading.Event: its set() from a signal handler can deadlock on the lock its wait() holds.
    with SignalStop().on_signals(signal.SIGINT, signal.SIGTERM) as stop:
        code = deployment.run(stop)
    if deployment.fleet:
        for line in deployment.group_summaries():
            print(line, flush=True)
    print(status_document(deployment.name, deployment.status), end="", flush=True)
    return code
