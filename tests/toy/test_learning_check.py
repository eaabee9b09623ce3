"""The CI learning check: ``key_digit:check`` (~2 min on 2 cores), the toy world's policy, warm
start and agent loop on constant-key games, whose return must rise and whose trained
tokens must be the ones the sampler wrote (``spade_jax.toy.check.check_agent_path``).
scripts/planted_faults.py runs it under the planted faults of the agent's signal path: the
advantage sign flipped fails the first claim, the loss mask shifted one token the second
(docs/toy_world.md, "The learning checks and the planted faults")."""

import os
import subprocess
import sys

import pytest

from spade_jax.metrics import read_metrics
from spade_jax.toy.check import check_agent_path


@pytest.mark.slow  # one short run: warm start and 16 rounds (~2 min)
def test_the_agent_learns_a_constant_key_in_sixteen_updates(tmp_path):
    # As the README's command runs it: one CPU device (the suite's 8 simulated devices
    # would shard a 755k-parameter policy 8 ways on 2 cores, ~3x slower).
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    proc = subprocess.run([sys.executable, "-m", "spade_jax.train", "--experiment=key_digit:check",
                           f"--workdir={tmp_path}"], capture_output=True, text=True, env=env,
                          timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    findings = check_agent_path(read_metrics(tmp_path))
    assert all(f.ok for f in findings), "\n".join(f.line() for f in findings)
