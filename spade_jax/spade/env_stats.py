"""Code-level difficulty statistics of environments and the learnable share (SPADE §6).

Measured on the generated environments themselves (the paper: independent of the agent),
so they separate "tasks got harder" from "the model got worse":

- `probe_program_levels`: plays a PROGRAM in the sandbox with seeded scripted/random action
  sequences and counts the distinct episode returns it emits (`reward_levels`, paper: mean
  3.7 -> 5.8 over training) and those strictly between 0 and 1 (`strict_partial_levels`,
  2.2 -> 4.0). It never raises on a hostile program: NaN and a reason instead.
- `formula_reveal`: whether an opening observation prints the governing formula; the paper
  measures it on physics-style environments only (25% -> 5%), see `is_physics_environment`
  and `formula_reveal_rate`.
- `LearnableShareTracker`: share of environments with agent win rate in [0.2, 0.8] over a
  16-step window (about one third late in training).
- `agent_return_levels` / `agent_return_strict_partial_levels`: the same counts over the
  AGENT's returns (depend on the agent; labelled as such, not the paper's metric).
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from spade_jax.seeding import Phase, rng


def _observed_values(values: Sequence[float] | np.ndarray, decimals: int) -> set[float]:
    array = np.asarray(values, dtype=np.float64).reshape(-1)
    if array.size == 0:
        raise ValueError("no reward values observed")
    if not np.all(np.isfinite(array)):
        raise ValueError("reward values contain non-finite entries")
    # Rounding merges values that differ only by float accumulation (0.1 + 0.2 vs 0.3).
    return set(np.round(array, decimals).tolist())


def agent_return_levels(values: Sequence[float] | np.ndarray, decimals: int = 6) -> int:
    """Number of distinct values among the AGENT's episode returns (agent-dependent)."""
    return len(_observed_values(values, decimals))


def agent_return_strict_partial_levels(
    values: Sequence[float] | np.ndarray, decimals: int = 6
) -> int:
    """Number of distinct AGENT returns strictly between 0 and 1 (agent-dependent)."""
    return sum(1 for v in _observed_values(values, decimals) if 0.0 < v < 1.0)


# Old names of the agent-return counts, kept so existing callers run; they are NOT the
# paper's program-level metric (use `probe_program_levels`).
reward_levels = agent_return_levels
strict_partial_levels = agent_return_strict_partial_levels


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


# Words that mark a physics-style environment. Generic game words that also occur in
# physics ("energy", "force", "mass", "spring", "orbit") count only next to other terms,
# because the rule needs several distinct terms (see `is_physics_environment`).
_PHYSICS_TERMS = re.compile(
    r"\b(physics|physical law|velocity|velocities|acceleration|accelerate|gravity|"
    r"gravitational|momentum|friction|projectile|pendulum|kinetic|potential energy|torque|"
    r"newton|joules?|inertia|mass|spring constant|collision|orbit|oscillat\w*|thrust|drag|"
    r"energy|force|trajectory|free fall|m/s\^?2?|buoyan\w*|viscosity|pressure)\b",
    re.IGNORECASE,
)


@dataclasses.dataclass(frozen=True)
class PhysicsRule:
    """When an environment counts as physics-style (the population of formula reveal).

    Attributes:
      min_terms: distinct physics terms (velocity, gravity, momentum, friction, ...) that
        the program source and its opening observation must mention together.
      skill_words: a skill name containing one of these (case-insensitive) is enough.
    """

    min_terms: int = 3
    skill_words: tuple[str, ...] = ("physic", "mechanic", "kinematic")

    def __post_init__(self) -> None:
        if self.min_terms < 1:
            raise ValueError(f"PhysicsRule.min_terms must be >= 1, got {self.min_terms}")


def is_physics_environment(
    source: str | None = None,
    observation: str | None = None,
    skill: str | None = None,
    rule: PhysicsRule | None = None,
) -> bool:
    """Whether an environment is physics-style.

    Rule: the skill name says so ("physics", "mechanics", "kinematics"), or the program
    source and opening observation together mention at least `min_terms` (3) distinct
    physics terms. One stray word ("brute force", "energy bar") is not enough; a
    projectile game that talks of velocity, gravity and trajectory is.
    """
    rule = rule or PhysicsRule()
    if skill and any(word in skill.lower() for word in rule.skill_words):
        return True
    text = "\n".join(t for t in (source, observation) if isinstance(t, str))
    terms = {m.group(0).lower() for m in _PHYSICS_TERMS.finditer(text)}
    return len(terms) >= rule.min_terms


def physics_formula_reveal(
    opening_observation: str,
    *,
    source: str | None = None,
    skill: str | None = None,
    rule: PhysicsRule | None = None,
) -> bool | None:
    """`formula_reveal` of a physics-style environment; None for any other (not counted)."""
    if not is_physics_environment(source, opening_observation, skill, rule):
        return None
    return formula_reveal(opening_observation)


def formula_reveal_rate(reveals: Iterable[bool | None]) -> float:
    """Share of physics-style environments that reveal their formula (None entries, the
    non-physics environments, are left out); NaN when there is none."""
    counted = [bool(r) for r in reveals if r is not None]
    return float(np.mean(counted)) if counted else math.nan


# --- learnable share ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LearnableShareConfig:
    """Learnable share of environments.

    Attributes:
      window: steps pooled (paper: 16).
      band: inclusive win-rate band counted as learnable (paper: [0.2, 0.8]; the recipe's
        "medium" games are those neither above 0.8 nor below 0.2).
    """

    window: int = 16
    band: tuple[float, float] = (0.2, 0.8)

    def __post_init__(self) -> None:
        object.__setattr__(self, "band", tuple(float(b) for b in self.band))
        if self.window < 1:
            raise ValueError(f"LearnableShareConfig.window must be >= 1, got {self.window}")
        lo, hi = self.band
        if not -1.0 <= lo <= hi <= 1.0:
            raise ValueError(f"LearnableShareConfig.band needs -1 <= lo <= hi <= 1, got {self.band}")


class LearnableShareTracker:
    """Share of environments with win rate in the band, over the last `window` steps.

    Each step contributes its environments' win rates (win rate = the mean episode score
    of that environment's plays in that step, in [-1, 1] under the recipe's contract).
    The window share pools the environments of all its steps, i.e. it is the mean of the
    per-step shares weighted by each step's number of environments; with a fixed number of
    games per step (the recipe: 24) that is the plain 16-step moving average of the
    recipe's per-step "medium" share.
    """

    def __init__(self, config: LearnableShareConfig | None = None) -> None:
        self.config = config or LearnableShareConfig()
        # (learnable, total) per step, most recent last.
        self._steps: deque[tuple[int, int]] = deque(maxlen=self.config.window)

    def record_step(self, win_rates: Sequence[float] | np.ndarray) -> float:
        """Adds one step's per-environment win rates; returns the WINDOW share after it."""
        rates = np.asarray(win_rates, dtype=np.float64).reshape(-1)
        if not np.all(np.isfinite(rates)) or np.any((rates < -1) | (rates > 1)):
            raise ValueError(f"win rates must be finite and in [-1, 1], got {rates}")
        lo, hi = self.config.band
        learnable = int(np.sum((rates >= lo) & (rates <= hi)))
        self._steps.append((learnable, int(rates.size)))
        return self.share()

    # The loop's old name: it now returns the window share too (the paper's number).
    record_round = record_step

    def step_share(self) -> float:
        """The latest step's own share (not the paper's metric); NaN if it had no envs."""
        if not self._steps or not self._steps[-1][1]:
            return math.nan
        learnable, total = self._steps[-1]
        return learnable / total

    def share(self) -> float:
        """Pooled share over the window; NaN before any environment was recorded."""
        total = sum(t for _, t in self._steps)
        return sum(n for n, _ in self._steps) / total if total else math.nan

    def state_dict(self) -> dict[str, Any]:
        return {"steps": [list(r) for r in self._steps]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        key = "steps" if "steps" in state else "rounds"  # "rounds": older checkpoints
        if key not in state:
            raise ValueError("LearnableShareTracker state is missing 'steps'")
        steps = [(int(n), int(t)) for n, t in state[key]]
        if any(not 0 <= n <= t for n, t in steps):
            raise ValueError(f"LearnableShareTracker state has inconsistent steps {steps}")
        self._steps = deque(steps, maxlen=self.config.window)


# --- reward levels of a program, measured by probing it -----------------------------------

_DEFAULT_ACTIONS = (
    "0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "10",
    "A", "B", "C", "D", "yes", "no", "up", "down", "left", "right",
    "start", "next", "pass", "help", "",
)
_OBSERVATION_TOKEN = re.compile(r"-?\d+(?:\.\d+)?|[A-Za-z][A-Za-z_]{0,15}")


@dataclasses.dataclass(frozen=True)
class ProbeConfig:
    """How a program is probed for the reward levels it can emit.

    Attributes:
      episodes: episodes played (a few: the probe must stay cheap next to training).
      max_turns: turn cap of one episode (the recipe's turn budget, 25); an episode still
        running at the cap is left out (its score is not defined yet).
      time_budget_s: wall-clock budget of the whole probe; each sandbox call also has the
        sandbox's own deadline. Episodes finished in time still count.
      actions: actions always available to the probe; the tokens of the current
        observation (numbers, words) are added to them.
      max_candidates: cap on candidate actions per turn.
      decimals: returns are rounded to this many decimals before counting levels.
    """

    episodes: int = 16
    max_turns: int = 25
    time_budget_s: float = 60.0
    actions: tuple[str, ...] = _DEFAULT_ACTIONS
    max_candidates: int = 48
    decimals: int = 6

    def __post_init__(self) -> None:
        for name in ("episodes", "max_turns", "max_candidates"):
            if getattr(self, name) < 1:
                raise ValueError(f"ProbeConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not self.time_budget_s > 0:
            raise ValueError(f"ProbeConfig.time_budget_s must be > 0, got {self.time_budget_s}")
        if not self.actions or not all(isinstance(a, str) for a in self.actions):
            raise ValueError("ProbeConfig.actions must be a non-empty tuple of str")


@dataclasses.dataclass(frozen=True)
class ProgramLevels:
    """What a probe measured on one program. NaN counts and a `reason` when it could not."""

    levels: tuple[float, ...]  # distinct episode returns, sorted
    reward_levels: float  # len(levels), NaN when no episode finished cleanly
    strict_partial_levels: float  # levels strictly between 0 and 1, NaN likewise
    episodes_counted: int
    opening_observation: str | None  # first episode's opening observation
    reason: str | None  # why counts are NaN or episodes were left out; None if all clean

    def as_metrics(self) -> dict[str, float]:
        return {
            "program_reward_levels": self.reward_levels,
            "program_strict_partial_levels": self.strict_partial_levels,
        }


def _candidate_actions(tokens: list[str], config: ProbeConfig) -> tuple[list[str], int]:
    """(candidates, how many of them come from the episode's observations): the tokens
    the episode's observations showed so far first (a game names its moves there, often
    only in the opening), then the fixed actions; deduplicated in order, capped."""
    candidates = list(dict.fromkeys([*tokens, *config.actions]))[: config.max_candidates]
    return candidates, min(len(tokens), len(candidates))


def _pick_action(
    tokens: list[str], episode: int, turn: int, generator: np.random.Generator,
    config: ProbeConfig,
) -> str:
    """Turn 0 of episode i plays the i-th candidate (a deterministic sweep of first moves
    across episodes); later turns draw a seeded random candidate, from the observed
    tokens three times in four."""
    candidates, from_observation = _candidate_actions(tokens, config)
    if turn == 0:
        return candidates[episode % len(candidates)]
    pool_size = len(candidates)
    if from_observation and generator.uniform() < 0.75:
        pool_size = from_observation
    return candidates[int(generator.integers(0, pool_size))]


def _play_probe_episode(
    env: Any, episode: int, generator: np.random.Generator, config: ProbeConfig,
    boxed: bool, deadline: float,
) -> tuple[float | None, str, str | None]:
    """(return or None, opening observation, why it does not count or None)."""
    reset_seed = int(generator.integers(0, 2**31 - 1))
    observation, info = env.reset(seed=reset_seed)
    opening = observation
    if "sandbox_error" in info:
        return None, opening, f"reset: {info['sandbox_error']}"
    total = 0.0
    tokens: dict[str, None] = {}  # the episode's observed tokens, in order of appearance
    for turn in range(config.max_turns):
        if time.monotonic() > deadline:
            return None, opening, "time budget spent"
        tokens.update(dict.fromkeys(_OBSERVATION_TOKEN.findall(observation[:4000])))
        action = _pick_action(list(tokens), episode, turn, generator, config)
        observation, reward, terminated, truncated, info = env.step(
            f"\\boxed{{{action}}}" if boxed else action
        )
        if "sandbox_error" in info:
            return None, opening, f"step: {info['sandbox_error']}"
        total += float(reward)
        if terminated or truncated:
            return total, opening, None
    return None, opening, f"no end within {config.max_turns} turns"


def _open_env(source: str, pool: Any, contract: str | None) -> Any:
    from spade_jax.envs import make_env  # the sandbox starts workers: import when used

    if contract is None:
        return make_env(source, pool)
    return make_env(source, pool, contract=contract)


def probe_program_levels(
    source: str,
    *,
    seed: int,
    step: int,
    index: int = 0,
    pool: Any = None,
    contract: str | None = None,
    config: ProbeConfig | None = None,
) -> ProgramLevels:
    """Distinct episode returns a program emits under seeded scripted/random play.

    Runs only inside the sandbox (`spade_jax.envs.make_env`); never raises on a hostile or
    broken program: the counts are NaN and `reason` says why. Episodes that hit a sandbox
    error or the turn cap are left out.

    Args:
      source: the environment program.
      seed, step, index: the draws come from `seeding.rng(seed, step, Phase.PROBE, index)`.
      pool: the sandbox pool (None: the process-wide default pool).
      contract: passed to make_env when given; None keeps make_env's default. Actions
        are sent as \\boxed{...} (the recipe's format) when the env runs the "reference"
        contract, asked for or detected.
      config: episodes, turn cap, time budget, action vocabulary.
    """
    config = config or ProbeConfig()
    generator = rng(seed, step, Phase.PROBE, index)
    deadline = time.monotonic() + config.time_budget_s
    returns: list[float] = []
    problems: list[str] = []
    opening: str | None = None
    env = None
    try:
        env = _open_env(source, pool, contract)
        # Box actions when the env runs the recipe's contract, whether asked for or
        # detected by make_env (its resolved contract is `env.contract`).
        boxed = getattr(env, "contract", contract) == "reference"
        for episode in range(config.episodes):
            if time.monotonic() > deadline:
                problems.append("time budget spent")
                break
            value, first_obs, problem = _play_probe_episode(
                env, episode, generator, config, boxed, deadline
            )
            opening = first_obs if opening is None else opening
            if problem is None and value is not None and math.isfinite(value):
                returns.append(value)
            else:
                problems.append(problem or f"non-finite return {value}")
    except Exception as error:  # noqa: BLE001 - a hostile program must never stop the loop
        problems.append(f"{type(error).__name__}: {error}"[:300])
    finally:
        if env is not None:
            try:
                env.close()
            except Exception:  # noqa: BLE001
                pass
    return _levels_result(returns, opening, problems, config)


def _levels_result(
    returns: list[float], opening: str | None, problems: list[str], config: ProbeConfig
) -> ProgramLevels:
    reason = None
    if problems:
        counts: dict[str, int] = {}
        for p in problems:
            counts[p] = counts.get(p, 0) + 1
        reason = "; ".join(f"{p} (x{n})" if n > 1 else p for p, n in counts.items())
    if not returns:
        return ProgramLevels((), math.nan, math.nan, 0, opening, reason or "no episode played")
    levels = tuple(sorted(set(np.round(returns, config.decimals).tolist())))
    partial = sum(1 for v in levels if 0.0 < v < 1.0)
    return ProgramLevels(levels, float(len(levels)), float(partial), len(returns), opening, reason)


_STATED_LEVEL = re.compile(r"^LEVEL\s*=\s*(\d+)\s*$", re.M)


def stated_level(source: str) -> int | None:
    """The difficulty a program states with a top-level ``LEVEL = n`` line (the toy
    world's programs do: ``spade_jax.toy.family``), None when it states none."""
    match = _STATED_LEVEL.search(source)
    return int(match.group(1)) if match else None


def stated_level_span(text: str) -> tuple[int, int] | None:
    """Where the digits of the first ``LEVEL = n`` line are in ``text`` ([start, end)),
    None when it states no level."""
    match = _STATED_LEVEL.search(text)
    return match.span(1) if match else None
