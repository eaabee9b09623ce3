"""Designer rewards: hint-based regret (SPADE §4.2) and the EMA learning-potential ablation.

Everything here is computed in the trainer process from agent returns only; no program
code runs here.

Hint-based regret, the deployed form (SPEC §2):

    regret   = mean(R_A(e | h)) - mean(R_A(e))          # raw, may be negative
    clipped  = clip(regret, 0, 1)                        # returns in [0, 1] -> already normalised
    win_rate = mean(R_A(e) >= success_threshold)         # no-hint arm
    anchor   = flat-top: 1 on [lo, hi], linear to 0 at win rates 0 and 1
    r_D      = 0.4 * clipped + 0.6 * anchor

Three regimes (paper §4.2): high regret = learning frontier; low regret with high returns =
mastered; low regret with low returns even with the hint = intractable (or buggy).

The EMA learning potential (ablation, 55.9 vs 58.3) scores an environment by the unsigned
deviation of its no-hint mean return from a per-skill exponential moving mean of returns.
It needs no hint arm, and it pays mastered and hopeless environments alike once the moving
mean sits in between: that bluntness is what the ablation measures.

Designer-reward rules are registered by name so an experiment file can pick one:
`make_designer_reward("hint_regret")` or `make_designer_reward("ema_learning_potential")`.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

ReturnsLike = Sequence[float] | np.ndarray


class Regime(enum.StrEnum):
    """Where an environment sits relative to the agent (paper §4.2)."""

    FRONTIER = "frontier"  # solvable with the hint, not without: high regret
    MASTERED = "mastered"  # low regret, the agent already solves it
    INTRACTABLE = "intractable"  # low regret, low returns even with the hint (or buggy)


@dataclasses.dataclass(frozen=True)
class DesignerRewardConfig:
    """Settings of the hint-based regret designer reward.

    Attributes:
      regret_weight: weight of the clipped regret in r_D (paper: 0.4).
      anchor_weight: weight of the flat-top difficulty anchor in r_D (paper: 0.6).
      band: (lo, hi) no-hint win-rate band where the anchor pays 1 (paper: [0.4, 0.6]);
        outside it the anchor falls linearly to 0 at win rate 0 and at win rate 1.
      frontier_regret: raw regret strictly above this -> `Regime.FRONTIER`.
      mastered_return: with regret at or below `frontier_regret`, the better arm's mean
        return at or above this -> `Regime.MASTERED`, below -> `Regime.INTRACTABLE`.
      invalid_penalty: designer reward for a program that fails validation (it never
        reaches the agent, so no returns exist). Used by the round loop.
    """

    regret_weight: float = 0.4
    anchor_weight: float = 0.6
    band: tuple[float, float] = (0.4, 0.6)
    frontier_regret: float = 0.2
    mastered_return: float = 0.5
    invalid_penalty: float = -1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "band", tuple(float(b) for b in self.band))
        for name in ("regret_weight", "anchor_weight"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(
                    f"DesignerRewardConfig.{name} must be finite and >= 0, got {value}"
                )
        if len(self.band) != 2:
            raise ValueError(f"DesignerRewardConfig.band must be (lo, hi), got {self.band}")
        lo, hi = self.band
        if not 0.0 <= lo <= hi <= 1.0:
            raise ValueError(f"DesignerRewardConfig.band needs 0 <= lo <= hi <= 1, got {self.band}")
        if not 0.0 <= self.frontier_regret < 1.0:
            raise ValueError(
                f"DesignerRewardConfig.frontier_regret must be in [0, 1), got {self.frontier_regret}"
            )
        if not 0.0 <= self.mastered_return <= 1.0:
            raise ValueError(
                f"DesignerRewardConfig.mastered_return must be in [0, 1], got {self.mastered_return}"
            )
        if not math.isfinite(self.invalid_penalty):
            raise ValueError(
                f"DesignerRewardConfig.invalid_penalty must be finite, got {self.invalid_penalty}"
            )


@dataclasses.dataclass(frozen=True)
class DesignerReward:
    """One environment's designer reward and its parts (all logged every round)."""

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


def validate_returns(returns: Sequence[float] | np.ndarray, name: str) -> np.ndarray:
    """Returns as a float64 vector, or a ValueError naming what is wrong."""
    array = np.asarray(returns, dtype=np.float64)
    if array.ndim != 1:
        raise ValueError(
            f"{name} must be a 1-D sequence of episode returns, got shape {array.shape}"
        )
    if array.size == 0:
        raise ValueError(f"{name} is empty: every arm needs at least one episode")
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{name} contains non-finite returns: {array[~np.isfinite(array)][:5]}")
    if array.min() < 0.0 or array.max() > 1.0:
        raise ValueError(
            f"{name} must lie in [0, 1] (environment returns are normalised); "
            f"got min {array.min()}, max {array.max()}"
        )
    return array


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
    returns_hint: Sequence[float] | np.ndarray,
    returns_no_hint: Sequence[float] | np.ndarray,
    success_threshold: float = 1.0,
    config: DesignerRewardConfig | None = None,
) -> DesignerReward:
    """Hint-based regret designer reward of one environment from its two arms' returns.

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

    mean_hint = float(hint.mean())
    mean_no_hint = float(no_hint.mean())
    regret = mean_hint - mean_no_hint
    clipped = min(max(regret, 0.0), 1.0)
    win_rate = float(np.mean(no_hint >= success_threshold))
    win_rate_hint = float(np.mean(hint >= success_threshold))
    anchor = flat_top_anchor(win_rate, config.band)
    total = config.regret_weight * clipped + config.anchor_weight * anchor
    return DesignerReward(
        regret=regret,
        clipped=clipped,
        win_rate=win_rate,
        anchor=anchor,
        total=total,
        regime=classify_regime(regret, mean_hint, mean_no_hint, config),
        mean_hint=mean_hint,
        mean_no_hint=mean_no_hint,
        win_rate_hint=win_rate_hint,
        num_hint=int(hint.size),
        num_no_hint=int(no_hint.size),
    )


# ----------------------------------------------------------------------------------------
# Registry of designer-reward rules.
# ----------------------------------------------------------------------------------------


class ScoredEnvironment(Protocol):
    """What every designer-reward rule returns: a scalar `total` plus loggable parts."""

    total: float

    def as_metrics(self) -> dict[str, float]: ...


class DesignerRewardRule(Protocol):
    """A designer-reward rule; stateful rules persist their state in checkpoints."""

    def score(
        self,
        returns_hint: Sequence[float] | np.ndarray | None,
        returns_no_hint: Sequence[float] | np.ndarray,
        *,
        skill: str,
    ) -> ScoredEnvironment: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


DESIGNER_REWARDS: dict[str, Callable[..., DesignerRewardRule]] = {}


def register_designer_reward(name: str):
    """Decorator adding a rule factory to `DESIGNER_REWARDS`; duplicate names are an error."""

    def decorator(factory):
        if name in DESIGNER_REWARDS:
            raise ValueError(f"designer reward {name!r} is already registered")
        DESIGNER_REWARDS[name] = factory
        return factory

    return decorator


def make_designer_reward(name: str, **kwargs: Any) -> DesignerRewardRule:
    """Builds the registered rule `name`; kwargs go to its constructor."""
    if name not in DESIGNER_REWARDS:
        raise KeyError(f"unknown designer reward {name!r}; registered: {sorted(DESIGNER_REWARDS)}")
    return DESIGNER_REWARDS[name](**kwargs)


@register_designer_reward("hint_regret")
class HintRegretReward:
    """`designer_reward` behind the rule protocol (stateless)."""

    def __init__(
        self, config: DesignerRewardConfig | None = None, success_threshold: float = 1.0
    ) -> None:
        self.config = config or DesignerRewardConfig()
        self.success_threshold = success_threshold

    def score(
        self,
        returns_hint: ReturnsLike | None,
        returns_no_hint: ReturnsLike,
        *,
        skill: str,
    ) -> DesignerReward:
        if returns_hint is None:
            raise ValueError("hint_regret needs the hint arm's returns, got None")
        return designer_reward(returns_hint, returns_no_hint, self.success_threshold, self.config)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state:
            raise ValueError(f"hint_regret is stateless, got state keys {sorted(state)}")


@dataclasses.dataclass(frozen=True)
class EMALearningPotentialConfig:
    """Settings of the EMA learning-potential designer reward (ablation).

    Attributes:
      decay: moving-mean update m_s <- decay * m_s + (1 - decay) * mean_return.
      initial_mean: moving mean of a skill before any environment was scored. None seeds
        it with the skill's first environment, which then scores 0 (no history yet).
    """

    decay: float = 0.9
    initial_mean: float | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(
                f"EMALearningPotentialConfig.decay must be in [0, 1), got {self.decay}"
            )
        if self.initial_mean is not None and not 0.0 <= self.initial_mean <= 1.0:
            raise ValueError(
                f"EMALearningPotentialConfig.initial_mean must be in [0, 1], got {self.initial_mean}"
            )


@dataclasses.dataclass(frozen=True)
class LearningPotential:
    """One environment's EMA learning-potential score."""

    mean_return: float  # no-hint arm mean return
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
    previous ones, and then folded into it; the order is the round loop's order.
    """

    def __init__(self, config: EMALearningPotentialConfig | None = None) -> None:
        self.config = config or EMALearningPotentialConfig()
        self.moving_means: dict[str, float] = {}

    def score(
        self,
        returns_hint: ReturnsLike | None,
        returns_no_hint: ReturnsLike,
        *,
        skill: str,
    ) -> LearningPotential:
        del returns_hint  # the cheaper signal uses the no-hint arm only
        mean_return = float(validate_returns(returns_no_hint, "returns_no_hint").mean())
        previous = self.moving_means.get(skill, self.config.initial_mean)
        if previous is None:
            previous = mean_return
        decay = self.config.decay
        self.moving_means[skill] = decay * previous + (1.0 - decay) * mean_return
        return LearningPotential(
            mean_return=mean_return, moving_mean=previous, total=abs(mean_return - previous)
        )

    def state_dict(self) -> dict[str, Any]:
        return {"moving_means": dict(self.moving_means)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        means = state.get("moving_means")
        if not isinstance(means, Mapping):
            raise ValueError(f"EMALearningPotential state needs a 'moving_means' dict, got {state}")
        self.moving_means = {str(k): float(v) for k, v in means.items()}
