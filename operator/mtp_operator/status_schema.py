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
