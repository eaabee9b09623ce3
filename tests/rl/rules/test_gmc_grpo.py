"""The GMC-GRPO group-wise importance correction (``rl/rules/gmc_grpo.py``): each group's
ratios shrink as a NumPy re-derivation says, and the gradient follows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spade_jax import rl


def np_gmc_scale(logp, sampler, mask, group_id, radius):
    b = logp.shape[0]
    scale = np.ones(b)
    for i in range(b):
        members = [j for j in range(b)
                   if j == i or (group_id[i] >= 0 and group_id[j] == group_id[i])]
        sq = sum(((logp[j] - sampler[j]) ** 2 * mask[j]).sum() for j in members)
        count = sum(mask[j].sum() for j in members)
        rms = np.sqrt(sq / max(count, 1.0))
        scale[i] = min(1.0, radius / max(rms, 1e-12))
    return scale


def test_gmc_shrinks_each_group_and_keeps_the_gradient():
    rng = np.random.default_rng(0)
    b, t = 6, 5
    logp = rng.normal(-1.5, 0.5, (b, t)).astype(np.float32)
    drift = np.array([0.02, 0.02, 0.5, 0.5, 0.3, 0.05])[:, None]  # group 1 drifted far
    sampler = (logp + rng.normal(0, 1, (b, t)) * drift).astype(np.float32)
    mask = (rng.random((b, t)) < 0.8).astype(np.float32)
    group_id = np.array([0, 0, 1, 1, -1, -1], np.int32)
    adv = rng.normal(0, 1, (b, t)).astype(np.float32)
    rule = rl.importance_corrections.get("gmc")
    cfg = rule.make_config(radius=0.1)
    corrected, metrics = rule.fn(jnp.asarray(logp), sampler, adv, mask, group_id, cfg)
    scale = np_gmc_scale(logp.astype(np.float64), sampler, mask, group_id, 0.1)
    assert scale[0] == 1.0 and scale[2] < 0.5  # only the drifted group shrinks
    log_ratio = np.asarray(logp, np.float64) - np.asarray(corrected.old_logp, np.float64)
    np.testing.assert_allclose(log_ratio, scale[:, None] * (logp - sampler.astype(np.float64)),
                               rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(corrected.advantages), adv)
    assert float(metrics["gmc/shrunk_frac"]) == pytest.approx(np.mean(scale < 1))

    def surrogate(lp):  # sum_it A exp(logp - old'): gradient A c_g exp(c_g l)
        out, _ = rule.fn(lp, sampler, adv, mask, group_id, cfg)
        return jnp.sum(out.advantages * jnp.exp(lp - out.old_logp) * mask)

    grad = jax.grad(surrogate)(jnp.asarray(logp))
    l_bt = logp.astype(np.float64) - sampler
    expected = adv * scale[:, None] * np.exp(scale[:, None] * l_bt) * mask
    np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-4, atol=1e-6)
