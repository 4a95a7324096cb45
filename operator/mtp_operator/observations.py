"""What a backend observed about one MtpDeployment, in backend-neutral terms.

The Kubernetes handlers fill these from Jobs, pods and HTTP probes; the local
backend (`mtp up`) fills them from its processes. Both hand them to
`mtp_operator.status.compute_status` and `mtp_operator.gang.evaluate_gang`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from mtp_operator.metrics import SpecDecodeStats

ExportState = Literal["absent", "running", "succeeded", "failed"]


@dataclass(frozen=True)
class ExportObservation:
    name: str  # Job name (or the local process's label)
    state: ExportState
    message: str = ""  # failure: the export pod's termination message / log tail


@dataclass(frozen=True)
class RankObservation:
    rank: int
    uid: str  # pod uid (or process id locally): a new one means the member was replaced
    restart_count: int  # container restarts of this member
    ready: bool  # readiness (pod Ready condition / process alive and listening)
    current: bool = True  # runs the current template (hash) — False while rolling
    terminating: bool = False  # being deleted
    healthy: bool | None = None  # GET /health == 200; None: not probed (no HTTP on this rank)
    health_detail: str = ""


@dataclass(frozen=True)
class GroupObservation:
    """One group of a fleet (spec.replicas groups of nnodes ranks)."""

    index: int
    revision: str | None  # the revision its StatefulSet runs
    nnodes: int
    ranks: list[RankObservation] = field(default_factory=list)


@dataclass(frozen=True)
class Observations:
    generation: int
    nnodes: int
    draft_model_path: str
    master_address: str
    endpoint: str
    template_hash: str
    export: ExportObservation | None  # None: spec.draftModel given, nothing to export
    ranks: list[RankObservation] = field(default_factory=list)
    stats: SpecDecodeStats | None = None  # None: not scraped this time (keep the last figures)
    stats_time: str | None = None  # RFC 3339 time of the scrape behind `stats`
    failure: tuple[str, str] | None = None  # (reason, message): the spec cannot run at all
    gang: dict | None = None  # GangStatus dict from evaluate_gang
    groups: list[GroupObservation] | None = None  # a fleet (Kubernetes); None: one group, `ranks`
