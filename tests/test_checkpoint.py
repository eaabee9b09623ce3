"""Checkpoint tests: bitwise-identical resume after kill -9 and after SIGTERM (a toy AdamW
training loop run as a subprocess: this file is also that script), corrupt / partial
newest checkpoints falling back to the previous one, sharded restore, RNG round trips.

Run as a script: ``python tests/test_checkpoint.py RUN_DIR TOTAL_STEPS [--block-after N]
[--wait-for-sigterm-after N] [--forget-sampler]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import rng_json

from spade_jax import checkpoint as ckpt_lib

# ----------------------------------------------------------------------------------------
# The toy training run (subprocess side)
# ----------------------------------------------------------------------------------------

DATASET_SIZE, BATCH, WIDTH = 64, 8, 16


class ToySampler:
    """A Python-side data sampler with state, like the corpus sampler: shuffled epochs."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.order: list[int] = []

    def next_batch(self) -> np.ndarray:
        if len(self.order) < BATCH:
            self.order += self.rng.permutation(DATASET_SIZE).tolist()
        batch, self.order = self.order[:BATCH], self.order[BATCH:]
        return np.asarray(batch)

    def state_dict(self) -> dict:
        return {"rng": rng_json.numpy_rng_to_json(self.rng), "order": self.order}

    def load_state_dict(self, state: dict) -> None:
        self.rng = rng_json.numpy_rng_from_json(state["rng"])
        self.order = list(state["order"])


def toy_optimizer() -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-2, warmup_steps=2, decay_steps=6)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))


@jax.jit
def toy_init(key: jax.Array) -> dict:
    k1, k2 = jax.random.split(key)
    params = {
        "w1": jax.random.normal(k1, (4, WIDTH)) * 0.5,
        "b1": jnp.zeros(WIDTH),
        "w2": jax.random.normal(k2, (WIDTH, 1)) * 0.5,
    }
    return {"params": params, "opt_state": toy_optimizer().init(params)}


@jax.jit
def toy_train_step(state: dict, x: jax.Array, y: jax.Array, key: jax.Array) -> dict:
    def loss_fn(params):
        hidden = jnp.tanh(x @ params["w1"] + params["b1"])
        dropout_keep = jax.random.bernoulli(key, 0.9, hidden.shape)  # uses the step's key
        pred = (hidden * dropout_keep / 0.9) @ params["w2"]
        return jnp.mean((pred[:, 0] - y) ** 2)

    grads = jax.grad(loss_fn)(state["params"])
    updates, opt_state = toy_optimizer().update(grads, state["opt_state"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}


def flat_leaves(tree) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


def toy_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("total_steps", type=int)
    parser.add_argument("--block-after", type=int, default=None)
    parser.add_argument("--wait-for-sigterm-after", type=int, default=None)
    parser.add_argument("--forget-sampler", action="store_true")
    args = parser.parse_args(argv)

    data_rng = np.random.default_rng(1234)
    xs = jnp.asarray(data_rng.normal(size=(DATASET_SIZE, 4)), jnp.float32)
    ys = jnp.sin(xs.sum(axis=1))
    guard = ckpt_lib.PreemptionGuard.install()
    ckpt = ckpt_lib.CheckpointManager(
        ckpt_lib.CheckpointConfig(args.run_dir / "ckpt", save_every_steps=3, keep=2),
        guard=guard,
        config_hash="toy-v1",
    )
    key = jax.random.key(0)
    state = toy_init(jax.random.key(1))
    sampler = ToySampler(seed=7)
    start = 0
    restored = ckpt.restore_latest(jax.eval_shape(lambda: state))
    if restored is not None:
        start, state = restored.step, restored.state
        key = rng_json.key_from_json(restored.run_state["key"])
        if not args.forget_sampler:
            sampler.load_state_dict(restored.run_state["sampler"])
        print(f"RESUMED {start}", flush=True)

    for step in range(start + 1, args.total_steps + 1):
        key, step_key = jax.random.split(key)
        idx = sampler.next_batch()
        state = toy_train_step(state, xs[idx], ys[idx], step_key)
        print(f"STEP {step}", flush=True)
        if step == args.wait_for_sigterm_after:
            for _ in range(600):  # the test sends SIGTERM after reading the line above
                if guard.requested():
                    break
                time.sleep(0.05)
        if ckpt.should_save(step):
            run_state = {"key": rng_json.key_to_json(key), "sampler": sampler.state_dict()}
            ckpt.save(step, state, run_state)
        if step == args.block_after:
            ckpt.wait()
            print(f"CHECKPOINTED {step}", flush=True)
            time.sleep(600)  # the test kills us here with SIGKILL
        if ckpt.preempted:
            print(f"PREEMPTED {step}", flush=True)
            break
    ckpt.close()
    np.savez(args.run_dir / "final.npz", **flat_leaves(state))


# ----------------------------------------------------------------------------------------
# Subprocess tests
# ----------------------------------------------------------------------------------------


def _env(cache_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    # The toy runs share compiled programs through JAX's persistent cache (same program,
    # same executable), so only the first one pays for compilation.
    env["JAX_COMPILATION_CACHE_DIR"] = str(cache_dir)
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = ""  # one device: the toy run is single-device
    here = Path(__file__).parent  # the script imports the helpers in tests/support
    env["PYTHONPATH"] = os.pathsep.join(
        [str(here.parent), str(here / "support"), env.get("PYTHONPATH", "")])
    return env


def _toy_cmd(run_dir: Path, total: int, *flags: str) -> list[str]:
    return [sys.executable, __file__, str(run_dir), str(total), *flags]


def _cache_dir(run_dir: Path) -> Path:
    return run_dir.parent / "jax_cache"


def _run_toy(run_dir: Path, total: int, *flags: str) -> str:
    proc = subprocess.run(_toy_cmd(run_dir, total, *flags), env=_env(_cache_dir(run_dir)),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _start_toy(run_dir: Path, total: int, *flags: str) -> subprocess.Popen:
    return subprocess.Popen(_toy_cmd(run_dir, total, *flags), env=_env(_cache_dir(run_dir)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _read_until(proc: subprocess.Popen, marker: str) -> None:
    for line in proc.stdout:
        if line.strip() == marker:
            return
    raise AssertionError(f"toy run ended before printing {marker!r}: {proc.stderr.read()[-3000:]}")


def _load(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as data:
        return {name: data[name] for name in data.files}


def _assert_bitwise_equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    assert any("opt_state" in name for name in a)  # optimizer moments and counts included
    for name in a:
        assert a[name].dtype == b[name].dtype and np.array_equal(a[name], b[name]), name


@pytest.fixture(scope="module")
def toy_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("toy")


@pytest.fixture(scope="module")
def straight_run(toy_root) -> dict[str, np.ndarray]:
    run_dir = toy_root / "straight"
    _run_toy(run_dir, 6)
    return _load(run_dir / "final.npz")


@pytest.mark.slow  # JAX subprocesses
def test_resume_after_kill_9_is_bitwise_identical(toy_root, straight_run):
    tmp_path = toy_root / "killed"
    proc = _start_toy(tmp_path, 6, "--block-after", "3")
    try:
        _read_until(proc, "CHECKPOINTED 3")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert not (tmp_path / "final.npz").exists()
    forgetful = toy_root / "forgetful"
    shutil.copytree(tmp_path, forgetful)
    out = _run_toy(tmp_path, 6)
    assert "RESUMED 3" in out and "STEP 4" in out and "STEP 1\n" not in out
    _assert_bitwise_equal(straight_run, _load(tmp_path / "final.npz"))

    # Control: the same resume without restoring the sampler's state must differ, or the
    # comparison above could not catch a missing piece of run state.
    _run_toy(forgetful, 6, "--forget-sampler")
    resumed = _load(forgetful / "final.npz")
    assert not np.array_equal(resumed["['params']['w1']"], straight_run["['params']['w1']"])


@pytest.mark.slow  # JAX subprocesses
def test_sigterm_saves_at_next_step_and_resume_is_bitwise_identical(toy_root, straight_run):
    tmp_path = toy_root / "sigterm"
    proc = _start_toy(tmp_path, 6, "--wait-for-sigterm-after", "2")
    _read_until(proc, "STEP 2")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert "PREEMPTED 2" in out
    ckpt = ckpt_lib.CheckpointManager(ckpt_lib.CheckpointConfig(tmp_path / "ckpt"))
    assert ckpt.all_steps() == [2]  # saved at the step boundary, not on the every-3 schedule
    ckpt.close()
    assert "RESUMED 2" in _run_toy(tmp_path, 6)
    _assert_bitwise_equal(straight_run, _load(tmp_path / "final.npz"))


# ----------------------------------------------------------------------------------------
# In-process tests
# ----------------------------------------------------------------------------------------


def _small_state(value: float) -> dict:
    return {"w": jnp.full((64, 32), value, jnp.float32), "step": jnp.asarray(int(value))}


def _manager(directory: Path, **overrides) -> ckpt_lib.CheckpointManager:
    cfg = dataclasses.replace(ckpt_lib.CheckpointConfig(directory, keep=3), **overrides)
    return ckpt_lib.CheckpointManager(cfg, config_hash="abc")


def _saved_steps(directory: Path, steps=(1, 2, 3), **overrides) -> None:
    with _manager(directory, **overrides) as ckpt:
        for step in steps:
            ckpt.save(step, _small_state(float(step)), {"step": step})


def _largest_data_file(step_dir: Path) -> Path:
    files = [p for p in step_dir.rglob("*") if p.is_file() and "state" in p.parts]
    return max(files, key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("damage", ["garble", "truncate", "no_manifest", "delete_file"])
def test_corrupt_latest_falls_back_to_previous_with_message(tmp_path, caplog, damage):
    _saved_steps(tmp_path)
    step_dir = tmp_path / "3"
    if damage == "no_manifest":  # killed after Orbax finished but before the manifest
        (step_dir / ckpt_lib.MANIFEST_NAME).unlink()
    else:
        victim = _largest_data_file(step_dir)
        data = bytearray(victim.read_bytes())
        if damage == "garble":
            data[len(data) // 2] ^= 0xFF
            victim.write_bytes(bytes(data))
        elif damage == "truncate":
            victim.write_bytes(bytes(data[: len(data) // 2]))
        else:
            victim.unlink()
    caplog.set_level(logging.WARNING, logger="spade_jax.checkpoint")
    ckpt = _manager(tmp_path)
    restored = ckpt.restore_latest(jax.eval_shape(lambda: _small_state(0.0)))
    assert restored.step == 2 and restored.run_state == {"step": 2}
    np.testing.assert_array_equal(np.asarray(restored.state["w"]), np.full((64, 32), 2.0))
    message = " ".join(r.getMessage() for r in caplog.records)
    assert "checkpoint step 3" in message and "using step 2 instead" in message
    assert list(tmp_path.glob("corrupt_step_3_*"))  # moved aside, not deleted
    ckpt.save(3, _small_state(3.0), {"step": 3})  # the run can save step 3 again
    ckpt.close()
    assert _manager(tmp_path).restore_latest().step == 3


def test_async_save_writes_manifest_without_waiting(tmp_path):
    """The manifest appears once Orbax finalises, without a later save() or wait(): a kill
    between two saves must not cost the newest checkpoint."""
    ckpt = _manager(tmp_path)
    ckpt.save(1, _small_state(1.0), {"step": 1})
    manifest = tmp_path / "1" / ckpt_lib.MANIFEST_NAME
    deadline = time.time() + 60
    while not manifest.exists() and time.time() < deadline:
        time.sleep(0.05)
    assert manifest.exists()
    assert ckpt_lib.manifest_problem(tmp_path / "1", 1) is None
    ckpt.close()


def test_unfinished_save_directory_is_ignored(tmp_path):
    """A save killed mid-write leaves only Orbax's temporary directory, never a step name."""
    _saved_steps(tmp_path, steps=(1, 2))
    partial = tmp_path / "3.orbax-checkpoint-tmp-1700000000"
    shutil.copytree(tmp_path / "2", partial)
    (partial / "state" / "_METADATA").write_bytes(b"")
    ckpt = _manager(tmp_path)
    assert ckpt.all_steps() == [1, 2]
    assert ckpt.restore_latest().step == 2
    ckpt.save(3, _small_state(3.0), {"step": 3})
    ckpt.close()
    assert _manager(tmp_path).restore_latest().step == 3


def test_unreadable_data_with_sizes_only_is_caught_by_trial_restore(tmp_path, caplog):
    _saved_steps(tmp_path, checksum=False)
    metadata = tmp_path / "3" / "state" / "_METADATA"
    metadata.write_bytes(b"{" * metadata.stat().st_size)  # same size, not JSON
    manifest = json.loads((tmp_path / "3" / ckpt_lib.MANIFEST_NAME).read_text())
    assert all("sha256" not in entry for entry in manifest["files"].values())
    caplog.set_level(logging.WARNING, logger="spade_jax.checkpoint")
    restored = _manager(tmp_path).restore_latest(jax.eval_shape(lambda: _small_state(0.0)))
    assert restored.step == 2
    assert "restoring failed" in caplog.text


def test_intact_checkpoint_with_wrong_target_raises_instead_of_falling_back(tmp_path):
    _saved_steps(tmp_path, steps=(1, 2))
    wrong_target = {"w": jax.ShapeDtypeStruct((64, 33), jnp.float32),
                    "step": jax.ShapeDtypeStruct((), jnp.int32)}
    with pytest.raises(RuntimeError, match="step 2 .* is intact .* does not restore"):
        _manager(tmp_path).restore_latest(wrong_target)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["1", "2"]


def test_preemption_is_latched_by_should_save(tmp_path):
    guard = ckpt_lib.PreemptionGuard()
    ckpt = ckpt_lib.CheckpointManager(ckpt_lib.CheckpointConfig(tmp_path, save_every_steps=5),
                                      guard=guard)
    assert not ckpt.should_save(1) and not ckpt.preempted
    guard.request()
    assert ckpt.should_save(2) and ckpt.preempted
    ckpt.close()


def test_no_valid_checkpoint_returns_none(tmp_path, caplog):
    assert _manager(tmp_path).restore_latest() is None
    _saved_steps(tmp_path, steps=(1,))
    (tmp_path / "1" / ckpt_lib.MANIFEST_NAME).write_text("not json")
    caplog.set_level(logging.WARNING, logger="spade_jax.checkpoint")
    assert _manager(tmp_path).restore_latest() is None
    assert "no older checkpoint" in caplog.text


def test_keep_n_and_config_hash_warning(tmp_path, caplog):
    _saved_steps(tmp_path, steps=(1, 2, 3, 4, 5))
    ckpt = ckpt_lib.CheckpointManager(ckpt_lib.CheckpointConfig(tmp_path, keep=3),
                                      config_hash="changed")
    assert ckpt.all_steps() == [3, 4, 5]
    caplog.set_level(logging.WARNING, logger="spade_jax.checkpoint")
    assert ckpt.restore_latest().step == 5
    assert "config hash abc" in caplog.text and "changed" in caplog.text
    with pytest.raises(ValueError, match="step 5 already exists"):
        ckpt.save(5, _small_state(5.0), {})
    with pytest.raises(TypeError, match="JSON-serialisable"):
        ckpt.save(6, _small_state(6.0), {"bad": object()})
    ckpt.close()


def test_restore_into_target_shardings(tmp_path):
    devices = np.asarray(jax.devices())
    if devices.size < 4:
        pytest.skip("needs the simulated multi-device CPU backend from conftest")
    mesh = jax.sharding.Mesh(devices.reshape(2, -1), ("data", "fsdp"))
    spec = jax.sharding.PartitionSpec
    saved_sharding = jax.sharding.NamedSharding(mesh, spec("data", "fsdp"))
    values = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
    state = {"w": jax.device_put(values, saved_sharding)}
    with _manager(tmp_path) as ckpt:
        ckpt.save(1, state, {})
    target_sharding = jax.sharding.NamedSharding(mesh, spec(None, ("data", "fsdp")))
    abstract = {"w": jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=target_sharding)}
    restored = _manager(tmp_path).restore_latest(abstract)
    assert restored.state["w"].sharding == target_sharding
    np.testing.assert_array_equal(np.asarray(restored.state["w"]), values)


def test_rng_state_round_trips_bitwise():
    typed = jax.random.split(jax.random.key(3), 4)
    raw = jax.random.PRNGKey(5)
    for key in (typed, raw, jax.random.key(7, impl="rbg")):
        blob = json.loads(json.dumps(rng_json.key_to_json(key)))
        back = rng_json.key_from_json(blob)
        assert back.dtype == key.dtype and back.shape == key.shape
        first, first_back = (back, key) if back.ndim == key.ndim == 0 else (key[0], back[0])
        if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
            np.testing.assert_array_equal(np.asarray(jax.random.bits(first_back)),
                                          np.asarray(jax.random.bits(first)))
        else:
            np.testing.assert_array_equal(np.asarray(back), np.asarray(key))
    rng = np.random.default_rng(11)
    rng.random(5)
    copy = rng_json.numpy_rng_from_json(json.loads(json.dumps(rng_json.numpy_rng_to_json(rng))))
    np.testing.assert_array_equal(copy.random(8), rng.random(8))


def test_config_validation():
    with pytest.raises(ValueError, match="keep must be >= 2"):
        ckpt_lib.CheckpointConfig("/tmp/x", keep=1)
    with pytest.raises(ValueError, match="save_every_steps must be >= 1"):
        ckpt_lib.CheckpointConfig("/tmp/x", save_every_steps=0)


if __name__ == "__main__":
    toy_main(sys.argv[1:])


@pytest.mark.parametrize("mode", ["max", "min"])
def test_best_checkpoint_survives_keep_n(tmp_path, mode):
    """keep=2 plus the best-scoring step: scores arrive on some saves only (evaluation
    rounds); the best is kept however old, across a restart, and replaced only by a better
    one. Its arrays restore as saved."""
    sign = 1.0 if mode == "max" else -1.0
    scores = {2: 0.5, 4: 0.2, 7: 0.9}  # in "max" terms; step 2 stays best until step 7
    ckpt = _manager(tmp_path, keep=2, best_metric="eval/mean/pass@1", best_mode=mode)
    assert ckpt.score({"eval/mean/pass@1": float("nan")}) is None
    assert ckpt.score({"loss": 1.0}) is None
    for step in range(1, 6):
        score = ckpt.score({"eval/mean/pass@1": sign * scores[step]}) if step in scores else None
        ckpt.save(step, _small_state(float(step)), {"step": step}, score=score)
    ckpt.wait()
    assert ckpt.all_steps() == [2, 4, 5] and ckpt.best_step() == 2
    ckpt.close()

    ckpt = _manager(tmp_path, keep=2, best_metric="eval/mean/pass@1", best_mode=mode)
    assert ckpt.best_step() == 2  # read back from the step directories
    assert not ckpt.is_new_best(sign * 0.4) and ckpt.is_new_best(sign * 0.6)
    assert not ckpt.is_new_best(None)
    restored = ckpt.restore(2)
    np.testing.assert_array_equal(np.asarray(restored.state["w"]), np.full((64, 32), 2.0))
    for step in (6, 7, 8, 9):
        score = sign * scores[step] if step in scores else None
        ckpt.save(step, _small_state(float(step)), {"step": step}, score=score)
    ckpt.wait()
    assert ckpt.all_steps() == [7, 8, 9] and ckpt.best_step() == 7
    ckpt.close()

    # Without a metric configured: plain keep-N, scores ignored.
    plain = _manager(tmp_path / "plain", keep=2)
    for step in range(1, 5):
        plain.save(step, _small_state(float(step)), {}, score=10.0 if step == 1 else None)
    plain.wait()
    assert plain.all_steps() == [3, 4] and plain.best_step() is None
    assert not plain.is_new_best(1.0)
    plain.close()


def test_best_mode_is_validated():
    with pytest.raises(ValueError, match="best_mode"):
        ckpt_lib.CheckpointConfig("/tmp/x", best_mode="highest")


# ----------------------------------------------------------------------------------------
# Arrays by name (the run's TrainState format)
# ----------------------------------------------------------------------------------------


def _train_state(layers: int, width: int = 3):
    """A TrainState as a run holds one, small: nnx params, AdamW moments, a typed key."""
    from flax import nnx

    from spade_jax.rl.train_step import TrainState

    class Tiny(nnx.Module):
        def __init__(self) -> None:
            self.embed = nnx.Param(jnp.arange(4.0 * width).reshape(4, width))
            self.layers = nnx.List([nnx.Linear(width, width, rngs=nnx.Rngs(i))
                                    for i in range(layers)])

    _, params = nnx.split(Tiny())
    opt_state = optax.adamw(1e-3).init(params)
    opt_state = jax.tree.map(lambda x: x + 0.5, opt_state)  # moments != zeros
    return TrainState(jnp.asarray(7, jnp.int32), params, opt_state, jax.random.key(3))


def _abstract(named: dict) -> dict:
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in named.items()}


def test_train_state_is_stored_by_name_and_restores_bitwise(tmp_path):
    state = _train_state(layers=2)
    named = ckpt_lib.named_arrays(state)
    assert list(named) == [
        "step", "params/embed", "params/layers/0/bias", "params/layers/0/kernel",
        "params/layers/1/bias", "params/layers/1/kernel", "opt_state/0/count",
        *(f"opt_state/0/{m}/{p}" for m in ("mu", "nu") for p in (
            "embed", "layers/0/bias", "layers/0/kernel", "layers/1/bias", "layers/1/kernel")),
        "rng"]
    np.testing.assert_array_equal(named["params/layers/1/kernel"],
                                  state.params["layers"][1]["kernel"].get_value())
    np.testing.assert_array_equal(named["rng"], jax.random.key_data(state.rng))
    with _manager(tmp_path) as ckpt:
        ckpt.save(1, named, {"round": 0})
    restored = _manager(tmp_path).restore_latest(_abstract(named))
    back = ckpt_lib.state_from_named(restored.state, _train_state(layers=2, width=3))
    want = jax.tree_util.tree_flatten_with_path(state)[0]
    got = jax.tree_util.tree_flatten_with_path(back)[0]
    assert [p for p, _ in want] == [p for p, _ in got]
    for (path, a), (_, b) in zip(want, got, strict=True):
        if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        assert np.array_equal(np.asarray(a), np.asarray(b)), jax.tree_util.keystr(path)


def test_a_checkpoint_of_another_model_names_the_missing_and_unexpected_arrays(tmp_path):
    with _manager(tmp_path) as ckpt:
        ckpt.save(1, ckpt_lib.named_arrays(_train_state(layers=2)), {"round": 0})
    target = _abstract(ckpt_lib.named_arrays(_train_state(layers=3)))
    with pytest.raises(ckpt_lib.CheckpointMismatchError) as err:
        _manager(tmp_path).restore_latest(target)
    message = str(err.value)
    assert "checkpoint step 1" in message
    assert ("missing (the state has them, the checkpoint does not): opt_state/0/mu/layers/2/"
            "bias, opt_state/0/mu/layers/2/kernel, opt_state/0/nu/layers/2/bias") in message
    assert "params/layers/2/kernel" in message and "unexpected" not in message
    assert (tmp_path / "1").is_dir()  # the checkpoint is fine: not moved aside
    # the other way round: arrays the state does not have are unexpected
    fewer = _abstract(ckpt_lib.named_arrays(_train_state(layers=1)))
    with pytest.raises(ckpt_lib.CheckpointMismatchError,
                       match=r"unexpected \(in the checkpoint only\): opt_state/0/mu/layers/1/"):
        _manager(tmp_path).restore_latest(fewer)


def test_a_positional_checkpoint_is_refused_by_name(tmp_path):
    """The old format: leaves under "00000", "00001", ... in pytree order."""
    state = _train_state(layers=1)
    with _manager(tmp_path) as ckpt:
        ckpt.save(1, {f"{i:05d}": x for i, x in enumerate(ckpt_lib.named_arrays(state).values())},
                  {"round": 0})
    with pytest.raises(ckpt_lib.CheckpointMismatchError,
                       match=r"missing .*params/embed.*unexpected .*00000.*leaf position"):
        _manager(tmp_path).restore_latest(_abstract(ckpt_lib.named_arrays(state)))


def test_names_are_checked_for_nested_targets_and_in_state_from_named(tmp_path):
    _saved_steps(tmp_path, steps=(1,))
    renamed = {"weights": jax.ShapeDtypeStruct((64, 32), jnp.float32),
               "step": jax.ShapeDtypeStruct((), jnp.int32)}
    with pytest.raises(ckpt_lib.CheckpointMismatchError,
                       match=r"missing .*: weights; unexpected .*: w$"):
        _manager(tmp_path).restore_latest(renamed)
    named = ckpt_lib.named_arrays(_train_state(layers=1))
    del named["params/embed"]
    with pytest.raises(ckpt_lib.CheckpointMismatchError, match=r"missing .*: params/embed$"):
        ckpt_lib.state_from_named(named, _train_state(layers=1))
