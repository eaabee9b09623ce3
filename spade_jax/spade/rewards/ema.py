"""The paper text's EMA learning-potential ablation (`ema_learning_potential`): the
unsigned deviation of a game's no-hint mean return from a per-skill moving mean."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from spade_jax.spade.regret import ReturnsLike, flatten_steps, mean_return
from spade_jax.spade.rewards.base import (
    StepsLike,
    register_designer_reward,
    validate_returns,
    window_steps,
)


@dataclasses.dataclass(frozen=True)
class EMALearningPotentialConfig:
    """Settings of the paper-text EMA learning-potential designer reward (ablation).

    Attributes:
      decay: moving-mean update m_s <- decay * m_s + (1 - decay) * mean_return (decay is
        the weight of the OLD mean, unlike the recipe's gamma).
      initial_mean: moving mean of a skill before any environment was scored. None seeds
        it with the skill's first environment, which then scores 0 (no history yet).
    """

    decay: float = 0.9
    initial_mean: float | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"EMALearningPotentialConfig.decay must be in [0, 1), got {self.decay}")
        if self.initial_mean is not None and not 0.0 <= self.initial_mean <= 1.0:
            raise ValueError(
                f"EMALearningPotentialConfig.initial_mean must be in [0, 1], got {self.initial_mean}"
            )


@dataclasses.dataclass(frozen=True)
class LearningPotential:
    """One environment's paper-text EMA learning-potential score."""

    mean_return: float  # no-hint window mean return
    moving_mean: float  # the skill's moving mean before this environment
    total: float  # |mean_return - moving_mean|

    def as_metrics(self) -> dict[str, float]:
        return {
            "mean_no_hint": self.mean_return,
            "skill_moving_mean": self.moving_mean,
            "total": self.total,
        }


@register_designer_reward("ema_learning_potential")
class EMALearningPotential:
    """Unsigned deviation of an environment's mean return from a per-skill moving mean.

    Environments are scored one at a time, each against the moving mean left by the
    previous ones, and then folded into it (scored BEFORE the update, unlike the recipe's
    `learning_potential`); the order is the round loop's order.
    """

    config_type = EMALearningPotentialConfig

    def __init__(self, config: EMALearningPotentialConfig | None = None) -> None:
        self.config = config or EMALearningPotentialConfig()
        self.moving_means: dict[str, float] = {}

    def score(
        self, hint_returns: ReturnsLike, no_hint_returns_by_step: StepsLike, *, skill: str
    ) -> LearningPotential:
        del hint_returns  # the cheaper signal uses the no-hint arm only
        no_hint = flatten_steps(window_steps(no_hint_returns_by_step))
        # Paper-text contract: a non-empty window in [0, 1]; its mean is the window win rate.
        window_mean = mean_return(validate_returns(no_hint, "no-hint window returns"))
        previous = self.moving_means.get(skill, self.config.initial_mean)
        if previous is None:
            previous = window_mean
        decay = self.config.decay
        self.moving_means[skill] = decay * previous + (1.0 - decay) * window_mean
        return LearningPotential(
            mean_return=window_mean, moving_mean=previous, total=abs(window_mean - previous)
        )

    def state_dict(self) -> dict[str, Any]:
        return {"moving_means": dict(self.moving_means)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        means = state.get("moving_means")
        if not isinstance(means, Mapping):
            raise ValueError(f"EMALearningPotential state needs a 'moving_means' dict, got {state}")
        self.moving_means = {str(k): float(v) for k, v in means.items()}
