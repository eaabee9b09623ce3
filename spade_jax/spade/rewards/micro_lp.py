"""The recipe's micro learning potential (`micro_lp`): how much the agent improved on the
game over its window, from the no-hint plays alone."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from spade_jax.spade.regret import ReturnsLike, flatten_steps
from spade_jax.spade.rewards.base import (
    StatelessRule,
    StepsLike,
    register_designer_reward,
    window_returns,
    window_steps,
)


@dataclasses.dataclass(frozen=True)
class MicroLPConfig:
    """Micro learning potential: how much the agent improved on the game over its window.

    Attributes:
      estimator: "slope" = weighted least-squares line through the per-step mean returns
        (weight of a step = its number of plays, the recipe's sqrt(n) residual weights),
        reported as fitted end minus start; "twobucket" = mean of the late half of the
        steps with plays minus mean of the early half (an odd middle step is late).
      signed: keep a negative improvement (recipe blend default); False floors it at 0
        (the recipe's standalone `micro_lp` variant: two-bucket, floored).
    """

    estimator: str = "slope"
    signed: bool = True

    def __post_init__(self) -> None:
        if self.estimator not in ("slope", "twobucket"):
            raise ValueError(
                f"MicroLPConfig.estimator must be 'slope' or 'twobucket', got {self.estimator!r}"
            )


@dataclasses.dataclass(frozen=True)
class MicroLearningPotential:
    """One environment's within-window improvement."""

    improvement: float  # the estimator's value before flooring
    steps_with_plays: int
    total: float

    def as_metrics(self) -> dict[str, float]:
        return {
            "micro_lp": self.improvement,
            "steps_with_plays": float(self.steps_with_plays),
            "total": self.total,
        }


def window_improvement(steps: Sequence[np.ndarray], estimator: str) -> float:
    """Fitted improvement over the steps that have plays (0 with fewer than two).

    Steps without plays carry no information and are left out; the slope is fitted on the
    steps' true offsets, so an empty middle step does not shift the later ones.
    """
    offsets = np.array([j for j, s in enumerate(steps) if s.size], dtype=np.float64)
    if offsets.size < 2:
        return 0.0
    played = [s for s in steps if s.size]
    if estimator == "twobucket":
        mid = len(played) // 2
        return float(flatten_steps(played[mid:]).mean() - flatten_steps(played[:mid]).mean())
    means = np.array([s.mean() for s in played])
    weights = np.array([s.size for s in played], dtype=np.float64)
    x_mean = np.average(offsets, weights=weights)
    y_mean = np.average(means, weights=weights)
    slope = np.sum(weights * (offsets - x_mean) * (means - y_mean)) / np.sum(
        weights * (offsets - x_mean) ** 2
    )
    return float(slope * (offsets[-1] - offsets[0]))


@register_designer_reward("micro_lp")
class MicroLPRule(StatelessRule):
    """total = the agent's fitted improvement on the game over its window."""

    config_type = MicroLPConfig

    def __init__(self, config: MicroLPConfig) -> None:
        self.config = config

    def score(
        self, hint_returns: ReturnsLike, no_hint_returns_by_step: StepsLike, *, skill: str
    ) -> MicroLearningPotential:
        del skill
        window_returns(hint_returns, "hint_returns")  # checked, unused: no hint in this signal
        steps = window_steps(no_hint_returns_by_step)
        improvement = window_improvement(steps, self.config.estimator)
        total = improvement if self.config.signed else max(0.0, improvement)
        return MicroLearningPotential(
            improvement=improvement,
            steps_with_plays=sum(1 for s in steps if s.size),
            total=total,
        )
