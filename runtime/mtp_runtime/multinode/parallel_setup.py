"""From a formed group to the ParallelState the layers shard by.

Every rank is one tensor-parallel rank (attention heads, dense MLPs,
vocabulary). With --ep_size equal to the group size the routed experts are
split over the ranks instead of being split by their intermediate size.
"""

from __future__ import annotations

from mtp_runtime.config import ModelConfig
from mtp_runtime.distributed import ParallelState

__all__ = ["ParallelConfigError", "build_parallel_state", "check_model_fits"]


class ParallelConfigError(ValueError):
    """The parallel layout does not fit the group or the model; the message names the flag or field."""


def build_parallel_state(rank: int, world_size: int, ep_size: int = 1, dp_size: int = 1, group=None) -> ParallelState:
    if dp_size != 1:
        raise ParallelConfigError(
            f"--dp_size {dp_size}: attention data parallelism is not implemented; use --dp_size 1 "
            f"(every rank is a tensor-parallel rank)"
        )
    # The layers sum expert partials over the whole group, so an expert may live on
    # exactly one rank (ep_size = group size) or be split on all of them (ep_size 1).
    if ep_size not in (1, world_size):
        raise ParallelConfigError(
            f"--ep_size {ep_size}: must be 1 (experts split by intermediate size over all ranks) or "
            f"{world_size} (one slice of the experts per rank, --nnodes {world_size})"
        )
    return ParallelState(tp_rank=rank, tp_size=world_size, ep_rank=rank if ep_size > 1 else 0,
                         ep_size=ep_size, group=group)


def check_model_fits(config: ModelConfig, parallel: ParallelState, source: str = "config.json") -> None:
    """Fail before loading when a sharded size does not divide, naming the config field."""
    tp, ep = parallel.tp_size, parallel.ep_size
    sizes = {"num_attention_heads": config.num_attention_heads, "vocab_size": config.vocab_size,
             "intermediate_size": config.intermediate_size}
    if config.arch == "glm4_moe":
        sizes["num_key_value_heads"] = config.num_key_value_heads
    if config.n_routed_experts and ep == 1:
        sizes["moe_intermediate_size"] = config.moe_intermediate_size
    if config.n_shared_experts:
        sizes["moe_intermediate_size * n_shared_experts"] = config.moe_intermediate_size * config.n_shared_experts
    for field_name, size in sizes.items():
        if size % tp:
            raise ParallelConfigError(
                f"{source}: {field_name} = {size} is not divisible by the {tp} tensor-parallel ranks "
                f"(--nnodes); pick --nnodes that divides it"
            )
    if config.n_routed_experts and config.n_routed_experts % ep:
        raise ParallelConfigError(
            f"{source}: n_routed_experts = {config.n_routed_experts} is not divisible by --ep_size {ep}"
        )
