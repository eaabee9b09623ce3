"""High-entropy token selection (``rl/rules/high_entropy.py``) against a NumPy
re-derivation: the kept share, the threshold over valid tokens only, and the identity at
``top_share=1``."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from rule_references import B, T, random_batch

from spade_jax import rl


def np_high_entropy(adv, entropy, mask, top_share):
    adv = np.broadcast_to(adv[:, None], mask.shape) if adv.ndim == 1 else adv
    threshold = np.quantile(entropy[mask > 0].astype(np.float64), 1.0 - top_share)
    return np.where((mask > 0) & (entropy >= threshold), adv, 0.0)


@pytest.mark.parametrize("token_adv", [False, True])
@pytest.mark.parametrize("top_share", [0.2, 0.5])
def test_high_entropy_matches_numpy(token_adv, top_share):
    batch = random_batch(3, token_adv)
    entropy = np.random.default_rng(2).gamma(2.0, 0.5, (B, T)).astype(np.float32)
    rule = rl.token_weightings.get("high_entropy")
    out, metrics = rule.fn(jnp.asarray(batch["advantages"]), jnp.asarray(entropy),
                           jnp.asarray(batch["loss_mask"]), rule.make_config(top_share=top_share))
    expected = np_high_entropy(batch["advantages"], entropy, batch["loss_mask"], top_share)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-6, atol=1e-7)
    kept = (expected != 0).sum() / batch["loss_mask"].sum()
    assert abs(float(metrics["high_entropy_kept_share"]) - kept) < 1e-6
    assert abs(kept - top_share) < 2.0 / batch["loss_mask"].sum()  # continuous entropies


def test_high_entropy_ignores_masked_tokens_and_is_identity_at_one():
    # the masked-out tokens have the highest entropy: they must not raise the threshold
    entropy = np.array([[0.1, 0.2, 3.0, 9.0], [0.4, 0.3, 2.0, 8.0]], np.float32)
    mask = np.array([[1, 1, 1, 0], [1, 1, 1, 0]], np.float32)
    adv = np.array([1.0, -2.0], np.float32)
    rule = rl.token_weightings.get("high_entropy")
    out, _ = rule.fn(jnp.asarray(adv), jnp.asarray(entropy), jnp.asarray(mask),
                     rule.make_config(top_share=1 / 3))
    np.testing.assert_allclose(np.asarray(out), [[0, 0, 1.0, 0], [0, 0, -2.0, 0]])
    out, _ = rule.fn(jnp.asarray(adv), jnp.asarray(entropy), jnp.asarray(mask),
                     rule.make_config(top_share=1.0))
    np.testing.assert_allclose(np.asarray(out), adv[:, None] * mask)
    with pytest.raises(ValueError, match="top_share"):
        rule.make_config(top_share=0.0)
