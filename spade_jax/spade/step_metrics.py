"""What one SPADE step logs (``metrics.jsonl``, one object per step).

Every step logs the same core keys (NaN when a step has nothing to measure), so a
stretch with nothing to score shows as a gap in the curves, not a missing key. The
functions here are pure: they read what a step produced and return numbers; the loop
updates its own state (the learnable-share window) before it calls them.
"""

from __future__ import annotations

import collections
import contextlib
import math
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from spade_jax.spade import env_stats
from spade_jax.spade.diversity import ProgramFeaturiser, normalized_vendi_score
from spade_jax.spade.window import Window, game_stats

NAN = float("nan")
_FEATURISER = ProgramFeaturiser()


class PhaseTimer:
    """``with timer("design"): ...`` accumulates wall seconds per phase name."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.times[phase] = self.times.get(phase, 0.0) + time.perf_counter() - start


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if len(values) else NAN


def design_metrics(attempts: Sequence[Any], window: Window, regeneration: bool) -> dict[str, float]:
    """Validity of this round's designer attempts (rejection sampling included)."""
    if not regeneration:
        return {"validity_rate": NAN}
    m = {"candidates": float(len(attempts)), "valid_envs": float(len(window.games)),
         "validity_rate": (sum(a.verdict.ok for a in attempts) / len(attempts)) if attempts
         else (1.0 if window.games else NAN)}
    for label, count in collections.Counter(a.verdict.label for a in attempts
                                            if not a.verdict.ok).items():
        m[f"invalid/{label}"] = float(count)
    m["hints_written"] = float(sum(g.hint is not None for g in window.games))
    # Reward levels of the new PROGRAMS (sandbox probes; the paper's metric).
    levels = [g.reward_levels for g in window.games if math.isfinite(g.reward_levels)]
    partial = [g.strict_partial_levels for g in window.games
               if math.isfinite(g.strict_partial_levels)]
    # The level a program states (a ``LEVEL = n`` line, as every toy-world program does):
    # whether the designer follows the agent shows in this mean rising with it.
    stated = [env_stats.stated_level(g.program) for g in window.games if g.verdict.ok]
    stated = [lv for lv in stated if lv is not None]
    m["designer/difficulty_mean"] = _mean(stated)
    # and how many games state each level (where the designer puts them, read from the
    # programs alone: the toy check compares it with a frontier known by construction)
    for level, count in collections.Counter(stated).items():
        m[f"designer/level/{level}"] = float(count)
    m["program_reward_levels_mean"] = _mean(levels)
    m["program_strict_partial_levels_mean"] = _mean(partial)
    sources = [g.program for g in window.games]
    try:
        m["vendi_per_n"] = normalized_vendi_score(_FEATURISER(sources)) if sources else NAN
    except ValueError:
        m["vendi_per_n"] = NAN
    return m


def window_metrics(window: Window, step: int) -> dict[str, float]:
    """The current window's games as measured so far (matched-timing regret, win rate)."""
    games = [g for g in window.games if g.verdict.ok and g.returns_by_offset[0]]
    stats = [game_stats(g) for g in games]
    regrets = np.array([s.regret for s in stats])
    # The recipe scores a game without a hint arm (no hint written, or none played) as a
    # hint mean of 0, so its regret is minus its no-hint return; this mean leaves those
    # games out and says what the hints did where there were hints.
    hinted = [s.regret for g, s in zip(games, stats, strict=True) if len(g.hint_returns)]
    reveals = [env_stats.physics_formula_reveal(g.opening_observation, source=g.program,
                                                skill=g.skill)
               for g in window.games if g.opening_observation]
    levels = [env_stats.agent_return_levels(sum(g.returns_by_offset, [])) for g in window.games
              if any(g.returns_by_offset)]
    return {
        "window/offset": float(step - window.start),
        "window/games": float(len(stats)),
        "regret_raw_mean": _mean(regrets),
        "regret_clipped_mean": _mean(np.clip(regrets, 0.0, 1.0)),
        "regret_negative_share": _mean(regrets < 0),
        "regret_hinted_mean": _mean(hinted),
        "return_hint_mean": _mean([s.hint_mean for s in stats if s.plays]),
        "win_rate_mean": _mean([s.mean_return for s in stats]),
        "solve_rate_mean": _mean([s.solve_rate for s in stats]),
        # Labelled for what they are: distinct returns the AGENT obtained (the program's
        # own levels are the probed program_reward_levels_mean).
        "agent_return_levels_mean": _mean(levels),
        # Over physics-style environments only (NaN when the window has none).
        "formula_reveal_rate": env_stats.formula_reveal_rate(reveals),
    }


def play_metrics(records: Sequence[Any]) -> dict[str, float]:
    no_hint = [r.return_ for r in records if not r.hinted]
    return {
        "return_no_hint_mean": _mean(no_hint),
        "episodes/no_hint": float(len(no_hint)),
        "episodes/hint": float(sum(r.hinted for r in records)),
        "tokens/agent_generated": float(sum(r.cost.tokens_generated for r in records)),
        "agent/parse_failures": float(sum(r.cost.parse_failures for r in records)),
        "agent/env_seconds": float(sum(r.cost.env_seconds for r in records)),
        # Policy turns per episode: above 1 when the agent keeps an episode going (a
        # multi-turn game's feedback, or a tool call, whose result comes back next turn).
        "agent/turns_mean": _mean([float(len(r.turn_spans)) for r in records]),
    }


def scored_metrics(scored: Sequence[Any], classify: Any = None) -> dict[str, float]:
    """The designer reward rule's parts, averaged over the games scored this round, and
    (with ``classify(regret, hint_mean, mean_return)``) how many of them fell in each
    regime (``regime/<name>``, 0 for a regime with none when any game was scored)."""
    m = {"designer/scored_games": float(len(scored)),
         "designer/total_mean": _mean([float(s.result.total) for s in scored])}
    if classify is not None and scored:
        counts = collections.Counter(str(classify(s.stats.regret, s.stats.hint_mean,
                                                  s.stats.mean_return)) for s in scored)
        for regime in ("frontier", "mastered", "intractable"):
            m[f"regime/{regime}"] = float(counts.get(regime, 0))
    parts: dict[str, list[float]] = collections.defaultdict(list)
    for s in scored:
        for key, value in s.result.as_metrics().items():
            parts[key].append(float(value))
    m.update({f"designer/{k}_mean": _mean(v) for k, v in parts.items() if k != "total"})
    return m


def step_metrics(config: Any, *, step: int, window: Window, attempts: Sequence[Any],
                 records: Sequence[Any], scored: Sequence[Any], classify: Any,
                 learnable_share: float, pending: int, memory_regimes: dict[str, int],
                 num_agent: int, num_designer: int, update_metrics: dict[str, float],
                 times: dict[str, float]) -> dict[str, float]:
    """One step's metrics from what it produced: its design attempts, the window, the plays,
    the scored games (regimes by ``classify``), the learnable share the loop recorded
    (a game's win rate in this step = its mean episode score, the recipe's; the share pools
    the last ``learnable_window`` steps), the designer samples pending, the memory's regime
    counts, the batch sizes, the update's metrics and the phase times."""
    m: dict[str, float] = {}
    m.update(design_metrics(attempts, window, config.is_regeneration(step)))
    m.update(window_metrics(window, step))
    m.update(play_metrics(records))
    m.update(scored_metrics(scored, classify))
    m["learnable_share"] = float(learnable_share)
    m["batch/agent"], m["batch/designer"] = float(num_agent), float(num_designer)
    m["designer/pending"] = float(pending)
    m["tokens/designer_generated"] = float(sum(len(a.output_ids) for a in attempts))
    for name, count in memory_regimes.items():
        m[f"memory/{name}"] = float(count)
    m.update({f"train/{k}": v for k, v in update_metrics.items()})
    m.update({f"time/{k}": v for k, v in times.items()})
    return m
