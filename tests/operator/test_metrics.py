"""Metrics adapters and interval acceptance, including counter resets."""

from __future__ import annotations

import pytest

from mtp_operator.metrics import (MetricsFormatError, interval_stats, parse_brpc_vars, read_counters)


def builtin_page(draft, accepted, steps, per_pos, gen=0.0, ttft=(0.0, 0)):
    lines = [
        "# TYPE mtp_spec_decode_draft_tokens_total counter", f"mtp_spec_decode_draft_tokens_total {draft}",
        "# TYPE mtp_spec_decode_accepted_tokens_total counter", f"mtp_spec_decode_accepted_tokens_total {accepted}",
        "# TYPE mtp_spec_decode_steps_total counter", f"mtp_spec_decode_steps_total {steps}",
        "# TYPE mtp_spec_decode_accepted_tokens_per_position_total counter",
        *[f'mtp_spec_decode_accepted_tokens_per_position_total{{position="{i}"}} {v}' for i, v in enumerate(per_pos)],
        "# TYPE mtp_generation_tokens_total counter", f"mtp_generation_tokens_total {gen}",
        "# TYPE mtp_time_to_first_token_seconds histogram",
        f'mtp_time_to_first_token_seconds_bucket{{le="+Inf"}} {ttft[1]}',
        f"mtp_time_to_first_token_seconds_sum {ttft[0]}", f"mtp_time_to_first_token_seconds_count {ttft[1]}",
        "# TYPE mtp_requests_running gauge", "mtp_requests_running 3",
    ]
    return "\n".join(lines) + "\n"


def test_builtin_interval_acceptance():
    first = read_counters("builtin", builtin_page(100, 80, 50, [45, 35], gen=1000, ttft=(2.0, 10)), 10.0)
    second = read_counters("builtin", builtin_page(300, 200, 150, [130, 70], gen=3000, ttft=(3.0, 12)), 20.0)
    stats = interval_stats(first, second, num_speculative_tokens=2)
    assert stats.acceptance_rate == pytest.approx(120 / 200)
    assert stats.mean_accepted_tokens_per_step == pytest.approx(120 / 100)
    assert stats.per_position_acceptance == [pytest.approx(0.85), pytest.approx(0.35)]
    assert stats.generation_tokens_per_second == pytest.approx(200.0)
    assert stats.time_to_first_token_seconds == pytest.approx(0.5)
    assert stats.requests_running == 3 and stats.interval_seconds == 10.0


def test_first_scrape_reports_since_start():
    only = read_counters("builtin", builtin_page(100, 80, 50, [45, 35]), 5.0)
    stats = interval_stats(None, only, 2)
    assert stats.acceptance_rate == pytest.approx(0.8)
    assert stats.generation_tokens_per_second is None  # no interval to divide by


def test_counter_reset_uses_the_new_value_as_delta():
    before = read_counters("builtin", builtin_page(10_000, 9_000, 5_000, [5000, 4000]), 0.0)
    after_restart = read_counters("builtin", builtin_page(40, 10, 20, [8, 2]), 30.0)
    stats = interval_stats(before, after_restart, 2)
    assert stats.acceptance_rate == pytest.approx(10 / 40)
    assert stats.per_position_acceptance == [pytest.approx(0.4), pytest.approx(0.1)]


def test_vllm_names_and_labels_are_summed():
    page = "\n".join([
        "# TYPE vllm:spec_decode_num_draft_tokens_total counter",
        'vllm:spec_decode_num_draft_tokens_total{model_name="a",engine="0"} 60',
        'vllm:spec_decode_num_draft_tokens_total{model_name="a",engine="1"} 40',
        "# TYPE vllm:spec_decode_num_accepted_tokens_total counter",
        'vllm:spec_decode_num_accepted_tokens_total{model_name="a"} 90',
        "# TYPE vllm:spec_decode_num_drafts_total counter",
        'vllm:spec_decode_num_drafts_total{model_name="a"} 100',
        "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter",
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="a",position="0"} 90',
        "# TYPE vllm:num_requests_waiting gauge", 'vllm:num_requests_waiting{model_name="a"} 2',
    ]) + "\n"
    stats = interval_stats(None, read_counters("vllm", page, 1.0), 1)
    assert stats.acceptance_rate == pytest.approx(0.9)
    assert stats.per_position_acceptance == [pytest.approx(0.9)]
    assert stats.requests_waiting == 2


def test_xllm_vars_page():
    page = "speculative_num_draft_tokens_total : 200\nspeculative_num_accepted_tokens_total : 170\n" \
           "process_uptime : 99\nversion : \"1.2\"\n  not a var line\n"
    assert parse_brpc_vars(page)["process_uptime"] == 99.0
    later = "speculative_num_draft_tokens_total : 400\nspeculative_num_accepted_tokens_total : 330\n"
    stats = interval_stats(read_counters("xllm", page, 0.0), read_counters("xllm", later, 10.0), 1)
    assert stats.acceptance_rate == pytest.approx(160 / 200)
    assert stats.mean_accepted_tokens_per_step == pytest.approx(0.8)  # steps = draft / k


def test_no_drafts_means_no_acceptance_figure():
    page = builtin_page(0, 0, 0, [])
    stats = interval_stats(read_counters("builtin", page, 0.0), read_counters("builtin", page, 1.0), 1)
    assert stats.acceptance_rate is None and stats.per_position_acceptance == []


def test_bad_input_is_named():
    with pytest.raises(MetricsFormatError, match="engine 'sglang'"):
        read_counters("sglang", "", 0.0)
    with pytest.raises(MetricsFormatError, match="Prometheus text"):
        read_counters("builtin", "mtp_spec_decode_draft_tokens_total{ 12\n", 0.0)
    bad_pos = 'mtp_spec_decode_accepted_tokens_per_position_total{position="first"} 1\n'
    with pytest.raises(MetricsFormatError, match="position label 'first'"):
        read_counters("builtin", bad_pos, 0.0)


def test_builtin_mean_chosen_k_over_the_interval():
    def page(k_sum, steps):
        return builtin_page(100, 80, 50, [45, 35]) + "\n".join([
            "# TYPE mtp_spec_decode_num_speculative_tokens histogram",
            f'mtp_spec_decode_num_speculative_tokens_bucket{{le="+Inf"}} {steps}',
            f"mtp_spec_decode_num_speculative_tokens_sum {k_sum}",
            f"mtp_spec_decode_num_speculative_tokens_count {steps}"]) + "\n"

    first = read_counters("builtin", page(300, 100), 10.0)
    second = read_counters("builtin", page(340, 200), 20.0)  # 100 steps at k = 0.4 on average
    assert interval_stats(first, second, 3).mean_speculative_tokens == pytest.approx(0.4)
    assert interval_stats(None, first, 3).mean_speculative_tokens == pytest.approx(3.0)
    assert interval_stats(None, read_counters("builtin", builtin_page(1, 1, 1, [1]), 1.0), 1) \
        .mean_speculative_tokens is None  # an engine without the histogram
