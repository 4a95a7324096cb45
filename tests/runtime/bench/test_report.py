"""Benchmark output: table, JSON with ratios, and a real PNG."""

import json

from mtp_runtime.bench.client import RequestResult
from mtp_runtime.bench.report import markdown_table, throughput_ratios, write_outputs
from mtp_runtime.bench.runner import LevelRun, summarise
from mtp_runtime.bench.suite import BenchPlan
from mtp_runtime.bench.server_metrics import SpecCounters


def level(concurrency, tokens_per_request, duration, spec=None):
    results = [RequestResult(ok=True, prompt_tokens=32, output_tokens=tokens_per_request, ttft_s=0.05,
                             latency_s=0.05 + 0.01 * (tokens_per_request - 1))] * (2 * concurrency)
    results = results + [RequestResult(ok=False, error="HTTP 429: full")]
    return summarise(concurrency, LevelRun(results, duration, spec or SpecCounters(found=False)))


def test_summary_figures():
    r = level(2, 11, 2.0, SpecCounters(found=True, draft=40, accepted=30, steps=40, per_position={0: 30}))
    assert r.requests == 5 and r.failed == 1 and r.first_error.startswith("HTTP 429")
    assert r.output_tokens == 44 and r.output_tokens_per_s == 22.0 and r.total_tokens_per_s == (44 + 128) / 2
    assert abs(r.mean_tpot_ms - 10.0) < 1e-9 and abs(r.mean_ttft_ms - 50.0) < 1e-9
    assert r.acceptance_rate == 0.75 and r.mean_accepted_per_step == 0.75 and r.accepted_per_position == {0: 0.75}


def test_runs_add_up_and_levels_split_into_turns():
    one = LevelRun([RequestResult(ok=True, output_tokens=10)], 1.0, SpecCounters(True, 4, 3, 4, {0: 3}))
    two = LevelRun([RequestResult(ok=True, output_tokens=30)], 3.0, SpecCounters(True, 4, 1, 4, {0: 1}))
    both = summarise(1, one.plus(two))
    assert both.output_tokens_per_s == 10.0 and both.acceptance_rate == 0.5 and both.accepted_per_position == {0: 0.5}
    plan = BenchPlan(concurrency=[4], input_len=8, output_len=8, requests_per_level=0, rounds=3)
    assert [len(c) for c in plan.chunks([[1]] * 16, 4)] == [6, 6, 4]
    assert [len(c) for c in plan.chunks([[1]] * 8, 8)] == [8]  # a turn keeps the whole concurrency busy
    assert [plan.requests_for(c) for c in (1, 4, 32)] == [8, 16, 128]  # max(8, 4 per client)
    longer = BenchPlan(concurrency=[32], input_len=8, output_len=8, requests_per_level=0, requests_per_client=16)
    assert longer.requests_for(32) == 512 and longer.requests_for(1) == 16
    assert BenchPlan(concurrency=[32], input_len=8, output_len=8, requests_per_level=5,
                     requests_per_client=16).requests_for(32) == 5  # a level's count wins


def test_output_lengths_are_seeded_and_spread_within_bounds():
    import pytest

    plan = BenchPlan(concurrency=[4], input_len=8, output_len=64, requests_per_level=0, output_spread=16, seed=7)
    lengths = plan.output_lengths(200)
    assert all(48 <= n <= 80 for n in lengths) and min(lengths) < 52 and max(lengths) > 76
    assert lengths == plan.output_lengths(200)  # every server of a comparison gets the same lengths, in order
    assert plan.output_lengths(5) == lengths[:5]
    other = BenchPlan(concurrency=[4], input_len=8, output_len=64, requests_per_level=0, output_spread=16, seed=8)
    assert other.output_lengths(200) != lengths
    equal = BenchPlan(concurrency=[4], input_len=8, output_len=64, requests_per_level=0)
    assert equal.output_lengths(3) == [64, 64, 64]
    for bad in (-1, 64, 65):  # every request must ask for at least one token
        with pytest.raises(ValueError, match=f"output spread {bad} must lie in"):
            BenchPlan(concurrency=[4], input_len=8, output_len=64, requests_per_level=0, output_spread=bad)


def test_comparison_outputs(tmp_path):
    runs = {"baseline": [level(1, 11, 2.0), level(4, 11, 4.0)], "mtp": [level(1, 11, 1.0), level(4, 11, 3.0)]}
    assert throughput_ratios(runs) == {1: 2.0, 4: 4 / 3}
    table = markdown_table(runs)
    assert "| 1 |" in table and "2.00x" in table and "1.33x" in table
    paths = write_outputs(runs, {"input_len": 32}, tmp_path)
    doc = json.loads(paths["json"].read_text())
    assert doc["mtp_over_baseline_output_tokens_per_s"] == {"1": 2.0, "4": 4 / 3}
    assert doc["runs"]["mtp"][0]["concurrency"] == 1
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    single = markdown_table({"server": runs["mtp"]})
    assert "**server**" in single and "Mean TPOT" in single
