"""GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): a sequence-level ratio.

Token ratios are noisy and, in MoE models, jump whenever the router changes its expert
choice between pi_old and pi_theta. GSPO clips one length-normalised ratio per sequence::

    s_i = exp( (1/|y_i|) sum_t (logp_it - old_logp_it) )

written in the paper's token form so per-token advantages still work, where sg = stop
gradient (its value is s_i; its gradient w.r.t. logp_it is s_i)::

    s_it = sg[s_i] * exp(logp_it - sg[logp_it])
    loss = mean_i [ (1/|y_i|) sum_t max(-A_it s_it, -A_it clip(s_it, 1-eps_low, 1+eps_high)) ]

With A_it = A_i this has exactly the gradient of the sequence-level GSPO objective.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from spade_jax.rl import terms
from spade_jax.rl.registry import Metrics, policy_losses
from spade_jax.rl.rules.grpo import reference_kl, token_metrics

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class GSPOLossConfig:
    """Settings of the GSPO loss (defaults: the paper's epsilons, much smaller than GRPO's
    because a sequence ratio averages many tokens).

    Attributes:
      clip_eps_low: lower epsilon of the sequence-ratio clip.
      clip_eps_high: upper epsilon of the sequence-ratio clip.
      kl_coef: beta of an optional per-token k3 KL to the reference policy.
    """

    clip_eps_low: float = 3e-4
    clip_eps_high: float = 4e-4
    kl_coef: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.clip_eps_low < 1:
            raise ValueError(f"clip_eps_low must be in (0, 1), got {self.clip_eps_low}")
        if self.clip_eps_high <= 0:
            raise ValueError(f"clip_eps_high must be > 0, got {self.clip_eps_high}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")


@policy_losses.register("gspo", config=GSPOLossConfig)
def gspo_loss(
    logp: Array,
    old_logp: Array,
    ref_logp: Array | None,
    advantages: Array,
    loss_mask: Array,
    cfg: GSPOLossConfig,
) -> tuple[Array, Metrics]:
    """Clipped sequence-level importance ratio in stop-gradient token form."""
    terms.check_token_arrays(loss_mask, logp=logp, old_logp=old_logp, ref_logp=ref_logp)
    logp = logp.astype(jnp.float32)
    mask = loss_mask.astype(jnp.float32)
    advantages_bt = terms.token_advantages(advantages, loss_mask)
    token_log_ratio = (logp - old_logp.astype(jnp.float32)) * mask
    seq_log_ratio_b = jnp.sum(token_log_ratio, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1.0)
    # log s_it: the value of log s_i, the gradient of logp_it.
    frozen_seq_log_ratio_b1 = jax.lax.stop_gradient(seq_log_ratio_b)[:, None]
    log_ratio = frozen_seq_log_ratio_b1 + logp - jax.lax.stop_gradient(logp)
    surrogate = terms.clipped_surrogate(
        log_ratio, advantages_bt, cfg.clip_eps_low, cfg.clip_eps_high
    )
    kl = reference_kl(logp, ref_logp, cfg.kl_coef, loss_mask)
    token_loss = surrogate.pg_loss + cfg.kl_coef * kl
    loss = terms.seq_mean_token_mean(token_loss, loss_mask)
    approx_kl = terms.k3_kl(old_logp.astype(jnp.float32), logp, loss_mask)
    return loss, token_metrics(loss, surrogate, kl, approx_kl, loss_mask)
