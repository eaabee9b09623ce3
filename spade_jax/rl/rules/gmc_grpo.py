"""GMC-GRPO (from the feed: "importance ratios: from per-sample clipping to whole-group
shrinkage"): instead of clipping each token's ratio on its own, which zeroes the gradient
of exactly the tokens that moved most, shrink the log-ratios of a whole group (the samples
of one prompt) towards on-policy by one common factor when the group has drifted further
than a trust radius. Within a group the ratios keep their order and every token keeps a
gradient. The feed entry is a title only (no text, no equations), so the formula is our
reading of that title, not the paper's::

    l_it   = logp_it - sampler_logp_it                      (log importance ratio)
    rms_g  = sqrt( mean_{i in g, t valid} l_it^2 )          (no gradient)
    c_g    = min(1, radius / rms_g)
    r~_it  = exp(c_g * l_it)        the loss's ratio: old'_it = logp_it - c_g * l_it

so ``logp - old' = c_g * l`` in value and ``c_g * d logp`` in gradient (the exact
derivative of exp(c_g l)). A row whose ``group_id`` is -1 is a group of its own. With
``policy_loss="grpo"`` the loss's own clip then rarely binds (set its eps wide to switch it
off). Microbatches: a group's statistic is over its rows in the microbatch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from spade_jax.rl import terms
from spade_jax.rl.registry import Corrected, Metrics, importance_corrections

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class GMCConfig:
    """radius: the largest root-mean-square log-ratio a group keeps unshrunk (> 0)."""

    radius: float = 0.1

    def __post_init__(self) -> None:
        if not self.radius > 0:
            raise ValueError(f"radius must be > 0, got {self.radius}")


def same_group(group_id: Array) -> Array:
    """``[B, B]`` 1.0 where rows share a group (-1: only itself)."""
    rows = jnp.arange(group_id.shape[0])
    shared = (group_id[:, None] == group_id[None, :]) & (group_id[:, None] >= 0)
    return (shared | (rows[:, None] == rows[None, :])).astype(jnp.float32)


@importance_corrections.register("gmc", config=GMCConfig)
def group_shrunk_ratios(
    logp: Array, sampler_logp: Array, advantages: Array, loss_mask: Array, group_id: Array,
    cfg: GMCConfig,
) -> tuple[Corrected, Metrics]:
    """Log-ratios of each group scaled by ``min(1, radius / rms_group)``."""
    terms.check_token_arrays(loss_mask, logp=logp, sampler_logp=sampler_logp)
    mask = loss_mask.astype(jnp.float32)
    log_ratio = logp.astype(jnp.float32) - sampler_logp.astype(jnp.float32)
    frozen = jax.lax.stop_gradient(log_ratio)
    same_bb = same_group(group_id)
    group_sq_b = same_bb @ jnp.sum(frozen**2 * mask, axis=1)
    group_tokens_b = same_bb @ jnp.sum(mask, axis=1)
    rms_b = jnp.sqrt(group_sq_b / jnp.maximum(group_tokens_b, 1.0))
    shrink_b = jnp.minimum(1.0, cfg.radius / jnp.maximum(rms_b, 1e-12))
    old_logp = logp - shrink_b[:, None] * log_ratio
    has_tokens_b = (jnp.sum(mask, axis=1) > 0).astype(jnp.float32)
    rows = jnp.maximum(jnp.sum(has_tokens_b), 1.0)
    metrics = {
        "gmc/shrink_mean": jnp.sum(shrink_b * has_tokens_b) / rows,
        "gmc/shrunk_frac": jnp.sum((shrink_b < 1.0) * has_tokens_b) / rows,
        "gmc/log_ratio_rms": jnp.sqrt(terms.masked_token_mean(frozen**2, mask)),
    }
    return Corrected(old_logp, advantages), metrics
