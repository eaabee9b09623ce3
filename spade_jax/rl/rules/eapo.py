"""EAPO sign-entropy coupled advantage reweighting (from the feed: KAIST + DeepAuto.ai).

Token entropy carries different information under positive and negative feedback: a
success through high-entropy tokens is a *surprising* success worth reinforcing, a failure
through low-entropy tokens is a *confident, repeated* mistake worth correcting. So tokens
are reweighted by their entropy in the direction set by the advantage's sign::

    z_it  = clip((H_it - mean H) / (std H + 1e-6), -z_clip, z_clip)   (over valid tokens)
    w_it  = exp(beta * sign(A_it) * z_it)
    w_it /= sum_t' |A_it'| w_it' / sum_t' |A_it'|   (t' = tokens of sequence i with the
                                                    same sign of A as token t)
    A'_it = A_it * w_it

The per-sequence, per-sign renormalisation keeps each sequence's total positive and total
negative credit unchanged (for sequence-level advantages: mean weight 1 over the
sequence): EAPO only moves credit between tokens. ``beta = 0`` is the
identity. Entropy is an input (computed by the train step from the logits) and is treated
as data: no gradient flows through the weights.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from spade_jax.rl import terms
from spade_jax.rl.registry import Metrics, token_weightings

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class EAPOConfig:
    """Settings of EAPO reweighting.

    Attributes:
      beta: strength of the coupling; weights range over exp(+-beta * z_clip).
      z_clip: bound on the standardised entropy, so one outlier token cannot take all credit.
    """

    beta: float = 0.5
    z_clip: float = 3.0

    def __post_init__(self) -> None:
        if self.beta < 0:
            raise ValueError(f"beta must be >= 0, got {self.beta}")
        if self.z_clip <= 0:
            raise ValueError(f"z_clip must be > 0, got {self.z_clip}")


def _credit_weighted_mean(weight_bt: Array, credit_bt: Array, members_bt: Array) -> Array:
    """``|A|``-weighted mean of the weights over each sequence's member tokens, ``[B, 1]``."""
    credit_bt = credit_bt * members_bt
    total_b1 = jnp.maximum(jnp.sum(credit_bt, axis=1, keepdims=True), 1e-30)
    return jnp.sum(weight_bt * credit_bt, axis=1, keepdims=True) / total_b1


@token_weightings.register("eapo", config=EAPOConfig)
def eapo_weighting(
    advantages: Array, entropy: Array, loss_mask: Array, cfg: EAPOConfig
) -> tuple[Array, Metrics]:
    """Reweights advantages by entropy: up-weights high-entropy tokens where A > 0 and
    low-entropy tokens where A < 0. Returns ``[B, T]`` advantages (0 off the mask)."""
    terms.check_token_arrays(loss_mask, entropy=entropy)
    mask = loss_mask.astype(jnp.float32)
    advantages_bt = terms.token_advantages(advantages, loss_mask)
    entropy = jax.lax.stop_gradient(entropy.astype(jnp.float32))
    entropy_mean = terms.masked_token_mean(entropy, mask)
    entropy_std = jnp.sqrt(terms.masked_token_mean((entropy - entropy_mean) ** 2, mask))
    z_bt = jnp.clip((entropy - entropy_mean) / (entropy_std + 1e-6), -cfg.z_clip, cfg.z_clip)
    sign_bt = jnp.sign(advantages_bt)
    raw_weight_bt = jnp.exp(cfg.beta * sign_bt * z_bt)
    credit_bt = jnp.abs(advantages_bt)
    positive_bt = mask * (sign_bt > 0)
    negative_bt = mask * (sign_bt < 0)
    norm_bt = (
        positive_bt * _credit_weighted_mean(raw_weight_bt, credit_bt, positive_bt)
        + negative_bt * _credit_weighted_mean(raw_weight_bt, credit_bt, negative_bt)
        + (1.0 - positive_bt - negative_bt)
    )
    weight_bt = jax.lax.stop_gradient(raw_weight_bt / norm_bt)
    reweighted_bt = advantages_bt * weight_bt * mask
    metrics = {
        "eapo_weight_max": jnp.max(jnp.where(mask > 0, weight_bt, 0.0)),
        "eapo_weight_min": jnp.min(jnp.where(mask > 0, weight_bt, jnp.inf)),
        "entropy_mean": entropy_mean,
    }
    return reweighted_bt, metrics
