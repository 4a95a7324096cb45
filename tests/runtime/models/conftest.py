"""Tiny checkpoints for the model tests, written in the published layout.

Weights are drawn with a larger spread than a fresh model's so that logits,
routing and the indexer's choices are decisive and differences show.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import torch

from mtp_runtime.checkpoint import naming
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
