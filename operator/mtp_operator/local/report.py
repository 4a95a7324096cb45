"""How `mtp up` shows a status: one line per change, the full status on exit.

The status is the dict `compute_status` returns, the same one the operator
writes into the resource, so what is printed here is what `kubectl get mtpd -o
yaml` shows on a cluster.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import yaml


def condition_summary(status: dict[str, Any]) -> str:
    parts = []
    for cond in status.get("conditions", []):
        text = f"{cond['type']}={cond['status']}"
        if cond["status"] != "True" or cond["type"] == "Degraded":
            text += f"({cond['reason']})"
        parts.append(text)
    return " ".join(parts)


def acceptance_summary(status: dict[str, Any]) -> str | None:
    spec = status.get("speculative") or {}
    rate = spec.get("acceptanceRate")
    if rate is None:
        return None
    text = f"acceptance rate {rate:.3f}"
    if spec.get("meanAcceptedTokensPerStep") is not None:
        text += f", {spec['meanAcceptedTokensPerStep']:.2f} accepted tokens/step"
    if spec.get("perPositionAcceptance"):
        text += ", per position " + "/".join(f"{p:.2f}" for p in spec["perPositionAcceptance"])
    return text + f" over {spec.get('draftTokens', 0)} drafted tokens"


def status_line(status: dict[str, Any]) -> str:
    clock = time.strftime("%H:%M:%S")
    line = f"[{clock}] {status.get('phase')} nodes {status.get('nodes')}  {condition_summary(status)}"
    waiting = [c["message"] for c in status.get("conditions", []) if c["type"] == "Ready" and c["status"] != "True"]
    if waiting and waiting[0]:
        line += f"\n           {waiting[0]}"
    return line


def change_key(status: dict[str, Any]) -> tuple:
    """What makes a new status worth a line: phase, node count, condition states."""
    conditions = tuple((c["type"], c["status"], c["reason"]) for c in status.get("conditions", []))
    return status.get("phase"), status.get("nodes"), conditions


def status_document(name: str, status: dict[str, Any]) -> str:
    return yaml.safe_dump({"name": name, "status": status}, sort_keys=False)


def write_status_file(path: Path, name: str, status: dict[str, Any]) -> None:
    """JSON status for scripts; written beside and renamed, never half-written."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"name": name, "status": status}, indent=2) + "\n")
    os.replace(tmp, path)
