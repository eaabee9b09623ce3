"""Designer rewards: the published recipe's `blend` and its variants, and the paper-text forms.

Everything here is computed in the trainer process from agent returns only; no program
code runs here. Returns are episode scores in [-1, 1] (the recipe's contract scores a loss
as 0 or -1 and a win as 1; the paper-text contract keeps returns in [0, 1]).

A designer sample is scored on its regeneration window: `hint_returns` are the hint plays
of the regeneration step, `no_hint_returns_by_step[j]` the no-hint plays of the window's
step j (offset 0 = the regeneration step itself; any step may be empty; an empty mean is 0).

`blend` (the 30B games recipe, `spade/core/utils/delayed_env_rewards.py`):

    regret      = mean(hint) - mean(no-hint plays at offset 0)      # matched timing
    regret_norm = clip(regret / regret_scale, 0, 1)                  # floor on (recipe)
    win_rate    = mean(all no-hint plays of the window)              # raw rewards, not wins
    plateau     = 1 on [lo, hi]; 1 - distance / ramp outside, floored at 0
    total       = regret_weight * regret_norm + plateau_weight * plateau

A designer sample's advantage is `(total - mean total of its skill) * scale`, no std, with
`scale = env_reward_scale(...)`; totals < 0 are dropped: the loop's designer groups under
the designer's update rule (`train.designer`, default `dr_grpo`; `spade/loop.py`,
`docs/update_rules.md`), not a function here.

The recipe's other variants (`cmd/ablations/*.sh`) are rules selectable by name:
`solve_rate` (plateau only), `learning_potential` (|window mean - slow EMA| per skill),
`regret` (floored flattened-window regret), `micro_lp` (fitted improvement over the window).
The paper-text forms stay: `hint_regret` (`designer_reward`: clipped regret plus a flat-top
anchor on the success share) and `ema_learning_potential`.

Every rule has the same shape (`DesignerRewardRule`): `score(hint_returns,
no_hint_returns_by_step, *, skill)` returns an object with `.total` and `as_metrics()`.
A rule changes the reward only; the loop derives regret, win rate and regimes for memory
and metrics itself from the window's returns, never from the rule's object.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

ReturnsLike = Sequence[float] | np.ndarray
StepsLike = Sequence[ReturnsLike]

# An episode score of the recipe's contract lies in [-1, 1] (the last reward, clipped).
RETURN_BOUNDS = (-1.0, 1.0)


class Regime(enum.StrEnum):
    """Where an environment sits relative to the agent (paper §4.2)."""

    FRONTIER = "frontier"  # solvable with the hint, not without: high regret
    MASTERED = "mastered"  # low regret, the agent already solves it
    INTRACTABLE = "intractable"  # low regret, low returns even with the hint (or buggy)


# ----------------------------------------------------------------------------------------
# Input checks shared by every rule.
# ----------------------------------------------------------------------------------------


def window_returns(returns: ReturnsLike, name: str) -> np.ndarray:
    """One arm's returns as a float64 vector (may be empty), or a ValueError naming why."""
    array = np.asarray(returns, dtype=np.float64)
    if array.ndim != 1:
        raise ValueError(f"{name} must be a 1-D sequence of episode returns, got shape {array.shape}")
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{name} contains non-finite returns: {array[~np.isfinite(array)][:5]}")
    lo, hi = RETURN_BOUNDS
    if array.size and (array.min() < lo or array.max() > hi):
        raise ValueError(
            f"{name} must lie in [{lo}, {hi}] (episode scores); got min {array.min()}, "
            f"max {array.max()}"
        )
    return array


def window_steps(steps: StepsLike, name: str = "no_hint_returns_by_step") -> list[np.ndarray]:
    """The window's per-step returns (offset 0 first) as vectors; steps may be empty."""
    if isinstance(steps, (str, bytes)) or not isinstance(steps, (Sequence, np.ndarray)):
        raise ValueError(f"{name} must be a list over the window's steps, got {type(steps).__name__}")
    out = []
    for offset, step in enumerate(steps):
        if np.ndim(step) != 1:
            raise ValueError(
                f"{name}[{offset}] must be a 1-D sequence of returns (a list over steps of "
                f"lists of returns), got {step!r}"
            )
        out.append(window_returns(step, f"{name}[{offset}]"))
    return out


def _mean_or_zero(values: np.ndarray) -> float:
    """The recipe's convention: an arm or step without plays has mean 0."""
    return float(values.mean()) if values.size else 0.0


def _flatten(steps: Sequence[np.ndarray]) -> np.ndarray:
    return np.concatenate(steps) if steps else np.zeros(0)


def _check_finite(name: str, value: float, *, positive: bool = False) -> None:
    if not math.isfinite(value) or (positive and value <= 0):
        kind = "finite and > 0" if positive else "finite"
        raise ValueError(f"{name} must be {kind}, got {value}")


# ----------------------------------------------------------------------------------------
# The blend reward and its two batch helpers (public API of issue 17 item 2).
# ----------------------------------------------------------------------------------------


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
    _check_finite("regret_scale", regret_scale, positive=True)
    _check_finite("ramp", ramp, positive=True)
    _check_finite("regret_weight", regret_weight)
    _check_finite("plateau_weight", plateau_weight)
    if len(band) != 2 or not all(math.isfinite(b) for b in band) or band[0] > band[1]:
        raise ValueError(f"band must be (lo, hi) with finite lo <= hi, got {band}")
    hint = window_returns(hint_returns, "hint_returns")
    steps = window_steps(no_hint_returns_by_step)
    offset0 = steps[0] if steps else np.zeros(0)
    no_hint = _flatten(steps)

    mean_hint, mean_offset0 = _mean_or_zero(hint), _mean_or_zero(offset0)
    regret = mean_hint - mean_offset0
    regret_norm = regret / regret_scale
    if floor:
        regret_norm = min(1.0, max(0.0, regret_norm))
    win_rate = _mean_or_zero(no_hint)
    plateau = plateau_score(win_rate, (float(band[0]), float(band[1])), ramp)
    return BlendReward(
        regret=regret,
        regret_norm=regret_norm,
        win_rate=win_rate,
        plateau=plateau,
        total=regret_weight * regret_norm + plateau_weight * plateau,
        mean_hint=mean_hint,
        mean_no_hint_offset0=mean_offset0,
        num_hint=int(hint.size),
        num_no_hint=int(no_hint.size),
    )


def env_reward_scale(
    num_env_trajectories: int,
    num_actor_trajectories: int,
    regeneration_interval: int,
    max_scale: float = 50.0,
) -> float:
    """Scale of the designer advantages: min(actor / env * interval, max_scale).

    The designer's few samples are weighed up to the agent's many in the pooled loss; 1.0
    when either count is <= 0 (nothing to balance). Recipe: 192 / 24 * 4 = 32.
    """
    for name, value in (
        ("num_env_trajectories", num_env_trajectories),
        ("num_actor_trajectories", num_actor_trajectories),
        ("regeneration_interval", regeneration_interval),
        ("max_scale", max_scale),
    ):
        _check_finite(name, float(value))
    if num_env_trajectories <= 0 or num_actor_trajectories <= 0:
        return 1.0
    scale = num_actor_trajectories / num_env_trajectories * regeneration_interval
    return float(min(scale, max_scale))


def variance_bonus(returns: np.ndarray) -> float:
    """The recipe's optional solver-variance bonus: a bump peaking at return variance 0.25
    (a 50/50 win/loss game), exp(-(var - 0.25)^2 / 0.02); 0 with fewer than two plays."""
    if returns.size < 2:
        return 0.0
    return float(np.exp(-((returns.var() - 0.25) ** 2) / (2 * 0.01)))


# ----------------------------------------------------------------------------------------
# The paper-text reward (`designer_reward`), kept with its signature.
# ----------------------------------------------------------------------------------------


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


def validate_returns(returns: ReturnsLike, name: str) -> np.ndarray:
    """Paper-text returns: a non-empty float64 vector in [0, 1], or a ValueError naming why."""
    array = np.asarray(returns, dtype=np.float64)
    if array.ndim != 1:
        raise ValueError(f"{name} must be a 1-D sequence of episode returns, got shape {array.shape}")
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

    mean_hint = float(hint.mean())
    mean_no_hint = float(no_hint.mean())
    regret = mean_hint - mean_no_hint
    clipped = min(max(regret, 0.0), 1.0)
    win_rate = float(np.mean(no_hint >= success_threshold))
    anchor = flat_top_anchor(win_rate, config.band)
    return DesignerReward(
        regret=regret,
        clipped=clipped,
        win_rate=win_rate,
        anchor=anchor,
        total=config.regret_weight * clipped + config.anchor_weight * anchor,
        regime=classify_regime(regret, mean_hint, mean_no_hint, config),
        mean_hint=mean_hint,
        mean_no_hint=mean_no_hint,
        win_rate_hint=float(np.mean(hint >= success_threshold)),
        num_hint=int(hint.size),
        num_no_hint=int(no_hint.size),
    )


# ----------------------------------------------------------------------------------------
# The rule protocol and its registry.
# ----------------------------------------------------------------------------------------


class ScoredEnvironment(Protocol):
    """What every rule returns: the designer's scalar `total` (< 0 = drop) and its parts."""

    total: float

    def as_metrics(self) -> dict[str, float]: ...


class DesignerRewardRule(Protocol):
    """A designer-reward rule; stateful rules update inside score() and checkpoint state."""

    def score(
        self, hint_returns: ReturnsLike, no_hint_returns_by_step: StepsLike, *, skill: str
    ) -> ScoredEnvironment: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


# name -> rule class; each class has `config_type` and takes one config argument.
DESIGNER_REWARDS: dict[str, type] = {}


def register_designer_reward(name: str) -> Callable[[type], type]:
    """Decorator adding a rule class to `DESIGNER_REWARDS`; duplicate names are an error."""

    def decorator(rule_class: type) -> type:
        if name in DESIGNER_REWARDS:
            raise ValueError(f"designer reward {name!r} is already registered")
        DESIGNER_REWARDS[name] = rule_class
        return rule_class

    return decorator


def _build_config(name: str, config_type: type, config: Any) -> Any:
    if config is None:
        return config_type()
    if isinstance(config, config_type):
        return config
    if isinstance(config, Mapping):
        known = {f.name for f in dataclasses.fields(config_type)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(
                f"designer reward {name!r}: unknown config field(s) {unknown}; "
                f"{config_type.__name__} has {sorted(known)}"
            )
        return config_type(**config)
    # A base config (e.g. DesignerRewardConfig for hint_regret) is upgraded field by field.
    if dataclasses.is_dataclass(config) and issubclass(config_type, type(config)):
        return config_type(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)})
    raise ValueError(
        f"designer reward {name!r} takes None, a dict of overrides or a "
        f"{config_type.__name__}, got {type(config).__name__}"
    )


def make_designer_reward(name: str, config: Any = None) -> DesignerRewardRule:
    """The registered rule `name` built from `config` (None, a dict of overrides, or the
    rule's own config dataclass). Unknown names or fields raise ValueError naming them."""
    if name not in DESIGNER_REWARDS:
        raise ValueError(f"unknown designer reward {name!r}; registered: {sorted(DESIGNER_REWARDS)}")
    rule_class = DESIGNER_REWARDS[name]
    return rule_class(_build_config(name, rule_class.config_type, config))


class _StatelessRule:
    """state_dict / load_state_dict of a rule that keeps nothing between calls."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} is stateless, got state keys {sorted(state)}")


# ----------------------------------------------------------------------------------------
# The recipe's rules.
# ----------------------------------------------------------------------------------------


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
class BlendRule(_StatelessRule):
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


@dataclasses.dataclass(frozen=True)
class SolveRateConfig:
    """The recipe's solve-rate ablation: the plateau alone (weight 1, regret weight 0)."""

    band: tuple[float, float] = (0.4, 0.6)
    ramp: float = 0.25

    def __post_init__(self) -> None:
        object.__setattr__(self, "band", tuple(float(b) for b in self.band))
        blend_reward([], [], band=self.band, ramp=self.ramp)


@register_designer_reward("solve_rate")
class SolveRateRule(_StatelessRule):
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
class RegretRule(_StatelessRule):
    """Floored regret against the flattened window (not matched timing), never dropped."""

    config_type = RegretConfig

    def __init__(self, config: RegretConfig) -> None:
        self.config = config

    def score(
        self, hint_returns: ReturnsLike, no_hint_returns_by_step: StepsLike, *, skill: str
    ) -> WindowRegret:
        del skill
        hint = window_returns(hint_returns, "hint_returns")
        window = _flatten(window_steps(no_hint_returns_by_step))
        regret = _mean_or_zero(hint) - _mean_or_zero(window)
        bonus = variance_bonus(window) if self.config.variance_bonus else 0.0
        return WindowRegret(regret=regret, bonus=bonus, total=max(0.0, regret) + bonus)


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
        return float(_flatten(played[mid:]).mean() - _flatten(played[:mid]).mean())
    means = np.array([s.mean() for s in played])
    weights = np.array([s.size for s in played], dtype=np.float64)
    x_mean = np.average(offsets, weights=weights)
    y_mean = np.average(means, weights=weights)
    slope = np.sum(weights * (offsets - x_mean) * (means - y_mean)) / np.sum(
        weights * (offsets - x_mean) ** 2
    )
    return float(slope * (offsets[-1] - offsets[0]))


@register_designer_reward("micro_lp")
class MicroLPRule(_StatelessRule):
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
        window = _flatten(window_steps(no_hint_returns_by_step))
        tracker = self.means.get(skill)
        if window.size:  # the recipe updates the tracker BEFORE scoring
            mean = float(window.mean())
            fast, slow = (tracker["mu_fast"], tracker["mu_slow"]) if tracker else (None, None)
            tracker = {
                "mu_fast": _ema_update(fast, mean, self.config.gamma_fast),
                "mu_slow": _ema_update(slow, mean, self.config.gamma_slow),
            }
            self.means[skill] = tracker
        baseline = tracker["mu_slow"] if tracker else 0.0
        raw = abs(float(window.mean()) - baseline) if window.size else 0.0
        bonus = variance_bonus(window) if self.config.variance_bonus else 0.0
        return WindowLearningPotential(
            window_mean=_mean_or_zero(window),
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


# ----------------------------------------------------------------------------------------
# The paper-text rules behind the same protocol.
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HintRegretConfig(DesignerRewardConfig):
    """`DesignerRewardConfig` plus the success threshold of the win rate (paper text)."""

    success_threshold: float = 1.0


@register_designer_reward("hint_regret")
class HintRegretReward(_StatelessRule):
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
        no_hint = _flatten(window_steps(no_hint_returns_by_step))
        return designer_reward(
            hint_returns, no_hint, self.config.success_threshold, self.config
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
        no_hint = _flatten(window_steps(no_hint_returns_by_step))
        mean_return = float(validate_returns(no_hint, "no-hint window returns").mean())
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
