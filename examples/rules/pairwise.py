# examples/rules/pairwise.py
"""Pairwise advantages: A_i = scale * mean_{j != i} sign(r_i - r_j) within a group.

Scale-free (any reward scale gives the same advantages), ties count 0, and a group's
advantages sum to 0, like GRPO's, without dividing by a possibly tiny std.
"""

import dataclasses

import jax.numpy as jnp

from spade_jax.rl.registry import advantage_estimators


@dataclasses.dataclass(frozen=True)
class PairwiseConfig:
    """scale: the advantage of a sample that beats every other sample of its group."""

    scale: float = 1.0

    def __post_init__(self):
        if not self.scale > 0:
            raise ValueError(f"scale must be > 0, got {self.scale}")


@advantage_estimators.register("pairwise", config=PairwiseConfig)
def pairwise_advantages(rewards, group_size, cfg):
    if group_size < 1 or rewards.shape[0] % group_size:
        raise ValueError(f"group_size {group_size} does not divide {rewards.shape[0]} rewards")
    rewards_gn = jnp.asarray(rewards, jnp.float32).reshape(-1, group_size)
    sign_gnn = jnp.sign(rewards_gn[:, :, None] - rewards_gn[:, None, :])
    others = max(group_size - 1, 1)  # a group of one gets advantage 0
    advantages_gn = cfg.scale * jnp.sum(sign_gnn, axis=2) / others
    off_diagonal = group_size * others
    ties = jnp.sum(sign_gnn == 0) - rewards_gn.size  # the diagonal always ties
    return advantages_gn.reshape(-1), {
        "tie_frac": ties / (rewards_gn.shape[0] * off_diagonal),
    }
