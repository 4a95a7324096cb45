"""Graph mode's greedy decode step: verify, acceptance and the MTP draft chain in ONE compiled call.

In a decode step of a small model, what costs is not the arithmetic but the
calls around it: each compiled forward checks its guards, the step goes back
to Python between the main forward, the logits, the acceptance and every
draft position. When every sequence of a step is a greedy decode (one new
token plus its k drafts), this module runs the whole step as one graph:

1. main forward over the k+1 positions of every sequence (the batch is not
   padded: every sequence brings exactly k+1 tokens), logits, argmax t;
2. a = number of leading drafts equal to t (greedy acceptance);
3. the draft's first pass over the same k+1 positions, fed the main hidden
   states and t as the next tokens: every row writes its key to the draft
   cache (rows past a sequence's acceptance write slots past its verified
   length, which the next step overwrites before anything reads them, as in
   the eager step; runtime/README.md, "Speculative step"), and only row a
   attends and runs the MLP (models.mtp.MtpDraft.forward_selected);
4. the draft hidden at row a gives the first new draft; k-1 chained
   single-token draft forwards give the rest, on a copy of the step's own
   cache blocks (their keys lie past each sequence's verified length, so the
   cache itself never needs them; a second write to the cache in one graph
   made inductor copy all of it).

Positions, cache slots and the attention masks are computed inside the
graph from the block tables and the cached lengths, so the host sends one
small tensor (the step's plan) and reads back three.

Only two sizes are dynamic: the batch size and the block-table width. The
weights, the caches and the k + 1 tokens per sequence are constants of the
graph, so its kernels have fixed trip counts, and inductor writes the code
that calls them in C++ (in Python, calling a hundred small kernels cost as
much as running them).
"""

from __future__ import annotations

import logging
import time

import torch

from mtp_runtime.engine.sampler import greedy_verify
from mtp_runtime.layers.attention import DecodeBatch, RowSelection, write_cache
from mtp_runtime.models.graph import compile_failure, compile_method, contiguous_copy

# Architectures whose decode steps take the one-call graph. GLM's (GQA) one-call graph measured slower
# than its per-forward graphs at batch 4 and above (hack/bench_engine.py --enable-graph: 301 vs 387-443
# tokens/s at batch 4), for a reason not yet found, so GLM keeps the per-forward path.
ONE_CALL_ARCHS = ("deepseek_v3",)

log = logging.getLogger("mtp_runtime.engine")

# What dynamo raises when, with guard evaluation skipped, no compiled graph fits a call.
_UNWARMED_SHAPE = "Recompilation triggered with skip_guard_eval_unsafe"


class StepMetadata:
    """What the attention layers read of a step (`slot_mapping`, `decode_batch()`), built inside the
    graph. Every sequence has the same number of new tokens, so the batch needs no padding."""

    def __init__(self, slot_mapping: torch.Tensor, batch: DecodeBatch):
        self.slot_mapping = slot_mapping
        self._batch = batch

    def decode_batch(self) -> DecodeBatch:
        return self._batch

    def sequences(self):
        raise RuntimeError("StepMetadata describes a decode batch only; prefill chunks use AttentionMetadata")


def _slots(tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """tables [B, M] block ids, positions [B, n] -> cache slots [B, n]."""
    return tables.gather(1, torch.div(positions, block_size, rounding_mode="floor")) * block_size \
        + positions % block_size


def _metadata(tables: torch.Tensor, positions: torch.Tensor, key_pos: torch.Tensor,
              block_size: int) -> StepMetadata:
    """positions [B, n] of the new tokens; every sequence sees its keys up to each query's position."""
    rows = torch.arange(positions.numel(), device=positions.device)
    blocked = (key_pos.view(1, 1, 1, -1) > positions.unsqueeze(-1).unsqueeze(-1))  # [B, n, 1, L]
    slots = _slots(tables, positions, block_size).flatten()
    return StepMetadata(slots, DecodeBatch(rows, rows, tables.flatten(), blocked, positions))


class GreedyDecodeStep:
    """One compiled greedy decode step over `main` (and `draft` with k >= 1 drafts per sequence)."""

    def __init__(self, main, draft, k: int, block_size: int, compile_graph: bool = True, keep_hidden: bool = False):
        """keep_hidden (adaptive depth): the step's draft cache list ends with the store of main hidden
        states ({"hidden": [num_blocks, block_size, H]}), and the step writes every row's hidden at its
        slot there; a step at k = 0 writes nothing else for the draft (ModelRunner._fill_draft_keys
        writes the keys it skipped, from the store, when a step drafts again)."""
        if k and draft is None:
            raise ValueError("GreedyDecodeStep: k >= 1 drafts need the MTP draft model")
        self.main, self.draft, self.k, self.block_size = main, draft, k, block_size
        self.keep_hidden = keep_hidden
        self._fn = compile_method(self._step, cpp_wrapper=True) if compile_graph else self._step
        self._warm = False

    @staticmethod
    def plan(cached: int, tokens: list[int], table: list[int], width: int) -> list[int]:
        """One sequence's row of the step's plan: its cached length, its k+1 tokens (the last accepted
        token, then the drafts) and its block table padded to `width` blocks."""
        return [cached, *tokens, *table, *[0] * (width - len(table))]

    def _split(self, plan: torch.Tensor):
        """plan rows -> cached lengths [B], the k+1 tokens [B, k+1], block tables [B, M]. The tokens and
        tables are contiguous copies: flattening a strided slice of the plan is a view only when B or
        M is 1, a case the exported graph (engine/aot_step.py) must not depend on."""
        n = self.k + 1
        return plan[:, 0], contiguous_copy(plan[:, 1:1 + n]), contiguous_copy(plan[:, 1 + n:])

    def _verify(self, plan: torch.Tensor, main_caches: list):
        """Step 1 (module docstring): the main forward over every sequence's k+1 positions, argmax tokens."""
        n = self.k + 1
        cached, tokens, tables = self._split(plan)
        positions = cached.unsqueeze(1) + torch.arange(n, device=plan.device)  # [B, n]
        key_pos = torch.arange(tables.shape[1] * self.block_size, device=plan.device)  # every slot the tables reach
        meta = _metadata(tables, positions, key_pos, self.block_size)
        hidden = self.main._forward_eager(tokens.flatten(), positions.flatten(), main_caches, meta)
        targets = self.main.compute_logits(hidden).argmax(-1).view(plan.shape[0], n)
        return targets, hidden, positions, key_pos, meta

    def _step(self, plan: torch.Tensor, main_caches: list, draft_caches: list):
        """plan [B, 1 + (k+1) + M] (rows from `plan`) -> (targets [B, k+1], accepted [B], drafts [B, k])."""
        bs, k = self.block_size, self.k
        n = k + 1
        targets, hidden, positions, key_pos, meta = self._verify(plan, main_caches)
        if self.keep_hidden:  # rows past a sequence's acceptance are overwritten before they are read
            *draft_caches, store = draft_caches
            write_cache(store["hidden"], hidden, meta.slot_mapping)
        if not k:
            return targets, None, None
        cached, tokens, tables = self._split(plan)
        b = plan.shape[0]
        device = plan.device
        accepted = greedy_verify(targets, tokens[:, 1:])  # [B]
        # Every row's key enters the draft cache; only the row at each sequence's last final position
        # attends and runs the MLP: its output is the one the next draft reads.
        last = (cached + accepted).unsqueeze(1)  # [B, 1]
        select = RowSelection(torch.arange(b, device=device) * n + accepted, _metadata(tables, last, key_pos, bs))
        h = self.draft.forward_selected(targets.flatten(), hidden, positions.flatten(), draft_caches, meta,
                                        select)  # [B, H]
        draft = self.draft.compute_logits(h).argmax(-1)
        drafts = [draft]
        if k > 1:
            # the chain's keys go to a copy of this step's blocks, not the cache (module docstring, 4.)
            local_caches = [{name: cache.index_select(0, tables.flatten()) for name, cache in layer.items()}
                            for layer in draft_caches]
            local_tables = torch.arange(tables.numel(), device=device).view(tables.shape)
        for j in range(1, k):
            # the draft at position p reads the token at p + 1; position cached + accepted + j holds drafts[j-1]
            pos = (cached + accepted + j).unsqueeze(1)  # [B, 1]
            h = self.draft._forward_eager(draft, h, pos.flatten(), local_caches,
                                          _metadata(local_tables, pos, key_pos, bs))
            draft = self.draft.compute_logits(h).argmax(-1)
            drafts.append(draft)
        return targets, accepted, torch.stack(drafts, dim=1)

    def __call__(self, plan: torch.Tensor, main_caches: list, draft_caches: list):
        # the batch size and the block-table width vary; every other size is a constant of the graph
        torch._dynamo.maybe_mark_dynamic(plan, 0)
        torch._dynamo.maybe_mark_dynamic(plan, 1)
        if not self._warm:
            return self._fn(plan, main_caches, draft_caches)
        # After warm-up every graph this step needs exists, and the engine builds its inputs the
        # same way each step (same dtypes, devices, caches and modules); only the guards that told
        # the warm-up's graphs apart (the batch-size thresholds) are checked. A batch shape no
        # graph covers still compiles one.
        try:
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                return self._fn(plan, main_caches, draft_caches)
        except RuntimeError as exc:  # raised before the graph runs: no cache slot was written
            if _UNWARMED_SHAPE not in str(exc):
                raise
        log.warning("graph mode: no decode-step graph from the warm-up fits a batch of %d sequence(s) with "
                    "block tables %d wide; compiling one now", plan.shape[0], plan.shape[1] - self.k - 2)
        return self._fn(plan, main_caches, draft_caches)

    def warm_up(self, batch_sizes: list[int], num_blocks: int, main_caches: list, draft_caches: list,
                device: torch.device, threads_for=None) -> float:
        """Compile the step for each batch size on dummy tokens in the first blocks (no sequence owns
        a block yet, and a slot is written before it is read); returns the seconds it took.

        Each batch size runs with block tables several blocks wide and, where a sequence can fit in
        one block, one block wide: a size of 1 is a case of its own to the compiler.
        `threads_for(tokens)`: the torch thread count a step of that many tokens will run on (a
        graph is compiled for one thread count: inductor writes it into its kernels, and dynamo
        checks it before a call); default: the current one."""
        start = time.perf_counter()
        own = torch.get_num_threads()
        try:
            for b in batch_sizes:
                torch.set_num_threads(threads_for(b * (self.k + 1)) if threads_for else own)
                for width, cached in self._warm_up_tables():
                    rows = [self.plan(cached[i % len(cached)], [1] * (self.k + 1),
                                      [(i * width + j) % num_blocks for j in range(width)], width) for i in range(b)]
                    self(torch.tensor(rows, dtype=torch.long, device=device), main_caches, draft_caches)
        except Exception as exc:
            raise compile_failure("the decode step", exc, str(device)) from exc
        finally:
            torch.set_num_threads(own)
        self._warm = True
        return time.perf_counter() - start

    def _warm_up_tables(self) -> list[tuple[int, list[int]]]:
        """(table width, cached lengths) the warm-up runs. A decode step writes the slots from a
        sequence's cached length up to 2k past it (the k+1 verified positions, then the draft
        chain's k-1; one slot for k = 0), and the scheduler gives it the blocks for exactly those."""
        span = 2 * self.k if self.k else 1
        wide = -(-(15 + span) // self.block_size)  # cached lengths 8..15
        tables = [(max(wide, 2), list(range(8, 16)))]
        if self.block_size - span >= 1:  # a sequence of a few tokens fits one block
            tables.append((1, list(range(1, self.block_size - span + 1))))
        return tables


def warm_up_batch_sizes(max_seqs: int) -> list[int]:
    """1, 2, 3, 4, 6, 8, 12, 16, ... up to max_seqs (and max_seqs itself). A compiled step's graphs
    differ only at batch-size thresholds (the MoE's path per token count), and this sequence steps
    across each threshold with sizes on both sides."""
    sizes, b = [1, 2, 3], 4
    while b < max_seqs:
        sizes += [b, b + b // 2]
        b *= 2
    return sorted({s for s in sizes if s < max_seqs} | {max_seqs})
