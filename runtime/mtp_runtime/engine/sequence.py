"""Sequence: one request's tokens, cache bookkeeping and spec-decode counters."""

from __future__ import annotations

import enum
import itertools
import time
from typing import Any

from mtp_runtime.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_seq_ids = itertools.count()


class Sequence:
    """A request in flight.

    Cache invariant: the main and the draft cache hold valid entries for
    positions 0 .. num_cached_tokens - 1 (both caches share `block_table`).
    A decoding sequence has every token but the last cached; its
    `draft_token_ids` are the MTP proposals the next verify pass checks.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 max_model_len: int):
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty; give at least one token")
        self.seq_id = next(_seq_ids)  # arrival order: lower = older = preempted last
        self.request_id = request_id
        self.params = params
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        # Output is clamped so the sequence never outgrows the model's context.
        self.max_output_tokens = min(params.max_tokens, max_model_len - self.num_prompt_tokens)
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hash of each full block, filled lazily
        self.num_cached_tokens = 0
        self.draft_token_ids: list[int] = []
        self.draft_probs: Any = None  # [k, vocab] draft distribution when sampling (temperature > 0)
        # adaptive depth: the first position whose draft key is not written yet (steps at k = 0 leave
        # them out; the next step that drafts writes them), None when every cached position has one
        self.draft_keys_from: int | None = None
        # leading draft_token_ids the draft model proposed; the rest are filler (adaptive depth pads a
        # step's proposals to the largest k, so the scheduler reserves for it)
        self.num_real_drafts = 0
        self.generator: Any = None  # per-request torch.Generator, created by the sampler
        self.num_preemptions = 0
        # spec-decode counters
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.accepted_per_position: list[int] = []
        self.tried_per_position: list[int] = []  # verifies that reached draft j (the ones before it accepted)
        self.verify_steps = 0
        # timing
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_reported_tokens = 0  # output tokens already handed out in a RequestOutput
        self.text: Any = None  # engine.detokenizer.IncrementalText of the output, where stop strings need it

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, len={len(self)}, cached={self.num_cached_tokens}, "
                f"status={self.status.value})")

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncached_tokens(self) -> int:
        return len(self.token_ids) - self.num_cached_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def reset_for_recompute(self) -> None:
        """Preemption: drop all cache state; the tokens so far are prefilled again later."""
        self.block_table = []
        self.num_cached_tokens = 0
        self.draft_token_ids = []
        self.draft_probs = None
        self.num_real_drafts = 0
        self.draft_keys_from = None
        self.status = SequenceStatus.WAITING
        self.num_preemptions += 1

    def record_verify(self, num_drafts: int, num_accepted: int) -> None:
        self.draft_tokens += num_drafts
        self.accepted_tokens += num_accepted
        self.verify_steps += 1
        if len(self.accepted_per_position) < num_drafts:
            self.accepted_per_position.extend([0] * (num_drafts - len(self.accepted_per_position)))
            self.tried_per_position.extend([0] * (num_drafts - len(self.tried_per_position)))
        for pos in range(num_accepted):
            self.accepted_per_position[pos] += 1
        for pos in range(min(num_accepted + 1, num_drafts)):
            self.tried_per_position[pos] += 1

    def ttft_s(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    def tpot_s(self) -> float | None:
        """Mean time per output token after the first one."""
        if self.first_token_time is None or self.last_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_output_tokens - 1)
