"""The recipe's `learning_potential` variant: |window mean - slow EMA of the skill's window
means|, with the per-skill EMAs as checkpointed state."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from spade_jax.spade.regret import ReturnsLike, flatten_steps, mean_return
from spade_jax.spade.rewards.base import (
    StepsLike,
    register_designer_reward,
    variance_bonus,
    window_returns,
    window_steps,
)


@dataclasses.dataclass(frozen=True)
class LearningPotentialConfig:
    """The recipe's learning-potential variant (slow/fast EMAs of returns per skill).

    Each gamma is the weight of the NEWEST value, as in the recipe:
    mu <- (1 - gamma) * mu + gamma * window_mean; the first value initialises both means.

    Attributes:
      gamma_slow: the slow mean's gamma; the reward is |window mean - mu_slow| (30B: 0.85).
      gamma_fast: the fast mean's gamma, logged only (30B: 0.98); must exceed gamma_slow.
      variance_bonus: add `variance_bonus(window returns)` (recipe: off).
    """

    gamma_slow: float = 0.85
    gamma_fast: float = 0.98
    variance_bonus: bool = False

    def __post_init__(self) -> None:
        if not 0.0 < self.gamma_slow < self.gamma_fast <= 1.0:
            raise ValueError(
                "LearningPotentialConfig needs 0 < gamma_slow < gamma_fast <= 1, got "
                f"gamma_slow={self.gamma_slow}, gamma_fast={self.gamma_fast}"
            )


@dataclasses.dataclass(frozen=True)
class WindowLearningPotential:
    """One environment's distance from its skill's slow baseline."""

    window_mean: float  # mean of all no-hint plays of the window (0 without plays)
    baseline: float  # the skill's mu_slow after this window's update
    mu_fast: float
    bonus: float
    total: float

    def as_metrics(self) -> dict[str, float]:
        return {
            "window_mean": self.window_mean,
            "skill_baseline": self.baseline,
            "skill_mu_fast": self.mu_fast,
            "variance_bonus": self.bonus,
            "total": self.total,
        }


def _ema_update(previous: float | None, value: float, gamma_newest: float) -> float:
    return value if previous is None else (1.0 - gamma_newest) * previous + gamma_newest * value


@register_designer_reward("learning_potential")
class LearningPotentialRule:
    """|window mean - slow EMA baseline of the skill|, the tracker updated before scoring.

    The recipe folds the pooled window mean of a skill's whole batch into the tracker once
    per window; under this per-environment protocol each environment's own window mean is
    folded in, in the loop's (deterministic) scoring order. A game without plays scores 0
    and leaves the tracker alone.
    """

    config_type = LearningPotentialConfig

    def __init__(self, config: LearningPotentialConfig) -> None:
        self.config = config
        self.means: dict[str, dict[str, float]] = {}  # skill -> {"mu_fast", "mu_slow"}

    def score(
        self, hint_returns: ReturnsLike, no_hint_returns_by_step: StepsLike, *, skill: str
    ) -> WindowLearningPotential:
        window_returns(hint_returns, "hint_returns")  # checked, unused
        window = flatten_steps(window_steps(no_hint_returns_by_step))
        window_mean = mean_return(window)  # the window's win rate (0 without plays)
        tracker = self.means.get(skill)
        if window.size:  # the recipe updates the tracker BEFORE scoring
            fast, slow = (tracker["mu_fast"], tracker["mu_slow"]) if tracker else (None, None)
            tracker = {
                "mu_fast": _ema_update(fast, window_mean, self.config.gamma_fast),
                "mu_slow": _ema_update(slow, window_mean, self.config.gamma_slow),
            }
            self.means[skill] = tracker
        baseline = tracker["mu_slow"] if tracker else 0.0
        raw = abs(window_mean - baseline) if window.size else 0.0
        bonus = variance_bonus(window) if self.config.variance_bonus else 0.0
        return WindowLearningPotential(
            window_mean=window_mean,
            baseline=baseline,
            mu_fast=tracker["mu_fast"] if tracker else 0.0,
            bonus=bonus,
            total=raw + bonus,
        )

    def state_dict(self) -> dict[str, Any]:
        return {"means": {skill: dict(m) for skill, m in self.means.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        means = state.get("means")
        if not isinstance(means, Mapping):
            raise ValueError(f"LearningPotentialRule state needs a 'means' dict, got {state}")
        loaded = {}
        for skill, m in means.items():
            if not isinstance(m, Mapping) or set(m) != {"mu_fast", "mu_slow"}:
                raise ValueError(f"LearningPotentialRule state for {skill!r} is malformed: {m}")
            loaded[str(skill)] = {k: float(v) for k, v in m.items()}
        self.means = loaded
