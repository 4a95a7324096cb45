"""DeepSeek-V3 / R1 (MLA + DeepSeekMoE) and V3.2 (the same plus the sparse indexer)."""

from __future__ import annotations

from mtp_runtime.models.decoder import CausalLM
from mtp_runtime.models.mla import MLAttention


class DeepseekV3ForCausalLM(CausalLM):
    """V3, R1 and V3.2: MLAttention adds the indexer itself when config.arch is deepseek_v32."""

    make_attention = MLAttention
