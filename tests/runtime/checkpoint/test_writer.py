import json

import pytest
import torch

from mtp_runtime.checkpoint import naming, writer
from mtp_runtime.checkpoint.configs import build_config
from mtp_runtime.checkpoint.errors import MissingTensorError, OutputExistsError
from mtp_runtime.checkpoint.index import CheckpointIndex
from mtp_runtime.checkpoint.random_init import RandomTensors
from mtp_runtime.checkpoint.safetensors_io import ShardWriter


@pytest.fixture
def tokenizer_dir(tmp_path):
    d = tmp_path / "tok"
    d.mkdir()
    (d / "tokenizer.json").write_text("{}")
    (d / "tokenizer_config.json").write_text("{}")
    return d


def test_layout_index_and_dtypes(tmp_path, tokenizer_dir):
    config = build_config("deepseek_v3")
    tensors = RandomTensors(config, seed=1)
    out = writer.write_checkpoint(tmp_path / "m", config, tensors, tokenizer_dir, shards=3)
    names = sorted(p.name for p in out.iterdir())
    assert names == ["config.json", "generation_config.json", "model-00001-of-00003.safetensors",
                     "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors",
                     "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(naming.expected_tensors(config))
    reader = CheckpointIndex(out)
    assert index["metadata"]["total_size"] == sum(reader.info(n).nbytes for n in reader.names())
    assert reader.info("model.layers.1.mlp.gate.e_score_correction_bias").dtype == "F32"
    assert reader.info("model.layers.1.mlp.gate.weight").dtype == "BF16"
    name = "model.layers.3.eh_proj.weight"
    assert torch.equal(reader.read(name), tensors[name].to(torch.bfloat16))
    assert torch.equal(reader.read("model.norm.weight"), torch.ones(config["hidden_size"], dtype=torch.bfloat16))
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    gen = json.loads((out / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (0, 1)


def test_fp8_adds_scales_and_quantization_config(tmp_path, tokenizer_dir):
    config = build_config("deepseek_v32")
    out = writer.write_checkpoint(tmp_path / "m", config, RandomTensors(config), tokenizer_dir, shards=2, fp8=True)
    reader = CheckpointIndex(out)
    q = "model.layers.3.self_attn.indexer.wq_b.weight"
    assert reader.info(q).dtype == "F8_E4M3"
    assert reader.info(naming.scale_name(q)).dtype == "F32"
    assert reader.weight_map[q] == reader.weight_map[naming.scale_name(q)]
    assert reader.info("model.layers.3.eh_proj.weight").dtype == "BF16"
    assert json.loads((out / "config.json").read_text())["quantization_config"]["weight_block_size"] == [128, 128]


def test_shards_are_balanced_and_contiguous():
    entries = {f"t{i}": (torch.float32, (10,)) for i in range(10)}
    groups = writer.split_into_shards(entries, 3)
    assert [len(g) for g in groups] == [4, 3, 3]
    assert [n for g in groups for n in g] == list(entries)
    assert len(writer.split_into_shards(entries, 50)) == 10
    with pytest.raises(ValueError, match="shards must be a positive integer"):
        writer.split_into_shards(entries, 0)


def test_wrong_tensors_are_named(tmp_path, tokenizer_dir):
    config = build_config("glm4_moe")
    tensors = dict(RandomTensors(config))
    del tensors["model.layers.3.eh_proj.weight"]
    with pytest.raises(MissingTensorError, match="model.layers.3.eh_proj.weight"):
        writer.write_checkpoint(tmp_path / "m", config, tensors, tokenizer_dir)
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="'model.layers.3.eh_proj.weight' has shape \\[3, 3\\]"):
        writer.write_checkpoint(tmp_path / "m", config, tensors, tokenizer_dir)
    assert not (tmp_path / "m").exists()


def test_failure_leaves_nothing_and_existing_output_is_kept(tmp_path, tokenizer_dir, monkeypatch):
    config = build_config("glm4_moe")
    out = tmp_path / "m"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    with pytest.raises(OutputExistsError, match="is not empty"):
        writer.write_checkpoint(out, config, RandomTensors(config), tokenizer_dir)

    def fail(self, name, tensor):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ShardWriter, "write", fail)
    with pytest.raises(OSError):
        writer.write_checkpoint(out, config, RandomTensors(config), tokenizer_dir, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "tok"]
    assert (out / "mine.txt").read_text() == "keep"
