"""hack/bench_server_limits.py: the bodies it sends and how it judges what it measured."""

import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "hack" / "bench_server_limits.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_server_limits", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_bodies_are_the_size_asked_for_and_valid_json():
    bench = load_bench()
    body = bench.prompt_body(1)
    assert len(body) == 1_000_000 and json.loads(body)["max_tokens"] == 4
    assert b"".join(bench.chunks(body, 4096)) == body


def test_runs_combine_into_medians_and_worst_cases(capsys):
    bench = load_bench()
    runs = [bench.Case("c", 10, "chunked", 413, answer, 0.01, worst, 0.05, rss)
            for answer, worst, rss in ((0.5, 0.1, 5.0), (0.3, 0.25, 1.0), (0.4, 0.05, 2.0))]
    case = bench.median_case(runs)
    assert case.answer_s == 0.4 and case.health_max_s == 0.25 and case.rss_growth_mb == 5.0
    assert not bench.ok(case)  # /health took 0.25 s once: over the 0.2 s target
    assert abs(case.rss_ratio - 5.0 * 1024 * 1024 / 10e6) < 1e-9
    bench.print_table([case])
    assert "MISSED" in capsys.readouterr().out
