"""Scheduler: continuous batching with chunked prefill and preemption by recompute.

Every step schedules a flat batch. A sequence contributes the next chunk of
its uncached tokens; once the chunk reaches its last token the step samples
for it, and a decoding sequence also sends its k drafts for verification, so
prefill and decode mix freely in one model call. Running sequences go first,
oldest first; when blocks run out the newest running sequence is preempted
(its blocks freed, its tokens prefilled again later). The oldest sequence
always progresses, so there is no deadlock and no livelock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from mtp_runtime.engine.block_manager import BlockManager
from mtp_runtime.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_chunk_tokens: list[int] = field(default_factory=list)  # uncached tokens fed per sequence
    num_draft_tokens: list[int] = field(default_factory=list)  # drafts verified per sequence (0 or k)
    samples: list[bool] = field(default_factory=list)  # chunk reaches the end: sample this step
    preempted: list[Sequence] = field(default_factory=list)
    num_speculative_tokens: int = 0  # the step's k: drafts per verifying sequence, and to propose for the next
    # drafts per sequence the draft model made (the rest of its num_draft_tokens are filler, adaptive
    # depth after a step at a lower k); None: all of them
    num_real_drafts: list[int] | None = None

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_chunk_tokens) + sum(self.num_draft_tokens)

    def subset(self, rows: list[int]) -> "ScheduledBatch":
        """The batch of sequences `rows` alone (in that order), for a step run in parts."""
        return ScheduledBatch([self.seqs[i] for i in rows], [self.num_chunk_tokens[i] for i in rows],
                              [self.num_draft_tokens[i] for i in rows], [self.samples[i] for i in rows],
                              num_speculative_tokens=self.num_speculative_tokens,
                              num_real_drafts=None if self.num_real_drafts is None
                              else [self.num_real_drafts[i] for i in rows])


class Scheduler:
    def __init__(self, *, num_blocks: int, block_size: int, max_seqs_per_batch: int,
                 max_tokens_per_batch: int, max_model_len: int, num_speculative_tokens: int = 0,
                 enable_prefix_cache: bool = False, enable_chunked_prefill: bool = True,
                 eos_token_ids: tuple[int, ...] = ()):
        if max_tokens_per_batch < num_speculative_tokens + 1:
            raise ValueError(f"max_tokens_per_batch={max_tokens_per_batch} cannot hold one verify step of "
                             f"num_speculative_tokens + 1 = {num_speculative_tokens + 1} tokens; raise it")
        self.k = num_speculative_tokens
        self.max_seqs = max_seqs_per_batch
        self.max_tokens = max_tokens_per_batch
        self.max_model_len = max_model_len
        self.chunked = enable_chunked_prefill
        self.eos_token_ids = frozenset(eos_token_ids)
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_cache,
                                          lookahead=1 if num_speculative_tokens > 0 else 0)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # global spec-decode counters
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.verify_steps = 0
        self.accepted_per_position = [0] * num_speculative_tokens

    # requests ---------------------------------------------------------------

    def max_slots(self, seq: Sequence) -> int:
        """Cache slots `seq` may need at its longest: all tokens plus the speculative overhang."""
        return seq.num_prompt_tokens + seq.max_output_tokens + 2 * self.k

    def check(self, seq: Sequence) -> None:
        """Raise if `seq` could never run (reads only settings, so any thread may call it)."""
        if seq.num_prompt_tokens >= self.max_model_len:
            raise ValueError(f"request {seq.request_id!r}: prompt has {seq.num_prompt_tokens} tokens, "
                             f"max_model_len is {self.max_model_len}; shorten the prompt or raise max_model_len")
        need = self.block_manager.blocks_for(self.max_slots(seq))
        if need > self.block_manager.num_blocks:
            raise ValueError(f"request {seq.request_id!r} may need {need} KV blocks but the cache has "
                             f"{self.block_manager.num_blocks}; lower max_tokens or give the cache more memory")
        if not self.chunked and len(seq) > self.max_tokens:
            raise ValueError(f"request {seq.request_id!r}: prompt has {len(seq)} tokens > max_tokens_per_batch="
                             f"{self.max_tokens} with chunked prefill off; enable chunked prefill or raise it")

    def add(self, seq: Sequence) -> None:
        self.check(seq)
        self.waiting.append(seq)

    def abort(self, seq: Sequence) -> None:
        if seq.is_finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.finish(seq, "abort")

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq in self.running:
            self.running.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.free(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # scheduling ---------------------------------------------------------------

    def _slots_after_step(self, seq: Sequence, chunk: int, drafts: int, samples: bool) -> int:
        # Drafting after a sampled step writes up to k - 1 positions past the
        # verified ones (see runtime/README.md, "redraft").
        overhang = self.k - 1 if samples and self.k > 0 else 0
        return seq.num_cached_tokens + chunk + drafts + overhang

    def _plan(self, seq: Sequence, budget: int) -> tuple[int, int, bool] | None:
        """(chunk, drafts, samples) for `seq` within `budget` tokens, or None if it does not fit."""
        uncached = seq.num_uncached_tokens
        drafts = len(seq.draft_token_ids)
        if uncached + drafts <= budget:
            return uncached, drafts, True
        if drafts or not self._may_chunk(seq) or budget < 1:
            return None
        return budget, 0, False

    def _may_chunk(self, seq: Sequence) -> bool:
        # A preempted sequence may have outgrown the batch; its recompute is
        # chunked even with chunked prefill off, or it could never run again.
        return self.chunked or seq.num_preemptions > 0

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        batch.preempted.append(seq)

    def _add_to_batch(self, batch: ScheduledBatch, seq: Sequence, plan: tuple[int, int, bool]) -> None:
        chunk, drafts, samples = plan
        batch.seqs.append(seq)
        batch.num_chunk_tokens.append(chunk)
        batch.num_draft_tokens.append(drafts)
        batch.samples.append(samples)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch(num_speculative_tokens=self.k)
        budget = self.max_tokens
        bm = self.block_manager
        self.running.sort(key=lambda s: s.seq_id)
        i = 0
        while i < len(self.running) and len(batch) < self.max_seqs:
            seq = self.running[i]
            plan = self._plan(seq, budget)
            if plan is None:
                i += 1
                continue
            slots = self._slots_after_step(seq, *plan)
            while not bm.can_reserve(seq, slots) and self.running[-1] is not seq:
                self._preempt(self.running[-1], batch)
            if not bm.can_reserve(seq, slots):
                self._preempt(seq, batch)
                continue
            bm.reserve(seq, slots)
            self._add_to_batch(batch, seq, plan)
            budget -= plan[0] + plan[1]
            i += 1
        if batch.preempted:
            return batch  # blocks are short: admit nothing new this step
        while self.waiting and len(self.running) < self.max_seqs and budget > 0:
            seq = self.waiting[0]
            hits = bm.prefix_hits(seq)
            cached = len(hits) * bm.block_size
            uncached = len(seq) - cached
            if uncached > budget and not self._may_chunk(seq):
                break
            plan = (min(uncached, budget), 0, uncached <= budget)
            slots = cached + self._slots_after_step(seq, *plan)
            if not bm.can_reserve(seq, slots, hits):
                break
            self.waiting.popleft()
            bm.take_prefix(seq, hits)
            bm.reserve(seq, slots)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._add_to_batch(batch, seq, plan)
            budget -= plan[0]
        return batch

    # after the model step --------------------------------------------------

    def update(self, batch: ScheduledBatch, new_tokens: list[list[int]],
               num_accepted: list[int], now: float) -> list[Sequence]:
        """Apply one step's results; returns the sequences that finished.

        new_tokens[i]: tokens appended to batch.seqs[i] (accepted drafts + one
        sampled token; empty for a prefill chunk that does not sample).
        num_accepted[i]: how many of its drafts were accepted.
        """
        finished = []
        bm = self.block_manager
        reals = batch.num_real_drafts or batch.num_draft_tokens
        for seq, chunk, real, tokens, accepted in zip(batch.seqs, batch.num_chunk_tokens,
                                                      reals, new_tokens, num_accepted):
            if seq.is_finished:
                continue  # aborted while the step ran
            seq.num_cached_tokens += chunk + accepted
            if real:  # the counters count the draft model's proposals, not filler
                counted = min(accepted, real)
                seq.record_verify(real, counted)
                self.draft_tokens += real
                self.accepted_tokens += counted
                self.verify_steps += 1
                for pos in range(counted):
                    self.accepted_per_position[pos] += 1
            if not tokens:
                bm.register_full_blocks(seq, seq.num_cached_tokens)
                continue
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.last_token_time = now
            reason = self._append_checking_stop(seq, tokens)
            bm.register_full_blocks(seq, seq.num_cached_tokens)
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    def _append_checking_stop(self, seq: Sequence, tokens: list[int]) -> str | None:
        params = seq.params
        for token in tokens:
            seq.token_ids.append(token)
            if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
                return "stop"
            if seq.num_output_tokens >= seq.max_output_tokens:
                return "length"
        return None
