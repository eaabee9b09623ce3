"""The recipe's `regret` variant (`regret_based` in `cmd/ablations/*.sh`): the floored
regret against the WHOLE window (not matched timing), `regret(hint, flatten(window))`."""

from __future__ import annotations

import dataclasses

from spade_jax.spade.regret import ReturnsLike, flatten_steps, regret
from spade_jax.spade.rewards.base import (
    StatelessRule,
    StepsLike,
    register_designer_reward,
    variance_bonus,
    window_returns,
    window_steps,
)


@dataclasses.dataclass(frozen=True)
class RegretConfig:
    """The recipe's `regret_based` variant: max(0, mean hint - mean of the whole window).

    Attributes:
      variance_bonus: add `variance_bonus(window returns)` (the recipe offers this bonus on
        its learning-potential path; here it is available to both).
    """

    variance_bonus: bool = False


@dataclasses.dataclass(frozen=True)
class WindowRegret:
    """One environment's floored window regret."""

    regret: float  # mean hint - mean of all no-hint plays of the window (raw)
    bonus: float
    total: float  # max(0, regret) + bonus

    def as_metrics(self) -> dict[str, float]:
        return {"regret": self.regret, "variance_bonus": self.bonus, "total": self.total}


@register_designer_reward("regret")
class RegretRule(StatelessRule):
    """Floored regret against the flattened window (not matched timing), never dropped."""

    config_type = RegretConfig

    def __init__(self, config: RegretConfig) -> None:
        self.config = config

    def score(
        self, hint_returns: ReturnsLike, no_hint_returns_by_step: StepsLike, *, skill: str
    ) -> WindowRegret:
        del skill
        hint = window_returns(hint_returns, "hint_returns")
        window = flatten_steps(window_steps(no_hint_returns_by_step))
        raw_regret = regret(hint, window)
        bonus = variance_bonus(window) if self.config.variance_bonus else 0.0
        return WindowRegret(regret=raw_regret, bonus=bonus, total=max(0.0, raw_regret) + bonus)
