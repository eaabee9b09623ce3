"""The CI learning check: a shortened toy run (``toy:check``, ~3 min on 2 cores) whose
curves must show SPADE working (``spade_jax.toy.check``). scripts/planted_faults.py runs
the same check under four planted faults; each makes it fail (docs/toy_world.md)."""

import pytest

from spade_jax.experiment import load_experiment
from spade_jax.metrics import read_metrics
from spade_jax.run import run_experiment
from spade_jax.toy.check import check_run


@pytest.mark.slow  # one shortened toy run: warm start and 16 rounds (~3 min)
def test_a_short_toy_run_learns(tmp_path):
    run_experiment(load_experiment("toy:check"), tmp_path)
    findings = check_run(read_metrics(tmp_path))
    assert all(f.ok for f in findings), "\n".join(f.line() for f in findings)
