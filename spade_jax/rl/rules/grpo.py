"""GRPO (DeepSeekMath): group-normalised advantages and the clipped-ratio loss.

Advantages, per group of N samples of one prompt::

    A_i = (r_i - mean_j r_j) / (std_j r_j + eps),   exactly 0 if every r_j is equal

Loss, per token t of sequence i, with r_it = pi_theta / pi_old::

    pg_loss_it = max(-A_i r_it, -A_i clip(r_it, 1 - eps_low, 1 + eps_high))
    kl_it      = k3(pi_theta || pi_ref) = e^d - d - 1,  d = ref_logp - logp
                 (d and log r_it set to 0 off the loss mask before the exponential)
    loss       = mean_i [ (1/|y_i|) sum_t (pg_loss_it + beta * kl_it) ]
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from spade_jax.rl import terms
from spade_jax.rl.registry import Metrics, advantage_estimators, policy_losses

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class GroupNormAdvantageConfig:
    """Settings of the GRPO group-normalised advantage.

    Attributes:
      eps: added to the group std (no division by zero); groups whose rewards are all
        equal get exactly 0 whatever eps is (:func:`zero_constant_groups`).
      std_ddof: 0 for the population std, 1 for the unbiased (sample) std.
    """

    eps: float = 1e-6
    std_ddof: int = 0

    def __post_init__(self) -> None:
        if self.eps <= 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        if self.std_ddof not in (0, 1):
            raise ValueError(f"std_ddof must be 0 or 1, got {self.std_ddof}")


def grouped(rewards: Array, group_size: int) -> Array:
    """``[B]`` rewards -> ``[G, N]`` with clear errors on a bad group size."""
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be flat [B], got shape {rewards.shape}")
    if group_size < 1 or rewards.shape[0] % group_size:
        raise ValueError(
            f"group_size {group_size} does not divide the batch of {rewards.shape[0]} rewards"
        )
    return rewards.astype(jnp.float32).reshape(-1, group_size)


def zero_constant_groups(advantages_gn: Array, rewards_gn: Array) -> Array:
    """``advantages_gn`` with the groups whose rewards are all equal set to exactly 0.

    Such a group carries no signal, but float32 rounding leaves ``r - mean`` at ~1e-8
    (how much depends on the backend's reduction order), and the std division blows that
    up: eight returns of 0.7 gave advantages of 0.056 at eps 1e-6 and up to ~0.75 at the
    recipe's 1e-8 with a sequential sum. Estimators that centre on a group mean (GRPO,
    Dr.GRPO, RLOO) pass their result through this."""
    constant_g1 = jnp.max(rewards_gn, axis=1, keepdims=True) == jnp.min(
        rewards_gn, axis=1, keepdims=True)
    return jnp.where(constant_g1, 0.0, advantages_gn)


@advantage_estimators.register("grpo", config=GroupNormAdvantageConfig)
def group_norm_advantages(
    rewards: Array, group_size: int, cfg: GroupNormAdvantageConfig
) -> tuple[Array, Metrics]:
    """``A_i = (r_i - mean_group) / (std_group + eps)`` (0 in constant groups); returns ``[B]``."""
    rewards_gn = grouped(rewards, group_size)
    if cfg.std_ddof >= group_size:
        raise ValueError(f"std_ddof={cfg.std_ddof} needs group_size > {cfg.std_ddof}")
    group_mean_g1 = jnp.mean(rewards_gn, axis=1, keepdims=True)
    group_std_g1 = jnp.std(rewards_gn, axis=1, keepdims=True, ddof=cfg.std_ddof)
    advantages_gn = zero_constant_groups(
        (rewards_gn - group_mean_g1) / (group_std_g1 + cfg.eps), rewards_gn)
    metrics = {
        "reward_mean": jnp.mean(rewards_gn),
        "group_std": jnp.mean(group_std_g1),
        "zero_std_frac": jnp.mean(
            (jnp.max(rewards_gn, axis=1) == jnp.min(rewards_gn, axis=1)).astype(jnp.float32)
        ),
    }
    return advantages_gn.reshape(-1), metrics


@dataclasses.dataclass(frozen=True)
class GRPOLossConfig:
    """Settings of the GRPO loss.

    Attributes:
      clip_eps: epsilon of the ratio clip, ``clip(r, 1 - eps, 1 + eps_high)``.
      clip_eps_high: upper epsilon; None means symmetric (= clip_eps).
      kl_coef: beta, weight of the k3 KL to the reference policy (0 disables it and then
        ``ref_logp`` may be None).
    """

    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    kl_coef: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.clip_eps < 1:
            raise ValueError(f"clip_eps must be in (0, 1), got {self.clip_eps}")
        if self.clip_eps_high is not None and self.clip_eps_high <= 0:
            raise ValueError(f"clip_eps_high must be > 0, got {self.clip_eps_high}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")


def reference_kl(logp: Array, ref_logp: Array | None, kl_coef: float,
                 loss_mask: Array | None = None) -> Array:
    """k3 KL per token (0 off ``loss_mask``, where the reference's log-prob is not kept and
    the difference is masked before the exponential), or zeros when the KL term is off."""
    if kl_coef > 0 and ref_logp is None:
        raise ValueError(f"kl_coef={kl_coef} > 0 needs ref_logp, got None")
    if ref_logp is None:
        return jnp.zeros_like(logp)
    return terms.k3_kl(logp, ref_logp.astype(jnp.float32), loss_mask)


@policy_losses.register("grpo", config=GRPOLossConfig)
def grpo_loss(
    logp: Array,
    old_logp: Array,
    ref_logp: Array | None,
    advantages: Array,
    loss_mask: Array,
    cfg: GRPOLossConfig,
) -> tuple[Array, Metrics]:
    """Clipped-ratio GRPO loss with optional k3 KL, per-sequence token mean."""
    terms.check_token_arrays(loss_mask, logp=logp, old_logp=old_logp, ref_logp=ref_logp)
    logp = logp.astype(jnp.float32)
    advantages_bt = terms.token_advantages(advantages, loss_mask)
    log_ratio = terms.masked_log_ratio(logp, old_logp.astype(jnp.float32), loss_mask)
    clip_high = cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high
    surrogate = terms.clipped_surrogate(log_ratio, advantages_bt, cfg.clip_eps, clip_high)
    kl = reference_kl(logp, ref_logp, cfg.kl_coef, loss_mask)
    token_loss = surrogate.pg_loss + cfg.kl_coef * kl
    loss = terms.seq_mean_token_mean(token_loss, loss_mask)
    # KL(pi_old || pi_theta) from samples of pi_old: (r - 1) - log r, as in CleanRL.
    approx_kl = terms.k3_kl(old_logp.astype(jnp.float32), logp, loss_mask)
    return loss, token_metrics(loss, surrogate, kl, approx_kl, loss_mask)


def token_metrics(
    loss: Array,
    surrogate: terms.ClippedSurrogate,
    kl: Array,
    approx_kl: Array,
    loss_mask: Array,
) -> Metrics:
    """Loss terms averaged over valid tokens, keyed by their names in the equations."""

    def mean(x: Array) -> Array:
        return jax.lax.stop_gradient(terms.masked_token_mean(x, loss_mask))

    return {
        "loss": jax.lax.stop_gradient(loss),
        "pg_loss": mean(surrogate.pg_loss),
        "pg_loss1": mean(surrogate.pg_loss1),
        "pg_loss2": mean(surrogate.pg_loss2),
        "ratio": mean(surrogate.ratio),
        "clip_frac": mean(surrogate.clipped),
        "kl": mean(kl),
        "approx_kl": mean(approx_kl),
    }
