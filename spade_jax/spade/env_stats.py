"""Code-level difficulty statistics of environments and the learnable share (SPADE §6).

Measured on the generated environments themselves, so they separate "tasks got harder"
from "the model got worse":

- `reward_levels`: distinct return values observed over an environment's episodes (paper:
  mean 3.7 -> 5.8 over training);
- `strict_partial_levels`: of those, the ones strictly between 0 and 1 (2.2 -> 4.0);
- `formula_reveal`: whether an opening observation prints the governing formula (physics
  environments: 25% -> 5%), a documented heuristic, see its docstring;
- `LearnableShareTracker`: share of environments with agent win rate in [0.2, 0.8], pooled
  over a 16-round window (about one third late in training).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def _observed_values(values: Sequence[float] | np.ndarray, decimals: int) -> set[float]:
    array = np.asarray(values, dtype=np.float64).reshape(-1)
    if array.size == 0:
        raise ValueError("no reward values observed")
    if not np.all(np.isfinite(array)):
        raise ValueError("reward values contain non-finite entries")
    # Rounding merges values that differ only by float accumulation (0.1 + 0.2 vs 0.3).
    return set(np.round(array, decimals).tolist())


def reward_levels(values: Sequence[float] | np.ndarray, decimals: int = 6) -> int:
    """Number of distinct reward values observed (per-episode returns of one environment)."""
    return len(_observed_values(values, decimals))


def strict_partial_levels(values: Sequence[float] | np.ndarray, decimals: int = 6) -> int:
    """Number of distinct observed reward values strictly between 0 and 1 (partial credit)."""
    return sum(1 for v in _observed_values(values, decimals) if 0.0 < v < 1.0)


# --- formula reveal heuristic ------------------------------------------------------------

_LATEX = re.compile(
    r"\\(?:frac|sqrt|cdot|times|int|sum|partial|Delta|omega|theta|alpha|pi)\b"
    r"|\$[^$\n]*[=^][^$\n]*\$|\\\(.+?\\\)"
)
_KEYWORDS = re.compile(
    r"\b(?:formula|governing equation|equation of motion|is given by|obeys the law|"
    r"according to the law)\b",
    re.IGNORECASE,
)
# lhs: a symbol such as F, v_0, E_k, x(t), KE; rhs up to the end of the clause or sentence.
_EQUATION = re.compile(
    r"(?<![=<>!\w])([A-Za-z][A-Za-z0-9_]{0,5}(?:\([A-Za-z0-9_, ]*\))?)\s*=(?!=)\s*([^=\n,;]+?)(?=\.\s|\.$|[,;\n]|$)"
)
_RHS_SYMBOL = re.compile(r"(?<![\d.])\b[A-Za-z][A-Za-z0-9_]*\b")
_RHS_OPERATOR = re.compile(r"\*\*|[*/+^·]|(?<=\w)\s*-\s*(?=\w)|\b(?:sqrt|sin|cos|exp|log)\s*\(")
# "3.2 m/s^2", "-9.81 m/s²": a measurement with units, not a formula.
_MEASUREMENT = re.compile(r"^\s*-?\d[\d.,eE+-]*\s*[A-Za-z°/^²³0-9\s]*\.?\s*$")


def formula_reveal_reason(text: str) -> str | None:
    """Why `text` counts as revealing a governing formula, or None.

    Heuristic, in order:
      1. "latex": LaTeX math markup (\\frac, \\sqrt, ..., $..=..$, \\(..\\));
      2. "keyword": phrases that announce a law ("formula", "governing equation",
         "is given by", ...);
      3. "equation": a symbolic equation `lhs = rhs` whose lhs is a short symbol (F, v_0,
         x(t)) and whose rhs has a symbol and an operator (F = m * a, E = 0.5*m*v**2),
         excluding measurements with units (g = 9.81 m/s^2) and comparisons (==).
    Known misses: formulas in prose ("force equals mass times acceleration") and implicit
    products with units-like letters ("E = 0.5 m v^2" reads as a measurement).
    """
    if not isinstance(text, str):
        raise TypeError(f"opening observation must be str, got {type(text).__name__}")
    if _LATEX.search(text):
        return "latex"
    if _KEYWORDS.search(text):
        return "keyword"
    for match in _EQUATION.finditer(text):
        rhs = match.group(2).strip()
        if _MEASUREMENT.match(rhs):
            continue
        if _RHS_SYMBOL.search(rhs) and _RHS_OPERATOR.search(rhs):
            return "equation"
    return None


def formula_reveal(opening_observation: str) -> bool:
    """Whether the opening observation prints the governing formula (see the reason fn)."""
    return formula_reveal_reason(opening_observation) is not None


# --- learnable share ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LearnableShareConfig:
    """Learnable share of environments.

    Attributes:
      window: rounds pooled (paper: 16 steps); each environment weighs the same.
      band: inclusive no-hint win-rate band counted as learnable (paper: [0.2, 0.8]).
    """

    window: int = 16
    band: tuple[float, float] = (0.2, 0.8)

    def __post_init__(self) -> None:
        object.__setattr__(self, "band", tuple(float(b) for b in self.band))
        if self.window < 1:
            raise ValueError(f"LearnableShareConfig.window must be >= 1, got {self.window}")
        lo, hi = self.band
        if not 0.0 <= lo <= hi <= 1.0:
            raise ValueError(f"LearnableShareConfig.band needs 0 <= lo <= hi <= 1, got {self.band}")


class LearnableShareTracker:
    """Fraction of environments with win rate in the band, pooled over the last rounds."""

    def __init__(self, config: LearnableShareConfig | None = None) -> None:
        self.config = config or LearnableShareConfig()
        # (learnable, total) per round, most recent last.
        self._rounds: deque[tuple[int, int]] = deque(maxlen=self.config.window)

    def record_round(self, win_rates: Sequence[float] | np.ndarray) -> float:
        """Adds one round's environment win rates; returns that round's own share."""
        rates = np.asarray(win_rates, dtype=np.float64).reshape(-1)
        if not np.all(np.isfinite(rates)) or np.any((rates < 0) | (rates > 1)):
            raise ValueError(f"win rates must be finite and in [0, 1], got {rates}")
        lo, hi = self.config.band
        learnable = int(np.sum((rates >= lo) & (rates <= hi)))
        self._rounds.append((learnable, int(rates.size)))
        return learnable / rates.size if rates.size else math.nan

    def share(self) -> float:
        """Pooled share over the window; NaN before any environment was recorded."""
        total = sum(t for _, t in self._rounds)
        return sum(n for n, _ in self._rounds) / total if total else math.nan

    def state_dict(self) -> dict[str, Any]:
        return {"rounds": [list(r) for r in self._rounds]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "rounds" not in state:
            raise ValueError("LearnableShareTracker state is missing 'rounds'")
        rounds = [(int(n), int(t)) for n, t in state["rounds"]]
        if any(not 0 <= n <= t for n, t in rounds):
            raise ValueError(f"LearnableShareTracker state has inconsistent rounds {rounds}")
        self._rounds = deque(rounds, maxlen=self.config.window)
