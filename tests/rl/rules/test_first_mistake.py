"""The first-mistake step credit (``rl/rules/first_mistake.py``) against a NumPy
re-derivation."""

from __future__ import annotations

import numpy as np
import pytest
from rule_references import B

from spade_jax import rl


def np_first_mistake(step_rewards, step_mask, token_step, prefix, suffix, tol, initial):
    out = np.zeros(token_step.shape)
    for b in range(step_rewards.shape[0]):
        previous, mistake = initial, step_rewards.shape[1]
        for s in range(step_rewards.shape[1]):
            if step_mask[b, s] and step_rewards[b, s] < previous - tol:
                mistake = s
                break
            previous = step_rewards[b, s]
        for t, s in enumerate(token_step[b]):
            if s >= 0:
                out[b, t] = prefix if s < mistake else suffix
    return out


@pytest.mark.parametrize("tolerance", [0.0, 0.25])
def test_first_mistake_matches_numpy(tolerance):
    from spade_jax.rl.episodes import EpisodeBatch, StepContext

    rng = np.random.default_rng(11)
    num_steps = 5
    step_rewards = rng.choice([0.0, 0.2, 0.5, 1.0], size=(B, num_steps))
    step_rewards[0] = [0.2, 0.5, 0.5, 1.0, 1.0]  # never drops
    lengths = rng.integers(1, num_steps + 1, size=B)
    step_mask = (np.arange(num_steps)[None] < lengths[:, None]).astype(np.float64)
    token_step = np.sort(rng.integers(-1, num_steps, size=(B, 3 * num_steps)), axis=1)
    token_step = np.where(token_step < lengths[:, None], token_step, -1)
    outcome = rng.normal(0, 1, B)
    episodes = EpisodeBatch((None,) * B, np.zeros(B), np.arange(B), step_rewards, step_mask,
                            token_step)
    rule = rl.step_credits.get("first_mistake")
    cfg = rule.make_config(prefix_advantage=0.5, suffix_advantage=-1.0, tolerance=tolerance)
    out, metrics = rule.fn(episodes, outcome, cfg, StepContext())
    expected = np_first_mistake(step_rewards, step_mask, token_step, 0.5, -1.0, tolerance, 0.0)
    expected = np.where(token_step >= 0, expected + outcome[:, None], 0.0)
    np.testing.assert_allclose(np.asarray(out), expected)
    assert (np.asarray(out)[0][token_step[0] >= 0] == 0.5 + outcome[0]).all()
