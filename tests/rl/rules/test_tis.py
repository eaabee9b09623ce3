"""Truncated importance sampling (``rl/rules/tis.py``, the recipe's ``--use-tis``) through
a role's loss: GRPO with TIS equals slime's loss and gradient (NumPy, finite differences),
and GSPO receives TIS as a per-token weight."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rule_references import B, T, finite_diff_grad, np_k3, np_ppo_token, random_batch


def np_recipe_tis_loss(logp, trainer_old, rollout, ref, adv, mask, clamp, kl_coef):
    """slime's PPO loss with --use-tis, by loops: ratio against the trainer's pre-update
    log-probs, each token's clipped policy term times clip(pi_trainer / pi_rollout, 0, C),
    k3 KL unweighted, mean over tokens per sample, mean over samples (recipe clip 0.2/0.28)."""
    seq_means = []
    for b in range(logp.shape[0]):
        tokens = []
        for t in np.flatnonzero(mask[b]):
            w = min(np.exp(trainer_old[b, t] - rollout[b, t]), clamp)
            pg, _, _, _ = np_ppo_token(logp[b, t], trainer_old[b, t], adv[b], 0.2, 0.28)
            tokens.append(w * pg + kl_coef * np_k3(logp[b, t], ref[b, t]))
        if tokens:
            seq_means.append(np.mean(tokens))
    return np.mean(seq_means)


def tis_role_loss(policy_loss: str, loss_config: dict, batch: dict, clamp: float):
    from spade_jax.rl.batch import TrainBatch
    from spade_jax.rl.train_step import RoleConfig, role_loss

    role = RoleConfig(policy_loss=policy_loss, loss=loss_config, importance_correction="tis",
                      importance={"clamp": clamp})
    train_batch = TrainBatch(
        input_ids=np.zeros((B, T), np.int32), loss_mask=batch["loss_mask"],
        old_logp=batch["old_logp"], advantages=batch["advantages"],
        role_id=np.zeros((B,), np.int32), ref_logp=batch["ref_logp"])

    def loss(lp):
        value, metrics, _ = role_loss(role, 0, train_batch, lp, jnp.zeros((B, T)))
        return value, metrics

    return jax.value_and_grad(loss, has_aux=True)(jnp.asarray(batch["logp"]))


def test_tis_grpo_equals_the_recipes_loss_and_gradient():
    batch = random_batch(12)
    batch["old_logp"] = (batch["logp"] + np.random.default_rng(4).normal(0, 0.8, (B, T))
                         ).astype(np.float32)  # sampler log-probs: some ratios exceed C
    (loss, metrics), grad = tis_role_loss(
        "grpo", dict(clip_eps=0.2, clip_eps_high=0.28, kl_coef=0.05), batch, 2.0)
    logp0 = batch["logp"].astype(np.float64)

    def recipe(lp):
        return np_recipe_tis_loss(lp, logp0, batch["old_logp"], batch["ref_logp"],
                                  batch["advantages"], batch["loss_mask"], 2.0, 0.05)

    assert float(loss) == pytest.approx(recipe(logp0), rel=1e-5, abs=1e-6)
    expected = finite_diff_grad(recipe, batch["logp"])
    assert np.abs(expected).max() > 1e-3
    np.testing.assert_allclose(np.asarray(grad), expected, atol=2e-5)
    mask = batch["loss_mask"] > 0
    ratio = np.exp(batch["logp"].astype(np.float64) - batch["old_logp"])[mask]
    assert float(metrics["tis/weight_mean"]) == pytest.approx(np.minimum(ratio, 2).mean(), rel=1e-5)
    assert float(metrics["tis/clip_frac"]) == pytest.approx(np.mean(ratio > 2), rel=1e-6)
    assert 0 < float(metrics["tis/clip_frac"]) < 1
    # The rule's own ratio is 1 (against the trainer's log-probs): nothing is PPO-clipped.
    assert float(metrics["clip_frac"]) == 0.0


def test_tis_reaches_gspo_as_a_per_token_weight():
    """GSPO-token with TIS: each token's gradient is -A_i w_it / (|y_i| N) (docs/trainer.md)."""
    batch = random_batch(13)
    batch["old_logp"] = (batch["logp"] + np.random.default_rng(5).normal(0, 0.8, (B, T))
                         ).astype(np.float32)
    (_, metrics), grad = tis_role_loss("gspo", {}, batch, 1.5)
    mask = batch["loss_mask"]
    w = np.minimum(np.exp(batch["logp"].astype(np.float64) - batch["old_logp"]), 1.5)
    tokens = mask.sum(1, keepdims=True)
    scored = np.sum(tokens > 0)
    expected = -batch["advantages"][:, None] * w * mask / np.maximum(tokens, 1) / scored
    np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-4, atol=1e-7)
    assert float(metrics["tis/clip_frac"]) > 0
