"""A cache of warm-started weights, keyed by everything the supervised pass reads.

A toy run spends about a third of its time on its warm start, and the runs of an ablation
sweep at one seed (``toy``, ``spade_self_generation:toy``, a planted fault...) all run the
same one: the same examples, model, initial weights and settings give the same weights.
``warm_start.cache_dir`` names a directory where the first such run leaves its result
and the others load it instead of training it again.

The key is a SHA-256 over the inputs of :func:`spade_jax.spade.warm_start.warm_start`: the
supervised sequences (token ids and loss masks, in order), the initial weights (names,
dtypes, shapes and bytes), the pass's settings (steps, batch size, learning rate, seed,
pad id, loss mean), the model config and the JAX version. A change to any of them is a
miss, never a stale hit. The key does not cover the pass's *code*: after editing
``spade/warm_start.py``, empty the cache (or bump :data:`FORMAT`).

An entry is one ``<key>.npz`` (each array as raw bytes under its tree-path name, plus a
JSON manifest of dtypes, shapes and the pass's first and last loss) written to a temporary
name and renamed, so a run killed mid-write leaves no half entry. A corrupt or mismatched
entry is reported and ignored (the pass runs again and rewrites it). Single-process runs
only: a multi-host run's weights are not all addressable from one process.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from spade_jax.checkpoint import check_names, named_leaves
from spade_jax.rl.batch import TrainSequence

log = logging.getLogger(__name__)

FORMAT = 1  # bump when the warm-start pass changes what it computes from the same inputs
_MANIFEST = "__manifest__"


@dataclasses.dataclass(frozen=True)
class CachedWarmStart:
    """A cache hit: the warm-started weights (host arrays by tree-path name) and the
    loss of the pass's first and last step when it was trained."""

    arrays: dict[str, np.ndarray]
    first_loss: float
    last_loss: float


def cache_key(sequences: Sequence[TrainSequence], params: Any, settings: Mapping[str, Any]
              ) -> str:
    """The entry name for warm-starting ``params`` on ``sequences`` with ``settings`` (a
    JSON-able mapping: the pass's arguments and the model config)."""
    digest = hashlib.sha256()
    header = {"format": FORMAT, "jax": jax.__version__, "settings": settings}
    digest.update(json.dumps(header, sort_keys=True, default=str).encode())
    for seq in sequences:
        digest.update(np.asarray(seq.token_ids, np.int64).tobytes())
        digest.update(b"|")
        digest.update(np.asarray(seq.loss_mask, np.int8).tobytes())
        digest.update(b";")
    for name, leaf in named_leaves(params).items():
        array = np.asarray(leaf)
        digest.update(f"{name}:{array.dtype}:{array.shape}".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def _entry(cache_dir: str | os.PathLike, key: str) -> Path:
    return Path(cache_dir) / f"{key}.npz"


def load(cache_dir: str | os.PathLike, key: str, like: Any) -> CachedWarmStart | None:
    """The entry ``key`` if it exists and holds exactly ``like``'s arrays (names, dtypes,
    shapes); None otherwise (a damaged entry is logged and left to be rewritten)."""
    path = _entry(cache_dir, key)
    if not path.exists():
        return None
    try:
        with np.load(path, allow_pickle=False) as data:
            manifest = json.loads(bytes(data[_MANIFEST]).decode())
            reference = named_leaves(like)
            check_names(manifest["arrays"], reference, "the cache entry's arrays")
            arrays = {}
            for name, ref in reference.items():
                dtype, shape = manifest["arrays"][name]
                if dtype != str(ref.dtype) or tuple(shape) != tuple(ref.shape):
                    raise ValueError(f"{name}: cached {dtype}{shape}, the run's "
                                     f"{ref.dtype}{tuple(ref.shape)}")
                arrays[name] = np.frombuffer(data[name].tobytes(),
                                             jnp.dtype(dtype)).reshape(shape)
            return CachedWarmStart(arrays, float(manifest["first_loss"]),
                                   float(manifest["last_loss"]))
    except Exception as err:  # a damaged entry costs a warm start, never the run
        log.warning("warm-start cache entry %s unusable (%s: %s); training the warm start",
                    path, type(err).__name__, err)
        return None


def save(cache_dir: str | os.PathLike, key: str, params: Any, losses: Sequence[float]) -> Path:
    """Writes ``params`` as the entry ``key`` (atomically: a temporary file renamed)."""
    path = _entry(cache_dir, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays, shapes = {}, {}
    for name, leaf in named_leaves(params).items():
        array = np.asarray(leaf)  # (ascontiguousarray would make a 0-d leaf 1-d)
        shapes[name] = (str(array.dtype), list(array.shape))
        arrays[name] = np.frombuffer(array.tobytes(), np.uint8)  # bfloat16 has no npz dtype
    manifest = {"arrays": shapes, "first_loss": float(losses[0]),
                "last_loss": float(losses[-1])}
    arrays[_MANIFEST] = np.frombuffer(json.dumps(manifest).encode(), np.uint8)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(buffer.getvalue())
    os.replace(tmp, path)
    return path


def restore_like(arrays: Mapping[str, np.ndarray], like: Any) -> Any:
    """``like``'s tree with ``arrays`` in it, each placed as ``like``'s leaf is (its
    sharding), so the run continues exactly as after a trained warm start."""
    leaves = [jax.device_put(arrays[name], getattr(ref, "sharding", None))
              for name, ref in named_leaves(like).items()]
    return jax.tree.unflatten(jax.tree.structure(like), leaves)
