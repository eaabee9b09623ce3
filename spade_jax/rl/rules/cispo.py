"""CISPO (MiniMax-M1): REINFORCE whose importance weight is clipped and detached, so no
token's gradient is dropped by the clip (unlike PPO-style clipping of the update)::

    loss_it = -sg[clip(r_it, 1 - eps_low, 1 + eps_high)] * A_it * logp_it
    loss    = (1 / sum_i |y_i|) sum_it loss_it                  (token mean)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from spade_jax.rl import terms
from spade_jax.rl.registry import Metrics, policy_losses

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class CISPOConfig:
    """clip_eps_low / clip_eps_high: bounds of the detached importance weight."""

    clip_eps_low: float = 1.0
    clip_eps_high: float = 2.0

    def __post_init__(self) -> None:
        if not 0 <= self.clip_eps_low <= 1:
            raise ValueError(f"clip_eps_low must be in [0, 1], got {self.clip_eps_low}")
        if not self.clip_eps_high > 0:
            raise ValueError(f"clip_eps_high must be > 0, got {self.clip_eps_high}")


@policy_losses.register("cispo", config=CISPOConfig)
def cispo_loss(
    logp: Array, old_logp: Array, ref_logp: Array | None, advantages: Array,
    loss_mask: Array, cfg: CISPOConfig,
) -> tuple[Array, Metrics]:
    """Detached clipped-weight REINFORCE, token mean over the batch."""
    del ref_logp
    terms.check_token_arrays(loss_mask, logp=logp, old_logp=old_logp)
    logp = logp.astype(jnp.float32)
    advantages_bt = terms.token_advantages(advantages, loss_mask)
    ratio = jnp.exp(terms.masked_log_ratio(logp, old_logp.astype(jnp.float32), loss_mask))
    clipped_ratio = jnp.clip(ratio, 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
    pg_loss = -jax.lax.stop_gradient(clipped_ratio) * advantages_bt * logp
    loss = terms.masked_token_mean(pg_loss, loss_mask)
    clip_frac = (clipped_ratio != ratio).astype(jnp.float32)
    return loss, {
        "loss": jax.lax.stop_gradient(loss),
        "pg_loss": jax.lax.stop_gradient(loss),
        "ratio": jax.lax.stop_gradient(terms.masked_token_mean(ratio, loss_mask)),
        "clip_frac": terms.masked_token_mean(clip_frac, loss_mask),
    }
