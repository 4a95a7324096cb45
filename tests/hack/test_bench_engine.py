"""hack/bench_engine.py: the ratios, targets and report it derives from measured points."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "hack" / "bench_engine.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_engine", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def point(tokens_per_s, tokens_per_step=1.0, ids=((1, 2),)):
    return {"tokens_per_s": tokens_per_s, "tpot_ms": 1.0, "tokens_per_verify_step": tokens_per_step,
            "acceptance_per_position": [], "token_ids": [list(i) for i in ids]}


def test_summary_ratios_targets_and_losslessness():
    bench = load_bench()
    systems = {
        "transformers": {1: point(10.0), 16: point(100.0)},
        "k=0": {1: point(25.0), 16: point(200.0)},
        "k=1": {1: point(40.0, 1.8), 16: point(230.0, 1.7, ids=((1, 3),))},
    }
    summary = bench.summarize(systems, [0, 1], [1, 16])
    ratios = summary["ratios"]
    assert ratios["k1_over_k0_batch1"] == 1.6 and ratios["k1_over_k0_batch16"] == 1.15
    assert abs(ratios["min_efficiency"] - 1.6 / 1.8) < 1e-9
    assert ratios["k0_over_transformers_batch1"] == 2.5
    assert summary["targets_met"] == {"k1_over_k0_batch1": True, "best_k_over_k0_batch1": False,
                                      "k1_over_k0_batch16": False, "min_efficiency": True,
                                      "k0_over_transformers_batch1": True}
    assert summary["lossless"] == {"k=0": True, "k=1": False}
    table = bench.markdown("deepseek_v3", systems, summary, [0, 1], [1, 16])
    assert "| k=1 | 1 | 40.0 |" in table and "| k=1 / k=0 tokens/s at batch 16 | 1.15 | 1.2 | NO |" in table


def test_speedups_are_medians_of_the_ratios_within_each_repeat():
    bench = load_bench()
    base = {"tokens_per_s": 100.0, "seconds_samples": [1.0, 2.0, 1.0]}  # a slow spell in the second repeat
    fast = {"tokens_per_s": 150.0, "seconds_samples": [0.5, 1.0, 0.8]}
    assert bench.speedup_over(fast, base) == 2.0  # ratios 2.0, 2.0, 1.25
    assert bench.speedup_over({"tokens_per_s": 150.0}, base) == 1.5  # no samples: ratio of the figures


def test_adaptive_ratios_show_the_spread_of_the_ratios_within_each_repeat():
    bench = load_bench()

    def timed(seconds):  # 100 tokens per run
        return {**point(100.0 / seconds[0]), "seconds_samples": seconds}
    systems = {
        "k=0": {1: timed([1.0, 2.0, 1.0])},
        "k=1": {1: timed([0.5, 1.0, 0.8])},  # over k=0: 2.0, 2.0, 1.25
        "adaptive K=1": {1: timed([0.5, 1.25, 0.5])},  # over k=0: 2.0, 1.6, 2.0; over k=1: 1.0, 0.8, 1.6
    }
    summary = bench.summarize(systems, [0, 1], [1])
    assert summary["ratios"]["adaptive K=1_over_k0"] == {1: 2.0}
    assert summary["ratios"]["adaptive K=1_over_best_fixed"] == {1: 1.0}
    assert summary["ratio_spread"]["adaptive K=1_over_best_fixed"] == {1: (0.8, 1.6)}
    assert summary["targets_met"]["adaptive K=1_over_best_fixed"]
    table = bench.markdown("deepseek_v3", systems, summary, [0, 1], [1])
    assert "| adaptive K=1_over_best_fixed | b1: 1.00 (0.80-1.60) | 0.97 | yes |" in table
    assert "| adaptive K=1_over_k0 | b1: 2.00 (1.60-2.00) | 1.0 | yes |" in table


def test_a_system_that_fails_in_its_process_stops_the_run_naming_it(monkeypatch, tmp_path):
    import pytest

    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # the spawned worker imports the script by name
    import bench_engine

    system = bench_engine.IsolatedSystem("k=0", "engine", (str(tmp_path), 0, 100, 1), 1)
    with pytest.raises(SystemExit, match="k=0: failed while starting: .*no config.json"):
        system.wait_ready()
    system.close()
    assert not system.process.is_alive()


class FakeSystem:
    """Runs nothing: records what it was asked to run, in the order of every system's calls."""

    def __init__(self, name, log, seconds_per_prompt=0.5):
        self.name, self.log, self.seconds_per_prompt = name, log, seconds_per_prompt
        self.outs = []

    def run(self, groups, max_tokens):
        self.log.append((self.name, [len(g) for g in groups]))
        self.outs += [p for g in groups for p in g]
        return self.seconds_per_prompt * sum(len(g) for g in groups)

    def take_point(self, seconds, max_tokens):
        point, self.outs = {"token_ids": self.outs, "seconds_seen": seconds}, []
        return point

    def timed_run(self, groups, max_tokens):
        seconds = self.run(groups, max_tokens)
        return seconds, self.take_point(seconds, max_tokens)


def test_every_batch_size_runs_every_prompt():
    bench = load_bench()
    prompts = [[i] for i in range(16)]
    assert bench.batch_groups(prompts, 1) == [[[i]] for i in range(16)]
    assert [len(g) for g in bench.batch_groups(prompts, 4)] == [4] * 4
    assert [len(g) for g in bench.batch_groups(prompts[:10], 4)] == [4, 4, 2]

    log = []
    fake = FakeSystem("k=0", log, seconds_per_prompt=0.5)
    results = bench.measure({"k=0": fake}, prompts, [1, 16], max_tokens=10, repeats=3)
    # warm-up, then all 16 prompts each repeat: 16 batches of 1, or one batch of 16
    assert [sizes for _, sizes in log] == [[2]] + [[1]] * 48 + [[16]] * 3
    assert results["k=0"][1]["tokens_per_s"] == 16 * 10 / 8.0 and results["k=0"][1]["tpot_ms"] == 1e3 * 8.0 / 160
    assert results["k=0"][16]["tokens_per_s"] == 16 * 10 / 8.0 and results["k=0"][16]["tpot_ms"] == 1e3 * 8.0 / 10
    assert results["k=0"][1]["token_ids"] == prompts  # a repeat's point covers all of its batches
    assert results["k=0"][1]["seconds_seen"] == 8.0 and results["k=0"][1]["seconds_samples"] == [8.0] * 3


def test_systems_take_turns_batch_by_batch_and_the_first_rotates():
    bench = load_bench()
    prompts = [[i] for i in range(4)]
    log = []
    systems = {name: FakeSystem(name, log) for name in ("a", "b", "c")}
    bench.measure(systems, prompts, [2], max_tokens=1, repeats=2, waves=2)
    turns = [name for name, _ in log[3:]]  # after each system's warm-up
    # repeat 1: batch 1 a b c, batch 2 b c a; repeat 2: c a b, then a b c
    assert turns == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    assert all(sizes == [2] for _, sizes in log[3:])  # one batch per turn


def test_an_existing_checkpoint_gives_its_arch_or_a_clear_error(tmp_path):
    bench = load_bench()
    (tmp_path / "config.json").write_text('{"model_type": "deepseek_v3"}')
    assert bench.model_arch(str(tmp_path)) == "deepseek_v3"
    with pytest.raises(SystemExit, match="--model: .*config.json gives no model_type"):
        bench.model_arch(str(tmp_path / "missing"))
