"""Minimal, validating safetensors reader/writer over numpy memory maps.

Why not the ``safetensors`` package directly: we need bfloat16 as numpy (ml_dtypes), lazy
per-tensor reads from many shards, and errors that name the corrupt file and tensor.
Files may be local (read through a memory map) or remote (``gs://...`` through
``etils.epath``: the header, then each tensor's byte range, is read on demand).
The format: 8-byte little-endian header length, a JSON header mapping each tensor name to
{dtype, shape, data_offsets: [begin, end]} relative to the end of the header, then bytes.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator

import ml_dtypes
import numpy as np

from spade_jax import storage

_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


class CheckpointError(ValueError):
    """A checkpoint file or tensor that cannot be used; the message names it."""


class SafetensorsFile:
    """Lazy view of one .safetensors file; tensors are read on demand."""

    def __init__(self, path: storage.PathLike):
        self.path = storage.as_path(path)
        self.remote = storage.is_remote(self.path)
        self._handle = None  # remote only: kept open, so the client's read-ahead is reused
        try:
            size = self.path.stat().length
            with self.path.open("rb") as f:
                raw_len = f.read(8)
                if len(raw_len) < 8:
                    raise CheckpointError(f"{self.path}: truncated (no header length)")
                (header_len,) = struct.unpack("<Q", raw_len)
                if header_len > min(_MAX_HEADER, size - 8):
                    raise CheckpointError(f"{self.path}: corrupt header length {header_len}")
                header = json.loads(f.read(header_len))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{self.path}: unreadable safetensors header ({e})") from e
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: header is not a JSON object")
        self.metadata = header.pop("__metadata__", {}) or {}
        self._data_start = 8 + header_len
        self._entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            try:
                dtype = _DTYPES[info["dtype"]]
                shape = tuple(int(s) for s in info["shape"])
                begin, end = (int(o) for o in info["data_offsets"])
            except (KeyError, TypeError, ValueError) as e:
                raise CheckpointError(f"{self.path}: bad header entry for tensor {name!r}") from e
            expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if end - begin != expected or begin < 0 or self._data_start + end > size:
                raise CheckpointError(
                    f"{self.path}: tensor {name!r} data is truncated or corrupt "
                    f"(offsets {begin}..{end}, {expected} bytes expected, file {size} bytes)"
                )
            self._entries[name] = (dtype, shape, begin, end)

    def keys(self) -> list[str]:
        return list(self._entries)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the client may be gone already
            pass

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][1]

    def get(self, name: str) -> np.ndarray:
        dtype, shape, begin, end = self._entries[name]
        if end == begin:
            return np.zeros(shape, dtype)
        if self.remote:  # a ranged read of this tensor's bytes, on one handle per file
            if self._handle is None:
                self._handle = self.path.open("rb")
            self._handle.seek(self._data_start + begin)
            data = self._handle.read(end - begin)
            if len(data) != end - begin:
                raise CheckpointError(f"{self.path}: tensor {name!r} is truncated")
            return np.frombuffer(data, dtype=dtype).reshape(shape).copy()
        mm = np.memmap(self.path, dtype=np.uint8, mode="r", offset=self._data_start + begin,
                       shape=(end - begin,))
        return np.array(mm.view(dtype).reshape(shape))  # copy: detach from the file


class TensorIndex:
    """All tensors of a checkpoint directory (one or many shards), by name."""

    def __init__(self, directory: storage.PathLike):
        self.directory = storage.as_path(directory)
        if not self.directory.is_dir():
            raise CheckpointError(f"checkpoint directory {self.directory} does not exist")
        files = sorted((p for p in self.directory.iterdir() if p.name.endswith(".safetensors")),
                       key=lambda p: p.name)
        if not files:
            raise CheckpointError(f"no *.safetensors files in {self.directory}")
        index_path = self.directory / "model.safetensors.index.json"
        if index_path.exists():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index_path}: corrupt index ({e})") from e
            missing = sorted({f for f in weight_map.values() if not (self.directory / f).exists()})
            if missing:
                raise CheckpointError(f"{index_path} names shard files that are missing: {missing}")
        self._files = {f.name: SafetensorsFile(f) for f in files}
        self._where: dict[str, str] = {}
        for fname, sf in self._files.items():
            for key in sf.keys():
                self._where[key] = fname

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> set[str]:
        return set(self._where)

    def file_of(self, name: str) -> str:
        return self._where[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._files[self._where[name]].shape(name)

    def get(self, name: str) -> np.ndarray:
        if name not in self._where:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {self.directory}")
        return self._files[self._where[name]].get(name)


def write_safetensors(path: storage.PathLike, tensors: Iterable[tuple[str, np.ndarray]],
                      metadata: dict[str, str] | None = None) -> None:
    """Writes tensors (streamed once for the header, once for the bytes) to ``path``, local
    (through a temporary file and a rename) or remote (one upload)."""
    tensors = list(tensors)
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, arr in tensors:
        if arr.dtype not in _NAMES:
            raise CheckpointError(f"tensor {name!r}: dtype {arr.dtype} cannot be written")
        header[name] = {"dtype": _NAMES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data section 8-byte aligned
    path = storage.as_path(path)
    remote = storage.is_remote(path)
    tmp = path if remote else path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, arr in tensors:
            f.write(np.ascontiguousarray(arr).tobytes())
    if not remote:
        tmp.replace(path)


def shard_tensors(
    tensors: Iterator[tuple[str, np.ndarray]], max_shard_bytes: int
) -> Iterator[list[tuple[str, np.ndarray]]]:
    """Groups a tensor stream into shards of at most ``max_shard_bytes`` (one tensor min)."""
    shard, size = [], 0
    for name, arr in tensors:
        if shard and size + arr.nbytes > max_shard_bytes:
            yield shard
            shard, size = [], 0
        shard.append((name, arr))
        size += arr.nbytes
    if shard:
        yield shard
