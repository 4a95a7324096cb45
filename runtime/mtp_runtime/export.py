"""`mtp export`: cut the MTP layer(s) out of a checkpoint into a standalone draft model.

Streams through the safetensors index: only shards holding MTP tensors are
opened and only those tensors' bytes are read, one tensor at a time. Output
goes to a temporary directory beside the target, `mtp-export.json` is written
last, and the directory is renamed into place, so a reader never sees a
partial export. The output never overlaps the input: an output directory that
is, contains or lies inside the input directory is refused before anything is
written, so replacing an earlier export can never delete the checkpoint.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .checkpoint import draft_layout, naming
from .checkpoint.errors import CorruptFileError, MissingFileError, MissingTensorError
from .checkpoint.fp8 import FP8_DTYPE, QUANTIZATION_CONFIG, dequantize_fp8_blocks, scale_shape
from .checkpoint.index import CONFIG_FILE, INDEX_FILE, CheckpointIndex
from .checkpoint.manifest import MANIFEST_FILE, build_manifest, is_up_to_date, read_manifest, source_fingerprint
from .checkpoint.safetensors_io import DTYPES, READ_STATS, ShardWriter, file_sha256
from .checkpoint.tokenizer import copy_aux_files
from .checkpoint.writer import make_temp_dir_beside, move_into_place, shard_name

# Exit codes of `mtp export`, one per kind of failure (2 is argparse's usage error).
EXIT_OK = 0
EXIT_MISSING_INPUT = 3  # input dir, config.json or the safetensors index/shard missing
EXIT_UNKNOWN_MODEL = 4  # model_type not deepseek_v3 / deepseek_v32 / glm4_moe
EXIT_NO_MTP_LAYERS = 5  # num_nextn_predict_layers missing or 0
EXIT_MISSING_TENSORS = 6  # MTP tensors named by the config are absent from the checkpoint
EXIT_CORRUPT_INPUT = 7  # truncated/corrupt shard, invalid JSON, config lacking sizes
EXIT_OUTPUT_CONFLICT = 8  # output dir holds foreign files, or a different export without --force
EXIT_NO_SPACE = 9  # ENOSPC/EDQUOT while writing
EXIT_IO_ERROR = 10  # any other OS error
EXIT_OUTPUT_OVERLAPS_INPUT = 11  # output dir is, contains or lies inside the input dir

MODEL_TYPES = ("deepseek_v3", "deepseek_v32", "glm4_moe")
# Output shards are cut at this size, like Hugging Face's default.
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
# config.json keys the MTP tensors' names and shapes are computed from.
_SIZE_KEYS = (
    "num_hidden_layers", "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
    "num_attention_heads", "num_key_value_heads", "head_dim", "n_routed_experts", "n_shared_experts",
    "first_k_dense_replace", "moe_layer_freq", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim",
)


class ExportError(Exception):
    def __init__(self, exit_code: int, message: str):
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class ExportResult:
    output_dir: Path
    model_type: str  # the draft's model_type, e.g. "deepseek_v3_mtp"
    skipped: bool  # True when an up-to-date export was already there
    num_tensors: int = 0
    tensor_bytes: int = 0  # bytes of tensor data written
    bytes_read: int = 0  # bytes requested from input files (headers included)
    shards_opened: list[str] = field(default_factory=list)
    files: dict[str, dict] = field(default_factory=dict)  # name -> {"sha256", "size"}


@dataclass
class _Entry:
    source: str
    target: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    dequantize: bool  # FP8 weight to be turned into bf16 with its scale


def export_mtp(
    input_dir: Path | str,
    output_dir: Path | str,
    model_type: str | None = None,
    force: bool = False,
    keep_fp8: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> ExportResult:
    """Export the MTP draft of `input_dir` to `output_dir`; raises ExportError with an exit code."""
    input_dir, output_dir = Path(input_dir), Path(output_dir)
    try:
        return _export(input_dir, output_dir, model_type, force, keep_fp8, max_shard_bytes)
    except MissingTensorError as e:
        raise ExportError(EXIT_MISSING_TENSORS, str(e)) from None
    except MissingFileError as e:
        raise ExportError(EXIT_MISSING_INPUT, str(e)) from None
    except CorruptFileError as e:
        raise ExportError(EXIT_CORRUPT_INPUT, str(e)) from None
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ExportError(EXIT_NO_SPACE, f"{output_dir}: no space left on device while exporting; "
                              "free space on that disk or choose another --output-dir") from None
        raise ExportError(EXIT_IO_ERROR, f"{e.filename or output_dir}: {e.strerror or e}") from None


def _export(input_dir, output_dir, model_type, force, keep_fp8, max_shard_bytes) -> ExportResult:
    if not input_dir.is_dir():
        raise ExportError(EXIT_MISSING_INPUT, f"{input_dir}: input directory not found")
    if not (input_dir / CONFIG_FILE).is_file():
        raise ExportError(EXIT_MISSING_INPUT, f"{input_dir / CONFIG_FILE}: config.json not found")
    check_no_overlap(input_dir, output_dir)
    read_before = READ_STATS.bytes_read
    opens_before = len(READ_STATS.opens)
    index = CheckpointIndex(input_dir)
    arch = resolve_arch(index.config, model_type)
    options = {"model_type": draft_layout.DRAFT_MODEL_TYPES[arch], "keep_fp8": keep_fp8,
               "max_shard_bytes": max_shard_bytes}
    fingerprint = source_fingerprint(input_dir / CONFIG_FILE, index.index_path, options)
    if _check_existing_output(output_dir, fingerprint, force):
        return ExportResult(output_dir, options["model_type"], skipped=True, files=read_manifest(output_dir)["files"])

    entries = plan_entries(index, arch, keep_fp8)
    tmp = make_temp_dir_beside(output_dir)
    try:
        files, weight_map = _write_tensors(index, entries, tmp, max_shard_bytes)
        total = sum(_nbytes(e.dtype, e.shape) for e in entries)
        quantized = any(e.dtype == FP8_DTYPE for e in entries)
        qconfig = (index.config.get("quantization_config") or dict(QUANTIZATION_CONFIG)) if quantized else None
        config = draft_layout.draft_config(index.config, arch, qconfig)
        _write_json(tmp / CONFIG_FILE, config)
        _write_json(tmp / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
        names = [CONFIG_FILE, INDEX_FILE] + copy_aux_files(input_dir, tmp) + copy_remote_code(input_dir, tmp, config)
        files.update({n: {"sha256": file_sha256(tmp / n), "size": (tmp / n).stat().st_size} for n in names})
        # The manifest goes last: its presence marks a finished export.
        _write_json(tmp / MANIFEST_FILE, build_manifest(input_dir, fingerprint, options, files))
        move_into_place(tmp, output_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportResult(
        output_dir, options["model_type"], skipped=False, num_tensors=len(entries), tensor_bytes=total,
        bytes_read=READ_STATS.bytes_read - read_before,
        shards_opened=sorted({Path(p).name for p in READ_STATS.opens[opens_before:]}),
        files=files,
    )


def _same_dir_among(path: Path, ancestors_of: Path) -> bool:
    """True if `path` is `ancestors_of` or one of its parents (by inode, so symlinks and bind mounts
    count; by resolved path components for what does not exist yet)."""
    try:
        target = os.stat(path)
    except OSError:
        return False
    for candidate in (ancestors_of, *ancestors_of.parents):
        try:
            if os.path.samestat(target, os.stat(candidate)):
                return True
        except OSError:
            continue
    return False


def check_no_overlap(input_dir: Path, output_dir: Path) -> None:
    """Refuse an output directory that is, contains or lies inside the input directory.

    Writing inside the checkpoint would mix the draft into it, and replacing an
    output that contains the checkpoint (an earlier export, --force) would
    delete it.
    """
    src, dst = input_dir.resolve(), output_dir.resolve()
    if dst == src or dst.is_relative_to(src) or _same_dir_among(src, dst):
        same = dst == src or (dst.exists() and os.path.samefile(src, dst))
        where = "is" if same else "lies inside"
        raise ExportError(EXIT_OUTPUT_OVERLAPS_INPUT,
                          f"--output-dir {output_dir} {where} the input directory {input_dir}: the export would "
                          "write into the checkpoint it reads; choose an output directory outside it")
    if src.is_relative_to(dst) or _same_dir_among(dst, src):
        raise ExportError(EXIT_OUTPUT_OVERLAPS_INPUT,
                          f"--output-dir {output_dir} contains the input directory {input_dir}: replacing it would "
                          "delete the checkpoint; choose an output directory that does not hold the input")


def resolve_arch(config: dict, model_type: str | None) -> str:
    if model_type is not None:
        if model_type not in MODEL_TYPES:
            raise ExportError(EXIT_UNKNOWN_MODEL, f"--model-type {model_type!r} is not one of {', '.join(MODEL_TYPES)}")
        arch = model_type
    else:
        try:
            arch = naming.detect_arch(config)
        except ValueError as e:
            raise ExportError(EXIT_UNKNOWN_MODEL, f"{e} (or pass --model-type)") from None
    n = config.get("num_nextn_predict_layers")
    if not isinstance(n, int) or n <= 0:
        raise ExportError(EXIT_NO_MTP_LAYERS, f"config.json num_nextn_predict_layers is {n!r}: this checkpoint "
                          "has no MTP layer to export")
    return arch


def _check_existing_output(output_dir: Path, fingerprint: str, force: bool) -> bool:
    """True if an up-to-date export is already there; raises if the directory must not be touched."""
    if not output_dir.exists():
        return False
    if not output_dir.is_dir():
        raise ExportError(EXIT_OUTPUT_CONFLICT, f"{output_dir}: exists and is not a directory")
    if not any(output_dir.iterdir()):
        return False
    manifest = read_manifest(output_dir)
    if manifest is None:
        raise ExportError(EXIT_OUTPUT_CONFLICT, f"{output_dir}: holds files that mtp export did not write "
                          f"(no {MANIFEST_FILE}); choose an empty or new --output-dir")
    if force:  # re-export even an up-to-date one; only an earlier export is ever replaced
        return False
    if is_up_to_date(output_dir, manifest, fingerprint):
        return True
    raise ExportError(EXIT_OUTPUT_CONFLICT, f"{output_dir}: holds an export of a different checkpoint or with "
                      "different options (or damaged files); pass --force to replace it")


def plan_entries(index: CheckpointIndex, arch: str, keep_fp8: bool) -> list[_Entry]:
    """Draft tensors in source file order, after checking every expected MTP tensor exists."""
    config = index.config
    for key in _SIZE_KEYS:
        value = config.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ExportError(EXIT_CORRUPT_INPUT, f"config.json {key} is {value!r}: it must be a non-negative "
                              "integer (needed to list the MTP tensors)")
    try:
        expected = {}
        for layer in naming.mtp_layer_indices(config):
            expected.update(naming.mtp_layer_tensors(config, arch, layer))
    except KeyError as e:
        raise ExportError(EXIT_CORRUPT_INPUT, f"config.json lacks {e.args[0]!r}, needed to list the MTP tensors") from None
    missing = [n for n in expected if n not in index]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise MissingTensorError(f"{index.model_dir}: MTP tensors missing from the checkpoint: {shown}")
    sources = [n for n in index.names() if draft_layout.draft_name(n, config) is not None]
    scales = {n for n in sources if n.endswith(naming.SCALE_SUFFIX)}
    entries = []
    for name in sources:
        info = index.info(name)
        dtype, shape = DTYPES[info.dtype], tuple(info.shape)
        if name in expected and tuple(expected[name]) != shape:
            raise CorruptFileError(f"{index.shard_path(name)}: tensor {name!r} has shape {list(shape)}, "
                                   f"config.json implies {list(expected[name])}")
        is_fp8 = dtype == FP8_DTYPE
        if is_fp8:
            _check_fp8_scale(index, name, shape, scales)
        if name in scales and not keep_fp8:
            continue  # folded into its dequantised weight
        dequant = is_fp8 and not keep_fp8
        target = draft_layout.draft_name(name, config)
        entries.append(_Entry(name, target, torch.bfloat16 if dequant else dtype, shape, dequant))
    entries.sort(key=lambda e: (index.weight_map[e.source], index.info(e.source).start))
    return entries


def _check_fp8_scale(index: CheckpointIndex, name: str, shape: tuple[int, ...], scales: set[str]) -> None:
    """An FP8 weight must be 2-D with a `weight_scale_inv` of one entry per 128x128 block."""
    path = index.shard_path(name)
    if len(shape) != 2 or not name.endswith(".weight"):
        raise CorruptFileError(f"{path}: FP8 tensor {name!r} of shape {list(shape)} is not a 2-D block-quantised weight")
    scale = naming.scale_name(name)
    if scale not in scales:
        raise MissingTensorError(f"{index.model_dir}: FP8 tensor {name!r} has no {scale!r}")
    got, want = tuple(index.info(scale).shape), scale_shape(shape)
    if got != want:
        raise CorruptFileError(f"{index.shard_path(scale)}: {scale!r} has shape {list(got)}, expected {list(want)} "
                               f"for a {shape[0]}x{shape[1]} weight with 128x128 blocks")


def remote_code_modules(config: dict) -> list[str]:
    """The `.py` files config.json's `auto_map` names (DeepSeek-V3 ships
    configuration_deepseek.py and modeling_deepseek.py): a draft that keeps
    the auto_map needs them beside it for `trust_remote_code` loaders."""
    modules = set()
    for ref in (config.get("auto_map") or {}).values():
        for item in ref if isinstance(ref, list) else [ref]:
            if isinstance(item, str) and "." in item:
                module = item.split("--")[-1].rsplit(".", 1)[0]
                modules.add(module.replace(".", "/") + ".py")
    return sorted(modules)


def copy_remote_code(src_dir: Path, dst_dir: Path, config: dict) -> list[str]:
    copied = []
    for name in remote_code_modules(config):
        src = src_dir / name
        if src.is_file() and "/" not in name:
            shutil.copyfile(src, dst_dir / name)
            copied.append(name)
    return copied


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def _write_tensors(index, entries, tmp: Path, max_shard_bytes: int):
    groups: list[list[_Entry]] = [[]]
    size = 0
    for e in entries:
        nbytes = _nbytes(e.dtype, e.shape)
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(e)
        size += nbytes
    files, weight_map = {}, {}
    for i, group in enumerate(groups, start=1):
        fname = shard_name(i, len(groups))
        writer = ShardWriter(tmp / fname, {e.target: (e.dtype, e.shape) for e in group})
        try:
            for e in group:
                writer.write(e.target, _load(index, e))
                weight_map[e.target] = fname
            files[fname] = {"sha256": writer.close(), "size": (tmp / fname).stat().st_size}
        except BaseException:
            writer.abort()
            raise
    return files, weight_map


def _load(index: CheckpointIndex, e: _Entry) -> torch.Tensor:
    tensor = index.read(e.source)
    if e.dequantize:
        scale = index.read(naming.scale_name(e.source))
        tensor = dequantize_fp8_blocks(tensor, scale, torch.bfloat16, name=e.source)
    return tensor


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False))
