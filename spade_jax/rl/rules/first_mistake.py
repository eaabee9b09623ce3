"""First-mistake step credit located by a reward drop (Cliff's split, the mistake found
from the environment's own partial rewards; :mod:`.cliff` finds it with a judge instead).

After the first error the rest of a trajectory carries no information about what was
right, so the trajectory is split there: the correct prefix gets positive credit,
everything from the mistake on negative credit. SPADE environments pay partial rewards
per ``step()``, so here the mistake is the first step whose reward drops below the
previous step's (the step before step 0 has reward ``initial_reward``)::

    drop_is   = step_mask_is and r_is < r_i,s-1 - tolerance
    m_i       = min{ s : drop_is }   (S when no step drops: all prefix)
    A_it      = A_i + prefix_advantage  if 0 <= step(t) < m_i
              = A_i + suffix_advantage  if step(t) >= m_i
              = 0                       if step(t) = -1 (prompt / observation / padding)

with A_i the episode's outcome advantage.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from spade_jax.rl.episodes import EpisodeBatch, StepContext
from spade_jax.rl.registry import Metrics, step_credits


@dataclasses.dataclass(frozen=True)
class FirstMistakeConfig:
    """Settings of the reward-drop first-mistake credit.

    Attributes:
      prefix_advantage: added to the tokens of steps before the first mistake (>= 0).
      suffix_advantage: added to the tokens of the mistake step and after it (<= 0).
      tolerance: a drop smaller than this is not a mistake (reward noise).
      initial_reward: the reference the first step's reward is compared with.
    """

    prefix_advantage: float = 1.0
    suffix_advantage: float = -1.0
    tolerance: float = 0.0
    initial_reward: float = 0.0

    def __post_init__(self) -> None:
        if self.prefix_advantage < 0:
            raise ValueError(f"prefix_advantage must be >= 0, got {self.prefix_advantage}")
        if self.suffix_advantage > 0:
            raise ValueError(f"suffix_advantage must be <= 0, got {self.suffix_advantage}")
        if self.tolerance < 0:
            raise ValueError(f"tolerance must be >= 0, got {self.tolerance}")


def reward_drop_steps(
    step_rewards_bs: np.ndarray, step_mask_bs: np.ndarray, tolerance: float, initial: float
) -> np.ndarray:
    """``[B]`` index of each episode's first reward drop, S where there is none."""
    rewards_bs = np.asarray(step_rewards_bs, np.float64)
    previous_bs = np.concatenate([np.full_like(rewards_bs[:, :1], initial),
                                  rewards_bs[:, :-1]], axis=1)
    drop_bs = (np.asarray(step_mask_bs) > 0) & (rewards_bs < previous_bs - tolerance)
    return np.where(drop_bs.any(axis=1), np.argmax(drop_bs, axis=1), rewards_bs.shape[1])


def split_at_mistake(
    mistake_b: np.ndarray, token_step_bt: np.ndarray, prefix_bt: np.ndarray,
    suffix_bt: np.ndarray,
) -> np.ndarray:
    """``[B, T]``: ``prefix`` on policy tokens of steps before the mistake, ``suffix`` from
    it on, 0 on non-policy tokens (``prefix``/``suffix`` broadcast to [B, T])."""
    before_bt = token_step_bt < np.asarray(mistake_b)[:, None]
    credit_bt = np.where(before_bt, prefix_bt, suffix_bt)
    return np.where(token_step_bt >= 0, credit_bt, 0.0)


@step_credits.register("first_mistake", config=FirstMistakeConfig)
def first_mistake_credit(
    episodes: EpisodeBatch, outcome_advantages: np.ndarray, cfg: FirstMistakeConfig,
    context: StepContext,
) -> tuple[np.ndarray, Metrics]:
    """Outcome advantage plus prefix / suffix credit around the first reward drop."""
    del context
    mistake_b = reward_drop_steps(episodes.step_rewards_bs, episodes.step_mask_bs,
                                  cfg.tolerance, cfg.initial_reward)
    outcome_b1 = np.asarray(outcome_advantages, np.float64)[:, None]
    advantages_bt = split_at_mistake(mistake_b, episodes.token_step_bt,
                                     outcome_b1 + cfg.prefix_advantage,
                                     outcome_b1 + cfg.suffix_advantage)
    has_mistake_b = mistake_b < episodes.step_rewards_bs.shape[1]
    return advantages_bt, {
        "mistake_frac": float(np.mean(has_mistake_b)),
        "first_mistake_step": float(np.sum(np.where(has_mistake_b, mistake_b, 0))
                                    / max(int(np.sum(has_mistake_b)), 1)),
    }
