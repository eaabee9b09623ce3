"""Truncated importance sampling (Yao et al.; the recipe's ``--use-tis``, clamp [0, 2]).

The sampler (inference engine) draws tokens from a slightly different distribution than
the one the trainer differentiates (other kernels and batch shapes, or a policy some
updates old). TIS takes the rule's ratio against the trainer's own pre-update log-probs
and weighs each token by the truncated ratio to the sampler::

    w_it      = clip(pi_trainer / pi_sampler, clamp_low, clamp)     (no gradient)
    old'_it   = sg(logp_it)            (one update per batch: ratio 1, gradient of log pi)
    A'_it     = A_it * w_it

Multiplying A by ``w >= 0`` equals multiplying the token's policy term ``max(-A r,
-A clip(r))`` by ``w`` (positively homogeneous in A); a KL term stays unweighted.
"""

from __future__ import annotations

import dataclasses

import jax

from spade_jax.rl import terms
from spade_jax.rl.registry import Corrected, Metrics, importance_corrections

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class TISConfig:
    """clamp: C, the upper truncation (recipe 2.0); clamp_low: the lower one (recipe 0)."""

    clamp: float = 2.0
    clamp_low: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.clamp, bool) or not self.clamp > 0:
            raise ValueError(f"clamp must be > 0, got {self.clamp!r}")
        if not 0 <= self.clamp_low < self.clamp:
            raise ValueError(f"clamp_low must be in [0, clamp), got {self.clamp_low!r}")


@importance_corrections.register("tis", config=TISConfig)
def truncated_importance(
    logp: Array, sampler_logp: Array, advantages: Array, loss_mask: Array, group_id: Array,
    cfg: TISConfig,
) -> tuple[Corrected, Metrics]:
    """``A * clip(pi_trainer / pi_sampler, clamp_low, clamp)`` against ``sg(logp)``."""
    del group_id
    tis = terms.truncated_importance_weights(logp, sampler_logp, cfg.clamp, cfg.clamp_low)
    metrics = {
        "tis/weight_mean": terms.masked_token_mean(tis.weight, loss_mask),
        "tis/clip_frac": terms.masked_token_mean(tis.clipped, loss_mask),
    }
    return Corrected(jax.lax.stop_gradient(logp), advantages * tis.weight), metrics
