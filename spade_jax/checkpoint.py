"""Checkpoints: Orbax, asynchronous, atomic, keep-N, validated on restore, preemption-safe.

A checkpoint of step ``s`` is the directory ``<directory>/<s>/`` holding two Orbax items:

  state      the array pytree (params, optimizer state, ...), saved with
             ``StandardSave`` so each host writes its own shards, restored into the
             shardings of an abstract target tree. A training state is stored flat, its
             arrays named by their tree path (:func:`named_arrays`:
             ``params/layers/3/attn/q_dnh``, ``opt_state/1/0/mu/...``), so a restore into
             a different model names the arrays that differ (:class:`CheckpointMismatchError`).
  run_state  a JSON dict of everything Python-side that a bitwise-identical resume needs:
             data / corpus sampler state, environment memory, the round.

Orbax writes into a temporary directory and renames it when complete, so a crash never
leaves a half-written directory under a step name. On top of that, once Orbax has
finalised a save, process 0 writes ``spade_manifest.json`` into the step directory: the
size (and, by default, SHA-256) of every file. :meth:`CheckpointManager.restore_latest`
walks the steps newest first and accepts the first whose manifest matches the files and
which Orbax can restore; any newer step that fails is moved aside to
``<directory>/corrupt_step_<s>_<time>`` with a logged warning naming the reason and the
step used instead, so the run resumes from the previous checkpoint and can save that
step number again.

Best checkpoint: with ``CheckpointConfig.best_metric`` set, a save may carry a ``score``
(the run's held-out evaluation). Besides the newest ``keep`` steps, the step with the best
score is kept however old it gets (Orbax's ``LatestN`` + ``BestN`` preservation policies;
the score is stored in the step directory, so the choice survives restarts), and
:meth:`CheckpointManager.best_step` names it. :meth:`CheckpointManager.is_new_best` tells
the loop when an evaluated state beats every kept one, so it can save that state even off
the regular ``save_every_steps`` grid.

``directory`` may be local or remote (``gs://...``): Orbax writes through ``etils.epath``
and TensorStore, the manifest through ``etils.epath``.

Preemption: TPU VMs get SIGTERM shortly before they are taken away.
:class:`~spade_jax.preemption.PreemptionGuard` (re-exported here) turns SIGTERM into a flag
that :meth:`CheckpointManager.should_save` honours at the next step boundary; the loop then
saves, waits and exits (``spade_jax.preemption`` also stops a step in progress at its next
safe point, for steps longer than the notice)::

    guard = PreemptionGuard.install()
    ckpt = CheckpointManager(CheckpointConfig(directory=run_dir / "checkpoints"),
                             guard=guard, config_hash=config_hash)
    restored = ckpt.restore_latest(abstract_state)      # None on a fresh run
    for step in range(start_step, total_steps):
        state, metrics = train_step(state, batch)
        if ckpt.should_save(step + 1):
            ckpt.save(step + 1, state, run_state())
        if ckpt.preempted:            # latched by should_save: saved, now stop
            break
    ckpt.close()                                        # waits for the last save
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from spade_jax import storage
from spade_jax.preemption import PreemptionGuard

log = logging.getLogger(__name__)

MANIFEST_NAME = "spade_manifest.json"
_STATE_ITEM = "state"
_RUN_STATE_ITEM = "run_state"
_HASH_CHUNK_BYTES = 1 << 22


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Settings of :class:`CheckpointManager`.

    Attributes:
      directory: where step directories live (local path or ``gs://...``).
      save_every_steps: save when ``step % save_every_steps == 0`` (and on preemption).
      keep: how many newest checkpoints to keep; at least 2, so that a corrupt newest one
        always has a predecessor to fall back to.
      async_save: write in a background thread while training continues.
      checksum: record and verify SHA-256 of every file; False records sizes only (cheaper
        for very large checkpoints on remote storage; still catches truncation).
      best_metric: name of the score that ranks checkpoints (e.g. "eval/mean/pass@1"); the
        best-scoring step is kept besides the newest ``keep``. None: keep the newest only.
      best_mode: "max" (higher is better) or "min".
    """

    directory: str | epath.PathLike
    save_every_steps: int = 100
    keep: int = 3
    async_save: bool = True
    checksum: bool = True
    best_metric: str | None = None
    best_mode: str = "max"

    def __post_init__(self) -> None:
        if self.save_every_steps < 1:
            raise ValueError(f"save_every_steps must be >= 1, got {self.save_every_steps}")
        if self.keep < 2:
            raise ValueError(f"keep must be >= 2 so a corrupt checkpoint has a fallback, got {self.keep}")
        if self.best_mode not in ("max", "min"):
            raise ValueError(f"best_mode must be 'max' or 'min', got {self.best_mode!r}")


class RestoredCheckpoint(NamedTuple):
    step: int
    state: Any
    run_state: dict[str, Any]


# ----------------------------------------------------------------------------------------
# Arrays by name: a state pytree as {"params/layers/0/attn/q_dnh": array, ...}
# ----------------------------------------------------------------------------------------


class CheckpointMismatchError(ValueError):
    """A checkpoint whose array names are not the ones of the state it is restored into
    (a changed model, optimizer or format); names the missing and unexpected arrays."""


def _key_part(entry: Any) -> str:
    if isinstance(entry, jax.tree_util.DictKey):
        return str(entry.key)
    if isinstance(entry, jax.tree_util.SequenceKey):
        return str(entry.idx)
    if isinstance(entry, jax.tree_util.GetAttrKey):
        return entry.name
    if isinstance(entry, jax.tree_util.FlattenedIndexKey):
        return str(entry.key)
    raise TypeError(f"cannot name the pytree key {entry!r}")


def _path_names(tree: Any) -> list[str]:
    return ["/".join(map(_key_part, path))
            for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def leaf_name(path: tuple[Any, ...]) -> str:
    """A leaf's tree path as a name: ``params/layers/0/attn/q_dnh`` for
    ``.params['layers'][0]['attn']['q_dnh'].value`` (an ``nnx.Variable``'s ``.value`` is
    the variable itself, so it is dropped)."""
    parts = [_key_part(entry) for entry in path]
    if len(parts) > 1 and isinstance(path[-1], jax.tree_util.GetAttrKey) and parts[-1] == "value":
        parts.pop()
    return "/".join(parts)


def named_leaves(tree: Any) -> dict[str, Any]:
    """Every leaf of ``tree`` under its :func:`leaf_name`, in pytree order."""
    named: dict[str, Any] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = leaf_name(path)
        if name in named:
            raise ValueError(f"two leaves of the state are both named {name!r}")
        named[name] = leaf
    return named


def named_arrays(state: Any) -> dict[str, jax.Array]:
    """``state`` as the flat dict a checkpoint stores: arrays keyed by their tree path, so a
    checkpoint says what each array is and a changed model fails by name, not by position.
    Typed PRNG keys are stored as their raw key data."""
    return {name: jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x
            for name, x in named_leaves(state).items()}


def state_from_named(named: Mapping[str, Any], like: Any) -> Any:
    """Inverse of :func:`named_arrays`: ``like``'s tree with the arrays of ``named``; raises
    :class:`CheckpointMismatchError` when the names differ."""
    reference = named_leaves(like)
    check_names(named, reference, "the checkpoint's arrays")
    leaves = []
    for name, ref in reference.items():
        value = named[name]
        if jnp.issubdtype(ref.dtype, jax.dtypes.prng_key):
            value = jax.random.wrap_key_data(value)
        leaves.append(value)
    return jax.tree.unflatten(jax.tree.structure(like), leaves)


def check_names(saved: Any, expected: Any, what: str, limit: int = 8) -> None:
    """Raises :class:`CheckpointMismatchError` unless ``saved`` and ``expected`` (iterables
    of names) hold the same names; the message lists up to ``limit`` of each difference."""
    saved, expected = set(saved), set(expected)
    if saved == expected:
        return

    def listed(names: set[str]) -> str:
        shown = sorted(names)[:limit]
        more = f" and {len(names) - limit} more" if len(names) > limit else ""
        return ", ".join(shown) + more

    problems = []
    if expected - saved:
        problems.append(f"missing (the state has them, the checkpoint does not): "
                        f"{listed(expected - saved)}")
    if saved - expected:
        problems.append(f"unexpected (in the checkpoint only): {listed(saved - expected)}")
    if saved and all(name.isdigit() for name in saved):
        problems.append("the checkpoint keys its arrays by leaf position (\"00000\", ...), a "
                        "format from before arrays were named; it cannot be resumed by name")
    raise CheckpointMismatchError(
        f"{what} do not match the state they are restored into (a changed model, optimizer "
        f"or checkpoint format?): {'; '.join(problems)}")


# ----------------------------------------------------------------------------------------
# Preemption
# ----------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------
# Manifest: written after Orbax finalises a step, checked before restoring it
# ----------------------------------------------------------------------------------------


def _file_sha256(path: epath.Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _step_files(step_dir: epath.Path) -> list[epath.Path]:
    """Every file under ``step_dir`` except the manifest (explicit walk: epath's recursive
    glob is refused on GCS)."""
    files, pending = [], [step_dir]
    while pending:
        for path in pending.pop().iterdir():
            if path.is_dir():
                pending.append(path)
            elif path.name != MANIFEST_NAME and not path.name.startswith(f".{MANIFEST_NAME}"):
                files.append(path)
    return sorted(files)


def write_manifest(
    step_dir: epath.PathLike, step: int, checksum: bool, config_hash: str | None
) -> None:
    """Records every file of a finalised step; written last and atomically (locally tmp +
    rename; an object-store object only appears once complete)."""
    step_dir = epath.Path(step_dir)
    files = {}
    for path in _step_files(step_dir):
        entry: dict[str, Any] = {"size": path.stat().length}
        if checksum:
            entry["sha256"] = _file_sha256(path)
        files[str(path.relative_to(step_dir))] = entry
    manifest = {"step": step, "config_hash": config_hash, "written_at": time.time(), "files": files}
    storage.write_bytes_atomic(step_dir / MANIFEST_NAME, json.dumps(manifest, indent=1).encode())


def _has_checksums(step_dir: epath.Path) -> bool:
    manifest = json.loads((step_dir / MANIFEST_NAME).read_text())
    return all("sha256" in entry for entry in manifest["files"].values())


def manifest_problem(step_dir: epath.PathLike, step: int) -> str | None:
    """Why ``step_dir`` is not a complete, intact checkpoint; None when it is."""
    step_dir = epath.Path(step_dir)
    manifest_path = step_dir / MANIFEST_NAME
    if not manifest_path.exists():
        return f"no {MANIFEST_NAME} (the save never finished)"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        return f"{MANIFEST_NAME} is not valid JSON ({err})"
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return f"{MANIFEST_NAME} lacks its file list"
    if manifest.get("step") != step:
        return f"{MANIFEST_NAME} is for step {manifest.get('step')}, not {step}"
    for name, entry in manifest["files"].items():
        path = step_dir / name
        if not path.exists():
            return f"file {name} is missing"
        size = path.stat().length
        if size != entry["size"]:
            return f"file {name} has {size} bytes, expected {entry['size']}"
        if "sha256" in entry and _file_sha256(path) != entry["sha256"]:
            return f"file {name} does not match its SHA-256"
    return None


# ----------------------------------------------------------------------------------------
# The manager
# ----------------------------------------------------------------------------------------


def _orbax_options(cfg: CheckpointConfig) -> ocp.CheckpointManagerOptions:
    """Keep the newest ``cfg.keep`` steps, and with ``best_metric`` the best-scoring one."""
    common = dict(enable_async_checkpointing=cfg.async_save, cleanup_tmp_directories=True,
                  create=True)
    if cfg.best_metric is None:
        return ocp.CheckpointManagerOptions(max_to_keep=cfg.keep, **common)
    policies = ocp.checkpoint_managers
    rank = functools.partial(_metric_or_worst, cfg.best_metric, cfg.best_mode)
    keep = policies.AnyPreservationPolicy([
        policies.LatestN(n=cfg.keep),
        policies.BestN(get_metric_fn=rank, reverse=cfg.best_mode == "min", n=1,
                       keep_checkpoints_without_metrics=False),
    ])
    # best_fn switches on Orbax's writing of per-step metrics; retention is `keep` alone.
    return ocp.CheckpointManagerOptions(preservation_policy=keep, best_fn=rank,
                                        best_mode=cfg.best_mode, **common)


def _metric_or_worst(name: str, mode: str, metrics: Mapping[str, Any] | None) -> float:
    """A step's score for ranking; a step saved without one ranks below every scored one."""
    value = (metrics or {}).get(name)
    if value is None or not np.isfinite(value):
        return -np.inf if mode == "max" else np.inf
    return float(value)


class CheckpointManager:
    """Saves ``(step, state pytree, run_state dict)`` and restores the newest valid one."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        *,
        guard: PreemptionGuard | None = None,
        config_hash: str | None = None,
    ) -> None:
        self.cfg = cfg
        self.directory = epath.Path(cfg.directory)
        self.guard = guard
        self.config_hash = config_hash
        self._manager = ocp.CheckpointManager(
            self.directory, options=_orbax_options(cfg),
            item_names=(_STATE_ITEM, _RUN_STATE_ITEM),
        )
        self._manifest_lock = threading.Lock()
        self._manifest_thread: threading.Thread | None = None
        self._manifest_error: BaseException | None = None
        self._pending_manifest_steps: list[int] = []
        self._best = self._best_on_disk()
        self.preempted = False

    # -- best checkpoint ------------------------------------------------------------------

    def score(self, metrics: Mapping[str, Any]) -> float | None:
        """``metrics[best_metric]`` as a float when present and finite, else None (no
        ranking configured, or not evaluated this step)."""
        name = self.cfg.best_metric
        if name is None or name not in metrics:
            return None
        value = float(metrics[name])
        return value if np.isfinite(value) else None

    def is_new_best(self, score: float | None) -> bool:
        """True when ``score`` beats every saved step's (always for the first score)."""
        if score is None or self.cfg.best_metric is None:
            return False
        return self._best is None or self.is_better(score, self._best[1])

    def best_step(self) -> int | None:
        """The kept step with the best score; None when no saved step has one."""
        return None if self._best is None else self._best[0]

    def _best_on_disk(self) -> tuple[int, float] | None:
        if self.cfg.best_metric is None:
            return None
        best = None
        for step in self._manager.all_steps():
            score = self.score(self._manager.metrics(step) or {})
            if score is not None and (best is None or self.is_better(score, best[1])):
                best = (step, score)
        return best

    def is_better(self, score: float, than: float) -> bool:
        return score > than if self.cfg.best_mode == "max" else score < than

    # -- saving -------------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        """True on every ``save_every_steps``-th step and once a preemption was requested.

        The preemption flag is read here once per step and latched in :attr:`preempted`, so
        a loop that saves when this is True and stops when ``preempted`` is True cannot see
        a signal that arrives between the two checks and stop without saving."""
        if not self.preempted and self.guard is not None and self.guard.requested():
            self.preempted = True
        return self.preempted or step % self.cfg.save_every_steps == 0

    def save(self, step: int, state: Any, run_state: Mapping[str, Any],
             score: float | None = None) -> None:
        """Starts saving; returns once the arrays are copied off the devices (async).
        ``score``: this state's ``best_metric`` value, when it was evaluated."""
        self._raise_manifest_error()
        run_state = dict(run_state)
        try:
            json.dumps(run_state)
        except TypeError as err:
            raise TypeError(f"run_state must be JSON-serialisable: {err}") from err
        if step in self._manager.all_steps():
            raise ValueError(f"a checkpoint for step {step} already exists in {self.directory}")
        self._manager.save(
            step,
            args=ocp.args.Composite(
                **{
                    _STATE_ITEM: ocp.args.StandardSave(state),
                    _RUN_STATE_ITEM: ocp.args.JsonSave(run_state),
                }
            ),
            # Every step gets a (possibly empty) metrics dict when ranking is on: Orbax
            # warns about a missing one, and _metric_or_worst ranks {} last.
            metrics=None if self.cfg.best_metric is None else (
                {} if score is None else {self.cfg.best_metric: float(score)}),
            force=True,
        )
        if self.is_new_best(score):
            self._best = (step, float(score))
        with self._manifest_lock:
            self._pending_manifest_steps.append(step)
        if jax.process_count() == 1 and self.cfg.async_save:
            # Record the manifest as soon as Orbax finalises, not at the next save, so a
            # SIGKILL between saves does not cost the newest checkpoint.
            previous = self._manifest_thread
            self._manifest_thread = threading.Thread(
                target=self._finalise_in_background, args=(previous,), daemon=True
            )
            self._manifest_thread.start()
        if not self.cfg.async_save:
            self.wait()

    def _finalise_in_background(self, previous: threading.Thread | None) -> None:
        if previous is not None:
            previous.join()
        try:
            self._finalise_pending()
        except BaseException as err:  # re-raised in the main thread by wait()/save()
            self._manifest_error = err

    def _finalise_pending(self) -> None:
        self._manager.wait_until_finished()
        with self._manifest_lock:  # only the hand-over; hashing runs unlocked
            steps, self._pending_manifest_steps = self._pending_manifest_steps, []
        if jax.process_index() != 0:
            return
        existing = set(self._manager.all_steps())
        for step in steps:
            if step in existing:
                write_manifest(
                    self.directory / str(step), step, self.cfg.checksum, self.config_hash
                )

    def _raise_manifest_error(self) -> None:
        if self._manifest_error is not None:
            err, self._manifest_error = self._manifest_error, None
            raise RuntimeError("writing a checkpoint failed") from err

    def wait(self) -> None:
        """Blocks until every started save is finalised and has its manifest."""
        if self._manifest_thread is not None:
            self._manifest_thread.join()
            self._manifest_thread = None
        self._raise_manifest_error()
        self._finalise_pending()

    def close(self) -> None:
        self.wait()
        self._manager.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- restoring ----------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def restore(self, step: int, abstract_state: Any = None) -> RestoredCheckpoint:
        """Restores one step. ``abstract_state`` is a pytree of ``jax.ShapeDtypeStruct``
        (with ``sharding=`` for sharded arrays, e.g. from ``jax.eval_shape`` plus the
        target shardings); None restores the arrays as they were saved. A target whose
        leaf names differ from the saved arrays' raises :class:`CheckpointMismatchError`
        naming the missing and unexpected ones."""
        if abstract_state is not None:
            self._check_saved_names(step, abstract_state)
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                **{
                    _STATE_ITEM: ocp.args.StandardRestore(abstract_state),
                    _RUN_STATE_ITEM: ocp.args.JsonRestore(),
                }
            ),
        )
        return RestoredCheckpoint(step, restored[_STATE_ITEM], dict(restored[_RUN_STATE_ITEM]))

    def restore_latest(self, abstract_state: Any = None) -> RestoredCheckpoint | None:
        """The newest checkpoint that is complete and intact, or None if there is none.

        Newer steps that fail validation are moved aside and a warning says why and which
        step is used instead. A checkpoint whose files all match their SHA-256 but which
        does not restore into ``abstract_state`` is not corrupt: the target is wrong (a
        changed model or optimizer), so that raises instead of falling back."""
        self.wait()
        rejected: list[tuple[int, str]] = []
        restore_errors: list[Exception] = []
        restored: RestoredCheckpoint | None = None
        for step in reversed(self.all_steps()):
            step_dir = self.directory / str(step)
            problem = manifest_problem(step_dir, step)
            if problem is None:
                try:
                    restored = self.restore(step, abstract_state)
                    break
                except CheckpointMismatchError:  # the target is wrong, not the checkpoint
                    raise
                except Exception as err:
                    if _has_checksums(step_dir):
                        raise RuntimeError(
                            f"checkpoint step {step} in {self.directory} is intact (every file "
                            "matches its SHA-256) but does not restore into the given target: "
                            "does the state's structure or shapes differ from the saved run?"
                        ) from err
                    restore_errors.append(err)
                    problem = f"restoring failed: {type(err).__name__}: {err}"
            rejected.append((step, problem))
        if restored is None and restore_errors:
            raise RuntimeError(
                f"no checkpoint in {self.directory} could be restored; the newest error is "
                "chained below"
            ) from restore_errors[0]
        for step, problem in rejected:
            fallback = "no older checkpoint" if restored is None else f"step {restored.step}"
            log.warning(
                "checkpoint step %d in %s is incomplete or corrupt: %s; using %s instead",
                step, self.directory, problem, fallback,
            )
            self._move_aside(step)
        if rejected:
            self._manager.reload()
            self._best = self._best_on_disk()
        if restored is not None:
            self._check_config_hash(restored.step)
            log.info("restored checkpoint step %d from %s", restored.step, self.directory)
        return restored

    def _check_saved_names(self, step: int, abstract_state: Any) -> None:
        """Compares the saved arrays' names (from the step's metadata) with the target's."""
        handler = ocp.StandardCheckpointHandler()
        try:
            saved = handler.metadata(self.directory / str(step) / _STATE_ITEM)
        except Exception:  # unreadable metadata: the restore itself fails and says why
            return
        finally:
            handler.close()
        tree = getattr(saved, "tree", saved)
        if tree is None:
            return
        # Full paths on both sides: the metadata tree holds an nnx.Variable's ``.value`` as
        # a dict entry, so leaf_name's dropping of it would make the two disagree.
        try:
            saved_names, target_names = _path_names(tree), _path_names(abstract_state)
        except TypeError:  # a pytree node without a nameable key: leave it to Orbax
            return
        check_names(saved_names, target_names,
                    f"the arrays of checkpoint step {step} in {self.directory}")

    def _move_aside(self, step: int) -> None:
        if jax.process_index() == 0:
            target = self.directory / f"corrupt_step_{step}_{int(time.time())}"
            (self.directory / str(step)).rename(target)
            log.warning("moved corrupt checkpoint step %d to %s", step, target)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"spade_checkpoint_move_aside_{step}")

    def _check_config_hash(self, step: int) -> None:
        manifest = json.loads((self.directory / str(step) / MANIFEST_NAME).read_text())
        saved = manifest.get("config_hash")
        if self.config_hash is not None and saved is not None and saved != self.config_hash:
            log.warning(
                "checkpoint step %d was written with config hash %s but this run's is %s: "
                "resuming with a changed configuration", step, saved, self.config_hash,
            )
