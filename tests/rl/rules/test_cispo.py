"""The CISPO loss (``rl/rules/cispo.py``) against NumPy: its gradient is the detached,
clipped importance weight."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spade_jax import rl


def test_cispo_matches_numpy_and_its_gradient_is_the_detached_weight():
    rng = np.random.default_rng(5)
    logp = rng.normal(-1.5, 0.5, (4, 6)).astype(np.float32)
    old = (logp + rng.normal(0, 1.0, (4, 6))).astype(np.float32)
    mask = (rng.random((4, 6)) < 0.8).astype(np.float32)
    adv = rng.normal(0, 1, 4).astype(np.float32)
    rule = rl.policy_losses.get("cispo")
    cfg = rule.make_config(clip_eps_low=0.5, clip_eps_high=1.0)
    (loss, metrics), grad = jax.value_and_grad(
        lambda lp: rule.fn(lp, old, None, adv, mask, cfg), has_aux=True)(jnp.asarray(logp))
    weight = np.clip(np.exp(logp.astype(np.float64) - old), 0.5, 2.0)
    valid = mask > 0
    expected = (-weight * adv[:, None] * logp)[valid].mean()
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    np.testing.assert_allclose(np.asarray(grad), -weight * adv[:, None] * mask / valid.sum(),
                               rtol=1e-4, atol=1e-7)
    assert 0 < float(metrics["clip_frac"]) < 1
