"""Kill -9 resume of the real GRPO training step, bit for bit.

6 steps straight == 3 steps, SIGKILL right after step 3's checkpoint is committed, resume
from the run directory in a new process, 3 more steps. The run is ``tests/support/resume_driver.py``:
a tiny Qwen3-MoE, ``make_train_step`` with router replay, the project's AdamW schedule and
the asynchronous Orbax ``CheckpointManager`` saving every step; each batch's data comes from
a NumPy Generator checkpointed in ``run_state`` and its routing / behaviour log-probs from
the current policy. (test_checkpoint.py does the same with a toy optax loop; test_train_step
resumes the real step in-process without a kill.)
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from etils import epath
from xla_test_flags import jax_flags

from spade_jax.checkpoint import CheckpointConfig, CheckpointManager

REPO = Path(__file__).resolve().parents[1]
DRIVER = REPO / "tests" / "support" / "resume_driver.py"


def _env(cache_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    # Later runs reload the killed run's compiled programs from JAX's persistent cache (as
    # a real resume does), so only the first run pays for compilation. (The cache key
    # includes the cache directory's path, so the runs must share one directory.)
    env["JAX_COMPILATION_CACHE_DIR"] = str(cache_dir)
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = jax_flags()  # single device, LLVM -O0: these runs are mostly compiling
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _start(run_dir, *args: str, steps: int = 6, cache_dir: Path | None = None,
           extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    """The driver for ``steps`` steps; all runs share ``<tmp>/jax_cache`` (or
    ``cache_dir``). (Concurrent runs only read it here; a torn read of an entry being
    written would only cost a recompile.) ``run_dir`` may be a gs:// URL."""
    env = _env(cache_dir or run_dir.parent / "jax_cache")
    return subprocess.Popen(
        [sys.executable, str(DRIVER), str(run_dir), str(steps), *args],
        env={**env, **(extra_env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen, expect_rc: int = 0) -> str:
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()  # no-op once it has exited
    assert proc.returncode == expect_rc, f"rc {proc.returncode}, stderr:\n{err[-3000:]}"
    return out


def _losses(stdout: str) -> dict[int, str]:
    """Step -> loss as a float.hex() string, from the driver's ``STEP s loss=...`` lines."""
    return {int(s): loss for s, loss in re.findall(r"^STEP (\d+) loss=(\S+)$", stdout, re.M)}


def _load(path) -> dict[str, np.ndarray]:
    """An .npz file, local or gs://."""
    with np.load(io.BytesIO(epath.Path(path).read_bytes())) as data:
        return {name: data[name] for name in data.files}


def _checkpoint_leaves(ckpt_dir: Path, step: int) -> tuple[dict[str, np.ndarray], dict]:
    with CheckpointManager(CheckpointConfig(ckpt_dir)) as manager:
        restored = manager.restore(step)  # arrays as saved, no target needed
    leaves = jax.tree_util.tree_flatten_with_path(restored.state)[0]
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves}, restored.run_state


def _assert_bitwise_equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and np.array_equal(a[name], b[name]), name


@pytest.mark.slow  # ~45 s on 2 idle cores: one cold compile, then three warm runs
def test_kill_9_after_step_3_then_resume_equals_6_straight_steps(tmp_path):
    killed, straight, forgetful = tmp_path / "killed", tmp_path / "straight", tmp_path / "forgetful"
    procs: dict[str, subprocess.Popen] = {}
    try:
        out = _finish(_start(killed, "--kill-after", "3"), expect_rc=-signal.SIGKILL)
        assert "CHECKPOINTED 3" in out and sorted(_losses(out)) == [1, 2, 3]
        assert not (killed / "final.npz").exists()
        steps = sorted(int(p.name) for p in (killed / "ckpt").iterdir() if p.name.isdigit())
        assert steps == [1, 2, 3]
        shutil.copytree(killed, forgetful)
        procs["straight"] = _start(straight)
        procs["resumed"] = _start(killed)
        # Control: the same resume with the data RNG re-seeded instead of restored must end
        # elsewhere, or the comparisons below could not catch a lost piece of run state.
        procs["forgetful"] = _start(forgetful, "--forget-data-rng")
        outs = {name: _finish(proc) for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.kill()  # no-op for those that have exited

    assert "RESUMED" not in outs["straight"] and sorted(_losses(outs["straight"])) == list(
        range(1, 7))
    assert "RESUMED 3" in outs["resumed"] and sorted(_losses(outs["resumed"])) == [4, 5, 6]
    # Per-step losses, bit for bit (hex floats): steps 1-3 before the kill, 4-6 after.
    assert {**_losses(out), **_losses(outs["resumed"])} == _losses(outs["straight"])

    want, got = _load(straight / "final.npz"), _load(killed / "final.npz")
    for part in (".step", ".rng", ".params[", ".opt_state["):
        assert any(name.startswith(part) for name in want), part
    _assert_bitwise_equal(want, got)
    assert int(got[".step"]) == 6
    assert json.loads((straight / "final_data_rng.json").read_text()) == json.loads(
        (killed / "final_data_rng.json").read_text())

    # The step-6 checkpoints written by the two runs hold the same arrays and run state.
    want_ckpt, want_run_state = _checkpoint_leaves(straight / "ckpt", 6)
    got_ckpt, got_run_state = _checkpoint_leaves(killed / "ckpt", 6)
    assert len(want_ckpt) == len(want)
    _assert_bitwise_equal(want_ckpt, got_ckpt)
    assert want_run_state == got_run_state

    assert "RESUMED 3" in outs["forgetful"]
    control = _load(forgetful / "final.npz")
    assert not np.array_equal(control[".params['embed_vd'].value"],
                              want[".params['embed_vd'].value"])
