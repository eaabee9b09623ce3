"""Runs an experiment as the README's command runs it, for the CI learning checks."""

import os
import subprocess
import sys


def run_train(experiment: str, workdir) -> None:
    """``python -m spade_jax.train --experiment=<experiment>`` into ``workdir`` on one CPU
    device (the suite's 8 simulated devices would shard a 755k-parameter policy 8 ways on
    2 cores, ~3x slower) at XLA's default flags (these runs are execution-bound)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    proc = subprocess.run([sys.executable, "-m", "spade_jax.train", f"--experiment={experiment}",
                           f"--workdir={workdir}"], capture_output=True, text=True, env=env,
                          timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
