import json

import pytest
import torch
from safetensors.torch import save_file

from mtp_runtime.checkpoint.errors import CorruptFileError, MissingFileError, MissingTensorError
from mtp_runtime.checkpoint.index import CheckpointIndex
from mtp_runtime.checkpoint.safetensors_io import READ_STATS


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    save_file({"x": torch.ones(2, 2), "y": torch.zeros(3)}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"z": torch.arange(4.0)}, tmp_path / "model-00002-of-00002.safetensors")
    weight_map = {"x": "model-00001-of-00002.safetensors", "y": "model-00001-of-00002.safetensors",
                  "z": "model-00002-of-00002.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 44}, "weight_map": weight_map}))
    return tmp_path


def test_reads_one_tensor_opening_only_its_shard(model_dir):
    index = CheckpointIndex(model_dir)
    assert index.config["model_type"] == "deepseek_v3"
    READ_STATS.reset()
    assert torch.equal(index.read("z"), torch.arange(4.0))
    assert [p.rsplit("/", 1)[-1] for p in READ_STATS.files_opened] == ["model-00002-of-00002.safetensors"]
    assert index.info("x").shape == (2, 2)
    assert index.shard_files() == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def test_single_file_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    save_file({"w": torch.ones(3)}, tmp_path / "model.safetensors")
    assert torch.equal(CheckpointIndex(tmp_path).read("w"), torch.ones(3))


def test_errors_name_the_file_or_tensor(model_dir):
    with pytest.raises(MissingTensorError, match="tensor 'nope' is not in the checkpoint"):
        CheckpointIndex(model_dir).read("nope")
    (model_dir / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(MissingFileError, match="model-00002-of-00002.safetensors: shard file not found"):
        CheckpointIndex(model_dir).read("z")
    (model_dir / "model.safetensors.index.json").write_text("{")
    with pytest.raises(CorruptFileError, match="model.safetensors.index.json: safetensors index is not valid JSON"):
        CheckpointIndex(model_dir)
    (model_dir / "model.safetensors.index.json").unlink()
    with pytest.raises(MissingFileError, match="neither model.safetensors.index.json nor model.safetensors"):
        CheckpointIndex(model_dir)
    (model_dir / "config.json").unlink()
    with pytest.raises(MissingFileError, match="config.json: config.json not found"):
        CheckpointIndex(model_dir)


def test_row_range_reads_only_those_rows(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    w = torch.arange(60, dtype=torch.float32).reshape(10, 6)
    save_file({"w": w}, tmp_path / "model.safetensors")
    index = CheckpointIndex(tmp_path)
    READ_STATS.reset()
    assert torch.equal(index.read("w", rows=slice(2, 5)), w[2:5])
    assert READ_STATS.bytes_read == 3 * 6 * 4
    assert torch.equal(index.read("w", rows=slice(8, None)), w[8:])
    assert index.read("w", rows=slice(5, 5)).shape == (0, 6)
