"""Architecture name -> model class, and builders for main models and MTP drafts."""

from __future__ import annotations

from mtp_runtime.config import ModelConfig
from mtp_runtime.distributed import ParallelState
from mtp_runtime.models.decoder import CausalLM
from mtp_runtime.models.deepseek_v3 import DeepseekV3ForCausalLM
from mtp_runtime.models.glm4_moe import Glm4MoeForCausalLM
from mtp_runtime.models.mtp import MtpDraft

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "deepseek_v3": DeepseekV3ForCausalLM,
    "deepseek_v32": DeepseekV3ForCausalLM,
    "glm4_moe": Glm4MoeForCausalLM,
}


def model_class(arch: str) -> type[CausalLM]:
    try:
        return MODEL_CLASSES[arch]
    except KeyError:
        raise ValueError(f"no model for architecture {arch!r}; known: {sorted(MODEL_CLASSES)}") from None


def build_model(config: ModelConfig, parallel: ParallelState | None = None) -> CausalLM:
    return model_class(config.arch)(config, parallel)


def build_draft(config: ModelConfig, parallel: ParallelState | None = None, moe: bool | None = None) -> MtpDraft:
    return MtpDraft(config, model_class(config.arch).make_attention, parallel, moe)
