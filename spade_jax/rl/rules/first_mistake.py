"""First-mistake step-level advantages from environment step rewards (Cliff-style).

Cliff (AWS + UIUC) splits a trajectory at its first mistake: the correct prefix gets
positive credit, everything from the mistake on gets negative credit, since after the
first error the rest of the trajectory carries no information about what was right. SPADE
environments pay partial rewards per ``step()``, so the mistake is located from them: the
first step whose reward drops below the previous step's (the step before step 0 has
reward ``initial_reward``)::

    drop_is   = step_mask_is and r_is < r_i,s-1 - tolerance
    m_i       = min{ s : drop_is }   (S when no step drops)
    A_it      = prefix_advantage  if 0 <= step(t) < m_i
              = suffix_advantage  if step(t) >= m_i
              = 0                 if step(t) = -1 (prompt / observation / padding token)

A trajectory without a drop is all prefix. The trainer typically adds this to the
outcome advantage of the sequence (``A_outcome[:, None] + A_step``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from spade_jax.rl.registry import Metrics, step_advantage_estimators

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class FirstMistakeConfig:
    """Settings of the first-mistake estimator.

    Attributes:
      prefix_advantage: credit of tokens in steps before the first mistake (>= 0).
      suffix_advantage: credit of tokens in the mistake step and after it (<= 0).
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


@step_advantage_estimators.register("first_mistake", config=FirstMistakeConfig)
def first_mistake_advantages(
    step_rewards: Array, step_mask: Array, token_step: Array, cfg: FirstMistakeConfig
) -> tuple[Array, Metrics]:
    """Positive credit before the first reward drop, negative from it on; ``[B, T]``.

    Args:
      step_rewards: ``[B, S]`` reward returned by each environment step.
      step_mask: ``[B, S]`` 1 for steps that happened, 0 for padding after the episode.
      token_step: ``[B, T]`` int, the step each token's action belongs to, -1 for none.
    """
    if step_rewards.ndim != 2 or step_mask.shape != step_rewards.shape:
        raise ValueError(
            f"step_rewards and step_mask must both be [B, S], got {step_rewards.shape} "
            f"and {step_mask.shape}"
        )
    if token_step.ndim != 2 or token_step.shape[0] != step_rewards.shape[0]:
        raise ValueError(
            f"token_step must be [B, T] with B = {step_rewards.shape[0]}, got {token_step.shape}"
        )
    num_steps = step_rewards.shape[1]
    rewards_bs = step_rewards.astype(jnp.float32)
    initial_b1 = jnp.full_like(rewards_bs[:, :1], cfg.initial_reward)
    previous_bs = jnp.concatenate([initial_b1, rewards_bs[:, :-1]], axis=1)
    drop_bs = (step_mask > 0) & (rewards_bs < previous_bs - cfg.tolerance)
    has_mistake_b = jnp.any(drop_bs, axis=1)
    first_mistake_b = jnp.where(has_mistake_b, jnp.argmax(drop_bs, axis=1), num_steps)
    before_mistake_bt = token_step < first_mistake_b[:, None]
    credit_bt = jnp.where(before_mistake_bt, cfg.prefix_advantage, cfg.suffix_advantage)
    advantages_bt = jnp.where(token_step >= 0, credit_bt, 0.0).astype(jnp.float32)
    metrics = {
        "mistake_frac": jnp.mean(has_mistake_b.astype(jnp.float32)),
        "first_mistake_step": jnp.sum(jnp.where(has_mistake_b, first_mistake_b, 0))
        / jnp.maximum(jnp.sum(has_mistake_b), 1),
    }
    return advantages_bt, metrics
