"""ModelConfig from config.json: architecture detection and validation errors that name the field."""

from __future__ import annotations

import json

import pytest

from mtp_runtime.checkpoint.configs import build_config
from mtp_runtime.config import ConfigError, ModelConfig


def test_v32_detected_by_indexer_fields_under_deepseek_v3_model_type():
    raw = build_config("deepseek_v32")
    assert raw["model_type"] == "deepseek_v3"
    config = ModelConfig.from_dict(raw)
    assert config.arch == "deepseek_v32" and config.index_topk == raw["index_topk"]
    assert ModelConfig.from_dict(build_config("deepseek_v3")).arch == "deepseek_v3"
    draft = ModelConfig.from_dict(dict(raw, model_type="deepseek_v32_mtp"))
    assert draft.is_mtp and draft.model_type == "deepseek_v32_mtp"


def test_rope_and_glm_defaults():
    ds = ModelConfig.from_dict(build_config("deepseek_v3"))
    assert ds.rope_scaling["factor"] == 4.0 and ds.rotary_dim == ds.qk_rope_head_dim
    # YaRN with mscale_all_dim sharpens the softmax beyond 1/sqrt(d)
    assert ds.softmax_scale > ds.qk_head_dim**-0.5
    glm = ModelConfig.from_dict(build_config("glm4_moe"))
    assert glm.rope_scaling is None and glm.rotary_dim == glm.head_dim // 2
    new_style = dict(build_config("glm4_moe"), rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    new_style.pop("rope_theta")
    assert ModelConfig.from_dict(new_style).rope_theta == 5e5


@pytest.mark.parametrize("change, message", [
    ({"model_type": "llama"}, "model_type 'llama' is not supported"),
    ({"hidden_size": 0}, "'hidden_size' must be a positive integer"),
    ({"n_group": 3}, "must be divisible by n_group"),
    ({"topk_group": 9}, "topk_group"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"kv_lora_rank": None}, "'kv_lora_rank' must be a positive integer"),
    ({"quantization_config": {"quant_method": "awq"}}, "quant_method"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope type 'dynamic'"),
    ({"scoring_func": "softmax"}, "scoring_func 'softmax' is not supported"),
])
def test_invalid_fields_are_named(change, message):
    raw = dict(build_config("deepseek_v3"), **change)
    raw = {k: v for k, v in raw.items() if v is not None}
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(raw)


def test_from_dir_names_the_file(tmp_path):
    with pytest.raises(ConfigError, match="config.json: not found"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(dict(build_config("glm4_moe"), num_key_value_heads=3)))
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        ModelConfig.from_dir(tmp_path)
