"""Reading a Hugging Face model directory through its index, one tensor at a time."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .errors import CorruptFileError, MissingFileError, MissingTensorError
from .safetensors_io import TensorInfo, read_header, read_tensor

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def load_json(path: Path, what: str) -> dict:
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise MissingFileError(f"{path}: {what} not found") from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise CorruptFileError(f"{path}: {what} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CorruptFileError(f"{path}: {what} must be a JSON object")
    return data


def load_config(model_dir: Path) -> dict:
    return load_json(Path(model_dir) / CONFIG_FILE, "config.json")


class CheckpointIndex:
    """config.json + tensor name -> shard map of a model directory; reads single tensors.

    Shard headers are parsed lazily and cached, so only shards that hold a
    requested tensor are ever opened.
    """

    def __init__(self, model_dir: Path | str):
        self.model_dir = Path(model_dir)
        if not self.model_dir.is_dir():
            raise MissingFileError(f"{self.model_dir}: model directory not found")
        self.config = load_config(self.model_dir)
        self._headers: dict[str, dict[str, TensorInfo]] = {}
        self.index_path, self.weight_map, self.metadata = self._load_weight_map()

    def _load_weight_map(self) -> tuple[Path, dict[str, str], dict]:
        index_path = self.model_dir / INDEX_FILE
        if index_path.exists():
            index = load_json(index_path, "safetensors index")
            weight_map = index.get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CorruptFileError(f"{index_path}: has no 'weight_map' of tensor name -> shard file")
            return index_path, weight_map, index.get("metadata") or {}
        single = self.model_dir / SINGLE_FILE
        if single.exists():
            return single, {name: SINGLE_FILE for name in self.shard_header(SINGLE_FILE)}, {}
        raise MissingFileError(
            f"{self.model_dir}: neither {INDEX_FILE} nor {SINGLE_FILE} found (is this a Hugging Face model directory?)"
        )

    def names(self) -> list[str]:
        return list(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def shard_path(self, name: str) -> Path:
        try:
            return self.model_dir / self.weight_map[name]
        except KeyError:
            raise MissingTensorError(f"{self.model_dir}: tensor {name!r} is not in the checkpoint") from None

    def shard_header(self, shard: str) -> dict[str, TensorInfo]:
        if shard not in self._headers:
            self._headers[shard] = read_header(self.model_dir / shard)[0]
        return self._headers[shard]

    def info(self, name: str) -> TensorInfo:
        """Dtype, shape and byte range of one tensor (reads only its shard's header)."""
        path = self.shard_path(name)
        header = self.shard_header(self.weight_map[name])
        if name not in header:
            raise CorruptFileError(f"{path}: index lists tensor {name!r} in this shard but the shard lacks it")
        return header[name]

    def read(self, name: str, rows: slice | None = None) -> torch.Tensor:
        """Read one tensor (or only `rows` of its first dimension) without loading the rest of the shard."""
        return read_tensor(self.shard_path(name), name, self.info(name), rows)

    def shard_files(self) -> list[str]:
        return sorted(set(self.weight_map.values()))
