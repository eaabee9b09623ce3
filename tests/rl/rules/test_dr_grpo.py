"""Dr.GRPO (``rl/rules/dr_grpo.py``) against NumPy re-derivations: the mean-centred
advantages (next to RLOO's leave-one-out ones, ``rl/rules/rloo.py``) and the
constant-normalised loss."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from rule_references import grouped_rewards, np_clipped_loss, random_batch, run_loss

from spade_jax import rl


def test_dr_grpo_and_rloo_advantages_match_numpy():
    rewards_gn = grouped_rewards(1).astype(np.float64)
    flat = jnp.asarray(rewards_gn.reshape(-1), dtype=jnp.float32)
    dr = rl.advantage_estimators.get("dr_grpo")
    rloo = rl.advantage_estimators.get("rloo")
    dr_adv, _ = dr.fn(flat, 4, dr.make_config())
    rloo_adv, _ = rloo.fn(flat, 4, rloo.make_config())
    dr_expected, rloo_expected = [], []
    for group in rewards_gn:
        for i, r in enumerate(group):
            dr_expected.append(r - np.mean(group))
            others = [group[j] for j in range(len(group)) if j != i]
            rloo_expected.append(r - sum(others) / len(others))
    np.testing.assert_allclose(np.asarray(dr_adv), dr_expected, atol=1e-6)
    np.testing.assert_allclose(np.asarray(rloo_adv), rloo_expected, atol=1e-6)


@pytest.mark.parametrize("norm_tokens", [None, 32])
def test_dr_grpo_loss_matches_numpy(norm_tokens):
    batch = random_batch(4, token_advantages=True)
    loss, _ = run_loss("dr_grpo", batch, kl_coef=0.1, norm_tokens=norm_tokens)
    expected, _ = np_clipped_loss(batch, 0.2, 0.2, 0.1, "sum_norm", norm_tokens)
    assert float(loss) == pytest.approx(expected, rel=1e-5, abs=1e-6)
