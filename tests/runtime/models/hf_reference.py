"""Build the transformers reference model for a tiny checkpoint (weights read with our index reader)."""

from __future__ import annotations

from pathlib import Path

import torch

from mtp_runtime.checkpoint.fp8 import dequantize_fp8_blocks
from mtp_runtime.checkpoint.index import CheckpointIndex
from mtp_runtime.checkpoint.naming import SCALE_SUFFIX, detect_arch, layer_index


def read_dense_state(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    index = CheckpointIndex(path)
    state = {}
    for name in index.names():
        if name.endswith(SCALE_SUFFIX):
            continue
        t = index.read(name)
        if t.dtype == torch.float8_e4m3fn:
            t = dequantize_fp8_blocks(t, index.read(name[:-len(".weight")] + SCALE_SUFFIX), torch.float32, name)
        state[name] = t.float()
    return index.config, state


def hf_model(path: Path):
    import transformers

    config, state = read_dense_state(path)
    arch = detect_arch(config)
    cls_config, cls_model = {
        "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
        "deepseek_v32": (transformers.DeepseekV32Config, transformers.DeepseekV32ForCausalLM),
        "glm4_moe": (transformers.Glm4MoeConfig, transformers.Glm4MoeForCausalLM),
    }[arch]
    kwargs = {k: v for k, v in config.items() if k not in ("model_type", "architectures", "quantization_config",
                                                          "transformers_version", "torch_dtype")}
    if arch == "deepseek_v32":
        kwargs.pop("rope_interleave", None)
    hf_config = cls_config(**kwargs)
    hf_config._attn_implementation = "eager"
    model = cls_model(hf_config).float().eval()
    L = config["num_hidden_layers"]
    state = {k: v for k, v in state.items() if layer_index(k) is None or layer_index(k) < L}
    model.load_state_dict(fuse_experts(state, config), strict=True)
    return model


def fuse_experts(state: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """Per-expert gate/up/down tensors -> transformers' stacked gate_up_proj [E, 2I, H] and down_proj [E, H, I]."""
    out = {k: v for k, v in state.items() if ".mlp.experts." not in k}
    E = config["n_routed_experts"]
    prefixes = sorted({k.split(".mlp.experts.")[0] for k in state if ".mlp.experts." in k})
    for p in prefixes:
        e = f"{p}.mlp.experts"
        out[f"{e}.gate_up_proj"] = torch.stack(
            [torch.cat([state[f"{e}.{i}.gate_proj.weight"], state[f"{e}.{i}.up_proj.weight"]]) for i in range(E)])
        out[f"{e}.down_proj"] = torch.stack([state[f"{e}.{i}.down_proj.weight"] for i in range(E)])
    return out
