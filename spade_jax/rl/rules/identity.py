"""Identity rules: the defaults when an experiment wants no token reweighting or no group
filtering. Registered so every stage of the update is always chosen by name."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from spade_jax.rl import terms
from spade_jax.rl.registry import Metrics, group_filters, token_weightings

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
