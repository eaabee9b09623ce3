"""Identity rules: the defaults when an experiment wants no group filtering, no step-level
credit, no token reweighting or no importance correction. Registered so every part of a
role's rule is always chosen by name."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from spade_jax.rl import terms
from spade_jax.rl.episodes import EpisodeBatch, StepContext
from spade_jax.rl.registry import (
    Corrected,
    Metrics,
    group_filters,
    importance_corrections,
    step_credits,
    token_weightings,
)

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class NoSettings:
    """The identity rules have no settings."""


@token_weightings.register("none", config=NoSettings)
def no_weighting(
    advantages: Array, entropy: Array, loss_mask: Array, cfg: NoSettings
) -> tuple[Array, Metrics]:
    """Broadcasts advantages to ``[B, T]`` and zeroes them off the mask; nothing else."""
    del entropy, cfg
    return terms.token_advantages(advantages, loss_mask) * loss_mask.astype(jnp.float32), {}


@group_filters.register("keep_all", config=NoSettings)
def keep_all_groups(rewards_gn: Array, cfg: NoSettings) -> tuple[Array, Metrics]:
    """Keeps every group."""
    del cfg
    if rewards_gn.ndim != 2:
        raise ValueError(f"rewards must be grouped [G, N], got shape {rewards_gn.shape}")
    return jnp.ones(rewards_gn.shape[:1], dtype=bool), {}


@step_credits.register("none", config=NoSettings)
def outcome_credit(
    episodes: EpisodeBatch, outcome_advantages: np.ndarray, cfg: NoSettings,
    context: StepContext,
) -> tuple[np.ndarray, Metrics]:
    """The outcome advantage of each episode, for every one of its tokens (``[B]``)."""
    del episodes, cfg, context
    return np.asarray(outcome_advantages, np.float64), {}


@importance_corrections.register("none", config=NoSettings)
def sampler_ratio(
    logp: Array, sampler_logp: Array, advantages: Array, loss_mask: Array, group_id: Array,
    cfg: NoSettings,
) -> tuple[Corrected, Metrics]:
    """The loss's ratio against the sampler's log-probs; advantages unchanged."""
    del logp, loss_mask, group_id, cfg
    return Corrected(sampler_logp, advantages), {}
