"""`python -m spade_jax.train` end to end at a very small size, as a user runs it: a fresh
workdir, metrics, report, checkpoints, then a resume that continues where it stopped."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SHRINK = [
    "--set", "warm_start.steps=3",
    "--set", "spade.rounds=2",
    "--set", "spade.eval_every=2",
    "--set", "designer_sampler.max_new_tokens=48",
    "--set", "eval.suites=('RG-Math',)",
    "--set", "eval.tasks_per_suite=1",
    "--set", "eval.problems_per_task=1",
    "--set", "eval.max_new_tokens=4",
    "--set", "agent.max_turn_tokens=8",
    "--set", "checkpoint_every=1",
]


def _train(workdir, *extra: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    return subprocess.run(
        [sys.executable, "-m", "spade_jax.train", "--experiment=tiny", f"--workdir={workdir}",
         *SHRINK, *extra], capture_output=True, text=True, env=env, timeout=timeout)


def _rounds(workdir) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_main_command_runs_reports_and_resumes(tmp_path):
    workdir = tmp_path / "run"
    r = _train(workdir)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _rounds(workdir)
    assert [row["step"] for row in rows] == [0, 1]
    for key in ("validity_rate", "regret_raw_mean", "regret_clipped_mean", "learnable_share",
                "vendi_per_n", "time/design", "time/validate", "time/rollout", "time/update"):
        assert key in rows[-1] or key in rows[0], key
    assert any(k.startswith("eval/") for k in rows[-1])
    report = (workdir / "report.md").read_text()
    assert "validity_rate" in report and "plots/" in report
    assert list((workdir / "plots").glob("*.png"))
    assert (workdir / "checkpoints").is_dir()

    # Resume: one more round continues from the checkpoint instead of starting over.
    r = _train(workdir, "--set", "spade.rounds=3")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from round 1" in (workdir / "train.log").read_text()
    assert [row["step"] for row in _rounds(workdir)] == [0, 1, 2]


def test_bad_flags_get_clear_errors(tmp_path):
    r = _train(tmp_path / "x", "--set", "spade.roundz=3", timeout=120)
    assert r.returncode == 2 and "roundz" in r.stderr
    r = _train(tmp_path / "x", "--set", "spade.rounds=many", timeout=120)
    assert r.returncode == 2 and "spade.rounds" in r.stderr
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-m", "spade_jax.train", "--experiment=nope",
                        f"--workdir={tmp_path}"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "unknown experiment" in r.stderr
