"""`--node_rank auto`: this pod's ordinal in the StatefulSet.

Sources, first found wins:
1. MTP_POD_INDEX, set from the pod-index label through the downward API
   (`fieldRef: metadata.labels['apps.kubernetes.io/pod-index']`);
2. the same label in a downward-API labels file named by MTP_POD_LABELS_FILE;
3. the trailing ordinal of the hostname (`mtp-deepseek-3` -> 3).
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from typing import Mapping

# Env var the operator fills from the pod-index label (downward API).
POD_INDEX_ENV = "MTP_POD_INDEX"
# Env var naming a downward-API volume file holding the pod's labels.
POD_LABELS_FILE_ENV = "MTP_POD_LABELS_FILE"
# Label the StatefulSet controller puts on each pod (Kubernetes >= 1.28).
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"

_ORDINAL = re.compile(r"-(\d+)$")


class NodeRankError(ValueError):
    """--node_rank could not be worked out; the message says from where it was tried."""


def resolve_node_rank(
    node_rank: int | str,
    nnodes: int,
    environ: Mapping[str, str] | None = None,
    hostname: str | None = None,
) -> int:
    """--node_rank value (an int, a digit string or 'auto') -> rank in [0, nnodes)."""
    text = str(node_rank).strip()
    if text.lower() == "auto":
        rank, source = _auto_rank(os.environ if environ is None else environ, hostname)
    elif text.isdigit():
        rank, source = int(text), "--node_rank"
    else:
        raise NodeRankError(f"--node_rank {node_rank!r}: expected an integer or 'auto'")
    if not 0 <= rank < nnodes:
        raise NodeRankError(f"node rank {rank} (from {source}) is outside 0..{nnodes - 1} for --nnodes {nnodes}")
    return rank


def _auto_rank(environ: Mapping[str, str], hostname: str | None) -> tuple[int, str]:
    value = environ.get(POD_INDEX_ENV, "").strip()
    if value:
        if not value.isdigit():
            raise NodeRankError(f"{POD_INDEX_ENV}={value!r}: expected the pod index, a non-negative integer")
        return int(value), POD_INDEX_ENV
    labels_file = environ.get(POD_LABELS_FILE_ENV, "").strip()
    if labels_file:
        found = _label_from_file(Path(labels_file))
        if found is not None:
            return found, f"label {POD_INDEX_LABEL} in {labels_file}"
    host = hostname if hostname is not None else socket.gethostname()
    match = _ORDINAL.search(host.split(".")[0])
    if match is None:
        raise NodeRankError(
            f"--node_rank auto: no {POD_INDEX_ENV} env var, no {POD_INDEX_LABEL} label file, "
            f"and hostname {host!r} does not end in -<ordinal>; pass --node_rank N"
        )
    return int(match.group(1)), f"hostname {host!r}"


def _label_from_file(path: Path) -> int | None:
    """Parse a downward-API labels file (`key="value"` per line)."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise NodeRankError(f"{POD_LABELS_FILE_ENV}={str(path)!r}: cannot read the labels file: {exc}") from exc
    for line in lines:
        key, sep, value = line.partition("=")
        if sep and key.strip() == POD_INDEX_LABEL:
            value = value.strip().strip('"')
            if not value.isdigit():
                raise NodeRankError(f"{path}: label {POD_INDEX_LABEL}={value!r} is not a pod index")
            return int(value)
    return None
