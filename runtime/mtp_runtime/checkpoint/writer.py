"""Write a model directory in the published Hugging Face layout, atomically.

config.json, model-0000i-of-0000N.safetensors, model.safetensors.index.json
(with metadata.total_size), tokenizer files and generation_config.json are
written into a temporary directory beside `out_dir`, which is renamed into
place only when everything is on disk.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch

from . import naming
from .errors import MissingTensorError, OutputExistsError
from .fp8 import FP8_DTYPE, QUANTIZATION_CONFIG, quantize_fp8_blocks, scale_shape
from .index import CONFIG_FILE, INDEX_FILE
from .safetensors_io import ShardWriter
from .tokenizer import TOKENIZER_FILES

GENERATION_CONFIG_FILE = "generation_config.json"
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}

# (dtype, shape) of one entry of a shard
Spec = tuple[torch.dtype, tuple[int, ...]]


def shard_name(i: int, n: int) -> str:
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def write_checkpoint(
    out_dir: Path | str,
    config: dict,
    tensors: Mapping[str, torch.Tensor],
    tokenizer_dir_or_obj,
    shards: int = 1,
    fp8: bool = False,
    overwrite: bool = False,
) -> Path:
    """Write `tensors` (exactly the names of naming.expected_tensors(config)) as a model directory.

    Tensors are cast to the published storage dtypes (bf16; float32 for
    e_score_correction_bias); with `fp8` the FP8 linear weights become e4m3 +
    128x128 `weight_scale_inv` and config.json gets the matching
    quantization_config. `tensors` may be lazy: if it has a `spec` dict
    (name -> (dtype, shape)), tensors are materialised one at a time.
    `tokenizer_dir_or_obj` is a directory with tokenizer files or a
    `tokenizers.Tokenizer`. An existing non-empty `out_dir` is replaced only
    with `overwrite`.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise OutputExistsError(f"{out_dir}: output directory is not empty (choose another --out or remove it)")
    entries = plan_entries(config, tensors, fp8)
    groups = split_into_shards(entries, shards)
    tmp = make_temp_dir_beside(out_dir)
    try:
        weight_map = _write_shards(tmp, tensors, groups)
        total = sum(_nbytes(spec) for spec in entries.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2))
        _write_config_files(tmp, config, fp8)
        _write_tokenizer(tmp, tokenizer_dir_or_obj)
        move_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def plan_entries(config: dict, tensors: Mapping[str, torch.Tensor], fp8: bool) -> dict[str, Spec]:
    """Ordered name -> (storage dtype, shape) of everything the shards will hold."""
    expected = naming.expected_tensors(config)
    missing = [n for n in expected if n not in tensors]
    if missing:
        raise MissingTensorError(f"tensor {missing[0]!r} is missing ({len(missing)} expected tensors missing)")
    extra = [n for n in tensors if n not in expected]
    if extra:
        raise ValueError(f"tensor {extra[0]!r} is not part of a {naming.detect_arch(config)} checkpoint with this config")
    spec = getattr(tensors, "spec", None)
    entries: dict[str, Spec] = {}
    for name, shape in expected.items():
        given = tuple(spec[name][1]) if spec is not None else tuple(tensors[name].shape)
        if given != shape:
            raise ValueError(f"tensor {name!r} has shape {list(given)}, config.json implies {list(shape)}")
        if fp8 and naming.is_fp8_linear(name):
            entries[name] = (FP8_DTYPE, shape)
            entries[naming.scale_name(name)] = (torch.float32, scale_shape(shape))
        else:
            entries[name] = (DTYPES[naming.expected_dtype(name)], shape)
    return entries


def _nbytes(spec: Spec) -> int:
    dtype, shape = spec
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def split_into_shards(entries: dict[str, Spec], shards: int) -> list[dict[str, Spec]]:
    """Contiguous groups of about equal bytes; a weight and its scale stay together."""
    if not isinstance(shards, int) or shards < 1:
        raise ValueError(f"shards must be a positive integer, got {shards!r}")
    units: list[dict[str, Spec]] = []
    for name, spec in entries.items():
        if name.endswith(naming.SCALE_SUFFIX):
            units[-1][name] = spec
        else:
            units.append({name: spec})
    shards = min(shards, len(units))
    target = sum(_nbytes(s) for s in entries.values()) / shards
    groups: list[dict[str, Spec]] = [{}]
    done = 0
    for i, unit in enumerate(units):
        # Start a new shard once this one reached its share, keeping one unit for each shard left.
        if groups[-1] and len(groups) < shards and (done >= target * len(groups) or len(units) - i == shards - len(groups)):
            groups.append({})
        groups[-1].update(unit)
        done += sum(_nbytes(s) for s in unit.values())
    return groups


def _write_shards(tmp: Path, tensors: Mapping[str, torch.Tensor], groups: list[dict[str, Spec]]) -> dict[str, str]:
    weight_map = {}
    for i, group in enumerate(groups, start=1):
        fname = shard_name(i, len(groups))
        writer = ShardWriter(tmp / fname, group)
        try:
            pending_scale = None
            for name, (dtype, _) in group.items():
                if name.endswith(naming.SCALE_SUFFIX):
                    writer.write(name, pending_scale)
                elif dtype == FP8_DTYPE:
                    weight, pending_scale = quantize_fp8_blocks(tensors[name])
                    writer.write(name, weight)
                else:
                    writer.write(name, tensors[name].detach().to(dtype))
                weight_map[name] = fname
            writer.close()
        except BaseException:
            writer.abort()
            raise
    return weight_map


def _write_config_files(tmp: Path, config: dict, fp8: bool) -> None:
    config = dict(config)
    config.pop("quantization_config", None)
    if fp8:
        config["quantization_config"] = dict(QUANTIZATION_CONFIG)
    (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    (tmp / GENERATION_CONFIG_FILE).write_text(json.dumps(generation_config(config), indent=2))


def generation_config(config: dict) -> dict:
    gen = {"_from_model_config": True, "do_sample": True, "temperature": 0.6, "top_p": 0.95}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if config.get(key) is not None:
            gen[key] = config[key]
    gen["transformers_version"] = config.get("transformers_version", "4.57.0")
    return gen


def _write_tokenizer(tmp: Path, tokenizer_dir_or_obj) -> None:
    if isinstance(tokenizer_dir_or_obj, (str, Path)):
        src = Path(tokenizer_dir_or_obj)
        for name in TOKENIZER_FILES:
            if not (src / name).is_file():
                raise FileNotFoundError(f"{src / name}: tokenizer file missing")
            shutil.copyfile(src / name, tmp / name)
    elif hasattr(tokenizer_dir_or_obj, "save"):
        tokenizer_dir_or_obj.save(str(tmp / "tokenizer.json"))
    else:
        raise TypeError("tokenizer_dir_or_obj must be a directory path or a tokenizers.Tokenizer")


def make_temp_dir_beside(out_dir: Path) -> Path:
    """An empty directory next to `out_dir` (same filesystem, so the final rename is atomic)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    # mkdtemp makes it private (0700); a model directory should get the usual permissions.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    return tmp


def move_into_place(tmp: Path, out_dir: Path) -> None:
    """Rename the finished temp dir to `out_dir`; an old `out_dir` is removed only after that."""
    if not out_dir.exists():
        tmp.rename(out_dir)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
    old.rmdir()
    out_dir.rename(old)
    tmp.rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)
