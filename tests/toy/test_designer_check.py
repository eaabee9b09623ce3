"""The CI learning check's designer path: ``toy:check`` (~3 min on 2 cores), the toy world
with the agent held at its warm start, whose designer must keep its programs valid, put
its games where the hint helps and move them into the agent's frontier, training the
tokens it sampled (``spade_jax.toy.check.check_designer_path``). scripts/planted_faults.py
--check designer_path runs it under the four planted faults, each of which fails it
(docs/toy_world.md, "The learning checks and the planted faults")."""

import pytest
from learning_runs import run_train

from spade_jax.metrics import read_metrics
from spade_jax.toy.check import check_designer_path


@pytest.mark.slow  # one short run: warm start and 12 rounds (~3 min)
def test_the_designer_moves_its_games_into_the_agents_frontier(tmp_path):
    run_train("toy:check", tmp_path)
    findings = check_designer_path(read_metrics(tmp_path))
    assert all(f.ok for f in findings), "\n".join(f.line() for f in findings)
