"""The paper text's designer reward: `designer_reward` (hint-based regret plus a flat-top
anchor on the no-hint success share, and the paper's regimes) and its window rule,
`hint_regret`.

Paper-text contract: returns in [0, 1] and both arms non-empty (ValueError otherwise).
The regret is :func:`spade_jax.spade.regret.regret` of the two arms, the same definition
the recipe's rules and the loop's measurements use.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from spade_jax.spade.regret import ReturnsLike, flatten_steps, mean_return, regret
from spade_jax.spade.rewards.base import (
    Regime,
    StatelessRule,
    StepsLike,
    register_designer_reward,
    validate_returns,
    window_steps,
)


@dataclasses.dataclass(frozen=True)
class DesignerRewardConfig:
    """Settings of the paper-text hint-based regret designer reward.

    Attributes:
      regret_weight: weight of the clipped regret in r_D (paper: 0.4).
      anchor_weight: weight of the flat-top difficulty anchor in r_D (paper: 0.6).
      band: (lo, hi) no-hint win-rate band where the anchor pays 1 (paper: [0.4, 0.6]);
        outside it the anchor falls linearly to 0 at win rate 0 and at win rate 1.
      frontier_regret: raw regret strictly above this -> `Regime.FRONTIER`.
      mastered_return: with regret at or below `frontier_regret`, the better arm's mean
        return at or above this -> `Regime.MASTERED`, below -> `Regime.INTRACTABLE`.
      invalid_penalty: designer reward for a program that fails validation (paper-text
        variant only; the recipe rejection-samples instead).
    """

    regret_weight: float = 0.4
    anchor_weight: float = 0.6
    band: tuple[float, float] = (0.4, 0.6)
    frontier_regret: float = 0.2
    mastered_return: float = 0.5
    invalid_penalty: float = -1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "band", tuple(float(b) for b in self.band))
        name = type(self).__name__
        for field in ("regret_weight", "anchor_weight"):
            value = getattr(self, field)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}.{field} must be finite and >= 0, got {value}")
        if len(self.band) != 2:
            raise ValueError(f"{name}.band must be (lo, hi), got {self.band}")
        lo, hi = self.band
        if not 0.0 <= lo <= hi <= 1.0:
            raise ValueError(f"{name}.band needs 0 <= lo <= hi <= 1, got {self.band}")
        if not 0.0 <= self.frontier_regret < 1.0:
            raise ValueError(f"{name}.frontier_regret must be in [0, 1), got {self.frontier_regret}")
        if not 0.0 <= self.mastered_return <= 1.0:
            raise ValueError(f"{name}.mastered_return must be in [0, 1], got {self.mastered_return}")
        if not math.isfinite(self.invalid_penalty):
            raise ValueError(f"{name}.invalid_penalty must be finite, got {self.invalid_penalty}")


@dataclasses.dataclass(frozen=True)
class DesignerReward:
    """One environment's paper-text designer reward and its parts."""

    regret: float  # raw: mean_hint - mean_no_hint, negative when the hint hurts
    clipped: float  # clip(regret, 0, 1)
    win_rate: float  # fraction of no-hint episodes with return >= success_threshold
    anchor: float  # flat-top difficulty anchor of win_rate
    total: float  # regret_weight * clipped + anchor_weight * anchor
    regime: Regime
    mean_hint: float
    mean_no_hint: float
    win_rate_hint: float  # same threshold, hint arm (for memory statistics)
    num_hint: int
    num_no_hint: int

    def as_metrics(self) -> dict[str, float]:
        """Scalar parts keyed by the names used in the logs."""
        return {
            "regret": self.regret,
            "clipped_regret": self.clipped,
            "win_rate": self.win_rate,
            "win_rate_hint": self.win_rate_hint,
            "anchor": self.anchor,
            "total": self.total,
            "mean_hint": self.mean_hint,
            "mean_no_hint": self.mean_no_hint,
        }


def flat_top_anchor(win_rate: float, band: tuple[float, float]) -> float:
    """1 on [lo, hi]; linear from 0 at win rate 0 up to lo, and from hi down to 0 at 1."""
    lo, hi = band
    if win_rate < lo:
        return win_rate / lo
    if win_rate > hi:
        return (1.0 - win_rate) / (1.0 - hi)
    return 1.0


def classify_regime(
    regret: float, mean_hint: float, mean_no_hint: float, config: DesignerRewardConfig
) -> Regime:
    """Paper §4.2's three regimes from raw regret and per-arm mean returns.

    The better arm (not just the hint arm) decides mastered vs intractable so that an
    environment the agent solves without the hint, but where the hint misleads it
    (negative regret), counts as mastered rather than intractable.
    """
    if regret > config.frontier_regret:
        return Regime.FRONTIER
    if max(mean_hint, mean_no_hint) >= config.mastered_return:
        return Regime.MASTERED
    return Regime.INTRACTABLE


def designer_reward(
    returns_hint: ReturnsLike,
    returns_no_hint: ReturnsLike,
    success_threshold: float = 1.0,
    config: DesignerRewardConfig | None = None,
) -> DesignerReward:
    """Paper-text hint-based regret designer reward of one environment from its two arms.

    Args:
      returns_hint: per-episode returns of the agent given the hint (paper: 16 episodes).
      returns_no_hint: per-episode returns without the hint (paper: 16 * k episodes).
      success_threshold: an episode "fully solves" the environment when its return is at
        least this; the win rate counts such no-hint episodes.
      config: weights, anchor band and regime thresholds; defaults are the paper's.
    """
    config = config or DesignerRewardConfig()
    if not (math.isfinite(success_threshold) and 0.0 < success_threshold <= 1.0):
        raise ValueError(f"success_threshold must be in (0, 1], got {success_threshold}")
    hint = validate_returns(returns_hint, "returns_hint")
    no_hint = validate_returns(returns_no_hint, "returns_no_hint")

    mean_hint, mean_no_hint = mean_return(hint), mean_return(no_hint)
    raw_regret = regret(hint, no_hint)
    clipped = min(max(raw_regret, 0.0), 1.0)
    # The paper's win rate is a success share (return >= threshold), not the recipe's
    # window win rate (a mean of raw returns).
    win_rate = float(np.mean(no_hint >= success_threshold))
    anchor = flat_top_anchor(win_rate, config.band)
    return DesignerReward(
        regret=raw_regret,
        clipped=clipped,
        win_rate=win_rate,
        anchor=anchor,
        total=config.regret_weight * clipped + config.anchor_weight * anchor,
        regime=classify_regime(raw_regret, mean_hint, mean_no_hint, config),
        mean_hint=mean_hint,
        mean_no_hint=mean_no_hint,
        win_rate_hint=float(np.mean(hint >= success_threshold)),
        num_hint=int(hint.size),
        num_no_hint=int(no_hint.size),
    )


@dataclasses.dataclass(frozen=True)
class HintRegretConfig(DesignerRewardConfig):
    """`DesignerRewardConfig` plus the success threshold of the win rate (paper text)."""

    success_threshold: float = 1.0


@register_designer_reward("hint_regret")
class HintRegretReward(StatelessRule):
    """`designer_reward` with the window's no-hint steps flattened into one arm.

    Paper-text contract: returns in [0, 1] and both arms non-empty (ValueError otherwise).
    """

    config_type = HintRegretConfig

    def __init__(self, config: HintRegretConfig) -> None:
        self.config = config

    def score(
        self, hint_returns: ReturnsLike, no_hint_returns_by_step: StepsLike, *, skill: str
    ) -> DesignerReward:
        del skill
        no_hint = flatten_steps(window_steps(no_hint_returns_by_step))
        return designer_reward(
            hint_returns, no_hint, self.config.success_threshold, self.config
        )
