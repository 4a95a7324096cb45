"""Byte-exact safetensors reading and streaming writing.

Reading uses the header plus one positioned read per tensor (os.pread), so a
caller gets one tensor without touching the rest of a shard, and every byte
requested from disk is counted in `READ_STATS`. Writing lays out the header
first and then streams tensors one at a time, hashing each in a thread while
the next is read and written, so memory stays at two tensors however large
the shard.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import CorruptFileError, MissingFileError, MissingTensorError

DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

_MAX_HEADER = 100 * 1024 * 1024


@dataclass
class ReadStats:
    """Bytes requested from checkpoint files and which files were opened (this process)."""

    bytes_read: int = 0
    opens: list[str] = field(default_factory=list)  # one entry per open, in order

    @property
    def files_opened(self) -> set[str]:
        return set(self.opens)

    def reset(self) -> None:
        self.bytes_read = 0
        self.opens = []


READ_STATS = ReadStats()


@dataclass(frozen=True)
class TensorInfo:
    dtype: str  # safetensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]
    start: int  # absolute file offset of the first data byte
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate a shard's header: (tensor name -> TensorInfo, __metadata__)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            READ_STATS.opens.append(str(path))
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CorruptFileError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", prefix)
            if n > min(_MAX_HEADER, size - 8):
                raise CorruptFileError(f"{path}: corrupt or truncated safetensors header (claims {n} bytes)")
            raw = f.read(n)
    except FileNotFoundError:
        raise MissingFileError(f"{path}: shard file not found") from None
    READ_STATS.bytes_read += 8 + len(raw)
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise CorruptFileError(f"{path}: safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CorruptFileError(f"{path}: safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    base = 8 + n
    infos: dict[str, TensorInfo] = {}
    data_end = 0
    for name, entry in header.items():
        infos[name] = _tensor_info(path, name, entry, base)
        data_end = max(data_end, infos[name].end)
    if data_end > size:
        raise CorruptFileError(
            f"{path}: truncated shard: tensors need {data_end} bytes, file has {size} (re-download this file)"
        )
    return infos, metadata


def _tensor_info(path: Path, name: str, entry: object, base: int) -> TensorInfo:
    try:
        dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        torch_dtype = DTYPES[dtype]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (*shape, begin, end)):
            raise ValueError("shape and data_offsets must be integers")
    except (TypeError, KeyError, ValueError):
        raise CorruptFileError(f"{path}: bad header entry for tensor {name!r}: {entry!r}") from None
    numel = 1
    for d in shape:
        numel *= d
    if end - begin != numel * torch_dtype.itemsize or begin < 0 or min(shape, default=0) < 0:
        raise CorruptFileError(f"{path}: tensor {name!r} offsets {begin}..{end} do not match {dtype}{list(shape)}")
    return TensorInfo(dtype, shape, base + begin, base + end)


def read_tensor(path: Path, name: str, info: TensorInfo, rows: slice | None = None) -> torch.Tensor:
    """Read exactly one tensor's bytes from `path`; `rows` reads only a dim-0 range (e.g. a TP shard)."""
    torch_dtype = DTYPES[info.dtype]
    shape, start, nbytes = info.shape, info.start, info.nbytes
    if rows is not None:
        if not shape or rows.step not in (None, 1):
            raise ValueError(f"{name}: row ranges need a tensor with dimensions and a step of 1")
        lo, hi, _ = rows.indices(shape[0])
        hi = max(lo, hi)
        row_bytes = nbytes // shape[0] if shape[0] else 0
        shape, start, nbytes = (hi - lo, *shape[1:]), start + lo * row_bytes, (hi - lo) * row_bytes
    if nbytes == 0:
        return torch.empty(shape, dtype=torch_dtype)
    buf = bytearray(nbytes)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise MissingFileError(f"{path}: shard file not found (needed for tensor {name!r})") from None
    try:
        READ_STATS.opens.append(str(path))
        view, got = memoryview(buf), 0
        while got < nbytes:
            n = os.preadv(fd, [view[got:]], start + got)
            if n == 0:
                raise CorruptFileError(f"{path}: truncated shard: tensor {name!r} ends past end of file")
            got += n
    finally:
        os.close(fd)
    READ_STATS.bytes_read += nbytes
    return torch.frombuffer(buf, dtype=torch_dtype).reshape(shape)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a tensor (no copy when already contiguous)."""
    flat = t.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


class ShardWriter:
    """Write one safetensors file whose tensor list is known up front, one tensor at a time.

    plan: ordered {name: (torch dtype, shape)}. Call `write(name, tensor)` for every
    planned name in order, then `close()`; `sha256` is the hex digest of the file.
    """

    def __init__(self, path: Path, plan: dict[str, tuple[torch.dtype, tuple[int, ...]]], metadata=None):
        self.path = Path(path)
        self._plan = list(plan.items())
        self._next = 0
        header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
        offset = 0
        for name, (dtype, shape) in self._plan:
            numel = 1
            for d in shape:
                numel *= d
            nbytes = numel * dtype.itemsize
            header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
        self.data_bytes = offset
        self._hash = hashlib.sha256()
        # One worker hashes in write order; hashlib releases the GIL on large buffers.
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-sha256")
        self._hashing: Future | None = None
        self._file = open(self.path, "wb")
        self._emit(struct.pack("<Q", len(raw)) + raw)

    def _emit(self, data) -> None:
        self._file.write(data)
        if self._hashing is not None:
            self._hashing.result()  # at most one tensor is hashed behind the writes
        self._hashing = self._hasher.submit(self._hash.update, data)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._plan) or self._plan[self._next][0] != name:
            raise ValueError(f"{self.path.name}: tensor {name!r} written out of the planned order")
        dtype, shape = self._plan[self._next][1]
        if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
            raise ValueError(
                f"{self.path.name}: tensor {name!r} is {tensor.dtype}{list(tensor.shape)}, planned {dtype}{list(shape)}"
            )
        self._emit(tensor_bytes(tensor))
        self._next += 1

    def close(self) -> str:
        if self._next != len(self._plan):
            missing = self._plan[self._next][0]
            self.abort()
            raise MissingTensorError(f"{self.path.name}: tensor {missing!r} was planned but never written")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._hasher.shutdown(wait=True)
        if self._hashing is not None:
            self._hashing.result()
        self.sha256 = self._hash.hexdigest()
        return self.sha256

    def abort(self) -> None:
        self._file.close()
        self._hasher.shutdown(wait=True, cancel_futures=True)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 * 1024 * 1024):
            h.update(chunk)
    return h.hexdigest()
