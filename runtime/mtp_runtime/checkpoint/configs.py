"""config.json dicts with the keys of the published DeepSeek-V3 / V3.2 and GLM-4.5-Air configs.

Sizes default to something tiny (fast tests); every size is a keyword so other
presets (e.g. a deep-and-narrow benchmark model) are one call away.
"""

from __future__ import annotations

from typing import Any

ARCHS = ("deepseek_v3", "deepseek_v32", "glm4_moe")

# Architecture names as the published checkpoints spell them.
ARCHITECTURES = {
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek_v32": "DeepseekV32ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
}

# Keys shared by all three families, at tiny sizes.
_COMMON = dict(
    vocab_size=1024,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    num_nextn_predict_layers=1,
    hidden_act="silu",
    initializer_range=0.02,
    attention_dropout=0.0,
    tie_word_embeddings=False,
    use_cache=True,
    torch_dtype="bfloat16",
    transformers_version="4.57.0",
)

_DEEPSEEK = dict(
    _COMMON,
    num_key_value_heads=4,
    n_group=4,
    topk_group=2,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    max_position_embeddings=4096,
    rope_theta=10000,
    rms_norm_eps=1e-6,
    routed_scaling_factor=2.5,
    scoring_func="sigmoid",
    topk_method="noaux_tc",
    moe_layer_freq=1,
    ep_size=1,
    aux_loss_alpha=0.001,
    seq_aux=True,
    pretraining_tp=1,
    attention_bias=False,
    bos_token_id=0,
    eos_token_id=1,
)

# YaRN as in DeepSeek-V3's config (factor 40 over 4k there; scaled down here).
_YARN = dict(
    type="yarn",
    factor=4.0,
    original_max_position_embeddings=1024,
    beta_fast=32,
    beta_slow=1,
    mscale=1.0,
    mscale_all_dim=1.0,
)

_V32_INDEXER = dict(index_n_heads=4, index_head_dim=16, index_topk=64)

_GLM = dict(
    _COMMON,
    num_key_value_heads=2,
    head_dim=16,
    partial_rotary_factor=0.5,
    n_group=1,
    topk_group=1,
    max_position_embeddings=4096,
    rope_theta=1000000,
    rope_scaling=None,
    rms_norm_eps=1e-5,
    routed_scaling_factor=1.0,
    attention_bias=True,
    use_qk_norm=False,
    # ids of <|endoftext|>, <|user|>, <|observation|> in our tokenizer (see tokenizer.py)
    pad_token_id=1,
    eos_token_id=[1, 2, 5],
)

# Tensor-shape keys that must be positive integers.
_SIZE_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group",
)


def build_config(arch: str, **size_overrides: Any) -> dict:
    """Return a config.json dict for `arch` ("deepseek_v3", "deepseek_v32", "glm4_moe").

    Keyword overrides replace (or add) top-level keys, e.g. hidden_size=256;
    `rope_scaling` may be given as a dict to replace the YaRN defaults.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}: expected one of {', '.join(ARCHS)}")
    if arch == "glm4_moe":
        config = dict(_GLM)
    else:
        config = dict(_DEEPSEEK, rope_scaling=dict(_YARN))
        if arch == "deepseek_v32":
            config.update(_V32_INDEXER)
    config["architectures"] = [ARCHITECTURES[arch]]
    # V3.2 keeps model_type deepseek_v3; the indexer keys tell it apart.
    config["model_type"] = "glm4_moe" if arch == "glm4_moe" else "deepseek_v3"
    config.update(size_overrides)
    validate_sizes(config)
    return dict(sorted(config.items()))


def validate_sizes(config: dict) -> None:
    """Reject sizes that no loader could build a model from, naming the key."""
    for key in _SIZE_KEYS:
        value = config.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"config key {key!r} must be a positive integer, got {value!r}")
    if config["n_routed_experts"] % config["n_group"]:
        raise ValueError(
            f"n_routed_experts ({config['n_routed_experts']}) must be divisible by n_group ({config['n_group']})"
        )
    if config["topk_group"] > config["n_group"]:
        raise ValueError(f"topk_group ({config['topk_group']}) must be <= n_group ({config['n_group']})")
    if config["num_experts_per_tok"] > config["n_routed_experts"]:
        raise ValueError("num_experts_per_tok must be <= n_routed_experts")
    if config["num_attention_heads"] % config["num_key_value_heads"]:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    fkdr = config.get("first_k_dense_replace", 0)
    if not isinstance(fkdr, int) or not 0 <= fkdr <= config["num_hidden_layers"]:
        raise ValueError(f"first_k_dense_replace must be in 0..num_hidden_layers, got {fkdr!r}")
    nextn = config.get("num_nextn_predict_layers", 0)
    if not isinstance(nextn, int) or nextn < 0:
        raise ValueError(f"num_nextn_predict_layers must be a non-negative integer, got {nextn!r}")
