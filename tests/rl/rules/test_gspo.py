"""GSPO (``rl/rules/gspo.py``): the sequence-ratio loss against a NumPy re-derivation,
and the gradient of its stop-gradient token form against finite differences of the
sequence-level objective."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rule_references import B, T, finite_diff_grad, random_batch, run_loss

from spade_jax import rl


def np_gspo_loss(batch, eps_low, eps_high):
    """Sequence-level GSPO: one ratio per sequence, loss_i = max(-A s_i, -A clip(s_i))."""
    lp, olp = batch["logp"].astype(np.float64), batch["old_logp"].astype(np.float64)
    adv, mask = batch["advantages"].astype(np.float64), batch["loss_mask"]
    losses = []
    for b in range(lp.shape[0]):
        idx = np.flatnonzero(mask[b])
        if idx.size == 0:
            continue
        s = np.exp(np.mean(lp[b, idx] - olp[b, idx]))
        a = adv[b]
        losses.append(max(-a * s, -a * min(max(s, 1 - eps_low), 1 + eps_high)))
    return np.mean(losses)


@pytest.mark.parametrize("eps", [(3e-4, 4e-4), (0.05, 0.08)])
def test_gspo_loss_matches_numpy(eps):
    batch = random_batch(5)
    batch["old_logp"] = batch["logp"] + np.random.default_rng(9).normal(0, 0.05, (B, T)).astype(
        np.float32)
    loss, _ = run_loss("gspo", batch, clip_eps_low=eps[0], clip_eps_high=eps[1])
    assert float(loss) == pytest.approx(np_gspo_loss(batch, *eps), rel=1e-5, abs=1e-6)


def test_gspo_gradient_equals_sequence_level_objective():
    """The stop-gradient token form must have the gradient of the sequence-ratio loss."""
    batch = random_batch(7, token_advantages=False)
    batch["old_logp"] = batch["logp"] + np.random.default_rng(3).normal(0, 0.1, (B, T)).astype(
        np.float32)
    rule = rl.policy_losses.get("gspo")
    cfg = rule.make_config(clip_eps_low=0.05, clip_eps_high=0.06)
    grad = jax.grad(lambda lp: rule.fn(lp, batch["old_logp"], None, batch["advantages"],
                                       batch["loss_mask"], cfg)[0])(jnp.asarray(batch["logp"]))
    expected = finite_diff_grad(lambda lp: np_gspo_loss({**batch, "logp": lp}, 0.05, 0.06),
                                batch["logp"])
    assert np.abs(expected).max() > 1e-3
    np.testing.assert_allclose(np.asarray(grad), expected, atol=2e-5)
