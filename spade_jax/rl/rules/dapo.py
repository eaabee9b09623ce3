"""DAPO (Yu et al. 2025): clip-higher, token-level mean, dynamic sampling.

Loss: GRPO's clipped surrogate with a wider upper clip (eps_high > eps_low, so unlikely
tokens with positive advantage can grow), averaged over *all* valid tokens of the batch
rather than per sequence::

    loss = (1 / sum_i |y_i|) sum_i sum_t max(-A_i r_it, -A_i clip(r_it, 1-eps_low, 1+eps_high))

Dynamic sampling: groups whose rewards all agree give zero advantage and no gradient, so
they are filtered out::

    keep_g = max_j r_gj - min_j r_gj > min_spread

and the batch is refilled: while fewer groups pass than were sampled, and for at most
``max_refill_rounds`` rounds, the rollout side plays replacement groups (as many as are
missing; new seeds; ``refill_from`` says which environments) and they are filtered too
(:func:`spade_jax.rl.update_rule.apply_rule`; DAPO keeps sampling until the batch is full,
here the budget bounds it).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from spade_jax.rl import terms
from spade_jax.rl.registry import Metrics, group_filters, policy_losses
from spade_jax.rl.rules.grpo import reference_kl, token_metrics

Array = jax.Array
REFILL_FROM = ("dropped", "all")


@dataclasses.dataclass(frozen=True)
class DAPOLossConfig:
    """Settings of the DAPO loss.

    Attributes:
      clip_eps_low: epsilon_low of ``clip(r, 1 - eps_low, 1 + eps_high)``.
      clip_eps_high: epsilon_high, the decoupled ("clip-higher") upper epsilon.
      kl_coef: beta of an optional k3 KL to the reference (DAPO itself uses 0).
    """

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    kl_coef: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.clip_eps_low < 1:
            raise ValueError(f"clip_eps_low must be in (0, 1), got {self.clip_eps_low}")
        if self.clip_eps_high <= 0:
            raise ValueError(f"clip_eps_high must be > 0, got {self.clip_eps_high}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")


@policy_losses.register("dapo", config=DAPOLossConfig)
def dapo_loss(
    logp: Array,
    old_logp: Array,
    ref_logp: Array | None,
    advantages: Array,
    loss_mask: Array,
    cfg: DAPOLossConfig,
) -> tuple[Array, Metrics]:
    """Clip-higher surrogate averaged over every valid token in the batch."""
    terms.check_token_arrays(loss_mask, logp=logp, old_logp=old_logp, ref_logp=ref_logp)
    logp = logp.astype(jnp.float32)
    advantages_bt = terms.token_advantages(advantages, loss_mask)
    log_ratio = terms.masked_log_ratio(logp, old_logp.astype(jnp.float32), loss_mask)
    surrogate = terms.clipped_surrogate(
        log_ratio, advantages_bt, cfg.clip_eps_low, cfg.clip_eps_high
    )
    kl = reference_kl(logp, ref_logp, cfg.kl_coef, loss_mask)
    token_loss = surrogate.pg_loss + cfg.kl_coef * kl
    loss = terms.masked_token_mean(token_loss, loss_mask)
    approx_kl = terms.k3_kl(old_logp.astype(jnp.float32), logp, loss_mask)
    return loss, token_metrics(loss, surrogate, kl, approx_kl, loss_mask)


@dataclasses.dataclass(frozen=True)
class DynamicSamplingConfig:
    """Settings of DAPO's dynamic-sampling filter.

    Attributes:
      min_spread: a group is kept when max - min of its rewards exceeds this. The spread,
        not the std, so that a group of equal rewards is exactly zero-variance in floats.
      max_refill_rounds: rounds of replacement plays at most per update (0: dropped groups
        are not replaced; the update trains on fewer groups).
      refill_from: "dropped" (a dropped group is replaced by new plays of its own
        environment with fresh seeds) or "all" (replacements cycle through every
        environment of the step, in a seeded order per round).
    """

    min_spread: float = 0.0
    max_refill_rounds: int = 0
    refill_from: str = "dropped"

    def __post_init__(self) -> None:
        if self.min_spread < 0:
            raise ValueError(f"min_spread must be >= 0, got {self.min_spread}")
        if self.max_refill_rounds < 0:
            raise ValueError(f"max_refill_rounds must be >= 0, got {self.max_refill_rounds}")
        if self.refill_from not in REFILL_FROM:
            raise ValueError(f"refill_from must be one of {REFILL_FROM}, got "
                             f"{self.refill_from!r}")


@group_filters.register("dapo_dynamic_sampling", config=DynamicSamplingConfig)
def dynamic_sampling_keep(rewards_gn: Array, cfg: DynamicSamplingConfig) -> tuple[Array, Metrics]:
    """Keep-mask ``[G]`` of groups whose rewards are not all equal."""
    if rewards_gn.ndim != 2:
        raise ValueError(f"rewards must be grouped [G, N], got shape {rewards_gn.shape}")
    spread_g = jnp.max(rewards_gn, axis=1) - jnp.min(rewards_gn, axis=1)
    keep_g = spread_g > cfg.min_spread
    return keep_g, {"kept_group_frac": jnp.mean(keep_g.astype(jnp.float32))}
