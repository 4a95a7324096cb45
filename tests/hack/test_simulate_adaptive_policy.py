"""hack/simulate_adaptive_policy.py: its cost model, and the closed-batch effect it exists to show."""

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "hack" / "simulate_adaptive_policy.py"


@pytest.fixture(scope="module")
def sim():
    spec = importlib.util.spec_from_file_location("simulate_adaptive_policy", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_step_costs_follow_the_table_between_buckets(sim):
    assert sim.step_seconds(0, 1) == pytest.approx(sim.COSTS_MS[0][0] / 1e3)
    assert sim.step_seconds(2, 16) == pytest.approx(sim.COSTS_MS[2][4] / 1e3)
    middle = sim.step_seconds(1, 24)
    assert sim.step_seconds(1, 16) < middle < sim.step_seconds(1, 32)
    assert sim.step_seconds(3, 64) == pytest.approx(2 * sim.step_seconds(3, 32))


def test_runs_repeat_and_every_system_sees_the_same_machine(sim):
    a = sim.run(4, seed=3, fixed=1, waves=1, tokens=16)
    assert a == sim.run(4, seed=3, fixed=1, waves=1, tokens=16)
    assert a != sim.run(4, seed=4, fixed=1, waves=1, tokens=16)


def test_spread_acceptance_makes_a_closed_batch_drain_to_its_slowest_sequence(sim):
    """Same mean acceptance per step, but spread over the prompts: speculation that pays with every
    prompt alike loses at batch 32, where the batch's last steps run a few sequences."""
    uniform = sim.compare([32], 3, {}, waves=2, quality=(0.9,))[32]
    spread = sim.compare([32], 3, {}, waves=2, quality=(0.3, 0.8, 1.0, 1.15, 1.25))[32]
    assert uniform["k=1"] > 1.0 > spread["k=1"]


def test_the_policy_falls_to_k0_when_no_draft_agrees(sim):
    """Eight batches: a fresh policy's first probes of each depth (once per bucket) would weigh more in
    a shorter run than the probes that keep coming."""
    row = sim.compare([16], 2, {"adaptive": (lambda: sim.AdaptivePolicy(3), True)}, waves=8, quality=(0.0,))[16]
    assert row["adaptive mean k"] < 0.2
    assert row["adaptive"] > 0.95 and row["k=1"] < 0.8


def test_told_the_batch_is_closed_the_policy_speculates_less_where_the_tail_costs(sim):
    """Prompts whose drafts agree very differently: at batch 32 the per-step choice (k = 1, which pays
    per step) leaves a long tail; the closed-batch choice, which sees each sequence's acceptance and
    tokens left, speculates less and finishes sooner."""
    spread = (0.1, 0.5, 1.0, 1.25)
    policies = {"closed": (lambda: sim.AdaptivePolicy(3), True), "per step": (lambda: sim.AdaptivePolicy(3), False)}
    row = sim.compare([32], 4, policies, waves=2, quality=spread)[32]
    assert row["closed mean k"] < row["per step mean k"]
    assert row["closed"] > row["per step"]


def test_the_cli_prints_a_table_and_writes_json(sim, tmp_path, monkeypatch, capsys):
    out = tmp_path / "sim.json"
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--batches", "1,8", "--seeds", "1", "--waves", "1",
                                      "--switch-margin", "0.1", "--json", str(out)])
    sim.main()
    printed = capsys.readouterr().out
    assert "| 8 |" in printed and "adaptive margin 0.1 / best fixed" in printed
    assert set(__import__("json").loads(out.read_text())["table"]) == {"1", "8"}


def test_short_serving_levels_drain_like_closed_batches(sim):
    """mtp bench's open system: with every request the same length, k = 0's clients stay in lockstep
    and finish together, while speculation's finish apart and each turn ends on a ragged tail. The
    more requests per client, the less that tail weighs, so speculation's gain over k = 0 grows."""
    def gain(per_client):
        k0 = [sim.serve(32, s, fixed=0, requests_per_client=per_client)[0] for s in range(3)]
        k1 = [sim.serve(32, s, fixed=1, requests_per_client=per_client)[0] for s in range(3)]
        return sum(k1) / sum(k0)
    assert gain(8) > gain(2) + 0.02
    assert sim.serve(4, 1, fixed=2, requests_per_client=2) == sim.serve(4, 1, fixed=2, requests_per_client=2)
    speed, mean_k = sim.serve(4, 1, policy=sim.AdaptivePolicy(3), requests_per_client=2, tokens=16)
    assert speed > 0 and 0 <= mean_k <= 3
