"""Router telemetry streamed to disk in chunks, so a corpus of traces never sits in memory.

Per generated or teacher-forced token we keep: token id, position in its sequence, sequence
id, the router logits before top-k of every MoE layer ``[L, E]`` and the selected experts
``[L, k]``, and optionally the residual stream entering some decoder layers ``[R, D]``. The
writer buffers at most ``chunk_tokens`` tokens, then writes a numbered ``chunk_000000.npz``
and rewrites ``manifest.json`` (atomically, so a crashed run still leaves a readable
prefix). The reader loads one chunk at a time.

Layout of a directory::

    manifest.json       {"version", "num_layers", "num_experts", "top_k", "logits_dtype",
                         "chunk_tokens", "num_tokens", "complete", "chunks": [{file, num_tokens}],
                         "metadata": {...},
                         "residual_shape": [R, D] | null, "residual_dtype",   (optional)
                         "open_sequence": id | null}                          (optional)
    chunk_000000.npz    token_ids [n] int32, positions [n] int32, sequence_ids [n] int64,
                        router_logits [n, L, E] float16|float32, selected [n, L, k] int16|int32,
                        residuals [n, R, D] float16|float32 (only when recorded)

The optional keys and the ``residuals`` array were added without a version bump: a
directory written before them (or without residuals) reads as ``residuals=None``, and an
older reader ignores them. ``metadata["residual_layers"]`` names the decoder layer of each
R row (set by ``capture``).

Resuming (``TelemetryWriter(directory, resume=True)``): the chunks already on disk are kept
and the writer appends after them. A crash loses the buffer, so the last written chunk can
end in the head of a sequence whose tail was never written; the manifest names it
(``open_sequence``) and resuming cuts those tokens off, so every sequence on disk is whole
and :attr:`TelemetryWriter.resumed_sequence_ids` can be skipped by a re-run. This assumes
each sequence arrives in one ``append`` call or one ``append_batch`` row (what ``capture``
does).

Legend: ``T``/``n`` tokens, ``L`` MoE layers, ``E`` routed experts, ``k`` top-k, ``B`` batch,
``R`` recorded residual layers, ``D`` hidden size.
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
_UNKNOWN = object()  # a manifest from before "open_sequence" was recorded


@dataclasses.dataclass(frozen=True)
class TelemetryConfig:
    """Attributes:
    chunk_tokens: tokens per chunk file; also the writer's memory bound.
    logits_dtype: "float16" halves disk use (router logits are O(10), well inside range);
      "float32" keeps them exact.
    compress: zip-deflate the chunk files (smaller, slower).
    residual_dtype: storage of recorded residuals. "float16" halves the largest array (R x D
      per token); residual entries of real models stay well inside its range (+-65504), and
      the writer refuses a value that would overflow rather than store inf.
    """

    chunk_tokens: int = 65536
    logits_dtype: str = "float16"
    compress: bool = False
    residual_dtype: str = "float16"

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {self.chunk_tokens}")
        if self.logits_dtype not in LOGITS_DTYPES:
            raise ValueError(f"logits_dtype must be one of {LOGITS_DTYPES}, got {self.logits_dtype!r}")
        if self.residual_dtype not in LOGITS_DTYPES:
            raise ValueError(f"residual_dtype must be one of {LOGITS_DTYPES}, "
                             f"got {self.residual_dtype!r}")


class TelemetryChunk(NamedTuple):
    token_ids: np.ndarray  # [n]
    positions: np.ndarray  # [n]
    sequence_ids: np.ndarray  # [n]
    router_logits: np.ndarray  # [n, L, E]
    selected: np.ndarray  # [n, L, k]
    residuals: np.ndarray | None = None  # [n, R, D]; None when not recorded


_FIELDS = TelemetryChunk._fields
_REQUIRED = _FIELDS[:5]  # every chunk has these; "residuals" is optional


def _slice(record: TelemetryChunk, start: int, stop: int) -> TelemetryChunk:
    return TelemetryChunk(*(None if a is None else a[start:stop] for a in record))


def _concatenate(pieces: Sequence[TelemetryChunk]) -> TelemetryChunk:
    return TelemetryChunk(*(None if parts[0] is None else np.concatenate(parts)
                            for parts in zip(*pieces, strict=True)))


def _save_chunk(path: Path, chunk: TelemetryChunk, compress: bool) -> None:
    arrays = {name: a for name, a in chunk._asdict().items() if a is not None}
    (np.savez_compressed if compress else np.savez)(path, **arrays)


def _write_json_atomically(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


class TelemetryWriter:
    """Appends per-token router records and writes them out in fixed-size chunks.

    Use as a context manager (or call :meth:`close`) so the last partial chunk is written.
    Layer count, expert count and k, and whether residuals ``[R, D]`` are recorded, are fixed
    by the first append (or by the directory, when resuming).

    ``resume=True`` opens a directory that already holds telemetry (complete or crashed) and
    appends after its chunks; the settings must match the ones it was written with. Without
    it an existing directory is refused, so no run overwrites another by accident.
    """

    def __init__(
        self,
        directory: str | Path,
        chunk_tokens: int = 65536,
        logits_dtype: str = "float16",
        compress: bool = False,
        metadata: dict | None = None,
        *,
        residual_dtype: str = "float16",
        resume: bool = False,
    ) -> None:
        self.config = TelemetryConfig(chunk_tokens, logits_dtype, compress, residual_dtype)
        # Free-form JSON facts about the run (e.g. "moe_layers": decoder index of each L row);
        # written into the manifest with every chunk, so it may be filled in before the first.
        self.metadata: dict = dict(metadata or {})
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._buffer: list[TelemetryChunk] = []
        self._chunks: list[dict] = []
        self._shape: tuple[int, int, int] | None = None  # (L, E, k)
        self._residual_shape: tuple[int, int] | None = None  # (R, D)
        self._has_residuals: bool | None = None  # fixed by the first append
        self._open_sequence: int | None = None  # continues past the last written chunk
        self._closed = False
        # Sequence ids whose records were on disk when the writer opened (empty unless resumed).
        self.resumed_sequence_ids: frozenset[int] = frozenset()
        if (self.directory / MANIFEST).exists():
            if not resume:
                raise ValueError(f"{self.directory} already holds telemetry; use a fresh "
                                 f"directory (or resume=True to append to it)")
            self._resume()

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
            self._check_residuals(record.residuals, n),
        )

    def _check_residuals(self, residuals: np.ndarray | None, n: int) -> np.ndarray | None:
        has = residuals is not None
        if self._has_residuals is not None and has != self._has_residuals:
            raise ValueError("residuals must be given with every append or with none "
                             f"(this telemetry has {'them' if self._has_residuals else 'none'})")
        stored = None
        if has:
            if residuals.ndim != 3 or residuals.shape[0] != n:
                raise ValueError(f"residuals must be [T={n}, R, D], got {residuals.shape}")
            if self._residual_shape not in (None, residuals.shape[1:]):
                raise ValueError(f"(R, D) changed from {self._residual_shape} to "
                                 f"{residuals.shape[1:]}")
            stored = residuals.astype(self.config.residual_dtype)
            # A float16 overflow would silently store inf; refuse instead (use float32).
            if not np.isfinite(stored).all() and np.isfinite(residuals).all():
                raise ValueError(f"residuals overflow {self.config.residual_dtype}; "
                                 f"use residual_dtype='float32'")
            self._residual_shape = residuals.shape[1:]
        self._has_residuals = has
        return stored

    def append(
        self,
        token_ids_t: np.ndarray,
        positions_t: np.ndarray,
        sequence_ids_t: np.ndarray,
        router_logits_tle: np.ndarray,
        selected_tlk: np.ndarray,
        residuals_trd: np.ndarray | None = None,
    ) -> None:
        """Adds T token records; writes every chunk that fills up along the way.

        ``residuals_trd``: the recorded residual stream per token (all appends or none)."""
        record = self._check(
            TelemetryChunk(*(None if a is None else np.asarray(a) for a in (
                token_ids_t, positions_t, sequence_ids_t, router_logits_tle, selected_tlk,
                residuals_trd,
            )))
        )
        start, total = 0, len(record.token_ids)
        while start < total:
            room = self.config.chunk_tokens - self.buffered_tokens
            piece = _slice(record, start, start + room)
            self._buffer.append(piece)
            start += len(piece.token_ids)
            if self.buffered_tokens == self.config.chunk_tokens:
                # A sequence cut by this chunk boundary continues in the buffer: name it, so
                # a resume after a crash (buffer lost) can cut its head off.
                ids = record.sequence_ids
                split = start < total and ids[start] == ids[start - 1]
                self._flush(open_sequence=int(ids[start - 1]) if split else None)

    def append_batch(
        self,
        token_ids_bt: np.ndarray,
        router_logits_lbte: Sequence[np.ndarray] | np.ndarray,
        selected_lbtk: Sequence[np.ndarray] | np.ndarray,
        sequence_ids_b: np.ndarray,
        valid_bt: np.ndarray | None = None,
        positions_bt: np.ndarray | None = None,
        residuals_btrd: np.ndarray | None = None,
    ) -> None:
        """Adds a batch as the model returns it: per layer ``[B, T, E]`` logits and ``[B, T, k]``
        selections (and the ``[B, T, R, D]`` residuals, if recorded). Only ``valid_bt`` tokens
        (default: all) are kept, row by row."""
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
        residuals = None
        if residuals_btrd is not None:
            residuals_btrd = np.asarray(residuals_btrd)
            if residuals_btrd.shape[:2] != (batch, steps):
                raise ValueError(f"residuals_btrd must be [B={batch}, T={steps}, R, D], "
                                 f"got {residuals_btrd.shape}")
            residuals = residuals_btrd[valid]
        self.append(
            token_ids_bt[valid],
            positions[valid],
            np.broadcast_to(sequence_ids[:, None], (batch, steps))[valid],
            logits_btle[valid],
            selected_btlk[valid],
            residuals,
        )

    def _flush(self, open_sequence: int | None = None) -> None:
        if not self._buffer:
            return
        chunk = _concatenate(self._buffer)
        name = f"chunk_{len(self._chunks):06d}.npz"
        _save_chunk(self.directory / name, chunk, self.config.compress)
        self._chunks.append({"file": name, "num_tokens": int(len(chunk.token_ids))})
        self._buffer = []
        self._open_sequence = open_sequence
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
            "residual_shape": None if self._residual_shape is None else list(self._residual_shape),
            "residual_dtype": self.config.residual_dtype,
            "open_sequence": self._open_sequence,
        })

    def _resume(self) -> None:
        """Adopts the directory's chunks, cuts off a sequence left open by a crash, and
        collects the ids of the sequences on disk."""
        manifest = _read_manifest(self.directory)
        for key in ("chunk_tokens", "logits_dtype"):
            if manifest[key] != getattr(self.config, key):
                raise ValueError(f"{self.directory} was written with {key}={manifest[key]!r}, "
                                 f"resumed with {getattr(self.config, key)!r}")
        residual_shape = manifest.get("residual_shape")
        if residual_shape and manifest.get("residual_dtype") != self.config.residual_dtype:
            raise ValueError(f"{self.directory} was written with residual_dtype="
                             f"{manifest.get('residual_dtype')!r}, resumed with "
                             f"{self.config.residual_dtype!r}")
        self.metadata = {**manifest.get("metadata", {}), **self.metadata}
        self._chunks = list(manifest["chunks"])
        if manifest["num_layers"]:
            self._shape = (manifest["num_layers"], manifest["num_experts"], manifest["top_k"])
            self._residual_shape = tuple(residual_shape) if residual_shape else None
            self._has_residuals = bool(residual_shape)
        open_sequence = manifest.get("open_sequence", _UNKNOWN)
        if open_sequence is _UNKNOWN:  # older manifest: a crashed run's last sequence may be cut
            open_sequence = None if manifest["complete"] else self._last_sequence_id()
        referenced = self._cut_open_sequence(open_sequence)
        self._write_manifest(complete=False)
        for path in self.directory.glob("chunk_*.npz"):  # chunks cut off above, now unlisted
            if path.name not in referenced:
                path.unlink()
        ids: set[int] = set()
        for entry in self._chunks:
            with np.load(self.directory / entry["file"]) as data:  # reads this array only
                ids.update(np.unique(data["sequence_ids"]).tolist())
        self.resumed_sequence_ids = frozenset(ids)

    def _last_sequence_id(self) -> int | None:
        if not self._chunks:
            return None
        with np.load(self.directory / self._chunks[-1]["file"]) as data:
            ids = data["sequence_ids"]
            return int(ids[-1]) if len(ids) else None

    def _cut_open_sequence(self, open_sequence: int | None) -> set[str]:
        """Drops the tokens of ``open_sequence`` at the end of the written chunks (a sequence
        is contiguous, so they are a suffix, maybe spanning chunks); returns the files still
        listed. A shortened chunk gets a new file name, so the manifest written next never
        lists a file whose contents changed under it."""
        while open_sequence is not None and self._chunks:
            entry = self._chunks[-1]
            chunk = _load_chunk(self.directory / entry["file"], residuals=True)
            other = np.flatnonzero(chunk.sequence_ids != open_sequence)
            keep = int(other[-1]) + 1 if other.size else 0
            if keep == 0:
                self._chunks.pop()
                continue
            if keep < len(chunk.sequence_ids):
                name = f"chunk_{len(self._chunks) - 1:06d}_{keep}.npz"
                _save_chunk(self.directory / name, _slice(chunk, 0, keep), self.config.compress)
                self._chunks[-1] = {"file": name, "num_tokens": keep}
            break
        return {entry["file"] for entry in self._chunks}

    def close(self) -> None:
        if self._closed:
            return
        self._flush()
        self._open_sequence = None
        self._write_manifest(complete=True)
        self._closed = True

    def __enter__(self) -> TelemetryWriter:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _read_manifest(directory: Path) -> dict:
    manifest_path = directory / MANIFEST
    if not manifest_path.exists():
        raise FileNotFoundError(f"no {MANIFEST} in {directory}; not a telemetry directory")
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"{manifest_path}: format version {manifest.get('version')} "
            f"!= supported {FORMAT_VERSION}"
        )
    return manifest


def _load_chunk(path: Path, residuals: bool) -> TelemetryChunk:
    """One chunk file; ``residuals=False`` skips that array (an npz member loads only when
    asked for, so router-only readers never read the largest array)."""
    with np.load(path) as data:
        chunk = TelemetryChunk(*(data[name] for name in _REQUIRED))
        if residuals and "residuals" in data.files:
            chunk = chunk._replace(residuals=data["residuals"])
    return chunk


class TelemetryReader:
    """Lazily iterates the chunks of a telemetry directory, one in memory at a time."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.manifest = _read_manifest(self.directory)

    num_layers = property(lambda self: self.manifest["num_layers"])
    num_experts = property(lambda self: self.manifest["num_experts"])
    top_k = property(lambda self: self.manifest["top_k"])
    num_tokens = property(lambda self: self.manifest["num_tokens"])
    complete = property(lambda self: self.manifest["complete"])
    metadata = property(lambda self: self.manifest.get("metadata", {}))

    @property
    def residual_shape(self) -> tuple[int, int] | None:
        """(R, D) of the recorded residuals, or None (none recorded, or an older directory)."""
        shape = self.manifest.get("residual_shape")
        return tuple(shape) if shape else None

    @property
    def residual_layers(self) -> tuple[int, ...]:
        """Decoder-layer index of each residual row R (empty when none were recorded)."""
        return tuple(self.metadata.get("residual_layers", ())) if self.residual_shape else ()

    def __len__(self) -> int:
        return len(self.manifest["chunks"])

    def read_chunk(self, index: int, residuals: bool = True) -> TelemetryChunk:
        """Chunk ``index``; ``residuals=False`` leaves the residual array unread (None)."""
        entry = self.manifest["chunks"][index]
        chunk = _load_chunk(self.directory / entry["file"], residuals)
        if len(chunk.token_ids) != entry["num_tokens"]:
            raise ValueError(
                f"{entry['file']}: {len(chunk.token_ids)} tokens, manifest says {entry['num_tokens']}"
            )
        return chunk

    def iter_chunks(self, residuals: bool = True) -> Iterator[TelemetryChunk]:
        """Yields chunks in write order; the reader keeps no reference to earlier ones."""
        for index in range(len(self)):
            yield self.read_chunk(index, residuals)
