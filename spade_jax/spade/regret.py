"""The one definition of regret and of a window's win rate (issue 36, item 1).

Every place that measures how much the hint helps, or how often the agent wins a game over
its window, calls these functions, so the logged `regret_raw_mean`, the memory's regret and
regimes, and every designer reward rule agree by construction instead of by copy:

    mean_return(returns)                   mean of one set of episode returns; empty -> 0
    regret(hint, no_hint)                  mean_return(hint) - mean_return(no_hint)
    window_win_rate(no_hint_by_step)       mean_return of every no-hint play of the window

Which no-hint plays a caller compares the hint arm with is the caller's choice and part of
its definition, not a second formula:

- matched timing, the recipe's `blend` and the loop's own measurement
  (`window.game_stats`): `regret(hint, no_hint_by_step[0])`, the plays of the same step as
  the hint plays (offset 0);
- the recipe's `regret` variant: `regret(hint, flatten_steps(no_hint_by_step))`, the whole
  window;
- the paper text's `designer_reward`: `regret(hint, no_hint)`, its two arms.

Conventions (the recipe's): an arm or a step without plays has mean 0, so a game whose
hint arm was not played, or whose offset-0 step is empty, has a defined regret; the "win
rate" of the recipe is a mean of raw returns (a loss may score 0 or -1), not a share of
wins. Nothing here checks the returns' range: callers validate their own contract first
(`spade.rewards.base.window_returns`, `validate_returns`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

ReturnsLike = Sequence[float] | np.ndarray


def mean_return(returns: ReturnsLike) -> float:
    """The mean of one set of episode returns; an empty set has mean 0 (the recipe)."""
    array = np.asarray(returns, dtype=np.float64)
    if array.ndim != 1:
        raise ValueError(f"returns must be a 1-D sequence, got shape {array.shape}")
    return float(array.mean()) if array.size else 0.0


def regret(hint_returns: ReturnsLike, no_hint_returns: ReturnsLike) -> float:
    """How much the hint helps: mean_return(hint) - mean_return(no-hint), raw and signed
    (negative when the hint hurts; clipping or flooring is a reward rule's choice)."""
    return mean_return(hint_returns) - mean_return(no_hint_returns)


def flatten_steps(no_hint_returns_by_step: Sequence[ReturnsLike]) -> np.ndarray:
    """Every no-hint play of the window in one float64 vector, offset 0 first."""
    steps = [np.asarray(step, dtype=np.float64) for step in no_hint_returns_by_step]
    return np.concatenate(steps) if steps else np.zeros(0)


def window_win_rate(no_hint_returns_by_step: Sequence[ReturnsLike]) -> float:
    """The recipe's win rate of a game over its window: the mean raw return of every
    no-hint play of the window (all steps flattened, so a step with more plays weighs
    more); 0 without plays."""
    return mean_return(flatten_steps(no_hint_returns_by_step))
