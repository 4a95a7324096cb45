import pytest

from mtp_runtime.checkpoint import naming
from mtp_runtime.checkpoint.configs import build_config


def test_deepseek_v3_names_and_shapes():
    c = build_config("deepseek_v3")
    t = naming.expected_tensors(c)
    H, V, E = c["hidden_size"], c["vocab_size"], c["n_routed_experts"]
    assert t["model.embed_tokens.weight"] == (V, H)
    assert t["lm_head.weight"] == (V, H)
    assert t["model.layers.0.mlp.gate_proj.weight"] == (c["intermediate_size"], H)  # dense first layer
    assert "model.layers.0.mlp.gate.weight" not in t
    assert t["model.layers.1.mlp.gate.weight"] == (E, H)
    assert t["model.layers.1.mlp.gate.e_score_correction_bias"] == (E,)
    assert t[f"model.layers.1.mlp.experts.{E - 1}.down_proj.weight"] == (H, c["moe_intermediate_size"])
    assert t["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"] == (c["kv_lora_rank"] + c["qk_rope_head_dim"], H)
    mtp = "model.layers.3."
    assert t[mtp + "eh_proj.weight"] == (H, 2 * H)
    for part in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight", "shared_head.head.weight",
                 "embed_tokens.weight", "mlp.gate.weight", "self_attn.q_a_proj.weight"):
        assert mtp + part in t
    assert not any(".indexer." in n for n in t)


def test_v32_indexer_tensors():
    c = build_config("deepseek_v32")
    t = naming.expected_tensors(c)
    n, d = c["index_n_heads"], c["index_head_dim"]
    p = "model.layers.3.self_attn.indexer."
    assert t[p + "wq_b.weight"] == (n * d, c["q_lora_rank"])
    assert t[p + "wk.weight"] == (d, c["hidden_size"])
    assert t[p + "k_norm.weight"] == (d,) and t[p + "k_norm.bias"] == (d,)
    assert t[p + "weights_proj.weight"] == (n, c["hidden_size"])


def test_glm_attention_bias_and_qk_norm():
    c = build_config("glm4_moe", use_qk_norm=True)
    t = naming.expected_tensors(c)
    d, kv = c["head_dim"], c["num_key_value_heads"]
    assert t["model.layers.0.self_attn.k_proj.weight"] == (kv * d, c["hidden_size"])
    assert t["model.layers.0.self_attn.q_proj.bias"] == (c["num_attention_heads"] * d,)
    assert "model.layers.0.self_attn.o_proj.bias" not in t
    assert t["model.layers.0.self_attn.q_norm.weight"] == (d,)


def test_mtp_helpers():
    c = build_config("glm4_moe", num_hidden_layers=5, num_nextn_predict_layers=2)
    assert list(naming.mtp_layer_indices(c)) == [5, 6]
    assert naming.is_mtp_tensor("model.layers.5.eh_proj.weight", c)
    assert naming.is_mtp_tensor("model.layers.6.mlp.experts.0.up_proj.weight_scale_inv", c)
    assert not naming.is_mtp_tensor("model.layers.4.eh_proj.weight", c)
    assert not naming.is_mtp_tensor("model.embed_tokens.weight", c)
    assert not naming.is_mtp_tensor("model.layers.50.input_layernorm.weight", c)


def test_fp8_linear_classification():
    assert naming.is_fp8_linear("model.layers.3.self_attn.kv_b_proj.weight")
    assert naming.is_fp8_linear("model.layers.3.mlp.experts.17.down_proj.weight")
    assert naming.is_fp8_linear("model.layers.3.mlp.shared_experts.up_proj.weight")
    assert naming.is_fp8_linear("model.layers.3.self_attn.indexer.wq_b.weight")
    for name in ("model.layers.3.eh_proj.weight", "model.layers.3.mlp.gate.weight", "lm_head.weight",
                 "model.layers.3.shared_head.head.weight", "model.embed_tokens.weight",
                 "model.layers.3.self_attn.indexer.weights_proj.weight", "model.layers.3.input_layernorm.weight"):
        assert not naming.is_fp8_linear(name), name
    assert naming.scale_name("a.b.weight") == "a.b.weight_scale_inv"
    assert naming.expected_dtype("model.layers.1.mlp.gate.e_score_correction_bias") == "float32"


def test_detect_arch():
    assert naming.detect_arch(build_config("deepseek_v3")) == "deepseek_v3"
    assert naming.detect_arch(build_config("deepseek_v32")) == "deepseek_v32"
    assert naming.detect_arch(dict(build_config("deepseek_v3"), model_type="deepseek_v32")) == "deepseek_v32"
    assert naming.detect_arch(build_config("glm4_moe")) == "glm4_moe"
    with pytest.raises(ValueError, match="'llama' is not supported"):
        naming.detect_arch({"model_type": "llama"})
