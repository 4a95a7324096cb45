"""How `mtp up` shows a status: one line per change, the full status on exit
(after one line per group when it runs several).

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
    # With one group its nodes say it all; a fleet (or none) also says how many groups are ready.
    groups = f" groups {status.get('ready')}" if len(status.get("groups", [])) != 1 else ""
    line = f"[{clock}] {status.get('phase')} nodes {status.get('nodes')}{groups}  {condition_summary(status)}"
    waiting = [c["message"] for c in status.get("conditions", []) if c["type"] == "Ready" and c["status"] != "True"]
    if waiting and waiting[0]:
        line += f"\n           {waiting[0]}"
    return line


def change_key(status: dict[str, Any]) -> tuple:
    """What makes a new status worth a line: phase, node count, condition states."""
    conditions = tuple((c["type"], c["status"], c["reason"]) for c in status.get("conditions", []))
    return status.get("phase"), status.get("nodes"), status.get("ready"), conditions


def group_line(entry: dict[str, Any]) -> str:
    """One group of status.groups: phase, ranks, endpoint, its own figures and restarts."""
    line = f"group {entry['index']}: {entry['phase']}, {entry['readyNodes']} rank(s) ready, {entry['endpoint']}"
    if entry.get("acceptanceRate") is not None:
        line += f", acceptance rate {entry['acceptanceRate']:.3f} over {entry.get('draftTokens', 0)} drafted tokens"
    if entry.get("timePerOutputTokenSeconds") is not None:
        line += f", {entry['timePerOutputTokenSeconds'] * 1000:.1f} ms/token"
    return line + f", {entry['restarts']} restart(s)"


def status_document(name: str, status: dict[str, Any]) -> str:
    return yaml.safe_dump({"name": name, "status": status}, sort_keys=False)


def write_status_file(path: Path, name: str, status: dict[str, Any]) -> None:
    """JSON status for scripts; written beside and renamed, never half-written."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"name": name, "status": status}, indent=2) + "\n")
    os.replace(tmp, path)
