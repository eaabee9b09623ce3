"""RLOO (REINFORCE leave-one-out, Ahmadian et al. 2024): each sample's baseline is the mean
reward of the other N-1 samples of its group::

    A_i = r_i - (1/(N-1)) sum_{j != i} r_j  =  N/(N-1) * (r_i - mean_j r_j)

A group of one sample has no other sample to compare with: its advantage is 0 (a SPADE
designer skill can have a single sample in a window); so is every advantage of a group
whose rewards are all equal, exactly (not float32 rounding).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from spade_jax.rl.registry import Metrics, advantage_estimators
from spade_jax.rl.rules.grpo import grouped, zero_constant_groups

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class RLOOAdvantageConfig:
    """RLOO advantages have no settings (the group size comes with the rewards)."""


@advantage_estimators.register("rloo", config=RLOOAdvantageConfig)
def rloo_advantages(
    rewards: Array, group_size: int, cfg: RLOOAdvantageConfig
) -> tuple[Array, Metrics]:
    """Leave-one-out baseline per sample; returns ``[B]`` (0 for groups of one)."""
    del cfg
    rewards_gn = grouped(rewards, group_size)
    if group_size == 1:
        return jnp.zeros(rewards_gn.shape[0], jnp.float32), {"reward_mean": jnp.mean(rewards_gn)}
    others_sum_gn = jnp.sum(rewards_gn, axis=1, keepdims=True) - rewards_gn
    baseline_gn = others_sum_gn / (group_size - 1)
    advantages_gn = zero_constant_groups(rewards_gn - baseline_gn, rewards_gn)
    return advantages_gn.reshape(-1), {"reward_mean": jnp.mean(rewards_gn)}
