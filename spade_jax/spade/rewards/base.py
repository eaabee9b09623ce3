"""What every designer reward rule shares: the input checks, the rule protocol, the regimes,
the designer advantage scale, and the glue to the one rule registry.

The rules are classes registered in the ``designer_rewards`` category of
:mod:`spade_jax.rl.registry` (the same registry, and the same config resolver, as the
update rules); ``register_designer_reward`` / ``make_designer_reward`` /
``DESIGNER_REWARDS`` are the designer-facing names for it. The registry object lives in
``rl`` and the classes here in ``spade`` because ``spade`` may import ``rl``, never the
reverse.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from spade_jax.rl.registry import designer_rewards
from spade_jax.spade.regret import ReturnsLike

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


def check_finite(name: str, value: float, *, positive: bool = False) -> None:
    """A setting that must be finite (and > 0 with ``positive``), or a ValueError naming it."""
    if not math.isfinite(value) or (positive and value <= 0):
        kind = "finite and > 0" if positive else "finite"
        raise ValueError(f"{name} must be {kind}, got {value}")


# ----------------------------------------------------------------------------------------
# Helpers more than one rule uses.
# ----------------------------------------------------------------------------------------


def variance_bonus(returns: np.ndarray) -> float:
    """The recipe's optional solver-variance bonus: a bump peaking at return variance 0.25
    (a 50/50 win/loss game), exp(-(var - 0.25)^2 / 0.02); 0 with fewer than two plays."""
    if returns.size < 2:
        return 0.0
    return float(np.exp(-((returns.var() - 0.25) ** 2) / (2 * 0.01)))


def env_reward_scale(
    num_env_trajectories: int,
    num_actor_trajectories: int,
    regeneration_interval: int,
    max_scale: float = 50.0,
) -> float:
    """Scale of the designer advantages: min(actor / env * interval, max_scale).

    The designer's few samples are weighed up to the agent's many in the pooled loss; 1.0
    when either count is <= 0 (nothing to balance). Recipe: 192 / 24 * 4 = 32. It applies
    to whichever rule scored the samples.
    """
    for name, value in (
        ("num_env_trajectories", num_env_trajectories),
        ("num_actor_trajectories", num_actor_trajectories),
        ("regeneration_interval", regeneration_interval),
        ("max_scale", max_scale),
    ):
        check_finite(name, float(value))
    if num_env_trajectories <= 0 or num_actor_trajectories <= 0:
        return 1.0
    scale = num_actor_trajectories / num_env_trajectories * regeneration_interval
    return float(min(scale, max_scale))


# ----------------------------------------------------------------------------------------
# The rule protocol.
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


class StatelessRule:
    """state_dict / load_state_dict of a rule that keeps nothing between calls."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} is stateless, got state keys {sorted(state)}")


# ----------------------------------------------------------------------------------------
# The designer-facing names of the registry category.
# ----------------------------------------------------------------------------------------


class _RegisteredRuleClasses(Mapping[str, type]):
    """A live, read-only name -> rule class view of the ``designer_rewards`` category (a
    rule registered later, e.g. from an experiment's ``rule_modules``, shows up)."""

    def __getitem__(self, name: str) -> type:
        if name not in designer_rewards:
            raise KeyError(name)
        return designer_rewards.get(name).fn

    def __iter__(self) -> Iterator[str]:
        return iter(designer_rewards.names())

    def __len__(self) -> int:
        return len(designer_rewards.names())


DESIGNER_REWARDS: Mapping[str, type] = _RegisteredRuleClasses()


def register_designer_reward(name: str) -> Callable[[type], type]:
    """Decorator registering a rule class under ``name`` in the ``designer_rewards``
    category, with its ``config_type`` (a frozen dataclass) as its config; the class takes
    that config as its one argument. Duplicate names are an error."""

    def decorator(rule_class: type) -> type:
        config = getattr(rule_class, "config_type", None)
        return designer_rewards.register(name, config=config)(rule_class)

    return decorator


def make_designer_reward(name: str, config: Any = None) -> DesignerRewardRule:
    """The registered rule `name` built from `config` (None, a dict of overrides, the
    rule's own config dataclass, or a base dataclass it extends, upgraded field by field:
    the registry's one resolver). Unknown names or fields raise ValueError naming them."""
    if name not in designer_rewards:
        raise ValueError(
            f"unknown designer reward {name!r}; registered: {designer_rewards.names()}"
        )
    rule = designer_rewards.get(name)
    return rule.fn(rule.resolve_config(config))
