"""Dr.GRPO ("Understanding R1-Zero-Like Training"): GRPO without its two biases.

Advantages drop the std division (difficulty bias)::

    A_i = r_i - mean_j r_j

The loss drops the per-sequence 1/|y_i| (length bias) and divides by a constant L instead::

    loss = mean_i [ (1/L) sum_t (pg_loss_it + beta * kl_it) ]

with pg_loss_it and kl_it exactly as in GRPO.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from spade_jax.rl import terms
from spade_jax.rl.registry import Metrics, advantage_estimators, policy_losses
from spade_jax.rl.rules.grpo import grouped, reference_kl, token_metrics, zero_constant_groups

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class MeanCenteredAdvantageConfig:
    """Dr.GRPO advantages have no settings: ``A_i = r_i - mean_group``."""


@advantage_estimators.register("dr_grpo", config=MeanCenteredAdvantageConfig)
def mean_centered_advantages(
    rewards: Array, group_size: int, cfg: MeanCenteredAdvantageConfig
) -> tuple[Array, Metrics]:
    """``A_i = r_i - mean_group`` (exactly 0 in constant groups); returns ``[B]``."""
    del cfg
    rewards_gn = grouped(rewards, group_size)
    advantages_gn = zero_constant_groups(
        rewards_gn - jnp.mean(rewards_gn, axis=1, keepdims=True), rewards_gn)
    return advantages_gn.reshape(-1), {"reward_mean": jnp.mean(rewards_gn)}


@dataclasses.dataclass(frozen=True)
class DrGRPOLossConfig:
    """Settings of the Dr.GRPO loss.

    Attributes:
      clip_eps: lower (and by default upper) epsilon of the ratio clip.
      clip_eps_high: upper epsilon; None means symmetric.
      kl_coef: beta, weight of the k3 KL to the reference policy.
      norm_tokens: the constant L dividing each sequence's token sum (the generation budget);
        None uses the padded length T of the batch.
    """

    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    kl_coef: float = 0.0
    norm_tokens: int | None = None

    def __post_init__(self) -> None:
        if not 0 < self.clip_eps < 1:
            raise ValueError(f"clip_eps must be in (0, 1), got {self.clip_eps}")
        if self.clip_eps_high is not None and self.clip_eps_high <= 0:
            raise ValueError(f"clip_eps_high must be > 0, got {self.clip_eps_high}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.norm_tokens is not None and self.norm_tokens < 1:
            raise ValueError(f"norm_tokens must be >= 1, got {self.norm_tokens}")


@policy_losses.register("dr_grpo", config=DrGRPOLossConfig)
def dr_grpo_loss(
    logp: Array,
    old_logp: Array,
    ref_logp: Array | None,
    advantages: Array,
    loss_mask: Array,
    cfg: DrGRPOLossConfig,
) -> tuple[Array, Metrics]:
    """GRPO's clipped loss, token sum per sequence divided by a constant length."""
    terms.check_token_arrays(loss_mask, logp=logp, old_logp=old_logp, ref_logp=ref_logp)
    logp = logp.astype(jnp.float32)
    advantages_bt = terms.token_advantages(advantages, loss_mask)
    log_ratio = terms.masked_log_ratio(logp, old_logp.astype(jnp.float32), loss_mask)
    clip_high = cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high
    surrogate = terms.clipped_surrogate(log_ratio, advantages_bt, cfg.clip_eps, clip_high)
    kl = reference_kl(logp, ref_logp, cfg.kl_coef, loss_mask)
    token_loss = surrogate.pg_loss + cfg.kl_coef * kl
    norm_tokens = loss_mask.shape[1] if cfg.norm_tokens is None else cfg.norm_tokens
    loss = terms.seq_mean_token_sum_norm(token_loss, loss_mask, norm_tokens)
    approx_kl = terms.k3_kl(old_logp.astype(jnp.float32), logp, loss_mask)
    return loss, token_metrics(loss, surrogate, kl, approx_kl, loss_mask)
