"""The recipe's default designer reward, `blend` (the 30B games recipe,
`spade/core/utils/delayed_env_rewards.py`), and its config and rule.

    regret      = regret(hint, no-hint plays at offset 0)           # matched timing
    regret_norm = clip(regret / regret_scale, 0, 1)                  # floor on (recipe)
    win_rate    = window_win_rate(no-hint plays by step)             # raw rewards, not wins
    plateau     = 1 on [lo, hi]; 1 - distance / ramp outside, floored at 0
    total       = regret_weight * regret_norm + plateau_weight * plateau

`regret` and `window_win_rate` are the single definitions of :mod:`spade_jax.spade.regret`,
the same the loop logs and stores in memory (`window.game_stats`).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from spade_jax.spade.regret import ReturnsLike, mean_return, regret, window_win_rate
from spade_jax.spade.rewards.base import (
    StatelessRule,
    StepsLike,
    check_finite,
    register_designer_reward,
    window_returns,
    window_steps,
)


def plateau_score(win_rate: float, band: tuple[float, float], ramp: float) -> float:
    """1 on [lo, hi]; outside, 1 - distance to the band / ramp, floored at 0."""
    lo, hi = band
    distance = max(lo - win_rate, win_rate - hi, 0.0)
    return max(0.0, 1.0 - distance / ramp)


@dataclasses.dataclass(frozen=True)
class BlendReward:
    """One environment's blend reward and its parts (the names the logs use)."""

    regret: float  # mean hint return - mean no-hint return at offset 0 (raw, signed)
    regret_norm: float  # regret / regret_scale, clipped to [0, 1] when floored
    win_rate: float  # mean raw return of every no-hint play of the window
    plateau: float  # flat-top difficulty score of win_rate
    total: float  # regret_weight * regret_norm + plateau_weight * plateau
    mean_hint: float
    mean_no_hint_offset0: float
    num_hint: int
    num_no_hint: int  # all no-hint plays of the window

    def as_metrics(self) -> dict[str, float]:
        return {
            "regret": self.regret,
            "regret_norm": self.regret_norm,
            "win_rate": self.win_rate,
            "plateau": self.plateau,
            "total": self.total,
            "mean_hint": self.mean_hint,
            "mean_no_hint_offset0": self.mean_no_hint_offset0,
        }


def _check_settings(
    regret_scale: float, regret_weight: float, plateau_weight: float,
    band: tuple[float, float], ramp: float,
) -> None:
    check_finite("regret_scale", regret_scale, positive=True)
    check_finite("ramp", ramp, positive=True)
    check_finite("regret_weight", regret_weight)
    check_finite("plateau_weight", plateau_weight)
    if len(band) != 2 or not all(math.isfinite(b) for b in band) or band[0] > band[1]:
        raise ValueError(f"band must be (lo, hi) with finite lo <= hi, got {band}")


def blend_reward(
    hint_returns: ReturnsLike,
    no_hint_returns_by_step: StepsLike,
    *,
    regret_scale: float = 0.15,
    regret_weight: float = 0.4,
    plateau_weight: float = 0.6,
    band: tuple[float, float] = (0.4, 0.6),
    ramp: float = 0.25,
    floor: bool = True,
) -> BlendReward:
    """The recipe's `blend` designer reward of one environment over its window.

    Args:
      hint_returns: the hint plays of the regeneration step (recipe: 16).
      no_hint_returns_by_step: the window's no-hint returns per step, offset 0 first; any
        step may be empty (its mean counts as 0).
      regret_scale: fixed nominal scale the regret is divided by (recipe 0.15).
      regret_weight, plateau_weight: weights of the two parts (recipe 0.4, 0.6).
      band: (lo, hi) win rates where the plateau pays 1 (recipe [0.4, 0.6]).
      ramp: distance from the band over which the plateau falls to 0 (recipe 0.25).
      floor: clip regret_norm to [0, 1] (recipe on); off, a negative total is possible and
        the loop then drops the sample from its skill's group.
    """
    _check_settings(regret_scale, regret_weight, plateau_weight, band, ramp)
    hint = window_returns(hint_returns, "hint_returns")
    steps = window_steps(no_hint_returns_by_step)
    offset0 = steps[0] if steps else np.zeros(0)

    raw_regret = regret(hint, offset0)  # matched timing: the plays of the hint's step
    regret_norm = raw_regret / regret_scale
    if floor:
        regret_norm = min(1.0, max(0.0, regret_norm))
    win_rate = window_win_rate(steps)
    plateau = plateau_score(win_rate, (float(band[0]), float(band[1])), ramp)
    return BlendReward(
        regret=raw_regret,
        regret_norm=regret_norm,
        win_rate=win_rate,
        plateau=plateau,
        total=regret_weight * regret_norm + plateau_weight * plateau,
        mean_hint=mean_return(hint),
        mean_no_hint_offset0=mean_return(offset0),
        num_hint=int(hint.size),
        num_no_hint=sum(int(step.size) for step in steps),
    )


@dataclasses.dataclass(frozen=True)
class BlendConfig:
    """`blend_reward`'s settings; defaults are the 30B games recipe (see its docstring)."""

    regret_scale: float = 0.15
    regret_weight: float = 0.4
    plateau_weight: float = 0.6
    band: tuple[float, float] = (0.4, 0.6)
    ramp: float = 0.25
    floor: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "band", tuple(float(b) for b in self.band))
        # blend_reward checks every setting before it reads returns: one place for the rules.
        blend_reward([], [], **dataclasses.asdict(self))


@register_designer_reward("blend")
class BlendRule(StatelessRule):
    """The recipe's default designer reward: floored matched-timing regret + plateau."""

    config_type = BlendConfig

    def __init__(self, config: BlendConfig) -> None:
        self.config = config

    def score(
        self, hint_returns: ReturnsLike, no_hint_returns_by_step: StepsLike, *, skill: str
    ) -> BlendReward:
        del skill  # stateless and skill-blind: centring per skill is the batch's job
        return blend_reward(
            hint_returns, no_hint_returns_by_step, **dataclasses.asdict(self.config)
        )
