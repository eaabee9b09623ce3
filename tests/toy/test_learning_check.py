"""The CI learning check: ``toy:check`` (~2 min on 2 cores), the toy world's policy, warm
start and agent loop on constant-key games, whose return must rise
(``spade_jax.toy.check.check_agent_path``). scripts/planted_faults.py runs it under the
planted faults of the agent's signal path; each makes it fail (docs/toy_world.md)."""

import pytest

from spade_jax.experiment import load_experiment
from spade_jax.metrics import read_metrics
from spade_jax.run import run_experiment
from spade_jax.toy.check import check_agent_path


@pytest.mark.slow  # one short run: warm start and 16 rounds (~2 min)
def test_the_agent_learns_a_constant_key_in_sixteen_updates(tmp_path):
    run_experiment(load_experiment("toy:check"), tmp_path)
    findings = check_agent_path(read_metrics(tmp_path))
    assert all(f.ok for f in findings), "\n".join(f.line() for f in findings)
