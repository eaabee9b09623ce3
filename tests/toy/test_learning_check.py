"""The CI learning check's agent path: ``key_digit:check`` (~2 min on 2 cores), the toy
world's policy, warm start and agent loop on constant-key games, whose return must rise
and whose trained tokens must be the ones the sampler wrote
(``spade_jax.toy.check.check_agent_path``). The designer path's check is
tests/toy/test_designer_check.py (also in CI). scripts/planted_faults.py runs it under the planted
faults of the agent's signal path: the advantage sign flipped fails the first claim, the
loss mask shifted one token the second (docs/toy_world.md, "The learning checks and the
planted faults")."""

import pytest
from learning_runs import run_train

from spade_jax.metrics import read_metrics
from spade_jax.toy.check import check_agent_path


@pytest.mark.slow  # one short run: warm start and 16 rounds (~2 min)
@pytest.mark.timeout(1500)  # a hang, not a loaded box: 601 s beside two toy runs (2026-12-07)
def test_the_agent_learns_a_constant_key_in_sixteen_updates(tmp_path):
    run_train("key_digit:check", tmp_path)
    findings = check_agent_path(read_metrics(tmp_path))
    assert all(f.ok for f in findings), "\n".join(f.line() for f in findings)
