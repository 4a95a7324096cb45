import pytest

from mtp_runtime.checkpoint.configs import build_config

# Keys of the published DeepSeek-V3 config.json (auto_map dropped: we ship no remote code).
DEEPSEEK_V3_KEYS = {
    "architectures", "attention_bias", "attention_dropout", "aux_loss_alpha", "bos_token_id", "eos_token_id",
    "ep_size", "first_k_dense_replace", "hidden_act", "hidden_size", "initializer_range", "intermediate_size",
    "kv_lora_rank", "max_position_embeddings", "model_type", "moe_intermediate_size", "moe_layer_freq",
    "n_group", "n_routed_experts", "n_shared_experts", "norm_topk_prob", "num_attention_heads",
    "num_experts_per_tok", "num_hidden_layers", "num_key_value_heads", "num_nextn_predict_layers",
    "pretraining_tp", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "rms_norm_eps", "rope_scaling",
    "rope_theta", "routed_scaling_factor", "scoring_func", "seq_aux", "tie_word_embeddings", "topk_group",
    "topk_method", "torch_dtype", "transformers_version", "use_cache", "v_head_dim", "vocab_size",
}
GLM45_AIR_KEYS = {
    "architectures", "attention_bias", "attention_dropout", "pad_token_id", "eos_token_id", "head_dim",
    "hidden_act", "hidden_size", "partial_rotary_factor", "initializer_range", "intermediate_size",
    "max_position_embeddings", "model_type", "moe_intermediate_size", "norm_topk_prob", "num_attention_heads",
    "n_group", "topk_group", "n_routed_experts", "n_shared_experts", "routed_scaling_factor",
    "num_experts_per_tok", "first_k_dense_replace", "num_hidden_layers", "num_key_value_heads", "rms_norm_eps",
    "rope_scaling", "rope_theta", "num_nextn_predict_layers", "tie_word_embeddings", "torch_dtype",
    "transformers_version", "use_cache", "use_qk_norm", "vocab_size",
}


def test_deepseek_v3_has_published_keys_and_yarn():
    config = build_config("deepseek_v3")
    assert DEEPSEEK_V3_KEYS <= set(config)
    assert config["model_type"] == "deepseek_v3"
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["num_nextn_predict_layers"] == 1
    assert config["rope_scaling"]["type"] == "yarn"
    assert {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"} <= set(
        config["rope_scaling"]
    )
    assert config["n_routed_experts"] % config["n_group"] == 0


def test_v32_keeps_model_type_and_adds_indexer_keys():
    config = build_config("deepseek_v32")
    assert DEEPSEEK_V3_KEYS <= set(config)
    assert config["model_type"] == "deepseek_v3"
    assert config["architectures"] == ["DeepseekV32ForCausalLM"]
    assert {"index_n_heads", "index_head_dim", "index_topk"} <= set(config)


def test_glm_has_published_keys_partial_rotary_and_gqa():
    config = build_config("glm4_moe")
    assert GLM45_AIR_KEYS <= set(config)
    assert config["model_type"] == "glm4_moe"
    assert config["partial_rotary_factor"] == 0.5
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    assert "kv_lora_rank" not in config


def test_every_size_is_a_keyword():
    config = build_config("deepseek_v3", num_hidden_layers=8, vocab_size=8192, hidden_size=32, first_k_dense_replace=2)
    assert (config["num_hidden_layers"], config["vocab_size"], config["hidden_size"]) == (8, 8192, 32)


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"hidden_size": 0}, "hidden_size"),
        ({"n_routed_experts": 6}, "n_group"),
        ({"topk_group": 5}, "topk_group"),
        ({"first_k_dense_replace": 9}, "first_k_dense_replace"),
        ({"num_nextn_predict_layers": -1}, "num_nextn_predict_layers"),
    ],
)
def test_bad_sizes_name_the_key(overrides, key):
    with pytest.raises(ValueError, match=key):
        build_config("deepseek_v3", **overrides)


def test_unknown_arch():
    with pytest.raises(ValueError, match="unknown arch 'llama'"):
        build_config("llama")
