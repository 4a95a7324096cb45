"""The MtpDeployment status: pydantic models that give the CRD its status schema.

`mtp_operator.status.compute_status` produces a dict of this shape; the
models exist so the API server keeps (does not prune) every field we write.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mtp_operator.spec import ApiModel


class Condition(ApiModel):
    # Any type, as in metav1.Condition: other controllers may keep their own conditions here. Ours are
    # DraftReady, Ready, Progressing and Degraded.
    type: str = Field(pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                              r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$", max_length=316)
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
    message: str = ""
    last_transition_time: str = Field(description="RFC 3339; changes only when status flips.")
    observed_generation: int | None = None


class SpeculativeStatus(ApiModel):
    acceptance_rate: float | None = Field(None, description="Accepted / drafted tokens over the last interval.")
    mean_accepted_tokens_per_step: float | None = None
    per_position_acceptance: list[float] = Field(default_factory=list)
    mean_speculative_tokens: float | None = Field(
        None, description="Mean k the engine chose per step over the last interval (builtin engine; with "
        "spec.speculative.adaptive it moves with acceptance and load).")
    draft_tokens: int | None = Field(None, description="Drafted tokens in the last interval.")
    observed_time: str | None = None


class ThroughputStatus(ApiModel):
    generation_tokens_per_second: float | None = None
    prompt_tokens_per_second: float | None = None
    requests_running: float | None = None
    requests_waiting: float | None = None
    kv_cache_usage_ratio: float | None = None


class LatencyStatus(ApiModel):
    time_to_first_token_seconds: float | None = Field(None, description="Mean over the last interval.")
    time_per_output_token_seconds: float | None = None


class GangStatus(ApiModel):
    """Bookkeeping for whole-group restarts (see mtp_operator.gang)."""

    members: dict[str, str] = Field(default_factory=dict, description="rank -> pod uid/restart count.")
    restarts: int = 0
    retired: list[str] = Field(default_factory=list, description="Pod uids deleted by the last restart.")
    last_restart_time: str | None = None
    reason: str | None = None


class GroupStatus(ApiModel):
    """One group of the fleet, with its own rank 0's figures."""

    index: int
    revision: str | None = None
    stateful_set: str | None = None
    ready_nodes: int = 0
    phase: Literal["Pending", "Starting", "Running", "Updating"] = "Pending"
    restarts: int = Field(0, description="Whole-group restarts of this group (gang restarts).")
    acceptance_rate: float | None = None
    time_per_output_token_seconds: float | None = None
    draft_tokens: int | None = None
    template_hash: str | None = None
    applied_hash: str | None = Field(None, description="Digest of the group's StatefulSet as last applied.")
    gang: GangStatus | None = None


class CounterSnapshot(ApiModel):
    uid: str = Field("", description="The rank-0 pod the counters came from.")
    draft: float = 0.0
    accepted: float = 0.0
    tpot_sum: float = 0.0
    tpot_count: float = 0.0


class RolloutStatus(ApiModel):
    """The rollout in progress or last finished (mtp_operator.rollout); an operator restart resumes it."""

    revision: str | None = Field(None, description="The revision being rolled out.")
    phase: Literal["Canary", "Analyzing", "Rolling", "Failed"] | None = None
    canary_groups: list[int] = Field(default_factory=list)
    start_time: float | None = None
    analysis_start: float | None = None
    start_counters: dict[str, CounterSnapshot] = Field(
        default_factory=dict, description="Rank-0 counters of each compared group when the analysis began.")
    baseline: dict[str, float | None] | None = Field(
        None, description="The old revision's figures, recorded when the rollout began.")
    message: str | None = None
    last_result: str | None = None


class MtpDeploymentStatus(ApiModel):
    phase: Literal["Pending", "Exporting", "Starting", "Running", "Degraded", "Failed"] | None = None
    observed_generation: int | None = None
    conditions: list[Condition] = Field(default_factory=list)
    ready_nodes: int | None = None
    nnodes: int | None = None
    nodes: str | None = Field(None, description="ready/total, for kubectl get.")
    master_address: str | None = None
    endpoint: str | None = None
    draft_model_path: str | None = None
    export_job: str | None = None
    template_hash: str | None = None
    applied_hash: str | None = Field(None, description="Digest of the children last applied.")
    speculative: SpeculativeStatus | None = None
    throughput: ThroughputStatus | None = None
    latency: LatencyStatus | None = None
    gang: GangStatus | None = None
    replicas: int | None = Field(None, description="Groups that exist (the scale subresource's status).")
    ready_replicas: int | None = None
    updated_replicas: int | None = Field(None, description="Groups on updateRevision.")
    ready: str | None = Field(None, description="readyReplicas/replicas, for kubectl get.")
    selector: str | None = Field(None, description="Label selector of the rank-0 pods (scale subresource).")
    current_revision: str | None = None
    update_revision: str | None = None
    groups: list[GroupStatus] = Field(default_factory=list)
    rollout: RolloutStatus | None = None
