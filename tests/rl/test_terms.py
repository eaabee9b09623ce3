"""The equation terms every policy loss shares (``rl/terms.py``): masked positions cannot
overflow any loss or its gradient (the masked log-ratio and k3 KL), the shape checks, and
the truncated importance weights against NumPy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rule_references import B, T, np_clipped_loss, random_batch, run_loss

from spade_jax import rl
from spade_jax.rl import terms

LOSSES_WITH_KL = {"grpo": 0.005, "dr_grpo": 0.005, "dapo": 0.005, "gspo": 0.005, "cispo": None}


@pytest.mark.parametrize("masked", [(-100.0, 0.0, 0.0), (0.0, -100.0, -100.0)],
                         ids=["rare_prompt_token", "stale_sampler_logp"])
@pytest.mark.parametrize("name", sorted(LOSSES_WITH_KL))
def test_masked_positions_cannot_overflow_the_loss_or_its_gradient(name, masked):
    """Issue 37 item 2. Off the mask the batch stores 0 for the sampler's and reference's
    log-probs, while the policy's own may be -100 (a rare prompt token at T 0.6): the
    exponentials of the KL (e^(ref - logp)) and of the ratio must see a masked difference,
    else e^100 = inf, inf * 0 = NaN, and the step is skipped. One masked position at
    (logp, old_logp, ref_logp) = ``masked``: the loss and gradient are finite and equal
    those with a harmless value there (masked positions do not count)."""
    batch = random_batch(8)
    b, t = 2, 4
    batch["loss_mask"][b, t] = 0.0
    extreme = {k: v.copy() for k, v in batch.items()}
    for key, value in zip(("logp", "old_logp", "ref_logp"), masked, strict=True):
        extreme[key][b, t] = value
    rule = rl.policy_losses.get(name)
    kl = LOSSES_WITH_KL[name]
    cfg = rule.make_config() if kl is None else rule.make_config(kl_coef=kl)

    def loss_and_grad(values):
        def loss(lp):
            return rule.fn(lp, jnp.asarray(values["old_logp"]), jnp.asarray(values["ref_logp"]),
                           jnp.asarray(values["advantages"]), jnp.asarray(values["loss_mask"]),
                           cfg)[0]

        return jax.value_and_grad(loss)(jnp.asarray(values["logp"]))

    loss, grad = loss_and_grad(extreme)
    assert np.isfinite(float(loss)) and np.isfinite(np.asarray(grad)).all()
    want_loss, want_grad = loss_and_grad(batch)
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-6, abs=1e-7)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(want_grad), rtol=1e-6, atol=1e-7)
    assert float(grad[b, t]) == 0.0
    if name == "grpo":  # the registered recipe loss against the NumPy re-derivation
        assert float(loss) == pytest.approx(np_clipped_loss(extreme, 0.2, 0.2, kl, "seq_mean")[0],
                                            rel=1e-5, abs=1e-6)


def test_losses_reject_mismatched_shapes_and_missing_reference():
    batch = random_batch(0)
    with pytest.raises(ValueError, match="old_logp has shape"):
        run_loss("grpo", {**batch, "old_logp": batch["old_logp"][:, :-1]})
    with pytest.raises(ValueError, match="advantages must be"):
        run_loss("dapo", {**batch, "advantages": np.zeros(B + 1, np.float32)})
    rule = rl.policy_losses.get("grpo")
    with pytest.raises(ValueError, match="needs ref_logp"):
        rule.fn(batch["logp"], batch["old_logp"], None, batch["advantages"], batch["loss_mask"],
                rule.make_config(kl_coef=0.1))


def test_truncated_importance_weights_match_numpy():
    rng = np.random.default_rng(11)
    trainer = rng.normal(-1.5, 0.5, (B, T)).astype(np.float32)
    sampler = (trainer + rng.normal(0, 1.0, (B, T))).astype(np.float32)
    sampler[0, 0] = trainer[0, 0] + 40.0  # ratio e^-40: the lower clamp 0 leaves it alone
    sampler[0, 1] = trainer[0, 1] - 40.0  # ratio e^40: clamped to C
    tis = terms.truncated_importance_weights(trainer, sampler, 2.0)
    ratio = np.exp(trainer.astype(np.float64) - sampler)
    want = np.minimum(ratio, 2.0)
    np.testing.assert_allclose(np.asarray(tis.ratio), ratio, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(tis.weight), want, rtol=1e-5, atol=1e-30)
    np.testing.assert_array_equal(np.asarray(tis.clipped), (ratio > 2.0).astype(np.float32))
    assert 0 < float(np.mean(np.asarray(tis.clipped))) < 1
    low = terms.truncated_importance_weights(trainer, sampler, 2.0, clamp_low=0.5)
    np.testing.assert_allclose(np.asarray(low.weight), np.clip(ratio, 0.5, 2.0), rtol=1e-5)
    # The weight is data: no gradient through the trainer's log-probs.
    grad = jax.grad(lambda lp: jnp.sum(
        terms.truncated_importance_weights(lp, sampler, 2.0).weight))(jnp.asarray(trainer))
    np.testing.assert_array_equal(np.asarray(grad), 0.0)
