"""Joint training of a main model and its MTP module, for `mtp make-tiny --train-steps N`.

loss = CE(main logits at t, token t+1) + mtp_loss_weight * CE(draft logits at t, token t+2),
where the draft sees the main model's final-normed hidden at t and the embedding
of token t+1 (DeepSeek-V3's MTP objective). The draft shares the main model's
embedding and lm_head while training; the checkpoint stores copies, as the
published ones do. Runs are deterministic for a seed (fixed thread count,
seeded data order) and cached by a hash of everything that shapes the result.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mtp_runtime.checkpoint.corpus import corpus_texts
from mtp_runtime.checkpoint.tokenizer import cache_root
from mtp_runtime.checkpoint.writer import write_checkpoint
from mtp_runtime.config import ModelConfig
from mtp_runtime.layers.moe import TopkRouter
from mtp_runtime.models.decoder import CausalLM
from mtp_runtime.models.loader import checkpoint_tensors
from mtp_runtime.models.mtp import MtpDraft
from mtp_runtime.models.registry import build_draft, build_model

RECIPE_VERSION = 1  # bump when training changes, so stale cached checkpoints are not reused
INIT_STD = 0.02
BIAS_UPDATE_RATE = 1e-3  # aux-loss-free balancing: nudge each expert's selection bias toward equal load

# Deep and narrow like the published models (the MTP layer is a small share of a step), MoE from
# layer 1 with grouped routing, a 4k vocabulary. Trains in minutes on 2 CPU cores.
BENCH_SIZES = dict(
    vocab_size=4096, hidden_size=128, intermediate_size=320, moe_intermediate_size=96,
    num_hidden_layers=8, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
    q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
    head_dim=32, index_topk=256, index_n_heads=4, index_head_dim=32,
)


@dataclass(frozen=True)
class TrainOptions:
    steps: int
    seq_len: int = 128
    batch: int = 16
    mtp_loss_weight: float = 0.3
    lr: float = 3e-3
    seed: int = 0
    corpus_bytes: int = 4 * 1024 * 1024
    # Part of the recipe: float sums, and so the weights, can differ with the thread count.
    # One thread suits small models and busy machines; the benchmark model uses two.
    threads: int = 1

    def __post_init__(self) -> None:
        for name in ("steps", "seq_len", "batch", "corpus_bytes", "threads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--train-{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.mtp_loss_weight < 0:
            raise ValueError(f"--mtp-loss-weight must be >= 0, got {self.mtp_loss_weight}")


BENCH_TRAIN = TrainOptions(steps=300, threads=2)
_ARCH_ONLY_SIZES = {"deepseek_v32": ("index_topk", "index_n_heads", "index_head_dim"), "glm4_moe": ("head_dim",)}
_MLA_SIZES = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def bench_sizes(arch: str) -> dict:
    """The `--preset bench` sizes that apply to `arch`."""
    skip = {k for a, keys in _ARCH_ONLY_SIZES.items() if a != arch for k in keys}
    if arch == "glm4_moe":
        skip |= set(_MLA_SIZES)
    return {k: v for k, v in BENCH_SIZES.items() if k not in skip}


def init_weights(module: nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith(("norm.weight",)):
                param.fill_(1.0)
            elif name.endswith(("bias", "e_score_correction_bias")):
                param.zero_()
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * INIT_STD)


def corpus_ids(tokenizer_dir: Path, split: str, max_bytes: int) -> torch.Tensor:
    """The split's texts tokenized and joined, each followed by the tokenizer's end-of-text token."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    config = json.loads((Path(tokenizer_dir) / "tokenizer_config.json").read_text())
    eos = tokenizer.token_to_id(config["eos_token"])
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(corpus_texts(split, max_bytes), add_special_tokens=False):
        ids.extend(encoding.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def joint_loss(model: CausalLM, draft: MtpDraft, window: torch.Tensor, mtp_loss_weight: float
               ) -> tuple[torch.Tensor, float, float]:
    """window [B, S + 2] -> (loss, main CE, MTP CE)."""
    seq_len = window.shape[1] - 2
    hidden = model.forward_batched(window[:, :seq_len])  # [B, S, H]
    logits = model.compute_logits(hidden)  # [B, S, V]
    main_ce = F.cross_entropy(logits.flatten(0, 1), window[:, 1:seq_len + 1].flatten())
    draft_hidden = draft.forward_batched(window[:, 1:seq_len + 1], hidden)
    mtp_ce = F.cross_entropy(draft.compute_logits(draft_hidden).flatten(0, 1), window[:, 2:].flatten())
    return main_ce + mtp_loss_weight * mtp_ce, main_ce.item(), mtp_ce.item()


def learning_rate(step: int, opts: TrainOptions) -> float:
    warmup = max(1, opts.steps // 20)
    if step < warmup:
        return opts.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, opts.steps - warmup)
    return opts.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def balance_experts(model: nn.Module) -> None:
    for router in (m for m in model.modules() if isinstance(m, TopkRouter)):
        if router.last_load is not None:
            load = router.last_load.float()
            router.e_score_correction_bias.add_(BIAS_UPDATE_RATE * torch.sign(load.mean() - load))


def train(model: CausalLM, draft: MtpDraft, ids: torch.Tensor, opts: TrainOptions,
          log: Callable[[str], None] | None = None) -> list[float]:
    """Train in place; returns the loss of every step."""
    threads = torch.get_num_threads()
    torch.set_num_threads(opts.threads)
    try:
        return _train(model, draft, ids, opts, log)
    finally:
        torch.set_num_threads(threads)


def _train(model: CausalLM, draft: MtpDraft, ids: torch.Tensor, opts: TrainOptions,
           log: Callable[[str], None] | None) -> list[float]:
    if ids.numel() < opts.seq_len + 3:
        raise ValueError(f"corpus has {ids.numel()} tokens, fewer than one training window ({opts.seq_len + 2})")
    params = {id(p): p for p in [*model.parameters(), *draft.parameters()] if p.requires_grad}
    optimizer = torch.optim.AdamW(list(params.values()), lr=opts.lr, betas=(0.9, 0.95), weight_decay=0.01)
    order = torch.Generator().manual_seed(opts.seed)
    model.train(), draft.train()
    losses, start = [], time.monotonic()
    for step in range(opts.steps):
        offsets = torch.randint(0, ids.numel() - opts.seq_len - 2, (opts.batch,), generator=order)
        window = torch.stack([ids[o:o + opts.seq_len + 2] for o in offsets.tolist()])
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, opts)
        loss, main_ce, mtp_ce = joint_loss(model, draft, window, opts.mtp_loss_weight)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
        optimizer.step()
        with torch.no_grad():
            balance_experts(model), balance_experts(draft)
        losses.append(loss.item())
        if log and (step % 10 == 0 or step == opts.steps - 1):
            log(f"step {step + 1}/{opts.steps} loss {loss.item():.3f} (main {main_ce:.3f}, mtp {mtp_ce:.3f}) "
                f"{time.monotonic() - start:.0f}s")
    model.eval(), draft.eval()
    return losses


def build_for_training(config: dict, seed: int) -> tuple[CausalLM, MtpDraft]:
    cfg = ModelConfig.from_dict(config, source="make-tiny config")
    torch.manual_seed(seed)
    model, draft = build_model(cfg), build_draft(cfg)
    init_weights(model, seed)
    init_weights(draft, seed + 1)
    draft.use_main_embedding(model.model.embed_tokens)
    draft.use_main_head(model.lm_head)
    return model, draft


def cache_key(config: dict, tokenizer_dir: Path, opts: TrainOptions, shards: int, fp8: bool) -> str:
    tokenizer_hash = hashlib.sha256((Path(tokenizer_dir) / "tokenizer.json").read_bytes()).hexdigest()
    blob = json.dumps({"config": config, "tokenizer": tokenizer_hash, "train": asdict(opts), "shards": shards,
                       "fp8": fp8, "recipe": RECIPE_VERSION, "torch": torch.__version__}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def trained_checkpoint(config: dict, tokenizer_dir: Path, opts: TrainOptions, shards: int = 1,
                       fp8: bool = False, log: Callable[[str], None] | None = None) -> Path:
    """Directory of the trained checkpoint in the cache; trains and writes it on the first call."""
    cached = cache_root() / f"trained-{cache_key(config, tokenizer_dir, opts, shards, fp8)}"
    if (cached / "model.safetensors.index.json").exists():
        return cached
    model, draft = build_for_training(config, opts.seed)
    ids = corpus_ids(tokenizer_dir, "train", opts.corpus_bytes)
    if log:
        log(f"training {config['num_hidden_layers']} layers + MTP on {ids.numel()} tokens, {opts.steps} "
            f"steps of {opts.batch} x {opts.seq_len}, {opts.threads} thread(s)")
    train(model, draft, ids, opts, log)
    tensors = checkpoint_tensors(model, draft)
    write_checkpoint(cached, config, tensors, tokenizer_dir, shards=shards, fp8=fp8, overwrite=True)
    return cached


def copy_checkpoint(src: Path, out_dir: Path, overwrite: bool = False) -> Path:
    """Copy a cached checkpoint to out_dir, atomically (a temporary sibling renamed into place)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{out_dir}: output directory is not empty (choose another --out or remove it)")
        shutil.rmtree(out_dir)
    tmp = out_dir.parent / f".{out_dir.name}.copy"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    if out_dir.exists():
        out_dir.rmdir()
    tmp.rename(out_dir)
    return out_dir


def stderr_log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
