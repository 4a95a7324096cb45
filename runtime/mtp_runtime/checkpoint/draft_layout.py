"""The standalone MTP draft-model layout (as xLLM's export tool writes it).

The MTP decoder layer `model.layers.{L}.*` becomes `model.layers.0.*`; its
extras (`embed_tokens`, `enorm`, `hnorm`, `eh_proj`, `shared_head.*`) move to
the top as `model.*`. With more than one MTP layer, layer L+j becomes
`model.layers.j.*` and keeps its extras under that prefix.
"""

from __future__ import annotations

from . import naming

DRAFT_MODEL_TYPES = {
    "deepseek_v3": "deepseek_v3_mtp",
    "deepseek_v32": "deepseek_v32_mtp",
    "glm4_moe": "glm4_moe_mtp",
}
DRAFT_ARCHITECTURES = {
    "deepseek_v3": "DeepseekMTPForCausalLM",
    "deepseek_v32": "DeepseekV32MtpForCausalLM",
    "glm4_moe": "Glm4MoeMtpForCausalLM",
}
_TOP_LEVEL_PARTS = ("embed_tokens.", "enorm.", "hnorm.", "eh_proj.", "shared_head.")


def draft_name(name: str, config: dict) -> str | None:
    """Draft-model name of checkpoint tensor `name`, or None if it is not part of the MTP layers."""
    layer = naming.layer_index(name)
    mtp = naming.mtp_layer_indices(config)
    if layer is None or layer not in mtp:
        return None
    j = layer - mtp.start
    rest = name[len(f"model.layers.{layer}.") :]
    if j == 0 and rest.startswith(_TOP_LEVEL_PARTS):
        return "model." + rest
    return f"model.layers.{j}.{rest}"


def draft_config(config: dict, arch: str, quantization_config: dict | None) -> dict:
    """config.json of the draft: one decoder layer per MTP layer, all MoE as in the source."""
    n = config["num_nextn_predict_layers"]
    draft = dict(config)
    draft.update(
        model_type=DRAFT_MODEL_TYPES[arch],
        architectures=[DRAFT_ARCHITECTURES[arch]],
        num_hidden_layers=n,
        num_nextn_predict_layers=n,
        first_k_dense_replace=0,
    )
    # Only describe quantisation that the draft's tensors really carry.
    draft.pop("quantization_config", None)
    if quantization_config is not None:
        draft["quantization_config"] = quantization_config
    return dict(sorted(draft.items()))
