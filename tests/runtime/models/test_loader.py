"""Checkpoint loading: bad checkpoints fail naming the tensor; dtype and FP8 handling."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from mtp_runtime.config import ConfigError
from mtp_runtime.models.loader import LoadError, checkpoint_tensors, load_draft, load_model


def test_missing_tensor_is_named(tmp_path, tiny_writer):
    path = tiny_writer(tmp_path / "m", "glm4_moe", drop=("model.layers.2.mlp.experts.5.up_proj.weight",))
    with pytest.raises(LoadError, match=r"model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight"):
        load_model(path)


def test_unexpected_tensor_is_named(tmp_path, tiny_writer):
    path = tiny_writer(tmp_path / "m", "deepseek_v3")
    shard = sorted(path.glob("model-*.safetensors"))[0]
    tensors = load_file(shard)
    tensors["model.layers.0.self_attn.surprise.weight"] = torch.zeros(2, 2)
    save_file(tensors, shard, metadata={"format": "pt"})
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.self_attn.surprise.weight"] = shard.name
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(LoadError, match="unexpected tensor model.layers.0.self_attn.surprise.weight"):
        load_model(path)


def test_shape_mismatch_is_named(tmp_path, tiny_writer):
    path = tiny_writer(tmp_path / "m", "deepseek_v3")
    config = json.loads((path / "config.json").read_text())
    config["kv_lora_rank"] = 16
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(LoadError, match=r"tensor model\.layers\.\d\.self_attn\.\w+\.weight: checkpoint shape"):
        load_model(path)


def test_fp8_weight_without_scale_is_an_error(tmp_path, tiny_writer):
    path = tiny_writer(tmp_path / "m", "deepseek_v3", fp8=True,
                       drop=("model.layers.1.self_attn.o_proj.weight_scale_inv",))
    with pytest.raises(LoadError, match="model.layers.1.self_attn.o_proj.weight has no"):
        load_model(path)


def test_bfloat16_working_dtype_keeps_router_in_float32(tiny_dirs):
    model = load_model(tiny_dirs["deepseek_v32"], dtype="bfloat16")
    assert model.model.layers[0].self_attn.kv_b_proj.weight.dtype == torch.bfloat16
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32
    assert model.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    ids = torch.arange(3, 23)
    with torch.no_grad():
        low = model.compute_logits(model.forward_batched(ids[None]))
        full = load_model(tiny_dirs["deepseek_v32"]).compute_logits(
            load_model(tiny_dirs["deepseek_v32"]).forward_batched(ids[None]))
    assert low.dtype == torch.float32 and torch.isfinite(low).all()
    assert (low.argmax(-1) == full.argmax(-1)).float().mean() > 0.8
    with pytest.raises(LoadError, match="float16"):
        load_model(tiny_dirs["glm4_moe"], dtype="float16")


def test_draft_directory_is_not_a_main_model(tmp_path, tiny_dirs):
    config = json.loads((tiny_dirs["glm4_moe"] / "config.json").read_text())
    config["model_type"] = "glm4_moe_mtp"
    bad = tmp_path / "draft"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(config))
    for f in tiny_dirs["glm4_moe"].glob("model*"):
        (bad / f.name).write_bytes(f.read_bytes())
    with pytest.raises(LoadError, match="draft"):
        load_model(bad)


def test_checkpoint_tensors_round_trip(tiny_dirs):
    """Parameters written back under checkpoint names equal what was read (trained models are saved so)."""
    from mtp_runtime.checkpoint.index import CheckpointIndex

    model = load_model(tiny_dirs["glm4_moe"])
    draft = load_draft(tiny_dirs["glm4_moe"], model)
    tensors = checkpoint_tensors(model, draft)
    index = CheckpointIndex(tiny_dirs["glm4_moe"])
    assert set(tensors) == set(index.names())
    for name in ("model.layers.2.mlp.experts.3.up_proj.weight", "model.layers.3.eh_proj.weight",
                 "model.layers.3.self_attn.q_proj.bias", "model.layers.3.shared_head.head.weight"):
        assert torch.equal(tensors[name], index.read(name).float())


def test_bad_config_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="model_type 'llama' is not supported"):
        load_model(tmp_path)


def test_missing_draft_tensor_is_named_by_checkpoint_name(tmp_path, tiny_writer):
    path = tiny_writer(tmp_path / "m", "deepseek_v3", drop=("model.layers.3.self_attn.kv_b_proj.weight",))
    model = load_model(path)  # the main model does not need the MTP layer
    with pytest.raises(LoadError, match=r"lacks tensor\(s\) the model needs: model\.layers\.3\.self_attn\.kv_b_proj"):
        load_draft(path, model)
