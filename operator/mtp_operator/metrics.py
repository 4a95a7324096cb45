"""Rank 0's metrics -> speculative-decoding figures over the last interval.

    counters = read_counters(engine, text, observed_at)   # one scrape, any engine
    stats = interval_stats(previous, counters, k)         # deltas; None previous = since start

Adapters map each engine's names onto `SpecDecodeCounters`:
builtin `mtp_spec_decode_*` and `mtp_*` (Prometheus text), vLLM
`vllm:spec_decode_num_*` (Prometheus text), xLLM's brpc `/vars` page
(`name : value` lines, e.g. `speculative_num_draft_tokens_total : 123`).
Counter resets (a restarted rank 0) are detected per counter: a value below
the previous one means the counter restarted from zero, so the new value is
the delta.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families


class MetricsFormatError(ValueError):
    """A metrics page that cannot be parsed; names the engine and the line."""


@dataclass(frozen=True)
class SpecDecodeCounters:
    observed_at: float  # seconds (monotonic or epoch, consistently)
    draft_tokens: float | None = None
    accepted_tokens: float | None = None
    steps: float | None = None  # verify steps (vLLM: number of drafts)
    accepted_per_position: dict[int, float] = field(default_factory=dict)
    generation_tokens: float | None = None
    prompt_tokens: float | None = None
    ttft_sum: float | None = None
    ttft_count: float | None = None
    tpot_sum: float | None = None
    tpot_count: float | None = None
    requests_running: float | None = None  # gauges: the latest value, not a delta
    requests_waiting: float | None = None
    kv_cache_usage_ratio: float | None = None
    # the builtin engine's histogram of each step's k (mtp_spec_decode_num_speculative_tokens)
    speculative_tokens_sum: float | None = None
    speculative_tokens_count: float | None = None


@dataclass(frozen=True)
class SpecDecodeStats:
    acceptance_rate: float | None
    mean_accepted_tokens_per_step: float | None  # accepted draft tokens per verify step
    per_position_acceptance: list[float]
    draft_tokens: float
    interval_seconds: float | None
    generation_tokens_per_second: float | None
    prompt_tokens_per_second: float | None
    time_to_first_token_seconds: float | None
    time_per_output_token_seconds: float | None
    requests_running: float | None
    requests_waiting: float | None
    kv_cache_usage_ratio: float | None
    mean_speculative_tokens: float | None = None  # mean k the engine chose per step (adaptive depth)


def parse_prometheus(text: str) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """(sum of every sample by name, {name: {position: value}} for per-position samples)."""
    totals: dict[str, float] = defaultdict(float)
    by_position: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                totals[sample.name] += sample.value
                if "position" in sample.labels:
                    by_position[sample.name][sample.labels["position"]] += sample.value
    except ValueError as exc:
        raise MetricsFormatError(f"Prometheus text: {exc}") from None
    return dict(totals), {k: dict(v) for k, v in by_position.items()}


_VARS_LINE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_:.]*)\s*:\s*(\S+)\s*$")


def parse_brpc_vars(text: str) -> dict[str, float]:
    """brpc's /vars page; non-numeric variables (strings, JSON) are skipped."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = _VARS_LINE.match(line)
        if not match:
            continue
        try:
            values[match.group(1)] = float(match.group(2))
        except ValueError:
            continue
    return values


def _positions(raw: dict[str, float]) -> dict[int, float]:
    out = {}
    for key, value in raw.items():
        if not key.isdigit():
            raise MetricsFormatError(f"per-position counter has position label {key!r}, expected an integer")
        out[int(key)] = value
    return out


def builtin_counters(text: str, observed_at: float) -> SpecDecodeCounters:
    t, pos = parse_prometheus(text)
    return SpecDecodeCounters(
        observed_at, t.get("mtp_spec_decode_draft_tokens_total"), t.get("mtp_spec_decode_accepted_tokens_total"),
        t.get("mtp_spec_decode_steps_total"),
        _positions(pos.get("mtp_spec_decode_accepted_tokens_per_position_total", {})),
        t.get("mtp_generation_tokens_total"), t.get("mtp_prompt_tokens_total"),
        t.get("mtp_time_to_first_token_seconds_sum"), t.get("mtp_time_to_first_token_seconds_count"),
        t.get("mtp_time_per_output_token_seconds_sum"), t.get("mtp_time_per_output_token_seconds_count"),
        t.get("mtp_requests_running"), t.get("mtp_requests_waiting"), t.get("mtp_kv_cache_usage_ratio"),
        t.get("mtp_spec_decode_num_speculative_tokens_sum"), t.get("mtp_spec_decode_num_speculative_tokens_count"),
    )


def vllm_counters(text: str, observed_at: float) -> SpecDecodeCounters:
    t, pos = parse_prometheus(text)
    tpot = "vllm:time_per_output_token_seconds" if "vllm:time_per_output_token_seconds_sum" in t \
        else "vllm:inter_token_latency_seconds"
    kv = t.get("vllm:kv_cache_usage_perc", t.get("vllm:gpu_cache_usage_perc"))
    return SpecDecodeCounters(
        observed_at, t.get("vllm:spec_decode_num_draft_tokens_total"),
        t.get("vllm:spec_decode_num_accepted_tokens_total"), t.get("vllm:spec_decode_num_drafts_total"),
        _positions(pos.get("vllm:spec_decode_num_accepted_tokens_per_pos_total", {})),
        t.get("vllm:generation_tokens_total"), t.get("vllm:prompt_tokens_total"),
        t.get("vllm:time_to_first_token_seconds_sum"), t.get("vllm:time_to_first_token_seconds_count"),
        t.get(f"{tpot}_sum"), t.get(f"{tpot}_count"),
        t.get("vllm:num_requests_running"), t.get("vllm:num_requests_waiting"), kv,
    )


def xllm_counters(text: str, observed_at: float) -> SpecDecodeCounters:
    v = parse_brpc_vars(text)
    return SpecDecodeCounters(observed_at, v.get("speculative_num_draft_tokens_total"),
                              v.get("speculative_num_accepted_tokens_total"))


ADAPTERS = {"builtin": builtin_counters, "vllm": vllm_counters, "xllm": xllm_counters}


def read_counters(engine: str, text: str, observed_at: float) -> SpecDecodeCounters:
    if engine not in ADAPTERS:
        raise MetricsFormatError(f"no metrics adapter for engine {engine!r}; known: {sorted(ADAPTERS)}")
    return ADAPTERS[engine](text, observed_at)


def _delta(previous: float | None, current: float | None) -> float | None:
    if current is None:
        return None
    if previous is None or current < previous:  # first sample, or the counter restarted from zero
        return current
    return current - previous


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def interval_stats(previous: SpecDecodeCounters | None, current: SpecDecodeCounters,
                   num_speculative_tokens: int) -> SpecDecodeStats:
    """Figures over [previous, current]; with no previous scrape, since rank 0 started."""
    p = previous or SpecDecodeCounters(observed_at=current.observed_at)
    draft = _delta(p.draft_tokens, current.draft_tokens)
    accepted = _delta(p.accepted_tokens, current.accepted_tokens)
    steps = _delta(p.steps, current.steps)
    if steps is None and draft is not None:  # every verify step drafts k tokens
        steps = draft / num_speculative_tokens
    positions = [_ratio(_delta(p.accepted_per_position.get(i), current.accepted_per_position[i]), steps)
                 for i in sorted(current.accepted_per_position)]
    interval = current.observed_at - previous.observed_at if previous else None
    return SpecDecodeStats(
        acceptance_rate=_ratio(accepted, draft),
        mean_accepted_tokens_per_step=_ratio(accepted, steps),
        per_position_acceptance=[round(x, 6) for x in positions if x is not None],
        draft_tokens=draft or 0.0,
        interval_seconds=interval,
        generation_tokens_per_second=_ratio(_delta(p.generation_tokens, current.generation_tokens), interval),
        prompt_tokens_per_second=_ratio(_delta(p.prompt_tokens, current.prompt_tokens), interval),
        time_to_first_token_seconds=_ratio(_delta(p.ttft_sum, current.ttft_sum),
                                           _delta(p.ttft_count, current.ttft_count)),
        time_per_output_token_seconds=_ratio(_delta(p.tpot_sum, current.tpot_sum),
                                             _delta(p.tpot_count, current.tpot_count)),
        requests_running=current.requests_running,
        requests_waiting=current.requests_waiting,
        kv_cache_usage_ratio=current.kv_cache_usage_ratio,
        mean_speculative_tokens=_ratio(_delta(p.speculative_tokens_sum, current.speculative_tokens_sum),
                                       _delta(p.speculative_tokens_count, current.speculative_tokens_count)),
    )


def combine_stats(groups: list[SpecDecodeStats]) -> SpecDecodeStats | None:
    """A fleet's figures from its groups' rank 0s: rates weighted by drafted tokens (acceptance,
    accepted per step, per position, TPOT, TTFT, k), throughputs and queue lengths summed."""
    if not groups:
        return None
    if len(groups) == 1:
        return groups[0]
    weights = [g.draft_tokens for g in groups]

    def weighted(values: list[float | None]) -> float | None:
        pairs = [(v, w) for v, w in zip(values, weights) if v is not None]
        total = sum(w for _, w in pairs)
        if not pairs:
            return None
        if total <= 0:
            return sum(v for v, _ in pairs) / len(pairs)
        return sum(v * w for v, w in pairs) / total

    def summed(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return sum(present) if present else None

    depth = max(len(g.per_position_acceptance) for g in groups)
    positions = [weighted([g.per_position_acceptance[i] if i < len(g.per_position_acceptance) else None
                           for g in groups]) for i in range(depth)]
    return SpecDecodeStats(
        acceptance_rate=weighted([g.acceptance_rate for g in groups]),
        mean_accepted_tokens_per_step=weighted([g.mean_accepted_tokens_per_step for g in groups]),
        per_position_acceptance=[round(p, 6) for p in positions if p is not None],
        draft_tokens=sum(weights),
        interval_seconds=weighted([g.interval_seconds for g in groups]),
        generation_tokens_per_second=summed([g.generation_tokens_per_second for g in groups]),
        prompt_tokens_per_second=summed([g.prompt_tokens_per_second for g in groups]),
        time_to_first_token_seconds=weighted([g.time_to_first_token_seconds for g in groups]),
        time_per_output_token_seconds=weighted([g.time_per_output_token_seconds for g in groups]),
        requests_running=summed([g.requests_running for g in groups]),
        requests_waiting=summed([g.requests_waiting for g in groups]),
        kv_cache_usage_ratio=weighted([g.kv_cache_usage_ratio for g in groups]),
        mean_speculative_tokens=weighted([g.mean_speculative_tokens for g in groups]),
    )
