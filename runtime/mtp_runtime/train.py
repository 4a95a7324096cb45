"""Joint training of a main model and its MTP module, for `mtp make-tiny --train-steps N`.

loss = CE(main logits at t, token t+1) + mtp_loss_weight * CE(draft logits at t, token t+2),
where the draft sees the main model's final-normed hidden at t and the embedding
of token t+1 (DeepSeek-V3's MTP objective). The draft shares the main model's
embedding and lm_head while training; the checkpoint stores copies, as the
published ones do. Runs are deterministic for a seed (fixed thread count,
seeded data order) and cached by a hash of everything that shapes the result.

Then, with `distill_steps`, self-distillation of the MTP layer: the main model,
now frozen, continues training prompts greedily (through the runtime's own
paged-cache forward), and the draft's own weights learn to predict those
continuations: at a generated position t it sees main's hidden at t and token
t+1, both exactly what a greedy speculative step gives it, and its target is
main's own next token. Serving verifies drafts against the main model's
choices, not against text, so this is the objective acceptance measures; the
shared embedding and head stay untouched (the main model does not change).

With `distill_chain` n > 1 the draft also learns the chain it runs for drafts
2..n of a step: draft j at position t+j-1 reads its own output of draft j-1
(not main's hidden state) and main's token t+j, and attends, as in the
engine's draft cache, to the first drafts' keys up to t and the chain's own
keys at t+1..t+j-1 (`chain_mask`). Earlier chain inputs are main's tokens:
draft j only counts when drafts 1..j-1 were accepted, so they equal main's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import shutil
import sys
import time
from dataclasses import asdict, dataclass, replace
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
CHAIN_LOSS_WEIGHT = 0.5  # distillation: weight of each chained draft's loss beside the first draft's

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
    # self-distillation of the MTP layer on the main model's greedy continuations (module docstring)
    distill_steps: int = 0
    distill_prompts: int = 512
    distill_prompt_len: int = 32
    distill_tokens: int = 160
    distill_lr: float = 1e-3
    # draft positions distilled: 1 trains the draft on main's hidden states only; n > 1 also on its own
    # output, as the chained drafts 2..n of a step with k >= n feed it (module docstring)
    distill_chain: int = 1

    def __post_init__(self) -> None:
        for name in ("steps", "seq_len", "batch", "corpus_bytes", "threads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--train-{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        for name in ("distill_prompts", "distill_prompt_len", "distill_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TrainOptions.{name} must be positive, got {getattr(self, name)}")
        if self.distill_chain < 1:
            raise ValueError(f"--distill-chain must be >= 1, got {self.distill_chain}")
        if self.distill_chain >= self.distill_tokens:  # draft j's target is main's token j+1 steps on
            raise ValueError(f"--distill-chain {self.distill_chain} needs more generated tokens than that "
                             f"(TrainOptions.distill_tokens is {self.distill_tokens})")
        if self.distill_steps < 0:
            raise ValueError(f"--distill-steps must be >= 0, got {self.distill_steps}")
        for name in ("mtp_loss_weight", "distill_lr"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")


BENCH_TRAIN = TrainOptions(steps=300, threads=2, distill_steps=400, distill_chain=3)
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


def learning_rate(step: int, steps: int, peak: float) -> float:
    """Linear warm-up over the first 5% of the steps, then cosine decay to 10% of `peak`."""
    warmup = max(1, steps // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def balance_experts(model: nn.Module) -> None:
    for router in (m for m in model.modules() if isinstance(m, TopkRouter)):
        if router.last_load is not None:
            load = router.last_load.float()
            router.e_score_correction_bias.add_(BIAS_UPDATE_RATE * torch.sign(load.mean() - load))


def train(model: CausalLM, draft: MtpDraft, ids: torch.Tensor, opts: TrainOptions,
          log: Callable[[str], None] | None = None) -> list[float]:
    """Train in place; returns the loss of every step."""
    with torch_threads(opts.threads):
        losses = _train(model, draft, ids, opts, log)
        if opts.distill_steps:
            losses += distill_draft(model, draft, ids, opts, log)
        return losses


@contextlib.contextmanager
def torch_threads(threads: int):
    """torch's intra-op thread count set to `threads` for the block (part of the recipe)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


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
            group["lr"] = learning_rate(step, opts.steps, opts.lr)
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


@torch.no_grad()
def greedy_continuations(model: CausalLM, prompts: torch.Tensor, max_tokens: int, rows: int = 32,
                         block_size: int = 16) -> torch.Tensor:
    """prompts [N, P] -> [N, P + max_tokens]: each prompt and the main model's greedy continuation,
    `rows` sequences at a time through the paged-cache forward (prefill, then one token a step)."""
    from mtp_runtime.engine.model_runner import allocate_caches
    from mtp_runtime.layers.attention import AttentionMetadata

    dtype = model.lm_head.weight.dtype
    device = model.lm_head.weight.device
    prompt_len, total = prompts.shape[1], prompts.shape[1] + max_tokens
    per_seq = -(-total // block_size)
    out = []
    for chunk in prompts.split(rows):
        n = chunk.shape[0]
        caches = allocate_caches(model.kv_cache_spec(), n * per_seq, block_size, dtype, device)
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(n)]

        def forward(ids: torch.Tensor, start: int) -> torch.Tensor:
            """ids [n, m] at positions start..start+m-1 of every sequence -> hidden of each last one [n, H]."""
            m = ids.shape[1]
            positions = torch.arange(start, start + m, device=device)
            slots = torch.stack([positions + i * per_seq * block_size for i in range(n)]).flatten()
            meta = AttentionMetadata(list(range(0, n * m + 1, m)), [start + m] * n, tables, slots, block_size)
            hidden = model(ids.flatten().to(device), positions.repeat(n), caches, meta)
            return hidden.view(n, m, -1)[:, -1]

        seqs = [chunk]
        token = model.compute_logits(forward(chunk, 0)).argmax(-1, keepdim=True).cpu()
        for step in range(max_tokens):
            seqs.append(token)
            if step + 1 < max_tokens:
                token = model.compute_logits(forward(token, prompt_len + step)).argmax(-1, keepdim=True).cpu()
        out.append(torch.cat(seqs, dim=1))
    return torch.cat(out)


def chain_mask(span: int, depth: int, device: torch.device | None = None) -> torch.Tensor:
    """[depth * span, depth * span] bool attention mask of `depth` draft passes laid end to end: row t
    of pass 1 sits at position t and sees pass 1's rows up to t (causal); row t of pass j > 1 sits at
    position t + j - 1 and sees pass 1's rows up to t and row t of passes 2..j, the keys a chained
    draft finds in the draft cache when the step's last accepted position is t."""
    row = torch.arange(span, device=device)
    mask = torch.zeros(depth, span, depth, span, dtype=torch.bool, device=device)
    mask[:, :, 0] = row[None, :, None] >= row[None, None, :]
    same = torch.eye(span, dtype=torch.bool, device=device)
    for j in range(1, depth):
        mask[j, :, 1:j + 1] = same[:, None, :]
    return mask.view(depth * span, depth * span)


def chain_positions(span: int, depth: int, device: torch.device | None = None) -> torch.Tensor:
    """[depth * span] positions of the rows `chain_mask` lays out: row t of pass j sits at t + j - 1."""
    return torch.arange(span, device=device).repeat(depth) + \
        torch.arange(depth, device=device).repeat_interleave(span)


def distill_draft(model: CausalLM, draft: MtpDraft, ids: torch.Tensor, opts: TrainOptions,
                  log: Callable[[str], None] | None = None) -> list[float]:
    """Self-distillation of the draft (module docstring); returns the loss of every step."""
    order = torch.Generator().manual_seed(opts.seed + 1)
    prompt_len = opts.distill_prompt_len
    if ids.numel() < prompt_len + 1:
        raise ValueError(f"corpus has {ids.numel()} tokens, fewer than one distillation prompt ({prompt_len})")
    offsets = torch.randint(0, ids.numel() - prompt_len, (opts.distill_prompts,), generator=order)
    model.eval(), draft.eval()
    start = time.monotonic()
    data = greedy_continuations(model, torch.stack([ids[o:o + prompt_len] for o in offsets.tolist()]),
                                opts.distill_tokens)
    if log:
        log(f"distillation: {data.shape[0]} greedy continuations of {opts.distill_tokens} tokens "
            f"in {time.monotonic() - start:.0f}s")
    shared = {id(p) for p in model.parameters()}
    params = [p for p in draft.parameters() if id(p) not in shared]
    frozen = [p for p in model.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    optimizer = torch.optim.AdamW(params, lr=opts.distill_lr, betas=(0.9, 0.95), weight_decay=0.0)
    chain = opts.distill_chain
    span = data.shape[1] - 1 - chain  # draft j at row t reads token t+j and predicts token t+j+1
    generated = slice(prompt_len - 1, span)  # rows whose input and target tokens main generated
    chained = [(chain_positions(span, j, data.device), chain_mask(span, j, data.device))
               for j in range(2, chain + 1)]
    losses = []
    draft.train()
    try:
        for step in range(opts.distill_steps):
            window = data[torch.randint(0, data.shape[0], (opts.batch,), generator=order)]
            with torch.no_grad():
                hidden = model.forward_batched(window[:, :span])
            draft_hidden = draft.forward_batched(window[:, 1:span + 1], hidden)
            loss = F.cross_entropy(draft.compute_logits(draft_hidden[:, generated]).flatten(0, 1),
                                   window[:, 2:][:, generated].flatten())
            inputs, tokens = [hidden], [window[:, 1:span + 1]]
            for j, (positions, mask) in enumerate(chained, start=2):
                inputs.append(draft_hidden)
                tokens.append(window[:, j:span + j])
                draft_hidden = draft.forward_batched(torch.cat(tokens, 1), torch.cat(inputs, 1), positions,
                                                     mask, queries_from=(j - 1) * span)
                loss = loss + CHAIN_LOSS_WEIGHT * F.cross_entropy(
                    draft.compute_logits(draft_hidden[:, generated]).flatten(0, 1),
                    window[:, j + 1:span + j + 1][:, generated].flatten())
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, opts.distill_steps, opts.distill_lr)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            losses.append(loss.item())
            if log and (step % 25 == 0 or step == opts.distill_steps - 1):
                log(f"distill step {step + 1}/{opts.distill_steps} mtp loss {loss.item():.3f} "
                    f"{time.monotonic() - start:.0f}s")
    finally:
        for p in frozen:
            p.requires_grad_(True)
        draft.eval()
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
    train_fields = asdict(opts)
    if not opts.distill_steps:  # no distillation: its settings shape nothing (and older keys stay valid)
        train_fields = {k: v for k, v in train_fields.items() if not k.startswith("distill_")}
    elif opts.distill_chain == 1:  # the distillation as it was before chains existed: its keys stay valid
        del train_fields["distill_chain"]
    blob = json.dumps({"config": config, "tokenizer": tokenizer_hash, "train": train_fields, "shards": shards,
                       "fp8": fp8, "recipe": RECIPE_VERSION, "torch": torch.__version__}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def _is_written(checkpoint: Path) -> bool:
    return (checkpoint / "model.safetensors.index.json").exists()


def trained_checkpoint(config: dict, tokenizer_dir: Path, opts: TrainOptions, shards: int = 1,
                       fp8: bool = False, log: Callable[[str], None] | None = None) -> Path:
    """Directory of the trained checkpoint in the cache; trains and writes it on the first call.

    Two stages, each cached: the joint run (keyed without the distillation settings), then, with
    distill_steps, the draft's distillation starting from the joint checkpoint as stored. Other
    distillation settings reuse the joint run, and a fresh run gives what a cached one does."""
    joint_opts = replace(opts, distill_steps=0)
    joint = cache_root() / f"trained-{cache_key(config, tokenizer_dir, joint_opts, shards, fp8)}"
    ids = None
    if not _is_written(joint):
        model, draft = build_for_training(config, opts.seed)
        ids = corpus_ids(tokenizer_dir, "train", opts.corpus_bytes)
        if log:
            log(f"training {config['num_hidden_layers']} layers + MTP on {ids.numel()} tokens, {opts.steps} "
                f"steps of {opts.batch} x {opts.seq_len}, {opts.threads} thread(s)")
        train(model, draft, ids, joint_opts, log)
        write_checkpoint(joint, config, checkpoint_tensors(model, draft), tokenizer_dir, shards=shards, fp8=fp8,
                         overwrite=True)
    if not opts.distill_steps:
        return joint
    cached = cache_root() / f"trained-{cache_key(config, tokenizer_dir, opts, shards, fp8)}"
    if _is_written(cached):
        return cached
    model, draft = reload_for_training(config, joint, opts.seed)
    if ids is None:
        ids = corpus_ids(tokenizer_dir, "train", opts.corpus_bytes)
    with torch_threads(opts.threads):
        distill_draft(model, draft, ids, opts, log)
    write_checkpoint(cached, config, checkpoint_tensors(model, draft), tokenizer_dir, shards=shards, fp8=fp8,
                     overwrite=True)
    return cached


def reload_for_training(config: dict, checkpoint: Path, seed: int) -> tuple[CausalLM, MtpDraft]:
    """A trained checkpoint's weights in training modules (as build_for_training makes them: float32,
    the draft sharing the main model's embedding and head, nothing packed for inference kernels)."""
    from mtp_runtime.models.loader import load_draft, load_model

    model, draft = build_for_training(config, seed)
    main = load_model(checkpoint)
    for target, source in ((model, main), (draft, load_draft(checkpoint, main))):
        weights = dict(source.named_parameters())
        params = dict(target.named_parameters())
        if weights.keys() != params.keys():
            raise ValueError(f"{checkpoint}: its {type(source).__name__} parameters differ from a training "
                             f"module's: {sorted(weights.keys() ^ params.keys())[:5]}")
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(weights[name])
    return model, draft


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
