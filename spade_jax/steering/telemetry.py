"""Router telemetry streamed to disk in chunks, so a corpus of traces never sits in memory.

Per generated or teacher-forced token we keep: token id, position in its sequence, sequence
id, the router logits before top-k of every MoE layer ``[L, E]`` and the selected experts
``[L, k]``. The writer buffers at most ``chunk_tokens`` tokens, then writes a numbered
``chunk_000000.npz`` and rewrites ``manifest.json`` (atomically, so a crashed run still
leaves a readable prefix). The reader loads one chunk at a time.

Layout of a directory::

    manifest.json       {"version", "num_layers", "num_experts", "top_k", "logits_dtype",
                         "chunk_tokens", "num_tokens", "complete", "chunks": [{file, num_tokens}],
                         "metadata": {...}}
    chunk_000000.npz    token_ids [n] int32, positions [n] int32, sequence_ids [n] int64,
                        router_logits [n, L, E] float16|float32, selected [n, L, k] int16|int32

Legend: ``T``/``n`` tokens, ``L`` MoE layers, ``E`` routed experts, ``k`` top-k, ``B`` batch.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
LOGITS_DTYPES = ("float16", "float32")


@dataclasses.dataclass(frozen=True)
class TelemetryConfig:
    """Attributes:
    chunk_tokens: tokens per chunk file; also the writer's memory bound.
    logits_dtype: "float16" halves disk use (router logits are O(10), well inside range);
      "float32" keeps them exact.
    compress: zip-deflate the chunk files (smaller, slower).
    """

    chunk_tokens: int = 65536
    logits_dtype: str = "float16"
    compress: bool = False

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {self.chunk_tokens}")
        if self.logits_dtype not in LOGITS_DTYPES:
            raise ValueError(f"logits_dtype must be one of {LOGITS_DTYPES}, got {self.logits_dtype!r}")


class TelemetryChunk(NamedTuple):
    token_ids: np.ndarray  # [n]
    positions: np.ndarray  # [n]
    sequence_ids: np.ndarray  # [n]
    router_logits: np.ndarray  # [n, L, E]
    selected: np.ndarray  # [n, L, k]


_FIELDS = TelemetryChunk._fields


def _write_json_atomically(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


class TelemetryWriter:
    """Appends per-token router records and writes them out in fixed-size chunks.

    Use as a context manager (or call :meth:`close`) so the last partial chunk is written.
    Layer count, expert count and k are fixed by the first append.
    """

    def __init__(
        self,
        directory: str | Path,
        chunk_tokens: int = 65536,
        logits_dtype: str = "float16",
        compress: bool = False,
        metadata: dict | None = None,
    ) -> None:
        self.config = TelemetryConfig(chunk_tokens, logits_dtype, compress)
        # Free-form JSON facts about the run (e.g. "moe_layers": decoder index of each L row);
        # written into the manifest with every chunk, so it may be filled in before the first.
        self.metadata: dict = dict(metadata or {})
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        if (self.directory / MANIFEST).exists():
            raise ValueError(f"{self.directory} already holds telemetry; use a fresh directory")
        self._buffer: list[TelemetryChunk] = []
        self._chunks: list[dict] = []
        self._shape: tuple[int, int, int] | None = None  # (L, E, k)
        self._closed = False

    @property
    def buffered_tokens(self) -> int:
        return sum(len(piece.token_ids) for piece in self._buffer)

    @property
    def num_tokens_written(self) -> int:
        return sum(c["num_tokens"] for c in self._chunks)

    def _check(self, record: TelemetryChunk) -> TelemetryChunk:
        if self._closed:
            raise ValueError("writer is closed")
        n = len(record.token_ids)
        for name, array in zip(_FIELDS[:3], record[:3], strict=True):
            if array.shape != (n,):
                raise ValueError(f"{name} must be [T={n}], got {array.shape}")
        logits, selected = record.router_logits, record.selected
        if logits.ndim != 3 or selected.ndim != 3 or logits.shape[:2] != selected.shape[:2]:
            raise ValueError(
                f"router_logits must be [T, L, E] and selected [T, L, k] with matching T, L; "
                f"got {logits.shape} and {selected.shape}"
            )
        if logits.shape[0] != n:
            raise ValueError(f"router_logits has {logits.shape[0]} tokens, token_ids has {n}")
        shape = (logits.shape[1], logits.shape[2], selected.shape[2])
        if self._shape is None:
            self._shape = shape
        elif shape != self._shape:
            raise ValueError(f"(L, E, k) changed from {self._shape} to {shape}")
        if selected.size and (selected.min() < 0 or selected.max() >= shape[1]):
            raise ValueError(f"selected expert ids must be in [0, {shape[1]})")
        selected_dtype = np.int16 if shape[1] <= np.iinfo(np.int16).max else np.int32
        return TelemetryChunk(
            record.token_ids.astype(np.int32),
            record.positions.astype(np.int32),
            record.sequence_ids.astype(np.int64),
            logits.astype(self.config.logits_dtype),
            selected.astype(selected_dtype),
        )

    def append(
        self,
        token_ids_t: np.ndarray,
        positions_t: np.ndarray,
        sequence_ids_t: np.ndarray,
        router_logits_tle: np.ndarray,
        selected_tlk: np.ndarray,
    ) -> None:
        """Adds T token records; writes every chunk that fills up along the way."""
        record = self._check(
            TelemetryChunk(*(np.asarray(a) for a in (
                token_ids_t, positions_t, sequence_ids_t, router_logits_tle, selected_tlk
            )))
        )
        start, total = 0, len(record.token_ids)
        while start < total:
            room = self.config.chunk_tokens - self.buffered_tokens
            piece = TelemetryChunk(*(a[start : start + room] for a in record))
            self._buffer.append(piece)
            start += len(piece.token_ids)
            if self.buffered_tokens == self.config.chunk_tokens:
                self._flush()

    def append_batch(
        self,
        token_ids_bt: np.ndarray,
        router_logits_lbte: Sequence[np.ndarray] | np.ndarray,
        selected_lbtk: Sequence[np.ndarray] | np.ndarray,
        sequence_ids_b: np.ndarray,
        valid_bt: np.ndarray | None = None,
        positions_bt: np.ndarray | None = None,
    ) -> None:
        """Adds a batch as the model returns it: per layer ``[B, T, E]`` logits and ``[B, T, k]``
        selections. Only ``valid_bt`` tokens (default: all) are kept, row by row."""
        token_ids_bt = np.asarray(token_ids_bt)
        batch, steps = token_ids_bt.shape
        logits_btle = np.stack([np.asarray(x) for x in router_logits_lbte], axis=2)
        selected_btlk = np.stack([np.asarray(x) for x in selected_lbtk], axis=2)
        if logits_btle.shape[:2] != (batch, steps) or selected_btlk.shape[:2] != (batch, steps):
            raise ValueError(
                f"per-layer arrays must be [B={batch}, T={steps}, ...], got "
                f"{logits_btle.shape[:2]} and {selected_btlk.shape[:2]}"
            )
        valid = np.ones((batch, steps), bool) if valid_bt is None else np.asarray(valid_bt, bool)
        positions = np.broadcast_to(np.arange(steps), (batch, steps)) if positions_bt is None \
            else np.asarray(positions_bt)
        sequence_ids = np.asarray(sequence_ids_b)
        if valid.shape != (batch, steps) or positions.shape != (batch, steps):
            raise ValueError("valid_bt and positions_bt must be [B, T]")
        if sequence_ids.shape != (batch,):
            raise ValueError(f"sequence_ids_b must be [B={batch}], got {sequence_ids.shape}")
        self.append(
            token_ids_bt[valid],
            positions[valid],
            np.broadcast_to(sequence_ids[:, None], (batch, steps))[valid],
            logits_btle[valid],
            selected_btlk[valid],
        )

    def _flush(self) -> None:
        if not self._buffer:
            return
        chunk = TelemetryChunk(*(np.concatenate(parts) for parts in zip(*self._buffer, strict=True)))
        name = f"chunk_{len(self._chunks):06d}.npz"
        save = np.savez_compressed if self.config.compress else np.savez
        save(self.directory / name, **chunk._asdict())
        self._chunks.append({"file": name, "num_tokens": int(len(chunk.token_ids))})
        self._buffer = []
        self._write_manifest(complete=False)

    def _write_manifest(self, complete: bool) -> None:
        num_layers, num_experts, top_k = self._shape or (0, 0, 0)
        _write_json_atomically(self.directory / MANIFEST, {
            "version": FORMAT_VERSION,
            "num_layers": num_layers,
            "num_experts": num_experts,
            "top_k": top_k,
            "logits_dtype": self.config.logits_dtype,
            "chunk_tokens": self.config.chunk_tokens,
            "num_tokens": self.num_tokens_written,
            "complete": complete,
            "chunks": self._chunks,
            "metadata": self.metadata,
        })

    def close(self) -> None:
        if self._closed:
            return
        self._flush()
        self._write_manifest(complete=True)
        self._closed = True

    def __enter__(self) -> TelemetryWriter:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class TelemetryReader:
    """Lazily iterates the chunks of a telemetry directory, one in memory at a time."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        manifest_path = self.directory / MANIFEST
        if not manifest_path.exists():
            raise FileNotFoundError(f"no {MANIFEST} in {self.directory}; not a telemetry directory")
        self.manifest = json.loads(manifest_path.read_text())
        if self.manifest.get("version") != FORMAT_VERSION:
            raise ValueError(
                f"{manifest_path}: format version {self.manifest.get('version')} "
                f"!= supported {FORMAT_VERSION}"
            )

    num_layers = property(lambda self: self.manifest["num_layers"])
    num_experts = property(lambda self: self.manifest["num_experts"])
    top_k = property(lambda self: self.manifest["top_k"])
    num_tokens = property(lambda self: self.manifest["num_tokens"])
    complete = property(lambda self: self.manifest["complete"])
    metadata = property(lambda self: self.manifest.get("metadata", {}))

    def __len__(self) -> int:
        return len(self.manifest["chunks"])

    def read_chunk(self, index: int) -> TelemetryChunk:
        entry = self.manifest["chunks"][index]
        with np.load(self.directory / entry["file"]) as data:
            chunk = TelemetryChunk(*(data[name] for name in _FIELDS))
        if len(chunk.token_ids) != entry["num_tokens"]:
            raise ValueError(
                f"{entry['file']}: {len(chunk.token_ids)} tokens, manifest says {entry['num_tokens']}"
            )
        return chunk

    def iter_chunks(self) -> Iterator[TelemetryChunk]:
        """Yields chunks in write order; the reader keeps no reference to earlier ones."""
        for index in range(len(self)):
            yield self.read_chunk(index)
