"""The recipe's `solve_rate` ablation (`cmd/ablations/*.sh`): the blend's plateau alone."""

from __future__ import annotations

import dataclasses

from spade_jax.spade.regret import ReturnsLike
from spade_jax.spade.rewards.base import StatelessRule, StepsLike, register_designer_reward
from spade_jax.spade.rewards.blend import BlendReward, blend_reward


@dataclasses.dataclass(frozen=True)
class SolveRateConfig:
    """The recipe's solve-rate ablation: the plateau alone (weight 1, regret weight 0)."""

    band: tuple[float, float] = (0.4, 0.6)
    ramp: float = 0.25

    def __post_init__(self) -> None:
        object.__setattr__(self, "band", tuple(float(b) for b in self.band))
        blend_reward([], [], band=self.band, ramp=self.ramp)


@register_designer_reward("solve_rate")
class SolveRateRule(StatelessRule):
    """total = plateau(window win rate); the hint plays do not count."""

    config_type = SolveRateConfig

    def __init__(self, config: SolveRateConfig) -> None:
        self.config = config

    def score(
        self, hint_returns: ReturnsLike, no_hint_returns_by_step: StepsLike, *, skill: str
    ) -> BlendReward:
        del skill
        return blend_reward(
            hint_returns, no_hint_returns_by_step, regret_weight=0.0, plateau_weight=1.0,
            band=self.config.band, ramp=self.config.ramp, floor=True,
        )
