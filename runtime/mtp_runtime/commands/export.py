"""`mtp export`: write the MTP draft model of a checkpoint (flags as xLLM's tools/export_mtp.py)."""

from __future__ import annotations

import argparse
import sys
import time

HELP = "cut the MTP layer out of a checkpoint into a standalone draft model"
DESCRIPTION = """\
Export the Multi-Token-Prediction layer of a DeepSeek-V3/R1/V3.2 or GLM-4.5 MoE
checkpoint as a standalone draft model (for `mtp serve --draft_model`, xLLM or
any engine reading the same layout).

Only the shards that hold MTP tensors are opened and only those tensors are
read, so exporting from a 671B checkpoint reads ~2% of it. FP8 block-quantised
weights are dequantised to bf16 unless --keep-fp8. The output appears
atomically; `mtp-export.json` inside records the source and file hashes, and a
re-run on an up-to-date output returns at once.

Exit codes: 0 ok, 2 usage, 3 missing input file, 4 unknown model type,
5 no MTP layer, 6 MTP tensors missing, 7 corrupt input, 8 output directory
conflict, 9 no space left, 10 other I/O error, 11 output directory is,
contains or lies inside the input directory.

Example:
  mtp export --input-dir /models/DeepSeek-V3 --output-dir /models/DeepSeek-V3-mtp
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input-dir", required=True, help="Hugging Face checkpoint directory (config.json, safetensors + index)")
    parser.add_argument("--output-dir", required=True, help="where the draft model directory is created")
    parser.add_argument(
        "--model-type", choices=("deepseek_v3", "deepseek_v32", "glm4_moe"), default=None,
        help="override detection from config.json (V3/R1 -> deepseek_v3; V3.2 is detected from its indexer keys)",
    )
    parser.add_argument("--force", action="store_true", help="replace an existing export of a different source or options")
    parser.add_argument("--keep-fp8", action="store_true", help="keep FP8 weights and their block scales instead of bf16")


def run(args: argparse.Namespace) -> int:
    from mtp_runtime.export import ExportError, export_mtp

    start = time.monotonic()
    try:
        result = export_mtp(args.input_dir, args.output_dir, model_type=args.model_type,
                            force=args.force, keep_fp8=args.keep_fp8)
    except ExportError as e:
        print(f"mtp export: error: {e}", file=sys.stderr)
        return e.exit_code
    if result.skipped:
        print(f"{result.output_dir}: up to date ({result.model_type}), nothing to do")
    else:
        print(
            f"{result.output_dir}: exported {result.model_type}, {result.num_tensors} tensors, "
            f"{result.tensor_bytes / 1e6:.1f} MB from {len(result.shards_opened)} shard(s) "
            f"in {time.monotonic() - start:.1f}s"
        )
    return 0
