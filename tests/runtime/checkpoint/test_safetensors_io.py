import pytest
import torch
from safetensors import safe_open

from mtp_runtime.checkpoint.errors import CorruptFileError, MissingFileError
from mtp_runtime.checkpoint.safetensors_io import READ_STATS, ShardWriter, file_sha256, read_header, read_tensor

TENSORS = {
    "a": torch.randn(3, 5).to(torch.bfloat16),
    "b": torch.arange(7, dtype=torch.float32),
    "c": torch.randn(4, 4).to(torch.float8_e4m3fn),
    "empty": torch.empty(0, 3, dtype=torch.bfloat16),
}


def write(path):
    w = ShardWriter(path, {k: (v.dtype, tuple(v.shape)) for k, v in TENSORS.items()})
    for k, v in TENSORS.items():
        w.write(k, v)
    return w.close()


def test_written_shard_is_read_by_safetensors_and_by_us(tmp_path):
    path = tmp_path / "x.safetensors"
    digest = write(path)
    assert digest == file_sha256(path)
    with safe_open(path, "pt") as f:  # an outside reader
        for k, v in TENSORS.items():
            assert torch.equal(f.get_tensor(k).view(torch.uint8), v.view(torch.uint8))
    infos, meta = read_header(path)
    assert meta == {"format": "pt"}
    READ_STATS.reset()
    got = read_tensor(path, "b", infos["b"])
    assert torch.equal(got, TENSORS["b"])
    assert READ_STATS.bytes_read == 7 * 4


def test_writer_rejects_unplanned_order_and_shape(tmp_path):
    w = ShardWriter(tmp_path / "x.safetensors", {"a": (torch.float32, (2,)), "b": (torch.float32, (1,))})
    with pytest.raises(ValueError, match="'b' written out of the planned order"):
        w.write("b", torch.zeros(1))
    with pytest.raises(ValueError, match="tensor 'a' is torch.float32\\[3\\], planned"):
        w.write("a", torch.zeros(3))
    w.abort()


def test_truncated_shard_names_file(tmp_path):
    path = tmp_path / "model-00001-of-00001.safetensors"
    write(path)
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(CorruptFileError, match="model-00001-of-00001.safetensors: truncated shard"):
        read_header(path)
    path.write_bytes(data[:20])
    with pytest.raises(CorruptFileError, match="model-00001-of-00001.safetensors"):
        read_header(path)
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(CorruptFileError, match="not valid JSON"):
        read_header(path)
    with pytest.raises(MissingFileError, match="nope.safetensors: shard file not found"):
        read_header(tmp_path / "nope.safetensors")
