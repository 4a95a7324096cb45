"""`mtp operator`: run the MtpDeployment operator (kopf) against the current cluster."""

from __future__ import annotations

import argparse
import logging

from mtp_operator.settings import OperatorSettings, SettingsError

HELP = "run the Kubernetes operator for MtpDeployment resources"
DESCRIPTION = """\
Run the MtpDeployment operator against the current kubeconfig context, or the
in-cluster service account when running in a pod.

  mtp operator --namespace team-a        # one namespace (Role RBAC is enough)
  mtp operator --all-namespaces          # every namespace (ClusterRole)

Settings come from MTP_OPERATOR_* environment variables (see
mtp_operator/settings.py): reconcile and metrics intervals, gang-restart
budget and backoff, probe timeouts, default runtime images, the liveness port.
The liveness endpoint is http://0.0.0.0:$MTP_OPERATOR_HEALTH_PORT/healthz.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", action="append", metavar="NS",
                       help="watch this namespace (repeatable); default: MTP_OPERATOR_NAMESPACE")
    scope.add_argument("--all-namespaces", "-A", action="store_true", default=None,
                       help="watch every namespace; default: MTP_OPERATOR_ALL_NAMESPACES")
    parser.add_argument("--verbose", "-v", action="store_true", help="debug logging")


def run(args: argparse.Namespace) -> int:
    try:
        settings = OperatorSettings.from_env(
            namespace=tuple(args.namespace) if args.namespace else None,
            all_namespaces=args.all_namespaces or None,
        )
    except SettingsError as exc:
        print(f"mtp operator: {exc}")
        return 2
    if not settings.namespace and not settings.all_namespaces:
        print("mtp operator: pass --namespace NS or --all-namespaces "
              "(or set MTP_OPERATOR_NAMESPACE / MTP_OPERATOR_ALL_NAMESPACES=true)")
        return 2
    import asyncio

    import kopf

    from mtp_operator.handlers import build_registry

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(kopf.operator(
        registry=build_registry(settings),
        clusterwide=settings.all_namespaces,
        namespaces=list(settings.namespace),
        standalone=True,  # one replica (the chart uses Recreate); no peering objects needed
        liveness_endpoint=f"http://0.0.0.0:{settings.health_port}/healthz",
    ))
    return 0
