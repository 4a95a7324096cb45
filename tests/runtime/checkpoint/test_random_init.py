import torch

from mtp_runtime.checkpoint.configs import build_config
from mtp_runtime.checkpoint.random_init import RandomTensors


def test_scales_and_determinism():
    config = build_config("deepseek_v32", hidden_size=256)
    a, b = RandomTensors(config, seed=3), RandomTensors(config, seed=3)
    w = a["model.layers.1.self_attn.q_b_proj.weight"]
    assert torch.equal(w, b["model.layers.1.self_attn.q_b_proj.weight"])
    assert abs(w.std().item() - 0.02) < 0.002
    assert not torch.equal(w, RandomTensors(config, seed=4)["model.layers.1.self_attn.q_b_proj.weight"])
    for norm in ("model.norm.weight", "model.layers.3.enorm.weight", "model.layers.3.hnorm.weight",
                 "model.layers.0.self_attn.kv_a_layernorm.weight", "model.layers.3.self_attn.indexer.k_norm.weight"):
        assert torch.equal(a[norm], torch.ones_like(a[norm])), norm
    assert torch.equal(a["model.layers.3.self_attn.indexer.k_norm.bias"], torch.zeros(config["index_head_dim"]))
    bias = a["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert 0 < bias.abs().max() < 0.1
    assert len(a) == len(a.spec) and a.spec["lm_head.weight"][1] == (config["vocab_size"], 256)
