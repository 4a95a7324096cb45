"""hack/llama_cpp_gguf.py: the checkpoint -> GGUF tensor names and the MLA kv_b split (no llama.cpp needed)."""

import importlib.util
from pathlib import Path

import numpy as np

SCRIPT = Path(__file__).resolve().parents[2] / "hack" / "llama_cpp_gguf.py"


def load():
    spec = importlib.util.spec_from_file_location("llama_cpp_gguf", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_names_of_main_mtp_and_expert_tensors():
    conv = load()
    name = lambda hf: conv.gguf_name(hf, 8)  # noqa: E731
    assert name("model.embed_tokens.weight") == "token_embd.weight"
    assert name("lm_head.weight") == "output.weight"
    assert name("model.layers.0.self_attn.q_a_proj.weight") == "blk.0.attn_q_a.weight"
    assert name("model.layers.3.mlp.gate.e_score_correction_bias") == "blk.3.exp_probs_b.bias"
    assert name("model.layers.3.mlp.experts.5.down_proj.weight") == ("blk.3.ffn_down_exps.weight", 5)
    assert name("model.layers.3.self_attn.kv_b_proj.weight") == "kv_b"
    # the MTP layer: its own tensors under nextn.*, its transformer block named like any other
    assert name("model.layers.8.eh_proj.weight") == "blk.8.nextn.eh_proj.weight"
    assert name("model.layers.8.shared_head.head.weight") == "blk.8.nextn.shared_head_head.weight"
    assert name("model.layers.8.mlp.shared_experts.up_proj.weight") == "blk.8.ffn_up_shexp.weight"
    # a main layer has no eh_proj, and unknown names are reported, not guessed
    assert name("model.layers.2.eh_proj.weight") is None
    assert name("model.layers.2.self_attn.rotary_emb.inv_freq") is None


def test_kv_b_split_matches_the_per_head_product():
    conv = load()
    heads, nope, v, lora = 3, 4, 5, 6
    kv_b = np.random.default_rng(0).standard_normal((heads * (nope + v), lora)).astype(np.float32)
    k_b, v_b = conv.split_kv_b(kv_b, heads, nope, v)
    assert k_b.shape == (heads, lora, nope) and v_b.shape == (heads, v, lora)
    latent = np.random.default_rng(1).standard_normal(lora).astype(np.float32)
    full = (kv_b @ latent).reshape(heads, nope + v)
    np.testing.assert_allclose(np.einsum("hln,l->hn", k_b, latent), full[:, :nope], rtol=1e-5)
    np.testing.assert_allclose(v_b @ latent, full[:, nope:], rtol=1e-5)
