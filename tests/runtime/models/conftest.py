"""Tiny checkpoints for the model tests, written in the published layout, and the transformers
reference models built from them.

Weights are drawn with a larger spread than a fresh model's so that logits,
routing and the indexer's choices are decisive and differences show.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import torch

from mtp_runtime.checkpoint import naming
from mtp_runtime.checkpoint.fp8 import dequantize_fp8_blocks
from mtp_runtime.checkpoint.index import CheckpointIndex
from mtp_runtime.checkpoint.naming import SCALE_SUFFIX, detect_arch, layer_index
from mtp_runtime.checkpoint.configs import build_config
from mtp_runtime.checkpoint.tokenizer import build_tokenizer
from mtp_runtime.checkpoint.writer import write_checkpoint

VOCAB = 512

# Small enough to run in a fraction of a second, large enough that grouped
# routing matters (8 experts in 4 groups, 2 groups kept) and V3.2 prompts
# exceed index_topk.
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
             num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2)
ARCH_SIZES = {
    "deepseek_v3": dict(n_group=4, topk_group=2),
    "deepseek_v32": dict(n_group=4, topk_group=2, index_topk=12, index_n_heads=8, index_head_dim=16),
    "glm4_moe": dict(n_group=2, topk_group=1, use_qk_norm=True),
}


def spread_tensor(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 7919 + zlib.crc32(name.encode()))
    if name.endswith("norm.weight"):
        return 1.0 + 0.2 * torch.randn(shape, generator=gen)
    if name.endswith(("bias", "e_score_correction_bias")):
        return 0.1 * torch.randn(shape, generator=gen)
    fan_in = shape[-1] if len(shape) > 1 else 1
    return torch.randn(shape, generator=gen) * (1.5 / fan_in**0.5)


def tiny_config(arch: str, **overrides) -> dict:
    return build_config(arch, **{**SIZES, **ARCH_SIZES[arch], **overrides})


def write_tiny(out: Path, arch: str, fp8: bool = False, seed: int = 0, drop: tuple[str, ...] = (),
               **overrides) -> Path:
    config = tiny_config(arch, **overrides)
    tensors = {n: spread_tensor(n, s, seed) for n, s in naming.expected_tensors(config).items()}
    path = write_checkpoint(out, config, tensors, build_tokenizer(VOCAB), shards=2, fp8=fp8)
    if drop:  # remove tensors after writing (the writer insists on complete checkpoints)
        _drop_tensors(path, drop)
    return path


def _drop_tensors(path: Path, names: tuple[str, ...]) -> None:
    import json

    from safetensors.torch import load_file, save_file

    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(path / shard)
        kept = {k: v for k, v in tensors.items() if k not in names}
        save_file(kept, path / shard, metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k not in names}
    index_file.write_text(json.dumps(index))


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    """One checkpoint per architecture, plus DeepSeek-V3 in FP8, written once per session."""
    root = tmp_path_factory.mktemp("tiny")
    dirs = {arch: write_tiny(root / arch, arch) for arch in ARCH_SIZES}
    dirs["deepseek_v3_fp8"] = write_tiny(root / "deepseek_v3_fp8", "deepseek_v3", fp8=True, seed=1)
    return dirs


# ---- transformers reference (weights read with our index reader) ----
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


@pytest.fixture(scope="session")
def reference_model():
    """hf_model(path): the transformers model of a tiny checkpoint, float32, eager attention."""
    return hf_model


@pytest.fixture(scope="session")
def checkpoint_state():
    """read_dense_state(path) -> (config dict, float32 tensors by checkpoint name), and fuse_experts."""
    return read_dense_state, fuse_experts


@pytest.fixture(scope="session")
def tiny_writer():
    """write_tiny(out, arch, fp8=False, seed=0, drop=(), **config overrides) -> checkpoint directory."""
    return write_tiny
