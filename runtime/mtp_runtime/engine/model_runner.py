"""ModelRunner: owns the models and their paged caches, and runs one scheduled step.

One step = ONE main forward over the flattened batch (prefill chunks and the
k+1 verify positions of every decoding sequence), acceptance, then the MTP
draft: one forward over every position the step made final (fed the verify
pass's hidden states), and k-1 single-token forwards that reuse the draft's
own hidden state. Rejected positions need no cleanup: their cache slots lie
past the sequence's cached length and are overwritten before anything reads
them (see runtime/README.md, "Speculative step").
"""

from __future__ import annotations

import contextlib
import logging
import time

import numpy as np
import psutil
import torch

from mtp_runtime.engine.config import EngineConfig
from mtp_runtime.engine.aot_step import AotDecodeStep, AotUnavailable, aot_cache_dir, resolve_aot
from mtp_runtime.engine.graph_step import ONE_CALL_ARCHS, GreedyDecodeStep, warm_up_batch_sizes
from mtp_runtime.engine.sampler import RowParams, probabilities, sample_from, speculative_verify, uniform_rows
from mtp_runtime.engine.scheduler import ScheduledBatch
from mtp_runtime.engine.sequence import Sequence
from mtp_runtime.layers.attention import AttentionMetadata, RowSelection, gather_cache, write_cache
from mtp_runtime.models.graph import CompileCounts, GraphError, announce, compile_cache_dir, resolve_graph, warm_up
from mtp_runtime.models.loader import load_draft, load_model

log = logging.getLogger("mtp_runtime.engine")

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cache_bytes_per_block(spec: list[dict[str, tuple[int, ...]]], block_size: int, dtype: torch.dtype) -> int:
    elems = sum(_numel(shape) for layer in spec for shape in layer.values())
    return elems * block_size * torch.empty((), dtype=dtype).element_size()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def allocate_caches(spec, num_blocks: int, block_size: int, dtype, device) -> list[dict[str, torch.Tensor]]:
    return [{name: torch.zeros(num_blocks, block_size, *shape, dtype=dtype, device=device)
             for name, shape in layer.items()} for layer in spec]


def free_memory_bytes(device: str) -> int:
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[0]
    if device.startswith("npu"):
        return torch.npu.mem_get_info(torch.device(device))[0]  # provided by torch_npu
    return psutil.virtual_memory().available


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = TORCH_DTYPES[config.dtype]
        self.k = config.num_speculative_tokens  # the largest k (every step's k unless adaptive)
        self.adaptive = config.speculative_adaptive
        # torch's thread count when the engine was built: the most a step uses (`threads_for`)
        self.threads = torch.get_num_threads()
        self.last_step_threads = self.threads
        self.main = load_model(config.model, self.dtype, config.device)
        self.draft = None
        if self.k:
            self.draft = load_draft(config.draft_model or config.model, main=self.main, dtype=self.dtype,
                                    device=config.device)
        self.model_config = self.main.config
        self.graph = resolve_graph(config.enable_graph, self.model_config.arch, config.device)
        self.graph_enabled = self.graph.enabled
        self.graph_compile_counts = CompileCounts()
        if self.graph_enabled:
            self.graph_cache_dir = compile_cache_dir()
            self.main.enable_graph()
            if self.draft is not None:
                self.draft.enable_graph()
        self.vocab_size = self.model_config.vocab_size
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        self.block_size = config.block_size
        main_spec = self.main.kv_cache_spec()
        draft_spec = self.draft.kv_cache_spec() if self.draft is not None else []
        # Adaptive depth: a step at k = 0 drafts nothing and leaves the draft's keys of the positions it
        # makes final unwritten; every step keeps the main hidden of each position instead (one row
        # copy), and the next step that drafts writes the missing keys from them (_fill_draft_keys).
        hidden_spec = [{"hidden": (self.model_config.hidden_size,)}] if self.adaptive and self.draft else []
        self.main_block_bytes = cache_bytes_per_block(main_spec, self.block_size, self.dtype)
        self.draft_block_bytes = cache_bytes_per_block(draft_spec + hidden_spec, self.block_size, self.dtype)
        self.num_blocks = config.kv_block_count(self.main_block_bytes + self.draft_block_bytes,
                                                free_memory_bytes(config.device), self.max_model_len)
        self.main_caches = allocate_caches(main_spec, self.num_blocks, self.block_size, self.dtype, self.device)
        self.draft_caches = allocate_caches(draft_spec, self.num_blocks, self.block_size, self.dtype, self.device)
        self.hidden_caches = allocate_caches(hidden_spec, self.num_blocks, self.block_size, self.dtype, self.device)
        # what a one-call step takes as its draft caches: the draft's, then the hidden store (keep_hidden)
        self.step_draft_caches = self.draft_caches + self.hidden_caches
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        # Graph mode: all-greedy decode steps run verify, acceptance and drafting as one compiled call,
        # one graph for each k a step may have (0..K with adaptive depth, whose steps also keep the
        # main hidden states, and whose k = 0 step runs the main model only).
        # Each is compiled ahead of time (AotDecodeStep) where it can be, else by torch.compile.
        self.decode_steps: dict[int, GreedyDecodeStep] = {}
        self.aot_requested = resolve_aot(config.aot_step)  # True, False or None (auto)
        self.aot_reason = "off (graph mode is off)"  # what the one-call steps run on, in words (/health)
        if self.graph_enabled and self.model_config.arch in ONE_CALL_ARCHS:
            aot = self._aot_possible()
            for k in self.step_depths():
                self.decode_steps[k] = (AotDecodeStep if aot else GreedyDecodeStep)(
                    self.main, self.draft, k, self.block_size, keep_hidden=bool(self.hidden_caches))
        else:
            if self.graph_enabled:
                self.aot_reason = f"off ({self.model_config.arch} has no one-call decode step)"
            if config.aot_step:
                raise GraphError("aot_step: the one-call decode step runs only in graph mode on "
                                 f"{'/'.join(ONE_CALL_ARCHS)} models; this engine runs {self.graph.reason} with "
                                 f"a {self.model_config.arch} model; leave aot_step unset or false")
        self.decode_step = self.decode_steps.get(self.k)
        self.graph_warm_up_by_k: dict[int, float] = {}  # seconds compiling each k's one-call step
        self.on_step = None  # called with each step's k before its model calls (multi-node: into the plans)
        self.draft_keys_filled = 0  # draft keys written late, for positions steps at k = 0 made final
        # adaptive depth: the draft's passes outside decode steps since take_draft_pass (prompts, fills)
        self._draft_pass = [0, 0.0]  # positions, seconds
        # (rows, seconds) of the last step's one-call decode part when prompt chunks ran beside it
        # (_execute_split; None otherwise): adaptive depth times it as a decode step of those rows
        self.last_decode_part: tuple[int, float] | None = None
        self.graph_warm_up_s = self._warm_up_graphs() if self.graph_enabled else 0.0

    def swap_draft(self, draft) -> None:
        """Draft with another module of the same architecture and sizes from the next step on (a
        re-exported MTP layer; a benchmark's bad draft). Its cache keeps the keys the old one wrote.
        The compiled steps follow it: an ahead-of-time package is handed its tensors (nothing is
        compiled), a torch.compile step is compiled again (from the disk cache where it holds it)."""
        if self.draft is None:
            raise ValueError("swap_draft: this engine drafts nothing (num_speculative_tokens=0)")
        if draft is self.draft:
            return
        if draft.kv_cache_spec() != self.draft.kv_cache_spec() or draft.config.to_dict() != self.draft.config.to_dict():
            raise ValueError("swap_draft: the new draft's config or cache layout differs from the old one's")
        for k, step in list(self.decode_steps.items()):  # first, so a draft the packages refuse changes nothing
            if isinstance(step, AotDecodeStep):
                step.swap_draft(draft, self.main_caches, self.step_draft_caches)
        self.draft = draft
        with torch.inference_mode():
            if self.graph_enabled:
                draft.enable_graph()
                warm_up(draft, self._run_draft_dummy, self.k, self.config.device)
            for k, step in list(self.decode_steps.items()):
                if not isinstance(step, AotDecodeStep):
                    self.decode_steps[k] = GreedyDecodeStep(self.main, draft, k, self.block_size,
                                                            keep_hidden=step.keep_hidden)
                    self._warm_up_decode_step(k)
        self.decode_step = self.decode_steps.get(self.k)

    def _aot_possible(self) -> bool:
        """Whether the one-call steps are built ahead of time: on CPU, unless aot_step is false."""
        if self.aot_requested is False:
            self.aot_reason = "off (aot_step=false): torch.compile"
            return False
        if self.device.type != "cpu":
            if self.aot_requested:
                raise GraphError(f"aot_step: supported on CPU only in this build, not {self.device}; leave it "
                                 f"unset or false (--aot_step=false)")
            self.aot_reason = f"off ({self.device.type} devices use torch.compile in this build)"
            return False
        return True

    def threads_for(self, tokens: int) -> int:
        """Threads for a step of `tokens` tokens (EngineConfig.single_thread_tokens)."""
        return 1 if tokens < self.config.single_thread_tokens else self.threads

    def step_depths(self) -> list[int]:
        """The k a step of this engine may have."""
        return list(range(self.k + 1)) if self.adaptive else [self.k]

    def _dummy_metadata(self, news: list[int], context_lens: list[int]) -> AttentionMetadata:
        """A warm-up step's metadata: every sequence in the first blocks (no sequence owns a block yet,
        and a block's slots are written before they are read)."""
        qsl = [0]
        for n in news:
            qsl.append(qsl[-1] + n)
        table = [b % self.num_blocks for b in range(-(-max(context_lens) // self.block_size))]
        slots = [slot for n, ctx in zip(news, context_lens) for slot in self._slots(table, ctx - n, ctx)]
        return AttentionMetadata(qsl, context_lens, [table] * len(news), self._tensor(slots), self.block_size)

    def _dummy_positions(self, news: list[int], context_lens: list[int]) -> torch.Tensor:
        return self._tensor([p for n, ctx in zip(news, context_lens) for p in range(ctx - n, ctx)])

    def _run_main_dummy(self, news: list[int], context_lens: list[int]) -> None:
        self.main(self._tensor([1] * sum(news)), self._dummy_positions(news, context_lens), self.main_caches,
                  self._dummy_metadata(news, context_lens))

    def _run_draft_dummy(self, news: list[int], context_lens: list[int]) -> None:
        hidden = torch.zeros(sum(news), self.model_config.hidden_size, dtype=self.dtype, device=self.device)
        self.draft(self._tensor([1] * sum(news)), hidden, self._dummy_positions(news, context_lens),
                   self.draft_caches, self._dummy_metadata(news, context_lens))

    def _warm_up_graphs(self) -> float:
        """Compile the decode-step graphs now, on dummy tokens in the first blocks, so no request waits
        for them."""
        before = CompileCounts.now()
        with torch.inference_mode():
            seconds = warm_up(self.main, self._run_main_dummy, self.k, self.config.device)
            if self.draft is not None:
                seconds += warm_up(self.draft, self._run_draft_dummy, self.k, self.config.device)
            for k in list(self.decode_steps):
                self.graph_warm_up_by_k[k] = self._warm_up_decode_step(k)
                seconds += self.graph_warm_up_by_k[k]
        self.decode_step = self.decode_steps.get(self.k)
        self.graph_compile_counts = counts = CompileCounts.now().since(before)
        steps = ", ".join(f"{s:.1f}s" for s in self.graph_warm_up_by_k.values())
        aot = [step for step in self.decode_steps.values() if isinstance(step, AotDecodeStep)]
        if aot:
            built, loaded = sum(s.built for s in aot), sum(s.loaded for s in aot)
            self.aot_reason = f"ahead of time ({built} package(s) compiled, {loaded} loaded from {aot_cache_dir()})"
        announce(f"graph mode: start-up took {seconds:.1f}s to ready the decode graphs: {counts.compiled} compiled, "
                 f"{counts.cached} from the disk cache in {self.graph_cache_dir}"
                 + (f" (one-call steps for k = {list(self.decode_steps)}: {steps}; {self.aot_reason})" if steps else ""))
        return seconds

    def _warm_up_decode_step(self, k: int) -> float:
        """Ready k's one-call step; an ahead-of-time step that cannot be built gives way to the
        torch.compile one (with a warning), unless aot_step asked for it."""
        args = (warm_up_batch_sizes(self.config.max_seqs_per_batch), self.num_blocks, self.main_caches,
                self.step_draft_caches, self.device, self.threads_for)
        step = self.decode_steps[k]
        try:
            return step.warm_up(*args)
        except AotUnavailable as exc:
            if self.aot_requested:
                raise GraphError(f"aot_step: the decode step (k={k}) cannot be compiled ahead of time here ({exc}); "
                                 f"run with aot_step unset or false (--aot_step=false) for the torch.compile "
                                 f"step") from exc
            log.warning("aot step: the decode step (k=%d) cannot be compiled ahead of time here (%s); it runs "
                        "the torch.compile step instead", k, exc)
            self.aot_reason = f"off (ahead-of-time compile failed: {exc}): torch.compile"
        step = self.decode_steps[k] = GreedyDecodeStep(self.main, self.draft, k, self.block_size,
                                                       keep_hidden=step.keep_hidden)
        return step.warm_up(*args)

    # slots, tensors, generators ---------------------------------------------------

    def _slots(self, table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def _tensor(self, values: list) -> torch.Tensor:
        """A long tensor of `values` (a list of ints, or of equal-length lists of them). Through numpy:
        torch.tensor reads a Python list element by element at about 4x numpy's cost per element, and
        a decode step's plan and slots are built from lists every step."""
        tensor = torch.from_numpy(np.array(values, dtype=np.int64))
        return tensor if self.device.type == "cpu" else tensor.to(self.device)

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        if seq.params.seed is None:
            return None
        if seq.generator is None:
            seq.generator = torch.Generator(device=self.device).manual_seed(seq.params.seed)
        return seq.generator

    # the step -----------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[list[list[int]], list[int]]:
        """Run one step; returns per sequence the tokens to append and the drafts accepted,
        and leaves each sampled sequence's next drafts in seq.draft_token_ids."""
        if self.on_step is not None:
            self.on_step(batch.num_speculative_tokens)
        self.last_decode_part = None
        if self.hidden_caches:
            if batch.num_speculative_tokens:
                self._fill_draft_keys(batch.seqs)
            else:  # this step writes no draft keys: the first position it makes final starts a gap
                for seq in batch.seqs:
                    if seq.draft_keys_from is None:
                        seq.draft_keys_from = seq.num_cached_tokens
        if self.decode_step is not None or self.decode_steps:
            decoding = [i for i in range(len(batch)) if self._is_greedy_decode_row(batch, i)]
            if len(decoding) == len(batch):
                return self._run_decode_step(batch)
            if decoding:
                return self._execute_split(batch, decoding)
        return self._run_eager(batch)

    def _run_decode_step(self, batch: ScheduledBatch) -> tuple[list[list[int]], list[int]]:
        """The one-call step, on the threads its graphs were compiled for (warm-up: `threads_for`)."""
        with self._step_threads(self.threads_for(len(batch) * (batch.num_speculative_tokens + 1))):
            return self._execute_decode_step(batch)

    def _run_eager(self, batch: ScheduledBatch) -> tuple[list[list[int]], list[int]]:
        """The general step: the per-forward graphs were compiled for every thread; eager takes any count."""
        tokens = sum(batch.num_chunk_tokens) + sum(batch.num_draft_tokens)
        with self._step_threads(self.threads if self.graph_enabled else self.threads_for(tokens)):
            return self._execute_eager(batch)

    @contextlib.contextmanager
    def _step_threads(self, threads: int):
        """Run a step on `threads` torch threads, then give the caller its own count back."""
        self.last_step_threads = threads
        before = torch.get_num_threads()
        if threads == before:
            yield
            return
        torch.set_num_threads(threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def _execute_eager(self, batch: ScheduledBatch) -> tuple[list[list[int]], list[int]]:
        """The general step: one main forward over every chunk and verify position of the batch."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl = [0]
        context_lens = []
        for seq, chunk, nd in zip(batch.seqs, batch.num_chunk_tokens, batch.num_draft_tokens):
            start = seq.num_cached_tokens
            end = start + chunk + nd
            ids += seq.token_ids[start:start + chunk]
            if nd:
                ids += seq.draft_token_ids
            positions += range(start, end)
            slots += self._slots(seq.block_table, start, end)
            qsl.append(qsl[-1] + chunk + nd)
            context_lens.append(end)
        tables = [seq.block_table for seq in batch.seqs]
        meta = AttentionMetadata(qsl, context_lens, tables, self._tensor(slots), self.block_size)
        hidden = self.main(self._tensor(ids), self._tensor(positions), self.main_caches, meta)  # [T, H]
        if self.hidden_caches:  # as the main cache: slots past what the step makes final are rewritten
            write_cache(self.hidden_caches[0]["hidden"], hidden, meta.slot_mapping)

        new_tokens, accepted = self._sample(batch, hidden, qsl)
        if self.draft is not None:
            # adaptive depth charges the draft's pass over a prompt to speculating (engine/spec_policy.py)
            prompt = bool(self.hidden_caches) and batch.num_speculative_tokens > 0 and \
                any(chunk > 1 for chunk in batch.num_chunk_tokens)
            started = time.perf_counter()
            self._propose(batch, hidden, qsl, slots, new_tokens, accepted)
            if prompt:
                self._count_draft_pass(sum(batch.num_chunk_tokens) + sum(accepted), started)
        return new_tokens, accepted

    def _count_draft_pass(self, positions: int, started: float) -> None:
        if self.device.type != "cpu":  # the pass's kernels may still be running
            torch.accelerator.synchronize()
        self._draft_pass[0] += positions
        self._draft_pass[1] += time.perf_counter() - started

    def take_draft_pass(self) -> tuple[int, float]:
        """Positions the draft passed over outside decode steps (a prompt's pass at k > 0, a fill), and
        the seconds it took, since the last call."""
        positions, seconds = self._draft_pass
        self._draft_pass = [0, 0.0]
        return positions, seconds

    def _is_greedy_decode_row(self, batch: ScheduledBatch, i: int) -> bool:
        """Sequence i of the batch decodes (its one uncached token plus k drafts) and samples greedily."""
        return batch.num_chunk_tokens[i] == 1 and batch.num_draft_tokens[i] == batch.num_speculative_tokens \
            and batch.samples[i] and batch.seqs[i].params.greedy

    def _execute_split(self, batch: ScheduledBatch, decoding: list[int]) -> tuple[list[list[int]], list[int]]:
        """A step mixing greedy decodes with prompt chunks (or sampled sequences): the decodes take the
        one-call graph and the rest the general step. The two touch different sequences, so their
        order does not matter; as one step, every decode would run eagerly beside a prompt chunk (a
        continuous-batching server does this whenever a request arrives while others decode)."""
        chosen = set(decoding)
        rest = [i for i in range(len(batch)) if i not in chosen]
        new_tokens: list[list[int]] = [[] for _ in batch.seqs]
        accepted = [0] * len(batch.seqs)
        for rows, run in ((decoding, self._run_decode_step), (rest, self._run_eager)):
            started = time.perf_counter()
            tokens, acc = run(batch.subset(rows))  # (its results are on the host: the step has ended)
            if rows is decoding:
                self.last_decode_part = (len(rows), time.perf_counter() - started)
            for i, t, a in zip(rows, tokens, acc):
                new_tokens[i], accepted[i] = t, a
        return new_tokens, accepted

    def _execute_decode_step(self, batch: ScheduledBatch) -> tuple[list[list[int]], list[int]]:
        seqs, k = batch.seqs, batch.num_speculative_tokens
        # The tables as wide as this step reaches, not as wide as allocated: the step attends over every slot
        # its tables reach (masked past each sequence's end), and with adaptive depth the scheduler allocates
        # for K drafts before the step's k is chosen (at k = 0, bench preset, batch 32: 3% more slots, and
        # the step 3% slower, than a k = 0 engine's). It reaches position cached + k (the verify) and, with
        # k >= 1, cached + 2k - 1 (the draft chain's last key, in its copy of the step's blocks).
        reach = max(k + 1, 2 * k)
        width = max(-(-(seq.num_cached_tokens + reach) // self.block_size) for seq in seqs)
        plan = self._tensor([GreedyDecodeStep.plan(seq.num_cached_tokens, [seq.token_ids[-1], *seq.draft_token_ids],
                                                   seq.block_table[:width], width) for seq in seqs])
        step = self.decode_step if k == self.k else self.decode_steps[k]
        targets, accepted, drafts = step(plan, self.main_caches, self.step_draft_caches)
        targets = targets.tolist()
        if not k:
            if self.adaptive:  # filler up to K, as `_set_drafts` gives greedy rows (inline: every row, every step)
                width = self.k
                for seq, t in zip(seqs, targets):
                    seq.num_real_drafts, seq.draft_token_ids, seq.draft_probs = 0, [t[0]] * width, None
            return targets, [0] * len(seqs)
        accepted = accepted.tolist()
        for seq, row in zip(seqs, drafts.tolist()):
            self._set_drafts(seq, row, None, row[-1])
        return [t[:a + 1] for t, a in zip(targets, accepted)], accepted

    def _defers_first_drafts(self, batch: ScheduledBatch) -> bool:
        """Whether this step's sequences that sample (each finishing its prompt: no decode row among
        them) get filler instead of drafts: in graph mode, greedy ones whose next step is a one-call
        decode step. Their first drafts would cost the draft's attention and MLP at the last prompt
        position and k - 1 chained eager draft steps for those few rows (bench preset, batch 4: 1.6 ms
        at k = 1 to 2.9 ms at k = 3 a prompt, against a 2.8 ms decode step at k = 3); that one-call step
        verifies the filler (a token gained, as at k = 0) and drafts from it as from any other row."""
        return batch.num_speculative_tokens in self.decode_steps and all(
            nd == 0 and seq.params.greedy
            for seq, nd, samples in zip(batch.seqs, batch.num_draft_tokens, batch.samples) if samples)

    def _set_drafts(self, seq: Sequence, drafts: list[int], probs: torch.Tensor | None, last: int) -> None:
        """The step's proposals for `seq` (and their distribution [k, V] when it samples), padded to K
        with the last token (`last`) as filler where fewer were drafted (adaptive depth, so that the
        next step may verify up to K; a prompt's deferred first drafts, `_defers_first_drafts`); filler
        is drafted with certainty (its q is one-hot), which keeps speculative sampling exact: it is
        accepted with the target's probability of that token."""
        seq.num_real_drafts = len(drafts)
        fill = self.k - len(drafts)
        seq.draft_token_ids = drafts + [last] * fill
        if probs is None and fill and not seq.params.greedy:
            probs = torch.zeros(0, self.vocab_size, device=self.device)
        if probs is not None and fill:
            one_hot = torch.zeros(fill, self.vocab_size, dtype=probs.dtype, device=probs.device)
            one_hot[:, last] = 1.0
            probs = torch.cat([probs, one_hot])
        seq.draft_probs = probs

    def _sample(self, batch: ScheduledBatch, hidden: torch.Tensor, qsl: list[int]):
        rows: list[int] = []
        first_row: dict[int, int] = {}  # batch index -> its first row in `logits`
        for i, (nd, samples) in enumerate(zip(batch.num_draft_tokens, batch.samples)):
            if samples:
                first_row[i] = len(rows)
                rows += range(qsl[i + 1] - 1 - nd, qsl[i + 1])
        new_tokens: list[list[int]] = [[] for _ in batch.seqs]
        accepted = [0] * len(batch.seqs)
        if not rows:
            return new_tokens, accepted
        logits = self.main.compute_logits(hidden[self._tensor(rows)])  # [N, V] float32
        argmax = logits.argmax(-1).tolist()
        sampled = []
        for i, r in first_row.items():
            seq, nd = batch.seqs[i], batch.num_draft_tokens[i]
            if not seq.params.greedy:
                sampled.append(i)
                continue
            a = 0  # greedy: accept drafts while they equal the target's argmax
            while a < nd and seq.draft_token_ids[a] == argmax[r + a]:
                a += 1
            accepted[i] = a
            new_tokens[i] = argmax[r:r + a + 1]
        if sampled:
            self._sample_random(batch, logits, first_row, sampled, new_tokens, accepted)
        return new_tokens, accepted

    def _sample_random(self, batch, logits, first_row, sampled, new_tokens, accepted) -> None:
        verify = [i for i in sampled if batch.num_draft_tokens[i]]
        plain = [i for i in sampled if not batch.num_draft_tokens[i]]
        vocab = self.vocab_size
        if verify:
            k = batch.num_speculative_tokens
            seqs = [batch.seqs[i] for i in verify]
            rows = self._tensor([first_row[i] + j for i in verify for j in range(k + 1)])
            target = probabilities(logits[rows].view(len(verify), k + 1, vocab),
                                   RowParams.build([s.params for s in seqs], vocab, self.device))
            draft_probs = torch.stack([s.draft_probs for s in seqs])  # [B, k, V]
            drafts = self._tensor([s.draft_token_ids for s in seqs])  # [B, k]
            u = uniform_rows([self._generator(s) for s in seqs], k + vocab, self.device, self.generator)
            num_acc, next_tok = speculative_verify(target, draft_probs, drafts, u[:, :k], u[:, k:])
            for i, s, a, t in zip(verify, seqs, num_acc.tolist(), next_tok.tolist()):
                accepted[i] = a
                new_tokens[i] = s.draft_token_ids[:a] + [t]
        if plain:
            seqs = [batch.seqs[i] for i in plain]
            probs = probabilities(logits[self._tensor([first_row[i] for i in plain])],
                                  RowParams.build([s.params for s in seqs], vocab, self.device))
            u = uniform_rows([self._generator(s) for s in seqs], vocab, self.device, self.generator)
            for i, t in zip(plain, sample_from(probs, u).tolist()):
                new_tokens[i] = [t]

    def _propose(self, batch: ScheduledBatch, hidden: torch.Tensor, qsl: list[int], slots: list[int],
                 new_tokens: list[list[int]], accepted: list[int]) -> None:
        """MTP drafting: one forward over the positions this step made final, then k-1 chained steps."""
        k = batch.num_speculative_tokens
        if not k:  # adaptive depth at k = 0: no draft work (execute), only filler for the next step to verify
            for i, seq in enumerate(batch.seqs):
                if batch.samples[i]:
                    self._set_drafts(seq, [], None, new_tokens[i][-1])
            return
        ids: list[int] = []
        rows: list[int] = []
        d_slots: list[int] = []
        d_qsl = [0]
        d_context = []
        last_rows, next_pos, samplers, lasts = [], [], [], []
        for i, (seq, chunk) in enumerate(zip(batch.seqs, batch.num_chunk_tokens)):
            start = seq.num_cached_tokens
            n = chunk + accepted[i]  # positions start .. start+n-1 are final now
            # The draft at position p reads the main hidden at p and the token at p+1.
            following = seq.token_ids[start + 1:start + 1 + n]
            if len(following) < n:
                following = following + new_tokens[i][:n - len(following)]
            ids += following
            rows += range(qsl[i], qsl[i] + n)
            d_slots += slots[qsl[i]:qsl[i] + n]
            d_qsl.append(d_qsl[-1] + n)
            d_context.append(start + n)
            if batch.samples[i]:
                last_rows.append(d_qsl[-1] - 1)
                next_pos.append(start + n)
                samplers.append(seq)
                lasts.append(new_tokens[i][-1])
        tables = [seq.block_table for seq in batch.seqs]
        meta = AttentionMetadata(d_qsl, d_context, tables, self._tensor(d_slots), self.block_size)
        args = (self._tensor(ids), hidden[self._tensor(rows)], self._tensor(rows_positions(meta)), self.draft_caches)
        deferred = bool(samplers) and self._defers_first_drafts(batch)
        if not samplers or deferred:  # chunks of prompts still prefilling: their keys only, no attention or MLP
            self.draft.write_keys(*args, meta)
            for seq, last in zip(samplers, lasts):  # (deferred: filler, for the one-call step to verify)
                self._set_drafts(seq, [], None, last)
            return
        padded = meta.decode_batch()
        if self.draft.graph_enabled and padded is not None and padded.n <= k + 1:
            # verify rows: the compiled draft forward over every row costs less than selecting in eager
            h = self.draft(*args, meta)[self._tensor(last_rows)]
        else:
            # Every row's key enters the cache; only each sampling sequence's last final position attends
            # and runs the MLP (a prompt's draft pass: one row of the chunk's, not all of them).
            h = self.draft.forward_selected(*args, meta, RowSelection.of(meta, last_rows))
        # h [B, H]: the draft hidden at each sampling sequence's last final position
        drafts, probs = [], []
        tok = self._draft_token(samplers, h, probs)
        drafts.append(tok)
        tables = [s.block_table for s in samplers]
        for j in range(1, k):
            pos = [p + j - 1 for p in next_pos]
            meta = AttentionMetadata(list(range(len(samplers) + 1)), [p + 1 for p in pos], tables,
                                     self._tensor([t[p // self.block_size] * self.block_size + p % self.block_size
                                                   for t, p in zip(tables, pos)]), self.block_size)
            h = self.draft(tok, h, self._tensor(pos), self.draft_caches, meta)
            tok = self._draft_token(samplers, h, probs)
            drafts.append(tok)
        stacked = torch.stack(probs, dim=1) if probs else None  # [B, k, V]; rows of greedy sequences unused
        for b, (seq, row) in enumerate(zip(samplers, torch.stack(drafts, dim=1).tolist())):
            self._set_drafts(seq, row, None if stacked is None or seq.params.greedy else stacked[b], row[-1])

    def _fill_draft_keys(self, seqs: list[Sequence]) -> None:
        """Before a step that drafts (adaptive depth): write the draft's keys that steps at k = 0 left
        out, [seq.draft_keys_from, seq.num_cached_tokens) of each sequence, in one keys-only pass fed
        the main hidden states the steps kept. The draft at position p reads the token at p + 1."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl, context_lens, tables = [0], [], []
        for seq in seqs:
            start, end = seq.draft_keys_from, seq.num_cached_tokens
            seq.draft_keys_from = None
            if start is None or start >= end:
                continue
            ids += seq.token_ids[start + 1:end + 1]
            positions += range(start, end)
            slots += self._slots(seq.block_table, start, end)
            qsl.append(qsl[-1] + end - start)
            context_lens.append(end)
            tables.append(seq.block_table)
        if not ids:
            return
        started = time.perf_counter()
        slot_mapping = self._tensor(slots)
        meta = AttentionMetadata(qsl, context_lens, tables, slot_mapping, self.block_size)
        hidden = gather_cache(self.hidden_caches[0]["hidden"], slot_mapping)
        with self._step_threads(self.threads_for(len(ids))):
            self.draft.write_keys(self._tensor(ids), hidden, self._tensor(positions), self.draft_caches, meta)
        self.draft_keys_filled += len(ids)
        self._count_draft_pass(len(ids), started)

    def _draft_token(self, seqs: list[Sequence], h: torch.Tensor, probs: list[torch.Tensor]) -> torch.Tensor:
        """Next draft token per sequence [B]: the argmax, or a draw from the draft's distribution q
        (kept in `probs` for speculative sampling) for sequences that sample."""
        logits = self.draft.compute_logits(h)  # [B, V]
        tokens = logits.argmax(-1)
        random_rows = [b for b, s in enumerate(seqs) if not s.params.greedy]
        if random_rows:
            q = probabilities(logits, RowParams.build([s.params for s in seqs], self.vocab_size, self.device))
            u = uniform_rows([self._generator(seqs[b]) for b in random_rows], self.vocab_size, self.device,
                             self.generator)
            tokens[random_rows] = sample_from(q[random_rows], u)
            probs.append(q)
        return tokens


def rows_positions(meta: AttentionMetadata) -> list[int]:
    """Positions of the new tokens of a flattened batch, in order."""
    positions: list[int] = []
    for i, ctx in enumerate(meta.context_lens):
        n = meta.query_start_loc[i + 1] - meta.query_start_loc[i]
        positions += range(ctx - n, ctx)
    return positions
