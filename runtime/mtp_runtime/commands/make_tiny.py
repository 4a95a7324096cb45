"""`mtp make-tiny`: a small, randomly initialised checkpoint in the published layout."""

from __future__ import annotations

import argparse
import sys

HELP = "write a small random checkpoint in the real DeepSeek/GLM layout (for tests and demos)"
DESCRIPTION = """\
Write a randomly initialised model directory that loaders cannot tell apart
from the published DeepSeek-V3 / V3.2 / GLM-4.5 checkpoints, only smaller:
config.json with the published keys, sharded safetensors + index with the
published tensor names (MTP layer at model.layers.{num_hidden_layers}),
a byte-level BPE tokenizer trained on the Python standard library, and
generation_config.json. --fp8 stores DeepSeek-style FP8 e4m3 weights with
128x128 block scales.

Examples:
  mtp make-tiny --arch deepseek_v3 --out /tmp/tiny-v3
  mtp make-tiny --arch glm4_moe --out /tmp/tiny-glm --shards 4 --hidden-size 128
"""

# Size options: flag -> (config key, type, archs it applies to; None = all).
DEEPSEEK = ("deepseek_v3", "deepseek_v32")
SIZE_OPTIONS = {
    "vocab-size": ("vocab_size", int, None),
    "hidden-size": ("hidden_size", int, None),
    "intermediate-size": ("intermediate_size", int, None),
    "moe-intermediate-size": ("moe_intermediate_size", int, None),
    "num-hidden-layers": ("num_hidden_layers", int, None),
    "first-k-dense-replace": ("first_k_dense_replace", int, None),
    "num-attention-heads": ("num_attention_heads", int, None),
    "num-key-value-heads": ("num_key_value_heads", int, None),
    "n-routed-experts": ("n_routed_experts", int, None),
    "n-shared-experts": ("n_shared_experts", int, None),
    "num-experts-per-tok": ("num_experts_per_tok", int, None),
    "n-group": ("n_group", int, None),
    "topk-group": ("topk_group", int, None),
    "num-nextn-predict-layers": ("num_nextn_predict_layers", int, None),
    "max-position-embeddings": ("max_position_embeddings", int, None),
    "q-lora-rank": ("q_lora_rank", int, DEEPSEEK),
    "kv-lora-rank": ("kv_lora_rank", int, DEEPSEEK),
    "qk-nope-head-dim": ("qk_nope_head_dim", int, DEEPSEEK),
    "qk-rope-head-dim": ("qk_rope_head_dim", int, DEEPSEEK),
    "v-head-dim": ("v_head_dim", int, DEEPSEEK),
    "index-n-heads": ("index_n_heads", int, ("deepseek_v32",)),
    "index-head-dim": ("index_head_dim", int, ("deepseek_v32",)),
    "index-topk": ("index_topk", int, ("deepseek_v32",)),
    "head-dim": ("head_dim", int, ("glm4_moe",)),
    "partial-rotary-factor": ("partial_rotary_factor", float, ("glm4_moe",)),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", required=True, choices=("deepseek_v3", "deepseek_v32", "glm4_moe"))
    parser.add_argument("--out", required=True, help="output model directory (must not exist or be empty)")
    parser.add_argument("--fp8", action="store_true", help="FP8 e4m3 linear weights with 128x128 block scales")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the weights (default 0)")
    parser.add_argument("--shards", type=int, default=2, help="number of safetensors shards (default 2)")
    parser.add_argument("--force", action="store_true", help="replace a non-empty --out directory")
    sizes = parser.add_argument_group("size options (default: tiny sizes for fast tests)")
    for flag, (key, kind, archs) in SIZE_OPTIONS.items():
        only = f" ({'/'.join(archs)} only)" if archs else ""
        sizes.add_argument(f"--{flag}", dest=key, type=kind, default=None, help=f"config.json {key}{only}")
    sizes.add_argument("--use-qk-norm", dest="use_qk_norm", action="store_true", default=None,
                       help="config.json use_qk_norm (glm4_moe only)")
    train = parser.add_argument_group("training (main model + MTP jointly, on the standard library's sources)")
    train.add_argument("--preset", choices=("bench",), default=None,
                       help="bench: deep-and-narrow MoE benchmark model, trained (size flags still override)")
    train.add_argument("--train-steps", type=int, default=None, help="train for N steps (cached by arguments)")
    train.add_argument("--train-seq-len", type=int, default=128, help="tokens per training window")
    train.add_argument("--train-batch", type=int, default=16, help="windows per step")
    train.add_argument("--mtp-loss-weight", type=float, default=0.3, help="lambda of the MTP loss")
    train.add_argument("--train-threads", type=int, default=None,
                       help="torch threads for training (part of the cache key; default 2 for --preset bench, else 1)")
    train.add_argument("--distill-steps", type=int, default=None,
                       help="after training, N steps of MTP self-distillation on the main model's greedy "
                            "continuations (default 400 for --preset bench, else 0)")
    train.add_argument("--distill-chain", type=int, default=None,
                       help="draft positions distillation trains: 1 the first draft of a step, N also the "
                            "chained drafts 2..N that read the draft's own output (default 3 for --preset "
                            "bench, else 1)")


def size_overrides(args: argparse.Namespace) -> dict:
    """Config overrides from the size flags that were given; rejects flags of another architecture."""
    overrides = {}
    options = dict(SIZE_OPTIONS, **{"use-qk-norm": ("use_qk_norm", bool, ("glm4_moe",))})
    for flag, (key, _, archs) in options.items():
        value = getattr(args, key, None)
        if value is None:
            continue
        if archs and args.arch not in archs:
            raise ValueError(f"--{flag} does not apply to --arch {args.arch}")
        overrides[key] = value
    return overrides


def run(args: argparse.Namespace) -> int:
    from mtp_runtime.checkpoint.configs import build_config
    from mtp_runtime.checkpoint.errors import CheckpointError
    from mtp_runtime.checkpoint.random_init import RandomTensors
    from mtp_runtime.checkpoint.tokenizer import build_tokenizer, style_for_arch
    from mtp_runtime.checkpoint.writer import write_checkpoint
    from mtp_runtime import train

    try:
        preset = train.bench_sizes(args.arch) if args.preset == "bench" else {}
        config = build_config(args.arch, **{**preset, **size_overrides(args)})
        tokenizer_dir = build_tokenizer(config["vocab_size"], style_for_arch(args.arch))
        steps = args.train_steps if args.train_steps is not None else (
            train.BENCH_TRAIN.steps if args.preset == "bench" else 0)
        if steps:
            opts = train.TrainOptions(steps=steps, seq_len=args.train_seq_len, batch=args.train_batch,
                                      mtp_loss_weight=args.mtp_loss_weight, seed=args.seed,
                                      threads=args.train_threads or (
                                          train.BENCH_TRAIN.threads if args.preset == "bench" else 1),
                                      distill_steps=args.distill_steps if args.distill_steps is not None else (
                                          train.BENCH_TRAIN.distill_steps if args.preset == "bench" else 0),
                                      distill_chain=args.distill_chain if args.distill_chain is not None else (
                                          train.BENCH_TRAIN.distill_chain if args.preset == "bench" else 1))
            cached = train.trained_checkpoint(config, tokenizer_dir, opts, args.shards, args.fp8, train.stderr_log)
            train.copy_checkpoint(cached, args.out, overwrite=args.force)
        else:
            write_checkpoint(args.out, config, RandomTensors(config, args.seed), tokenizer_dir,
                             shards=args.shards, fp8=args.fp8, overwrite=args.force)
    except (ValueError, CheckpointError, FileExistsError) as e:
        print(f"mtp make-tiny: error: {e}", file=sys.stderr)
        return 1
    print(f"{args.out}: {args.arch} checkpoint, {config['num_hidden_layers']} layers + "
          f"{config['num_nextn_predict_layers']} MTP, vocab {config['vocab_size']}"
          f"{', fp8' if args.fp8 else ''}, {args.shards} shard(s)"
          f"{f', trained {steps} steps' if steps else ''}"
          f"{f' + {opts.distill_steps} MTP distillation steps' if steps and opts.distill_steps else ''}"
          f"{f' (drafts 1-{opts.distill_chain})' if steps and opts.distill_steps and opts.distill_chain > 1 else ''}")
    return 0
