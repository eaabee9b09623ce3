"""EAPO entropy-aware token weighting (``rl/rules/eapo.py``) against a NumPy
re-derivation: credit conserved per sequence and sign, its direction, beta 0 and the
``none`` weighting as identities."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from rule_references import B, T, random_batch

from spade_jax import rl


def np_eapo(adv, entropy, mask, beta, z_clip):
    adv = np.broadcast_to(adv[:, None], mask.shape) if adv.ndim == 1 else adv
    values = entropy[mask > 0].astype(np.float64)
    z = np.clip((entropy - values.mean()) / (values.std() + 1e-6), -z_clip, z_clip)
    out = np.zeros(mask.shape)
    for b in range(mask.shape[0]):
        for sign in (1, -1):
            tokens = [t for t in range(mask.shape[1]) if mask[b, t] and np.sign(adv[b, t]) == sign]
            if not tokens:
                continue
            raw = {t: np.exp(beta * sign * z[b, t]) for t in tokens}
            credit = sum(abs(adv[b, t]) for t in tokens)
            mean_raw = sum(abs(adv[b, t]) * raw[t] for t in tokens) / credit
            for t in tokens:
                out[b, t] = adv[b, t] * raw[t] / mean_raw
    return out


@pytest.mark.parametrize("token_adv", [False, True])
def test_eapo_matches_numpy_and_conserves_credit(token_adv):
    batch = random_batch(8, token_adv)
    entropy = np.random.default_rng(1).gamma(2.0, 0.5, (B, T)).astype(np.float32)
    rule = rl.token_weightings.get("eapo")
    out, _ = rule.fn(jnp.asarray(batch["advantages"]), jnp.asarray(entropy),
                     jnp.asarray(batch["loss_mask"]), rule.make_config(beta=0.7, z_clip=2.0))
    out = np.asarray(out)
    expected = np_eapo(batch["advantages"], entropy, batch["loss_mask"], 0.7, 2.0)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    base = np.broadcast_to(batch["advantages"][:, None], (B, T)) if not token_adv else \
        batch["advantages"]
    base = base * batch["loss_mask"]
    for sign in (1, -1):  # each sequence's positive and negative credit are unchanged
        sel = np.sign(base) == sign
        np.testing.assert_allclose((out * sel).sum(1), (base * sel).sum(1), rtol=1e-5, atol=1e-5)


def test_eapo_direction_and_identity():
    mask = np.ones((2, 4), np.float32)
    entropy = np.array([[0.1, 0.2, 3.0, 0.3]] * 2, np.float32)
    adv = np.array([1.0, -1.0], np.float32)
    rule = rl.token_weightings.get("eapo")
    out, _ = rule.fn(jnp.asarray(adv), jnp.asarray(entropy), jnp.asarray(mask), rule.make_config())
    out = np.asarray(out)
    assert out[0].argmax() == 2  # success: the high-entropy token gets the most credit
    assert np.abs(out[1]).argmin() == 2  # failure: the high-entropy token is blamed least
    identity, _ = rule.fn(jnp.asarray(adv), jnp.asarray(entropy), jnp.asarray(mask),
                          rule.make_config(beta=0.0))
    np.testing.assert_allclose(np.asarray(identity), np.broadcast_to(adv[:, None], (2, 4)),
                               rtol=1e-6)
    mask[1, 2:] = 0.0
    none = rl.token_weightings.get("none")
    out, _ = none.fn(jnp.asarray(adv), jnp.asarray(entropy), jnp.asarray(mask), none.make_config())
    np.testing.assert_array_equal(np.asarray(out), adv[:, None] * mask)
