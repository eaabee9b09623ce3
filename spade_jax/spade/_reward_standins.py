"""STAND-IN until helper "reward"'s spade/reward.py lands on main: the two designer
advantage helpers the loop needs, with the agreed semantics (INTERFACES.md). Deleted at
the merge; the loop then imports them from spade_jax.spade.reward."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np


def center_per_skill(totals: Sequence[float], skills: Sequence[Hashable],
                     scale: float) -> tuple[np.ndarray, np.ndarray]:
    values = np.asarray(totals, dtype=np.float64)
    kept = values >= 0.0
    advantages = np.zeros_like(values)
    skills = list(skills)
    for skill in dict.fromkeys(skills):
        members = kept & np.array([s == skill for s in skills], dtype=bool)
        if members.any():
            advantages[members] = (values[members] - values[members].mean()) * scale
    return advantages, kept


def env_reward_scale(num_env_trajectories: int, num_actor_trajectories: int,
                     regeneration_interval: int, max_scale: float = 50.0) -> float:
    if num_env_trajectories <= 0 or num_actor_trajectories <= 0:
        return 1.0
    return float(min(num_actor_trajectories / num_env_trajectories * regeneration_interval,
                     max_scale))
