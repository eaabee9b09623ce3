"""The designer path's learning check: ``toy:check``, the toy world with the agent held at
its warm start, whose designer must keep its programs valid, put its games where the hint
helps, move them into the agent's frontier (levels 2-4, known by construction), train each
program on its own game's reward, and train the tokens it sampled
(``spade_jax.toy.check.check_designer_path``). ``python scripts/planted_faults.py --check
designer_path`` runs it under the four planted faults, each of which fails it
(docs/toy_world.md, "The designer path's check")."""

import pytest
from learning_runs import run_train

from spade_jax.experiment import load_experiment
from spade_jax.metrics import read_metrics
from spade_jax.toy.check import TOY_CHECK_FRONTIER_LEVELS, check_designer_path


def test_the_frontier_the_check_names_is_the_one_the_warm_start_teaches():
    # the agent is taught to follow the hint's table up to chain_hint_max_level, and
    # plays level 1 without it: the levels in between are its frontier
    toy = load_experiment("toy:check").toy
    assert TOY_CHECK_FRONTIER_LEVELS == tuple(range(2, toy.chain_hint_max_level + 1))


@pytest.mark.slow  # one short run: warm start and 5 rounds (2.5-3 min alone)
@pytest.mark.timeout(1500)  # a hang, not a loaded box: 601 s beside two toy runs (2026-12-07)
def test_the_designer_moves_its_games_into_the_agents_frontier(tmp_path):
    run_train("toy:check", tmp_path)
    findings = check_designer_path(read_metrics(tmp_path))
    assert all(f.ok for f in findings), "\n".join(f.line() for f in findings)
