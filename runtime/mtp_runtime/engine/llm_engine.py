"""LLMEngine: requests in, one scheduled model step at a time, RequestOutputs out.

Threading: add_request and abort_request may be called from any thread. They
validate in the caller's thread (so a bad request raises there) and post to a
queue that step() drains; everything else (step, stats, has_unfinished_requests)
belongs to the one thread that steps the engine.
"""

from __future__ import annotations

import gc
import json
import logging
import queue
import time
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer

from mtp_runtime.engine.config import EngineConfig
from mtp_runtime.engine.detokenizer import IncrementalText
from mtp_runtime.engine.host_memory import keep_freed_host_memory
from mtp_runtime.engine.model_runner import ModelRunner
from mtp_runtime.engine.scheduler import ScheduledBatch, Scheduler
from mtp_runtime.engine.sequence import Sequence
from mtp_runtime.engine.spec_policy import bucket_sizes, make_policy
from mtp_runtime.sampling_params import SamplingParams

log = logging.getLogger("mtp_runtime.engine")


class RequestOutput:
    """What a step reports for one request. `text` is decoded on first access, unless the engine
    gave it (`engine_text`: a request with stop strings, whose text the engine reads every step and
    cuts at the stop string)."""

    def __init__(self, seq: Sequence, tokenizer: Tokenizer, new_token_ids: list[int], text: str | None = None):
        self.request_id = seq.request_id
        self.prompt_token_ids = seq.token_ids[:seq.num_prompt_tokens]
        self.token_ids = seq.output_token_ids
        self.new_token_ids = new_token_ids
        self.finished = seq.is_finished
        self.finish_reason = seq.finish_reason
        self.draft_tokens = seq.draft_tokens
        self.accepted_tokens = seq.accepted_tokens
        self.accepted_per_position = list(seq.accepted_per_position)
        self.verify_steps = seq.verify_steps
        self.ttft_s = seq.ttft_s()
        self.tpot_s = seq.tpot_s()
        self.tokenizer = tokenizer
        self._text = text
        self.engine_text = text is not None

    @property
    def text(self) -> str:
        if self._text is None:
            self._text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        return self._text

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    def __repr__(self) -> str:
        return (f"RequestOutput({self.request_id!r}, tokens={len(self.token_ids)}, finished={self.finished}, "
                f"reason={self.finish_reason!r})")


@dataclass
class StepRecord:
    """One model step as the metrics see it: its k, its wall time, its sequences."""

    num_speculative_tokens: int
    seconds: float
    batch_size: int


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_kv_blocks: int
    prompt_tokens: int
    generation_tokens: int
    draft_tokens: int
    accepted_tokens: int
    verify_steps: int
    accepted_per_position: list[int] = field(default_factory=list)
    num_steps: int = 0
    num_preemptions: int = 0
    prefix_cache_hit_tokens: int = 0


def eos_token_ids(model_dir: str, config_eos) -> tuple[int, ...]:
    ids: list[int] = []
    sources = [config_eos]
    gen = Path(model_dir, "generation_config.json")
    if gen.is_file():
        sources.append(json.loads(gen.read_text()).get("eos_token_id"))
    for value in sources:
        if isinstance(value, int):
            ids.append(value)
        elif isinstance(value, list):
            ids += [v for v in value if isinstance(v, int)]
    return tuple(dict.fromkeys(ids))


def load_tokenizer(model_dir: str) -> Tokenizer:
    path = Path(model_dir, "tokenizer.json")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the model directory has no tokenizer.json (needed to encode prompts)")
    return Tokenizer.from_file(str(path))


def freeze_start_up_objects() -> None:
    """Keep what start-up left alive (the model's modules, the compiled steps, torch's and the
    libraries' own objects: over half a million on the bench model) out of the cyclic garbage
    collector's passes. They live as long as the process, and its full passes over them took 3-4% of
    a batch-1 decode step's time (about 20 us every few steps)."""
    gc.collect()
    gc.freeze()


class LLMEngine:
    def __init__(self, config: EngineConfig, policy=None):
        """policy: what picks each step's k (engine/spec_policy.py); default: from the config."""
        self.config = config
        keep_freed_host_memory()
        self.policy = policy or make_policy(config.num_speculative_tokens, config.speculative_adaptive,
                                            config.seed)
        self.runner = ModelRunner(config)
        if self.policy.adaptive:  # (graph mode: a greedy prompt's first drafts wait for its first decode step)
            self.policy.first_drafts_deferred = bool(self.runner.decode_steps)
            # (what a probe up from k = 0 fills: AdaptivePolicy._probe_wait)
            self.policy.unseen_positions = lambda: sum(map(self._unseen_positions, self.scheduler.running))
        self.tokenizer = load_tokenizer(config.model)
        self.max_model_len = self.runner.max_model_len
        self.scheduler = Scheduler(
            num_blocks=self.runner.num_blocks, block_size=config.block_size,
            max_seqs_per_batch=config.max_seqs_per_batch, max_tokens_per_batch=config.max_tokens_per_batch,
            max_model_len=self.max_model_len, num_speculative_tokens=config.num_speculative_tokens,
            enable_prefix_cache=config.enable_prefix_cache, enable_chunked_prefill=config.enable_chunked_prefill,
            eos_token_ids=eos_token_ids(config.model, self.runner.model_config.eos_token_id))
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._requests: dict[str, Sequence] = {}  # engine thread only
        self._pending_ids: set[str] = set()  # ids posted but not yet drained
        self._num_steps = 0
        self._totals = {"prompt": 0, "generation": 0}
        self.last_step: StepRecord | None = None
        # adaptive depth: (k, batch size, model seconds, entry time) of the last decode step, whose host
        # time the next step's entry closes (`record_overhead`); None after a step that left nothing to do
        self._open_step: tuple[int, int, float, float] | None = None
        self.policy_warm_up_s = 0.0
        # True while no request beyond those queued will arrive (LLM.generate): once nothing waits,
        # adaptive depth picks the k that finishes the running sequences soonest (engine/spec_policy.py)
        self.closed_batch = False
        self._policy_seeded = not self.policy.adaptive
        # With several ranks every model call is broadcast by wrappers put in place after this
        # constructor (multinode/serve_group.py), which then seeds the policy; a lone rank 0 cannot run
        # the model here.
        if not self._policy_seeded and not _in_process_group():
            self.seed_policy()
        freeze_start_up_objects()

    # requests (any thread) ------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None) -> None:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"request {request_id!r}: params must be a SamplingParams, got {type(params).__name__}")
        token_ids = self.tokenizer.encode(prompt).ids if isinstance(prompt, str) else list(prompt)
        vocab = self.runner.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {request_id!r}: prompt token ids {bad[:5]} are outside the vocabulary "
                             f"(0..{vocab - 1})")
        if request_id in self._pending_ids or request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use; give each request a unique id")
        seq = Sequence(request_id, token_ids, params, self.max_model_len)
        self.scheduler.check(seq)
        self._pending_ids.add(request_id)
        self._inbox.put(("add", seq))

    def abort_request(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    # engine thread -------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or not self._inbox.empty()

    def _drain_inbox(self) -> list[Sequence]:
        aborted = []
        while True:
            try:
                verb, item = self._inbox.get_nowait()
            except queue.Empty:
                return aborted
            if verb == "add":
                self._pending_ids.discard(item.request_id)
                self._requests[item.request_id] = item
                self.scheduler.add(item)
                self._totals["prompt"] += item.num_prompt_tokens
            else:
                seq = self._requests.pop(item, None)
                if seq is not None and not seq.is_finished:
                    self.scheduler.abort(seq)
                    aborted.append(seq)

    def seed_policy(self, reps: int = 5) -> float:
        """Adaptive depth's warm-up: time dummy decode steps at every k and batch-size bucket (in
        blocks no sequence owns yet; a slot is written before it is read) so the first real steps
        choose from measured costs. Returns the seconds it took."""
        start = time.perf_counter()
        on_step, self.runner.on_step = self.runner.on_step, None  # dummy steps are no step of the engine's
        try:
            self._time_dummy_steps(reps)
        finally:
            self.runner.on_step = on_step
            self.runner.take_draft_pass()  # the dummy steps' draft passes are no prompt's
        self._policy_seeded = True
        self.policy_warm_up_s = time.perf_counter() - start
        log.info("adaptive depth: step costs at k = 0..%d measured in %.1fs", self.config.num_speculative_tokens,
                 self.policy_warm_up_s)
        return self.policy_warm_up_s

    def _time_dummy_steps(self, reps: int) -> None:
        # The depths take turns within each repeat, so a change in the machine's load between them
        # (other work on its cores) hits every k alike instead of skewing their ratios. Each turn runs
        # the policy's cold steps and times the step after them: the first steps after another depth's
        # run cold, as the policy's own probes do (engine/spec_policy.py), and decoding runs one depth
        # step after step.
        turns = getattr(self.policy, "cold_steps", 0) + 1
        for b in bucket_sizes(self.config.max_seqs_per_batch):
            timed: dict[int, list[float]] = {k: [] for k in self.runner.step_depths()}
            for rep in range(reps + 1):
                for k in timed:
                    for turn in range(turns):
                        batch = self._dummy_batch(b, k, turns * rep + turn)
                        t0 = time.perf_counter()
                        self.runner.execute(batch)
                        if rep and turn == turns - 1:  # the first repeat of each shape may pay one-off costs
                            timed[k].append(time.perf_counter() - t0)
            for k, seconds in timed.items():
                if seconds:
                    self.policy.seed_step_cost(k, b, seconds)

    def _dummy_batch(self, b: int, k: int, variant: int) -> ScheduledBatch:
        """A decode step of b sequences at depth k with 48 cached tokens each, in blocks no sequence
        owns yet (a slot is written before it is read); `variant` varies its tokens."""
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        cached = 48
        width = -(-(cached + 1 + 2 * self.config.num_speculative_tokens) // self.config.block_size)
        # Spread-out token ids: an MoE step's cost grows with the number of experts its tokens reach, and
        # one token repeated everywhere would reach the fewest, making deep steps of large batches look
        # cheap.
        vocab = self.runner.vocab_size
        seqs = []
        for i in range(b):
            row = [(7 + 131 * ((i + variant * b) * 64 + j)) % (vocab - 3) + 3 for j in range(cached + 1 + k)]
            seq = Sequence(f"policy-warm-up-{i}", row[:cached + 1], params, cached + 2)
            seq.block_table = [(i * width + j) % self.runner.num_blocks for j in range(width)]
            seq.num_cached_tokens = cached
            seq.draft_token_ids, seq.num_real_drafts = row[cached + 1:], k
            seqs.append(seq)
        return ScheduledBatch(seqs, [1] * b, [k] * b, [True] * b, num_speculative_tokens=k)

    @staticmethod
    def _unseen_positions(seq: Sequence) -> int:
        """Positions of `seq` the draft has not passed over: the keys steps at k = 0 left out, and the
        prompt still to prefill (its last position is drafted from, not passed over)."""
        gap = seq.num_cached_tokens - seq.draft_keys_from if seq.draft_keys_from is not None else 0
        return gap + max(0, seq.num_uncached_tokens - 1)

    def _drain_record(self, seq: Sequence) -> tuple:
        """What a closed batch's drain needs of `seq` (AdaptivePolicy.drain_scores): its decode steps'
        tokens left (a prompt still prefilling makes its first token in its prompt step, whatever k),
        its verifies, the positions the draft has not passed over, and its steps to come that gain one
        token whatever k: the verify of filler, where its drafts are filler (after a step at k = 0) or
        will be (a greedy prompt's first drafts wait for its first one-call decode step in graph mode,
        ModelRunner._defers_first_drafts)."""
        left = seq.max_output_tokens - seq.num_output_tokens
        if seq.num_uncached_tokens > 1 or not seq.num_output_tokens:  # prefilling (a decoding one holds 1)
            left -= 1
            filler = int(bool(self.runner.decode_steps) and seq.params.greedy)
        else:
            filler = int(not seq.num_real_drafts)
        return left, seq.tried_per_position, seq.accepted_per_position, self._unseen_positions(seq), filler

    def _choose_depth(self, batch: ScheduledBatch) -> list[bool]:
        """Ask the policy for this step's k and cut every verifying sequence's drafts to it; returns
        which rows decode (they verified drafts before the cut)."""
        decoding = [nd > 0 for nd in batch.num_draft_tokens]
        if self.policy.adaptive:
            k = batch.num_speculative_tokens = self._ask_policy(batch, decoding)
            if k < self.config.num_speculative_tokens:  # (at K no draft is cut: a decoding row has at most K)
                for i, seq in enumerate(batch.seqs):
                    if decoding[i]:
                        if len(seq.draft_token_ids) > k:
                            seq.draft_token_ids = seq.draft_token_ids[:k]
                            if seq.draft_probs is not None:
                                seq.draft_probs = seq.draft_probs[:k]
                        if seq.num_real_drafts > k:
                            seq.num_real_drafts = k
                        batch.num_draft_tokens[i] = k
        # (filler, where a prompt's first drafts were deferred, is no draft: ModelRunner._set_drafts)
        batch.num_real_drafts = [seq.num_real_drafts if d else 0 for seq, d in zip(batch.seqs, decoding)]
        return decoding

    def _ask_policy(self, batch: ScheduledBatch, decoding: list[bool]) -> int:
        """The adaptive policy's k for this step."""
        draining = None
        if self.closed_batch and not self.scheduler.waiting and self._inbox.empty():
            running = self.scheduler.running

            def draining():  # built only on the steps the policy revises a drain's choice
                return [self._drain_record(seq) for seq in running]
        size = sum(batch.samples)
        if not any(decoding):
            # Prompts alone: their k decides only whether the draft passes over them now, for the steps
            # after, whose batch holds every running and waiting sequence. (Asked at the prompts' number,
            # a closed batch of 32 whose first step prefilled 16 was asked at 16, a size its drain passes
            # through too fast to measure, and the draft passed over the prompts at k = 2 or 3.)
            size = min(self.config.max_seqs_per_batch, len(self.scheduler.running) + len(self.scheduler.waiting))
            self.policy.prompts_only()
        return self.policy.choose(max(1, size), draining)

    def step(self) -> list[RequestOutput]:
        entered = time.perf_counter()
        if self._open_step is not None:
            # The last decode step's time outside the model (scheduling, update, outputs, the policy, and
            # the caller's work until this step: a server's delivery and the threads it contends with)
            k, batch_size, model_s, started = self._open_step
            self._open_step = None
            self.policy.record_overhead(k, batch_size, entered - started - model_s)
        aborted = self._drain_inbox()
        outputs = [RequestOutput(seq, self.tokenizer, []) for seq in aborted]
        if not self._policy_seeded:
            self.seed_policy()
        batch = self.scheduler.schedule()
        if not len(batch):
            self.last_step = None
            return outputs
        self._num_steps += 1
        before = [len(seq) for seq in batch.seqs]
        decoding = self._choose_depth(batch)
        start = time.perf_counter()
        new_tokens, accepted = self.runner.execute(batch)
        now = time.perf_counter()
        k = batch.num_speculative_tokens
        self.last_step = StepRecord(k, now - start, len(batch))
        if k and self.policy.adaptive:  # (a step at k = 0 verifies nothing)
            self.policy.record_verifies([(real, a) for real, a in zip(batch.num_real_drafts, accepted) if real])
        self.scheduler.update(batch, new_tokens, accepted, now)
        for seq, n_before, sampled in zip(batch.seqs, before, new_tokens):
            if not sampled:
                continue
            added = seq.token_ids[n_before:]
            self._totals["generation"] += len(added)
            text = self._check_stop_strings(seq) if seq.params.stop else None
            outputs.append(RequestOutput(seq, self.tokenizer, added, text))
            if seq.is_finished:
                self._requests.pop(seq.request_id, None)
                if self.policy.adaptive:
                    self.policy.record_finished(seq.tried_per_position, seq.accepted_per_position)
                    self.policy.record_request(seq.num_prompt_tokens, seq.num_output_tokens)
        if self.policy.adaptive:
            # The model step's time, as the start-up's dummy steps are timed; the host's time around it is
            # measured apart, from this step's entry to the next's (`record_overhead`)
            if all(decoding) and all(c == 1 for c in batch.num_chunk_tokens):
                timed = (len(batch), now - start)
            else:
                # Prompt chunks beside the decodes (a server admits a request nearly every step at high
                # concurrency): the decodes ran as one call of their own, timed apart (None: they did
                # not). Left out, a depth's cost at such a load came from the start-up and the rare
                # decode-only steps, its probes went untimed, and a server at concurrency 32 ran k >= 2
                # where only k = 1 beat k = 0.
                timed = self.runner.last_decode_part
            if timed is not None:
                self.policy.record_step(k, *timed)
                if self.has_unfinished_requests():  # the caller steps again at once: its host time
                    self._open_step = (k, timed[0], now - start, entered)
            positions, seconds = self.runner.take_draft_pass()
            if positions:
                self.policy.record_draft_pass(positions, seconds)
            self.policy.end_step()
        return outputs

    def _check_stop_strings(self, seq: Sequence) -> str:
        """Finish `seq` with reason "stop" when its text contains a stop string; returns the text to report."""
        if seq.text is None:
            seq.text = IncrementalText(self.tokenizer)
        seq.text.update(seq.output_token_ids, final=seq.is_finished)  # the new tokens only
        text = seq.text.text
        hits = [i for i in (text.find(s) for s in seq.params.stop) if i >= 0]
        if not hits:
            return text
        if seq.is_finished:
            seq.finish_reason = "stop"  # the stop string wins over a length/eos finish in the same step
        else:
            self.scheduler.finish(seq, "stop")
        return text[:min(hits)]

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.scheduler.block_manager.usage(), num_kv_blocks=self.runner.num_blocks,
            prompt_tokens=self._totals["prompt"], generation_tokens=self._totals["generation"],
            draft_tokens=self.scheduler.draft_tokens, accepted_tokens=self.scheduler.accepted_tokens,
            verify_steps=self.scheduler.verify_steps,
            accepted_per_position=list(self.scheduler.accepted_per_position),
            num_steps=self._num_steps, num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_hit_tokens=self.scheduler.block_manager.num_hit_tokens)


def _in_process_group() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
