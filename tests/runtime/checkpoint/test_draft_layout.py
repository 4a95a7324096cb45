from mtp_runtime.checkpoint.configs import build_config
from mtp_runtime.checkpoint.draft_layout import draft_config, draft_name


def test_names_follow_the_xllm_draft_layout():
    c = build_config("deepseek_v3")
    assert draft_name("model.layers.3.self_attn.q_a_proj.weight", c) == "model.layers.0.self_attn.q_a_proj.weight"
    assert draft_name("model.layers.3.mlp.experts.0.up_proj.weight_scale_inv", c) == \
        "model.layers.0.mlp.experts.0.up_proj.weight_scale_inv"
    for part in ("embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight",
                 "shared_head.norm.weight", "shared_head.head.weight"):
        assert draft_name(f"model.layers.3.{part}", c) == f"model.{part}"
    assert draft_name("model.layers.2.self_attn.q_a_proj.weight", c) is None
    assert draft_name("model.embed_tokens.weight", c) is None
    two = build_config("glm4_moe", num_nextn_predict_layers=2)
    assert draft_name("model.layers.4.enorm.weight", two) == "model.layers.1.enorm.weight"


def test_draft_config():
    c = build_config("deepseek_v32", num_hidden_layers=5)
    d = draft_config(dict(c, quantization_config={"quant_method": "fp8"}), "deepseek_v32", None)
    assert d["model_type"] == "deepseek_v32_mtp" and d["architectures"] == ["DeepseekV32MtpForCausalLM"]
    assert (d["num_hidden_layers"], d["first_k_dense_replace"], d["num_nextn_predict_layers"]) == (1, 0, 1)
    assert "quantization_config" not in d
    assert d["index_topk"] == c["index_topk"] and d["hidden_size"] == c["hidden_size"]
    kept = draft_config(c, "glm4_moe", {"quant_method": "fp8"})
    assert kept["quantization_config"] == {"quant_method": "fp8"} and kept["model_type"] == "glm4_moe_mtp"
