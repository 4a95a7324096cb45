"""hack/bench_llama_cpp.py: the agreement helpers and the targets it derives (no llama.cpp needed)."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "hack" / "bench_llama_cpp.py"


def load():
    spec = importlib.util.spec_from_file_location("bench_llama_cpp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_first_difference():
    bench = load()
    assert bench.first_difference([1, 2, 3], [1, 2, 4]) == 2
    assert bench.first_difference([1, 2], [1, 2]) is None
    assert bench.first_difference([1], [1, 2]) == 1


def test_routing_margins_of_groups_and_experts():
    bench = load()
    config = SimpleNamespace(n_group=2, topk_group=1, num_experts_per_tok=2)
    # identity router: the scores are sigmoid(row); no correction bias
    router = SimpleNamespace(weight=torch.eye(4), e_score_correction_bias=torch.zeros(4))
    row = torch.logit(torch.tensor([0.9, 0.5, 0.6, 0.7]))
    group_margin, expert_margin = bench.routing_margins(config, router, row)
    # groups (0.9 + 0.5 = 1.4) and (0.6 + 0.7 = 1.3): group 0 kept by 0.1; inside it 0.9, 0.5 chosen,
    # and the best expert left out is in the dropped group (-inf): the expert margin is unbounded
    assert abs(group_margin - 0.1) < 1e-5 and expert_margin == float("inf")
    config.num_experts_per_tok = 1
    assert abs(bench.routing_margins(config, router, row)[1] - 0.4) < 1e-5


def test_targets_use_each_sides_best_setting():
    bench = load()
    lib = {"samples": {
        "ours LLM graph k=0": {1: {1: [1000, 1100, 900], 4: [3000]}},
        "ours LLM graph k=3": {1: {1: [2600], 4: [4000]}},
        "llama.cpp llama-bench tg": {1: {1: [2000]}},
        "llama.cpp llama-batched-bench": {1: {1: [1800], 4: [3000]}},
    }}
    srv = {1: {"levels": {"mtp serve k=2": [{"concurrency": 1, "output_tokens_per_s": 1300.0}],
                          "llama-server k=0": [{"concurrency": 1, "output_tokens_per_s": 1000.0}]}}}
    tgt = bench.targets(lib, srv, [1], [1, 4], [1])
    assert tgt["library_batch1_threads1"]["measured"] == 1.3 and tgt["library_batch1_threads1"]["met"]
    assert tgt["library_batch1_threads1"]["theirs"] == "llama.cpp llama-bench tg"
    assert abs(tgt["library_batch4_threads1"]["measured"] - 4000 / 3000) < 1e-9
    assert not tgt["library_batch4_threads1"]["met"]
    assert tgt["k0_over_llama_loop_threads1"]["measured"] == 0.5
    assert tgt["server_concurrency1_threads1"]["measured"] == 1.3
