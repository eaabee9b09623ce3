"""Equation terms shared by the policy losses: the clipped ratio surrogate, the k3 KL
estimator, and the three ways of reducing a ``[B, T]`` token loss to a scalar.

Shapes: B = sequences in the batch, T = tokens per sequence (padded). ``loss_mask`` is 1
on tokens the policy generated and is trained on, 0 elsewhere.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array


def check_token_arrays(loss_mask: Array, **arrays: Array | None) -> None:
    """Raises a ValueError naming any ``[B, T]`` input whose shape differs from the mask."""
    if loss_mask.ndim != 2:
        raise ValueError(f"loss_mask must be [B, T], got shape {loss_mask.shape}")
    for name, array in arrays.items():
        if array is not None and array.shape != loss_mask.shape:
            raise ValueError(
                f"{name} has shape {array.shape} but loss_mask has shape {loss_mask.shape}"
            )


def token_advantages(advantages: Array, loss_mask: Array) -> Array:
    """Broadcasts sequence advantages ``[B]`` to tokens ``[B, T]``; passes ``[B, T]`` through."""
    if advantages.shape == loss_mask.shape:
        return advantages.astype(jnp.float32)
    if advantages.shape == loss_mask.shape[:1]:
        return jnp.broadcast_to(advantages[:, None], loss_mask.shape).astype(jnp.float32)
    raise ValueError(
        f"advantages must be [B] or [B, T] = {loss_mask.shape}, got shape {advantages.shape}"
    )


class ClippedSurrogate(NamedTuple):
    """Token-level terms of the PPO/GRPO clipped objective, each ``[B, T]``."""

    ratio: Array  # pi_theta / pi_old
    pg_loss1: Array  # -A * ratio
    pg_loss2: Array  # -A * clip(ratio, 1 - eps_low, 1 + eps_high)
    pg_loss: Array  # max(pg_loss1, pg_loss2)
    clipped: Array  # 1.0 where the clipped branch is the active one


def clipped_surrogate(
    log_ratio: Array, advantages_bt: Array, clip_eps_low: float, clip_eps_high: float
) -> ClippedSurrogate:
    """``max(-A r, -A clip(r, 1-eps_low, 1+eps_high))`` with ``r = exp(log_ratio)``."""
    ratio = jnp.exp(log_ratio)
    pg_loss1 = -advantages_bt * ratio
    pg_loss2 = -advantages_bt * jnp.clip(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    pg_loss = jnp.maximum(pg_loss1, pg_loss2)
    clipped = (pg_loss2 > pg_loss1).astype(jnp.float32)
    return ClippedSurrogate(ratio, pg_loss1, pg_loss2, pg_loss, clipped)


def masked_log_ratio(logp: Array, other_logp: Array, loss_mask: Array | None) -> Array:
    """``logp - other_logp`` on the mask, 0 off it: what goes into an exponential.

    Off the mask the two log-probs need not be close (the batch stores 0 for the sampler's
    and the reference's there, while a prompt token's logp may be -100), and ``e^100``
    overflows; masking the product afterwards gives ``inf * 0 = NaN``, and a ``where`` after
    the exponential still sends NaN into the gradient. Masked first, the exponent is 0 there
    and the gradient exactly 0. ``loss_mask`` None: no masking."""
    delta = logp - other_logp
    return delta if loss_mask is None else jnp.where(loss_mask > 0, delta, 0.0)


def k3_kl(logp: Array, ref_logp: Array, loss_mask: Array | None = None) -> Array:
    """Schulman's k3 estimator of KL(pi_theta || pi_ref) per token: ``e^d - d - 1``,
    ``d = ref_logp - logp``; non-negative and unbiased under samples from pi_theta.
    With ``loss_mask``, ``d = 0`` (so the term is 0) off the mask (:func:`masked_log_ratio`)."""
    delta = masked_log_ratio(ref_logp, logp, loss_mask)
    return jnp.exp(delta) - delta - 1.0


def masked_token_mean(x_bt: Array, loss_mask: Array) -> Array:
    """Mean over every valid token in the batch (DAPO's token-level mean)."""
    mask = loss_mask.astype(jnp.float32)
    return jnp.sum(x_bt * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def seq_mean_token_mean(x_bt: Array, loss_mask: Array) -> Array:
    """Mean over tokens within each sequence, then over sequences (GRPO). Sequences with no
    valid token are left out of the outer mean."""
    mask = loss_mask.astype(jnp.float32)
    tokens_b = jnp.sum(mask, axis=1)
    seq_mean_b = jnp.sum(x_bt * mask, axis=1) / jnp.maximum(tokens_b, 1.0)
    has_tokens_b = (tokens_b > 0).astype(jnp.float32)
    return jnp.sum(seq_mean_b * has_tokens_b) / jnp.maximum(jnp.sum(has_tokens_b), 1.0)


def seq_mean_token_sum_norm(x_bt: Array, loss_mask: Array, norm_tokens: int) -> Array:
    """Sum over tokens divided by a constant length, then mean over sequences (Dr.GRPO):
    no per-sequence length normalisation, so long wrong answers are not favoured."""
    mask = loss_mask.astype(jnp.float32)
    return jnp.mean(jnp.sum(x_bt * mask, axis=1) / float(norm_tokens))


class TruncatedImportanceWeights(NamedTuple):
    """Token-level terms of truncated importance sampling (TIS), each ``[B, T]``, no gradient."""

    ratio: Array  # pi_trainer / pi_sampler
    weight: Array  # clip(ratio, clamp_low, clamp)
    clipped: Array  # 1.0 where the clamp changed the ratio


def truncated_importance_weights(
    trainer_logp: Array, sampler_logp: Array, clamp: float, clamp_low: float = 0.0
) -> TruncatedImportanceWeights:
    """``w = clip(pi_trainer / pi_sampler, clamp_low, clamp)`` per token (Yao et al.'s TIS).

    Corrects for the sampler (inference engine) drawing tokens from a slightly different
    distribution than the one the trainer differentiates: different kernels and batch
    shapes, or a policy some updates old (delayed designer samples). The weight is data: no
    gradient flows through it (``trainer_logp`` is stop-gradiented here).
    """
    log_ratio = jax.lax.stop_gradient(trainer_logp).astype(jnp.float32) - sampler_logp.astype(
        jnp.float32
    )
    ratio = jnp.exp(log_ratio)
    weight = jnp.clip(ratio, clamp_low, clamp)
    clipped = (weight != ratio).astype(jnp.float32)
    return TruncatedImportanceWeights(ratio, weight, clipped)
