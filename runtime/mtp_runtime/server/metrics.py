"""Prometheus metrics of rank 0, with exactly the names in ARCHITECTURE.md.

A private CollectorRegistry keeps them apart from anything else in the
process (tests start several apps in one interpreter). Counters move by the
per-request deltas the server sees in each RequestOutput, so they count what
the engine really drafted and accepted; gauges are set from the engine's own
stats after every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the app)

# `*_created` series would add names beyond the documented set; scrapers do not need them.
disable_created_metrics()

# Latency buckets in seconds: sub-ms tiny models on CPU up to big-model prefills.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
                0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
# Speculative depth: the chosen k per step (le = k, one bucket per k), a step's seconds, a request's
# acceptance rate.
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1,
                0.15, 0.25, 0.5, 1.0, 2.5)
ACCEPTANCE_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


@dataclass
class _RequestProgress:
    """What of one request has already been counted."""

    tokens: int = 0
    draft: int = 0
    accepted: int = 0
    steps: int = 0
    per_position: list[int] = field(default_factory=list)
    saw_first_token: bool = False


class ServerMetrics:
    def __init__(self, num_speculative_tokens: int = 0, speculative_adaptive: bool = False) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.draft_tokens = Counter("mtp_spec_decode_draft_tokens", "Tokens proposed by the MTP draft.", registry=r)
        self.accepted_tokens = Counter("mtp_spec_decode_accepted_tokens",
                                       "Draft tokens accepted by the main model.", registry=r)
        self.steps = Counter("mtp_spec_decode_steps", "Speculative verify steps.", registry=r)
        self.accepted_per_position = Counter(
            "mtp_spec_decode_accepted_tokens_per_position",
            "Accepted draft tokens by draft position (0 = first drafted token).",
            ["position"], registry=r)
        self.generation_tokens = Counter("mtp_generation_tokens", "Generated tokens.", registry=r)
        self.prompt_tokens = Counter("mtp_prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
        self.ttft = Histogram("mtp_time_to_first_token_seconds", "Time to first token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("mtp_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.",
                              buckets=TPOT_BUCKETS, registry=r)
        self.requests_running = Gauge("mtp_requests_running", "Requests being decoded.", registry=r)
        self.requests_waiting = Gauge("mtp_requests_waiting", "Requests waiting to be scheduled.", registry=r)
        self.kv_cache_usage = Gauge("mtp_kv_cache_usage_ratio", "Fraction of KV cache blocks in use.", registry=r)
        for pos in range(num_speculative_tokens):  # every position shows up from the first scrape
            self.accepted_per_position.labels(position=str(pos))
        self.num_speculative_tokens = Histogram(
            "mtp_spec_decode_num_speculative_tokens",
            "Drafts verified per step: the k of each step (adaptive depth chooses it every step).",
            buckets=tuple(float(k) for k in range(max(num_speculative_tokens, 1) + 1)), registry=r)
        self.step_seconds = Histogram("mtp_spec_decode_step_seconds", "Wall time of an engine step, by its k.",
                                      ["k"], buckets=STEP_BUCKETS, registry=r)
        for k in range(num_speculative_tokens + 1) if speculative_adaptive else (num_speculative_tokens,):
            self.step_seconds.labels(k=str(k))
        self.request_acceptance = Histogram(
            "mtp_spec_decode_request_acceptance_rate",
            "Accepted / drafted tokens of each finished request that verified drafts.",
            buckets=ACCEPTANCE_BUCKETS, registry=r)
        self._progress: dict[str, _RequestProgress] = {}

    def observe_output(self, out) -> None:
        """Count what a RequestOutput adds since the last one of its request."""
        seen = self._progress.setdefault(out.request_id, _RequestProgress())
        n_tokens = len(out.token_ids)
        if not seen.saw_first_token and n_tokens > 0:
            seen.saw_first_token = True
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            if out.ttft_s is not None:
                self.ttft.observe(out.ttft_s)
        self.generation_tokens.inc(max(0, n_tokens - seen.tokens))
        self.draft_tokens.inc(max(0, out.draft_tokens - seen.draft))
        self.accepted_tokens.inc(max(0, out.accepted_tokens - seen.accepted))
        self.steps.inc(max(0, out.verify_steps - seen.steps))
        per_position = list(out.accepted_per_position or [])
        for pos, count in enumerate(per_position):
            before = seen.per_position[pos] if pos < len(seen.per_position) else 0
            self.accepted_per_position.labels(position=str(pos)).inc(max(0, count - before))
        seen.tokens, seen.draft, seen.accepted = n_tokens, out.draft_tokens, out.accepted_tokens
        seen.steps, seen.per_position = out.verify_steps, per_position
        if out.finished:
            if n_tokens > 1 and out.tpot_s is not None:
                self.tpot.observe(out.tpot_s)
            if out.draft_tokens:
                self.request_acceptance.observe(out.accepted_tokens / out.draft_tokens)
            del self._progress[out.request_id]

    def observe_step(self, step) -> None:
        """One engine step (LLMEngine.last_step: its k and seconds)."""
        self.num_speculative_tokens.observe(step.num_speculative_tokens)
        self.step_seconds.labels(k=str(step.num_speculative_tokens)).observe(step.seconds)

    def forget(self, request_id: str) -> None:
        self._progress.pop(request_id, None)

    def set_engine_state(self, running: int, waiting: int, kv_cache_usage: float) -> None:
        self.requests_running.set(running)
        self.requests_waiting.set(waiting)
        self.kv_cache_usage.set(kv_cache_usage)

    def render(self) -> bytes:
        return generate_latest(self.registry)
