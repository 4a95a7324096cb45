"""Published tensor names and shapes, one table per architecture.

Main decoder layers are `model.layers.0..L-1`; the MTP module(s) follow at
`model.layers.L..L+n-1` (L = num_hidden_layers, n = num_nextn_predict_layers)
with `enorm`, `hnorm`, `eh_proj`, a full decoder layer, `shared_head.norm`,
`shared_head.head` and their own `embed_tokens`.
"""

from __future__ import annotations

import re

Shape = tuple[int, ...]

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")

# Tensors kept in float32 in the published checkpoints.
_FLOAT32_SUFFIXES = ("e_score_correction_bias",)

# DeepSeek's FP8 checkpoints quantise the linear weights of attention and MLPs
# (experts included) and the V3.2 indexer's wq_b/wk; embeddings, heads, norms,
# the router gate, eh_proj and the indexer's weights_proj stay bf16.
_FP8_LINEAR_RE = re.compile(
    r"\.(self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|q_proj|k_proj|v_proj"
    r"|indexer\.wq_b|indexer\.wk)"
    r"|mlp\.(gate_proj|up_proj|down_proj)"
    r"|mlp\.shared_experts\.(gate_proj|up_proj|down_proj)"
    r"|mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj))\.weight$"
)

SCALE_SUFFIX = ".weight_scale_inv"


def detect_arch(config: dict) -> str:
    """"deepseek_v3", "deepseek_v32" or "glm4_moe" from a config.json dict."""
    model_type = config.get("model_type")
    if model_type in ("deepseek_v3", "deepseek_v32"):
        is_v32 = model_type == "deepseek_v32" or all(
            k in config for k in ("index_n_heads", "index_head_dim", "index_topk")
        )
        return "deepseek_v32" if is_v32 else "deepseek_v3"
    if model_type == "glm4_moe":
        return "glm4_moe"
    raise ValueError(
        f"config.json model_type {model_type!r} is not supported: expected deepseek_v3 (V3/R1/V3.2), "
        "deepseek_v32 or glm4_moe"
    )


def expected_tensors(config: dict) -> dict[str, Shape]:
    """Every tensor of the published checkpoint (main model + MTP layers), bf16 view, no FP8 scales."""
    arch = detect_arch(config)
    H, V = config["hidden_size"], config["vocab_size"]
    L = config["num_hidden_layers"]
    tensors: dict[str, Shape] = {"model.embed_tokens.weight": (V, H)}
    for i in range(L):
        tensors.update(decoder_layer_tensors(config, arch, f"model.layers.{i}.", is_moe_layer(config, i)))
    tensors["model.norm.weight"] = (H,)
    tensors["lm_head.weight"] = (V, H)
    for i in mtp_layer_indices(config):
        tensors.update(mtp_layer_tensors(config, arch, i))
    return tensors


def mtp_layer_tensors(config: dict, arch: str, layer: int) -> dict[str, Shape]:
    """The MTP module at `model.layers.{layer}.`: its extras plus a full decoder layer."""
    H, V = config["hidden_size"], config["vocab_size"]
    p = f"model.layers.{layer}."
    tensors: dict[str, Shape] = {
        p + "embed_tokens.weight": (V, H),
        p + "enorm.weight": (H,),
        p + "hnorm.weight": (H,),
        p + "eh_proj.weight": (H, 2 * H),
    }
    tensors.update(decoder_layer_tensors(config, arch, p, is_moe_layer(config, layer)))
    tensors[p + "shared_head.norm.weight"] = (H,)
    tensors[p + "shared_head.head.weight"] = (V, H)
    return tensors


def decoder_layer_tensors(config: dict, arch: str, prefix: str, moe: bool) -> dict[str, Shape]:
    H = config["hidden_size"]
    tensors = {prefix + "input_layernorm.weight": (H,)}
    attn = _glm_attention(config) if arch == "glm4_moe" else _mla_attention(config, arch == "deepseek_v32")
    tensors.update({prefix + "self_attn." + k: v for k, v in attn.items()})
    tensors[prefix + "post_attention_layernorm.weight"] = (H,)
    mlp = _moe_mlp(config) if moe else _dense_mlp(H, config["intermediate_size"])
    tensors.update({prefix + "mlp." + k: v for k, v in mlp.items()})
    return tensors


def _mla_attention(config: dict, with_indexer: bool) -> dict[str, Shape]:
    H, heads = config["hidden_size"], config["num_attention_heads"]
    q_rank, kv_rank = config["q_lora_rank"], config["kv_lora_rank"]
    nope, rope, v_dim = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    t = {
        "q_a_proj.weight": (q_rank, H),
        "q_a_layernorm.weight": (q_rank,),
        "q_b_proj.weight": (heads * (nope + rope), q_rank),
        "kv_a_proj_with_mqa.weight": (kv_rank + rope, H),
        "kv_a_layernorm.weight": (kv_rank,),
        "kv_b_proj.weight": (heads * (nope + v_dim), kv_rank),
        "o_proj.weight": (H, heads * v_dim),
    }
    if with_indexer:
        n, d = config["index_n_heads"], config["index_head_dim"]
        t.update({
            "indexer.wq_b.weight": (n * d, q_rank),
            "indexer.wk.weight": (d, H),
            "indexer.k_norm.weight": (d,),
            "indexer.k_norm.bias": (d,),
            "indexer.weights_proj.weight": (n, H),
        })
    return t


def _glm_attention(config: dict) -> dict[str, Shape]:
    H, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or H // heads
    t = {
        "q_proj.weight": (heads * d, H),
        "k_proj.weight": (kv * d, H),
        "v_proj.weight": (kv * d, H),
        "o_proj.weight": (H, heads * d),
    }
    if config.get("attention_bias"):
        t.update({"q_proj.bias": (heads * d,), "k_proj.bias": (kv * d,), "v_proj.bias": (kv * d,)})
    if config.get("use_qk_norm"):
        t.update({"q_norm.weight": (d,), "k_norm.weight": (d,)})
    return t


def _dense_mlp(H: int, inter: int) -> dict[str, Shape]:
    return {"gate_proj.weight": (inter, H), "up_proj.weight": (inter, H), "down_proj.weight": (H, inter)}


def _moe_mlp(config: dict) -> dict[str, Shape]:
    H, E, inter = config["hidden_size"], config["n_routed_experts"], config["moe_intermediate_size"]
    t = {"gate.weight": (E, H), "gate.e_score_correction_bias": (E,)}
    for e in range(E):
        t.update({f"experts.{e}.{k}": v for k, v in _dense_mlp(H, inter).items()})
    shared = config.get("n_shared_experts") or 0
    if shared:
        t.update({f"shared_experts.{k}": v for k, v in _dense_mlp(H, inter * shared).items()})
    return t


def is_moe_layer(config: dict, layer: int) -> bool:
    """Dense for the first `first_k_dense_replace` layers, MoE after (every `moe_layer_freq`-th)."""
    freq = config.get("moe_layer_freq", 1) or 1
    return layer >= config.get("first_k_dense_replace", 0) and layer % freq == 0


def mtp_layer_indices(config: dict) -> range:
    L = config["num_hidden_layers"]
    return range(L, L + (config.get("num_nextn_predict_layers") or 0))


def layer_index(name: str) -> int | None:
    """The decoder-layer number in `model.layers.N.*`, else None."""
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else None


def is_mtp_tensor(name: str, config: dict) -> bool:
    """True for tensors (weights and FP8 scales) of the MTP layer(s)."""
    i = layer_index(name)
    return i is not None and i in mtp_layer_indices(config)


def is_fp8_linear(name: str) -> bool:
    """True for weights that DeepSeek-style FP8 checkpoints store as e4m3 with block scales."""
    return bool(_FP8_LINEAR_RE.search(name))


def scale_name(weight_name: str) -> str:
    """`x.weight` -> `x.weight_scale_inv` (the per-128x128-block dequantisation factor)."""
    if not weight_name.endswith(".weight"):
        raise ValueError(f"{weight_name!r} is not a weight tensor name")
    return weight_name[: -len(".weight")] + SCALE_SUFFIX


def expected_dtype(name: str) -> str:
    """Storage dtype of an unquantised tensor in the published checkpoints: "float32" or "bfloat16"."""
    return "float32" if name.endswith(_FLOAT32_SUFFIXES) else "bfloat16"
