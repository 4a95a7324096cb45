import json

import pytest
import torch

from mtp_runtime import cli
from mtp_runtime.checkpoint import naming
from mtp_runtime.checkpoint.fp8 import FP8_MAX
from mtp_runtime.checkpoint.index import CheckpointIndex
from mtp_runtime.checkpoint.random_init import RandomTensors

ARCHS = ("deepseek_v3", "deepseek_v32", "glm4_moe")


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    for arch in ARCHS:
        assert cli.main(["make-tiny", "--arch", arch, "--out", str(root / arch), "--shards", "3", "--seed", "7"]) == 0
    return root


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_loads_main_model_with_finite_logits(tiny_dirs, arch):
    transformers = pytest.importorskip("transformers")
    cls = {"deepseek_v3": transformers.DeepseekV3ForCausalLM, "deepseek_v32": transformers.DeepseekV32ForCausalLM,
           "glm4_moe": transformers.Glm4MoeForCausalLM}[arch]
    model, info = cls.from_pretrained(tiny_dirs / arch, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"]
    assert not info["mismatched_keys"]
    config = json.loads((tiny_dirs / arch / "config.json").read_text())
    mtp_prefix = f"model.layers.{config['num_hidden_layers']}."
    assert all(k.startswith(mtp_prefix) for k in info["unexpected_keys"])  # only the MTP layer is foreign to it
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_dirs / arch)
    ids = tokenizer("import os\nprint(os.getcwd())", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], config["vocab_size"])
    assert torch.isfinite(logits).all()


def test_layout_matches_published_names(tiny_dirs):
    for arch in ARCHS:
        d = tiny_dirs / arch
        index = CheckpointIndex(d)
        assert set(index.names()) == set(naming.expected_tensors(index.config))
        assert index.shard_files() == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
        assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= {p.name for p in d.iterdir()}


def test_fp8_weights_dequantise_to_the_bf16_values(tmp_path):
    out = tmp_path / "fp8"
    args = ["make-tiny", "--arch", "deepseek_v3", "--out", str(out), "--fp8", "--seed", "3", "--hidden-size", "160"]
    assert cli.main(args) == 0
    index = CheckpointIndex(out)
    assert index.config["quantization_config"]["fmt"] == "e4m3"
    reference = RandomTensors(index.config, seed=3)
    fp8_names = [n for n in index.names() if naming.is_fp8_linear(n)]
    assert len(fp8_names) > 50
    for name in fp8_names:
        assert index.info(name).dtype == "F8_E4M3"
        w = index.read(name).float()
        scale = index.read(naming.scale_name(name))
        deq = w * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
        ref = reference[name]
        tolerance = scale.max() * FP8_MAX * 2**-4
        assert (deq - ref).abs().max() <= tolerance, name
    assert index.info("model.layers.3.shared_head.head.weight").dtype == "BF16"


def test_cli_errors(tmp_path, capsys):
    assert cli.main(["make-tiny", "--arch", "glm4_moe", "--out", str(tmp_path / "a"), "--kv-lora-rank", "8"]) == 1
    assert "--kv-lora-rank does not apply to --arch glm4_moe" in capsys.readouterr().err
    assert cli.main(["make-tiny", "--arch", "glm4_moe", "--out", str(tmp_path / "a"), "--n-group", "3"]) == 1
    assert "n_group" in capsys.readouterr().err
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x").write_text("x")
    assert cli.main(["make-tiny", "--arch", "glm4_moe", "--out", str(tmp_path / "b")]) == 1
    assert "is not empty" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()


def test_same_seed_gives_identical_files(tiny_dirs, tmp_path):
    assert cli.main(["make-tiny", "--arch", "glm4_moe", "--out", str(tmp_path / "again"), "--shards", "3", "--seed", "7"]) == 0
    for path in (tiny_dirs / "glm4_moe").iterdir():
        assert (tmp_path / "again" / path.name).read_bytes() == path.read_bytes(), path.name
