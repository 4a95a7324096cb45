"""Load main models and MTP drafts from a Hugging Face checkpoint directory.

One table per architecture maps checkpoint names to module parameters; names
the table does not rewrite map to the parameter of the same name. FP8 weights
are dequantised with their block scales as they are read. Every checkpoint
tensor must land in a parameter and every parameter must be filled, or the
load fails naming the tensor.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mtp_runtime.checkpoint.fp8 import BLOCK as FP8_BLOCK
from mtp_runtime.checkpoint.fp8 import dequantize_fp8_blocks
from mtp_runtime.checkpoint.fp8 import scale_shape as fp8_scale_shape
from mtp_runtime.checkpoint.index import CheckpointIndex
from mtp_runtime.checkpoint.naming import SCALE_SUFFIX, layer_index
from mtp_runtime.checkpoint.safetensors_io import DTYPES, READ_STATS, TensorInfo, read_tensor
from mtp_runtime.config import ModelConfig
from mtp_runtime.distributed import ParallelState
from mtp_runtime.layers.embedding import VocabParallelEmbedding
from mtp_runtime.layers.linear import ColumnParallelLinear, RowParallelLinear, prepare_for_inference
from mtp_runtime.layers.moe import RoutedExperts
from mtp_runtime.models.decoder import CausalLM
from mtp_runtime.models.mtp import MtpDraft
from mtp_runtime.models.registry import build_draft, build_model


class LoadError(ValueError):
    """A checkpoint does not fit the model built from its config.json."""


# Parameters the published models keep in float32 whatever the working dtype.
FLOAT32_PARAMS = ("mlp.gate.weight", "e_score_correction_bias", "indexer.weights_proj.weight")

Rule = tuple[re.Pattern, str, Any]  # (checkpoint name pattern, module name template, loader kwargs)

_EXPERT_RULES: list[Rule] = [
    (re.compile(r"^(.*)\.mlp\.experts\.(\d+)\.gate_proj\.weight$"), r"\1.mlp.experts.w13", "gate"),
    (re.compile(r"^(.*)\.mlp\.experts\.(\d+)\.up_proj\.weight$"), r"\1.mlp.experts.w13", "up"),
    (re.compile(r"^(.*)\.mlp\.experts\.(\d+)\.down_proj\.weight$"), r"\1.mlp.experts.w2", "down"),
]
# The three architectures share the Hugging Face layout; V3.2's indexer and
# GLM's q/k/v tensors keep their names, so only the stacked experts are rewritten.
NAME_MAPS: dict[str, list[Rule]] = {
    "deepseek_v3": _EXPERT_RULES,
    "deepseek_v32": _EXPERT_RULES,
    "glm4_moe": _EXPERT_RULES,
}
# Parts of an MTP layer that belong to the draft module itself rather than to its decoder layer.
_DRAFT_OWN = ("embed_tokens.", "enorm.", "hnorm.", "eh_proj.", "shared_head.")


def map_name(arch: str, name: str) -> tuple[str, dict[str, Any]]:
    for pattern, template, shard in NAME_MAPS[arch]:
        m = pattern.match(name)
        if m:
            return m.expand(template), {"expert_id": int(m.group(2)), "shard": shard}
    return name, {}


def _read(index: CheckpointIndex, name: str, cut: tuple[int, int, int] | None = None) -> torch.Tensor:
    """The checkpoint tensor in float32. With `cut` (dim, start, size) only that slice of dim 0 or
    1 is read from disk (this rank's tensor-parallel shard; of an FP8 weight, its block scales are
    read whole, they are small); the rest of the full-shape result is NaN, and the weight loader,
    which takes the same slice, never copies it."""
    info = index.info(name)
    fp8 = info.dtype == "F8_E4M3"  # block-scaled, as DeepSeek stores its weights
    if cut is not None and len(info.shape) > cut[0] and cut[1] + cut[2] <= info.shape[cut[0]] \
            and (len(info.shape) == 2 or (cut[0] == 0 and not fp8)):
        dim, start, size = cut
        part = _read_slice(index.shard_path(name), name, info, dim, start, size)
        if fp8:
            # The same float32 products as dequantize_fp8_blocks, for this slice's elements only.
            rows = torch.arange(part.shape[0]) + (start if dim == 0 else 0)
            cols = torch.arange(part.shape[1]) + (start if dim == 1 else 0)
            scale = _fp8_scale(index, name)
            if tuple(scale.shape) != fp8_scale_shape(info.shape):
                raise LoadError(f"{index.model_dir}: {name} has block scales of shape {tuple(scale.shape)}, "
                                f"expected {fp8_scale_shape(info.shape)} for its {FP8_BLOCK}x{FP8_BLOCK} blocks")
            part = part * scale[rows // FP8_BLOCK][:, cols // FP8_BLOCK]
        full = torch.full(info.shape, float("nan"), dtype=torch.float32)
        full.narrow(dim, start, size).copy_(part)
        return full
    tensor = index.read(name)
    if tensor.dtype == torch.float8_e4m3fn:
        return dequantize_fp8_blocks(tensor, _fp8_scale(index, name), torch.float32, name)
    return tensor.float()


def _fp8_scale(index: CheckpointIndex, name: str) -> torch.Tensor:
    scale = name[: -len(".weight")] + SCALE_SUFFIX
    if scale not in index:
        raise LoadError(f"{index.model_dir}: FP8 tensor {name} has no {scale} (block scales) in the checkpoint")
    return index.read(scale).float()


def _load_tensors(module: nn.Module, index: CheckpointIndex, arch: str, names: dict[str, str]) -> set[tuple]:
    """names: checkpoint name -> module-relative name. Returns the (param, expert, shard) keys filled."""
    params = dict(module.named_parameters())
    filled: set[tuple] = set()
    with torch.no_grad():
        for ckpt_name, rel_name in names.items():
            param_name, kwargs = map_name(arch, rel_name)
            param = params.get(param_name)
            if param is None:
                raise LoadError(f"{index.model_dir}: unexpected tensor {ckpt_name} (no {param_name} in the "
                                f"{type(module).__name__} built from config.json)")
            owner = module.get_submodule(param_name.rpartition(".")[0])
            if isinstance(owner, RoutedExperts) and 0 <= kwargs["expert_id"] < owner.num_experts \
                    and not owner.is_local(kwargs["expert_id"]):
                continue  # another expert-parallel rank owns this expert: not even read
            loader = getattr(param, "weight_loader", None)
            try:
                if loader is None:
                    _copy_whole(param, _read(index, ckpt_name), ckpt_name)
                else:
                    loader(param, _read(index, ckpt_name, _local_slice(owner, kwargs)), ckpt_name, **kwargs)
            except ValueError as exc:
                raise LoadError(f"{index.model_dir}: {exc}") from None
            filled.add((param_name, kwargs.get("expert_id"), kwargs.get("shard")))
    return filled


def _local_slice(owner: nn.Module, kwargs: dict[str, Any]) -> tuple[int, int, int] | None:
    """(dim, start, size) of the checkpoint tensor this rank's weight loader keeps: rows of
    column-parallel outputs, vocabularies and TP-split expert gate/up; columns of row-parallel
    inputs and TP-split expert down projections. None: the loader keeps it whole."""
    parallel = getattr(owner, "parallel", None)
    if parallel is None or parallel.tp_size == 1:
        return None
    if isinstance(owner, ColumnParallelLinear):
        return (0, *parallel.shard(owner.full_out, "ColumnParallelLinear output features"))
    if isinstance(owner, RowParallelLinear):  # the weight's input columns; its 1-D bias stays whole
        return (1, *parallel.shard(owner.full_in, "RowParallelLinear input features"))
    if isinstance(owner, VocabParallelEmbedding):
        return 0, owner.vocab_start, owner.weight.shape[0]
    if isinstance(owner, RoutedExperts) and owner.inter < owner.full_inter:
        return (1 if kwargs.get("shard") == "down" else 0), owner.inter_start, owner.inter
    return None


def _read_slice(path: Path, name: str, info: TensorInfo, dim: int, start: int, size: int) -> torch.Tensor:
    """Read rows start..start+size (dim 0: one read) or, of a 2-D tensor, those columns of every
    row (dim 1: one read per row), counting only the bytes read."""
    if dim == 0:
        row_bytes = info.nbytes // info.shape[0]
        return read_tensor(path, name, TensorInfo(info.dtype, (size, *info.shape[1:]),
                                                  info.start + start * row_bytes,
                                                  info.start + (start + size) * row_bytes)).float()
    rows, cols = info.shape
    item = info.nbytes // (rows * cols)
    buf = bytearray(rows * size * item)
    view = memoryview(buf)
    fd = os.open(path, os.O_RDONLY)
    try:
        for r in range(rows):
            want = view[r * size * item:(r + 1) * size * item]
            got = os.preadv(fd, [want], info.start + (r * cols + start) * item)
            if got != len(want):
                raise LoadError(f"{path}: truncated shard: tensor {name!r} ends past end of file")
    finally:
        os.close(fd)
    READ_STATS.bytes_read += len(buf)
    return torch.frombuffer(buf, dtype=DTYPES[info.dtype]).reshape(rows, size).float()


def _copy_whole(param: nn.Parameter, loaded: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"tensor {name}: checkpoint shape {tuple(loaded.shape)} does not match the model's "
                         f"{tuple(param.shape)}")
    param.copy_(loaded)


def _missing(module: nn.Module, filled: set[tuple], skip: tuple[str, ...] = ()) -> list[str]:
    missing = []
    for param_name, param in module.named_parameters():
        if param_name.startswith(skip):
            continue
        if param_name.endswith((".experts.w13", ".experts.w2")):
            experts = module.get_submodule(param_name.rsplit(".", 1)[0])
            shards = ("gate", "up") if param_name.endswith("w13") else ("down",)
            for e in experts.local:
                for shard in shards:
                    if (param_name, e, shard) not in filled:
                        kind = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}[shard]
                        missing.append(param_name.replace("experts.w13", f"experts.{e}.{kind}.weight")
                                       .replace("experts.w2", f"experts.{e}.{kind}.weight"))
        elif (param_name, None, None) not in filled:
            missing.append(param_name)
    return missing


def to_working_dtype(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    for name, param in module.named_parameters():
        if not name.endswith(FLOAT32_PARAMS):
            param.data = param.data.to(dtype)
    return module


def _dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    except KeyError:
        raise LoadError(f"dtype {dtype!r} is not supported: use float32 or bfloat16") from None


def load_model(model_dir: str | Path, dtype: torch.dtype | str = torch.float32, device: str = "cpu",
               parallel: ParallelState | None = None) -> CausalLM:
    """The main model of a checkpoint (MTP layers, if present, are left for load_draft)."""
    config = ModelConfig.from_dir(model_dir)
    index = CheckpointIndex(model_dir)
    if config.is_mtp:
        raise LoadError(f"{model_dir}: model_type {config.model_type} is a draft module; load it with "
                        f"--draft_model, and give --model the main checkpoint")
    model = build_model(config, parallel)
    mtp_layers = range(config.num_hidden_layers, config.num_hidden_layers + config.num_nextn_predict_layers)
    names = {n: n for n in index.names() if not n.endswith(SCALE_SUFFIX) and layer_index(n) not in mtp_layers}
    filled = _load_tensors(model, index, config.arch, names)
    if config.tie_word_embeddings and ("lm_head.weight", None, None) not in filled:
        model.lm_head.weight.data.copy_(model.model.embed_tokens.weight.data)
        filled.add(("lm_head.weight", None, None))
    _raise_missing(index, _missing(model, filled))
    return prepare_for_inference(to_working_dtype(model, _dtype(dtype)).to(device).eval())


def load_draft(model_dir: str | Path, main: CausalLM | None = None, dtype: torch.dtype | str = torch.float32,
               device: str = "cpu", parallel: ParallelState | None = None) -> MtpDraft:
    """The MTP module from an exported draft directory (model_type *_mtp) or from the main checkpoint
    (its first MTP layer, model.layers.{num_hidden_layers}). Missing shared_head.head / embed_tokens
    fall back to `main`'s lm_head / embedding."""
    config = ModelConfig.from_dir(model_dir)
    index = CheckpointIndex(model_dir)
    names = _draft_names(index, config)
    if not names:
        raise LoadError(f"{model_dir}: no MTP layer found (expected model.layers.{config.num_hidden_layers}.* "
                        f"in a main checkpoint with num_nextn_predict_layers >= 1, or an `mtp export` directory)")
    moe = any(".mlp.experts." in rel for rel in names.values())
    draft = build_draft(config, parallel, moe)
    filled = _load_tensors(draft, index, config.arch, names)
    skip = []
    for part, attach, source in (("shared_head.head.", draft.use_main_head, "lm_head"),
                                 ("embed_tokens.", draft.use_main_embedding, "model.embed_tokens")):
        if any(rel.startswith(part) for rel in names.values()):
            continue
        if main is None:
            raise LoadError(f"{model_dir}: the MTP layer has no {part}weight; load the main model first so "
                            f"its {source} can be shared")
        skip.append(part)
    prefix = "model.layers.0." if config.is_mtp else f"model.layers.{config.mtp_layer_index}."
    _raise_missing(index, [prefix + (m[len("layer."):] if m.startswith("layer.") else m)
                           for m in _missing(draft, filled, tuple(skip))])
    draft = prepare_for_inference(to_working_dtype(draft, _dtype(dtype)).to(device).eval())
    # DeepSeek-V3 and GLM train the MTP layer with the main model's output head and embedding, and
    # their checkpoints store copies: share the main model's when they are equal (one copy in memory,
    # and a step reads the head's weights twice from the same place).
    if main is not None and ("shared_head.head." in skip or _same_weight(draft.shared_head.head, main.lm_head)):
        draft.use_main_head(main.lm_head)
    if main is not None and ("embed_tokens." in skip or _same_weight(draft.embed_tokens, main.model.embed_tokens)):
        draft.use_main_embedding(main.model.embed_tokens)
    return draft


def _same_weight(a: nn.Module, b: nn.Module) -> bool:
    wa, wb = a.weight, b.weight
    return wa.shape == wb.shape and wa.dtype == wb.dtype and wa.device == wb.device and torch.equal(wa, wb)


def _draft_names(index: CheckpointIndex, config: ModelConfig) -> dict[str, str]:
    """checkpoint name -> MtpDraft parameter name, for the first MTP layer only."""
    prefix = "model.layers.0." if config.is_mtp else f"model.layers.{config.mtp_layer_index}."
    names = {}
    for name in index.names():
        if name.endswith(SCALE_SUFFIX):
            continue
        if name.startswith(prefix):
            rel = name[len(prefix):]
        elif config.is_mtp and name.startswith("model.") and name[len("model."):].startswith(_DRAFT_OWN):
            rel = name[len("model."):]  # exported drafts keep these at the top level
        elif config.is_mtp and layer_index(name) is None:
            raise LoadError(f"{index.model_dir}: unexpected tensor {name} in a draft directory")
        else:
            continue  # main-model tensors and further MTP layers (the first one is reused) are not loaded
        names[name] = rel if rel.startswith(_DRAFT_OWN) else "layer." + rel
    return names


def checkpoint_tensors(model: CausalLM, draft: MtpDraft | None = None) -> dict[str, torch.Tensor]:
    """Parameters under their published checkpoint names (experts unstacked; the draft as the
    first MTP layer, model.layers.{num_hidden_layers}.*), in float32."""
    out = _unstack(dict(model.named_parameters()), "")
    if draft is not None:
        prefix = f"model.layers.{model.config.mtp_layer_index}."
        for name, tensor in _unstack(dict(draft.named_parameters()), "").items():
            out[prefix + (name[len("layer."):] if name.startswith("layer.") else name)] = tensor
    return out


def _unstack(params: dict[str, nn.Parameter], prefix: str) -> dict[str, torch.Tensor]:
    out = {}
    for name, param in params.items():
        data = param.detach().float()
        if name.endswith(".experts.w13"):
            base = name[: -len("w13")]
            for e, w in enumerate(data):
                gate, up = w.chunk(2)
                out[f"{prefix}{base}{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{prefix}{base}{e}.up_proj.weight"] = up.contiguous()
        elif name.endswith(".experts.w2"):
            base = name[: -len("w2")]
            for e, w in enumerate(data):
                out[f"{prefix}{base}{e}.down_proj.weight"] = w.contiguous()
        else:
            out[prefix + name] = data
    return out


def _raise_missing(index: CheckpointIndex, missing: list[str]) -> None:
    if missing:
        shown = ", ".join(missing[:8]) + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else "")
        raise LoadError(f"{index.model_dir}: checkpoint lacks tensor(s) the model needs: {shown}")
