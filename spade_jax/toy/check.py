"""The toy world's learning check: does a run's metrics show SPADE working?

``check_run(metrics)`` reads a run's ``metrics.jsonl`` curves and returns one finding per
claim, each with the measured value and the bar it had to clear:

agent_return_rises     mean of the last third of ``return_no_hint_mean`` above the first
                       third's by ``min_return_rise``
heldout_rises          the last held-out ``eval/toy/pass@1`` above the first one by
                       ``min_heldout_rise`` (the grid is fixed and never trained on)
validity_floor         every regeneration's ``validity_rate`` at or above ``validity_floor``
regret_positive        ``regret_raw_mean`` above 0 in at least ``min_positive_regret_share``
                       of the windows (the hint helps where the designer puts the games)
all_regimes_seen       the games scored over the run include each of memory's regimes
                       (``regime/frontier``, ``regime/mastered``, ``regime/intractable``)
learnable_in_most      ``learnable_share`` above 0 in at least ``min_learnable_share`` of the
                       rounds that log it (the designer's games are not all solved or all
                       failed)
designer_level_rises   the designer's mean stated level (``designer/difficulty_mean``) over
                       the last third above the first third's by ``min_level_rise`` (the
                       issue's "rising as the agent improves"; the agent's rise is
                       ``agent_return_rises``)
designer_follows_agent the designer's mean level (``designer/difficulty_mean``) over the
                       last third within ``max_frontier_gap`` levels of the agent's frontier
                       at the end (the highest held-out level it solves at least
                       ``frontier_pass`` of the time)
agent_tokens_sampled   the trainer's log-prob of every agent token it trains equals the
                       sampler's (``train/agent/logp_gap_max`` at most ``max_logp_gap`` in
                       every step). Not an outcome: an outcome check cannot see a loss mask
                       shifted by one token (the moved-in token is the same in every episode
                       of a group, so its gradients cancel), but a shifted mask trains a
                       position the sampler did not write, whose gap is the whole log-prob
                       (~12 against ~1e-5 clean on ``key_digit:check``; docs/toy_world.md).
                       The agent trains on-policy here; the designer's rows are a round old
                       (its reward comes a round later), so its gap is not checked.

``check_agent_path`` is the CI learning check's claims (``key_digit:check``: the agent's
return on constant-key games rises, and ``agent_tokens_sampled``);
``check_designer_path`` the designer path's (``toy:check``, in CI: the toy world with
the agent held at its warm start, so its frontier stays where the warm start put it,
levels 2-4, and the designer has one place to go):

validity_floor         as above
regret_positive        as above (the hint helps where the designer puts the games)
designer_moves_to_frontier
                       the share of the designer's valid games stating a level of the
                       agent's frontier (``designer/level/<n>``; levels 2-4, known by
                       construction) at least ``min_frontier_share`` over the last third of
                       the run, and above the first regeneration's (written by the
                       warm-started designer, before any designer update) by more than
                       ``min_frontier_rise``. Read from the programs, not from the plays'
                       returns: with the hint and no-hint returns swapped, memory's
                       frontier regime moves with the swap (the swapped designer goes to
                       level 5, where the no-hint play beats the failing hint, and its
                       games read "frontier"). Its line also shows that regime share.
designer_rewards_reach_their_programs
                       ``designer/reward_attribution`` at least ``min_reward_attribution`` in
                       every round that logs it: the correlation of each trained program's
                       advantage with its own game's score, matching sequences to games by
                       their tokens (``spade_jax.spade.loop.reward_attribution``; 1 clean,
                       about 0 with the scores handed to the wrong programs)
designer_tokens_sampled
                       ``agent_tokens_sampled`` for the designer's tokens
                       (``train/designer/logp_gap_max``): with the reward in the round that
                       wrote them (``designer_delay=0``) the designer trains on-policy

``scripts/planted_faults.py`` runs any of the checks clean and under each planted fault.
"""

from __future__ import annotations

import dataclasses
import io
import re
from collections.abc import Mapping, Sequence

import numpy as np
from etils import epath

from spade_jax import storage

Curves = Mapping[str, tuple[np.ndarray, np.ndarray]]
NAN = float("nan")


@dataclasses.dataclass(frozen=True)
class CheckConfig:
    """The bars of :func:`check_run` (module docstring)."""

    min_return_rise: float = 0.05
    min_heldout_rise: float = 0.05
    validity_floor: float = 0.5
    min_positive_regret_share: float = 0.5
    min_learnable_share: float = 0.5
    min_level_rise: float = 0.25
    frontier_pass: float = 0.5
    max_frontier_gap: float = 1.5
    max_logp_gap: float = 0.01
    min_reward_attribution: float = 0.9


@dataclasses.dataclass(frozen=True)
class Finding:
    name: str
    ok: bool
    value: float
    bar: str

    def line(self) -> str:
        return f"{'PASS' if self.ok else 'FAIL'}  {self.name}: {self.value:.3f} ({self.bar})"


def _finite(curves: Curves, key: str) -> tuple[np.ndarray, np.ndarray]:
    if key not in curves:
        return np.zeros(0), np.zeros(0)
    steps, values = (np.asarray(a, np.float64) for a in curves[key])
    keep = np.isfinite(values)
    return steps[keep], values[keep]


def thirds(values: np.ndarray) -> tuple[float, float]:
    """Means of the first and the last third of ``values`` (by position; NaN if < 3)."""
    if len(values) < 3:
        return float("nan"), float("nan")
    parts = np.array_split(np.asarray(values, np.float64), 3)
    return float(parts[0].mean()), float(parts[-1].mean())


def agent_frontier(curves: Curves, frontier_pass: float) -> float:
    """The highest held-out level whose last ``eval/toy/level_<L>/pass@1`` is at least
    ``frontier_pass`` (1 if none: level 1 is always within reach), NaN without evals."""
    levels = {}
    for key in curves:
        match = re.fullmatch(r"eval/toy/level_(\d+)/pass@1", key)
        _, values = _finite(curves, key)
        if match and len(values):
            levels[int(match.group(1))] = float(values[-1])
    if not levels:
        return float("nan")
    return float(max([1] + [lv for lv, p in levels.items() if p >= frontier_pass]))


def _tokens_sampled(curves: Curves, max_logp_gap: float, role: str = "agent") -> Finding:
    _, gaps = _finite(curves, f"train/{role}/logp_gap_max")
    worst = float(gaps.max()) if len(gaps) else NAN
    return Finding(f"{role}_tokens_sampled", bool(worst <= max_logp_gap), worst,
                   f"max |trainer - sampler| log-prob of trained {role} tokens <= {max_logp_gap}")


def _validity_floor(curves: Curves, floor: float) -> Finding:
    _, validity = _finite(curves, "validity_rate")
    low = float(validity.min()) if len(validity) else NAN
    return Finding("validity_floor", bool(low >= floor), low, f"lowest >= {floor}")


def _regret_positive(curves: Curves, min_share: float) -> Finding:
    _, regret = _finite(curves, "regret_raw_mean")
    share = float(np.mean(regret > 0)) if len(regret) else NAN
    return Finding("regret_positive", bool(share >= min_share), share,
                   f"share of rounds > 0 >= {min_share}")


def _rewards_reach_programs(curves: Curves, min_attribution: float) -> Finding:
    _, attribution = _finite(curves, "designer/reward_attribution")
    worst = float(attribution.min()) if len(attribution) else NAN
    return Finding("designer_rewards_reach_their_programs", bool(worst >= min_attribution),
                   worst, f"lowest correlation of a trained program's advantage with its own "
                   f"game's score >= {min_attribution}")


def check_agent_path(curves: Curves, min_rise: float = 0.2,
                     max_logp_gap: float = CheckConfig.max_logp_gap) -> list[Finding]:
    """``key_digit:check``'s claims: the agent's return on the constant-key games rises by
    ``min_rise`` (last third over first third of ``return_no_hint_mean``), and the tokens
    it trains are the ones its sampler wrote (``agent_tokens_sampled``)."""
    first, last = thirds(_finite(curves, "return_no_hint_mean")[1])
    return [Finding("agent_return_rises", bool(last - first > min_rise), last - first,
                    f"last third - first third > {min_rise}"),
            _tokens_sampled(curves, max_logp_gap)]


def _counts(curves: Curves, key: str) -> dict[float, float]:
    """``key``'s finite values by step."""
    return dict(zip(*_finite(curves, key), strict=True))


def _shares(counts: Mapping[object, Mapping[float, float]], inside: Sequence[object],
            steps: Sequence[float]) -> np.ndarray:
    """Per step with any count, the share of the counts under the keys ``inside``."""
    shares = []
    for step in steps:
        total = sum(by_step.get(step, 0.0) for by_step in counts.values())
        if total > 0:
            shares.append(sum(counts.get(k, {}).get(step, 0.0) for k in inside) / total)
    return np.asarray(shares, np.float64)


def shares_at_levels(curves: Curves, levels: Sequence[int]) -> np.ndarray:
    """Per regeneration, the share of the designer's valid games that state one of
    ``levels``, from the logged ``designer/level/<n>`` counts (``spade_jax.toy.levels``
    reads the same levels from a local run's ``designs.jsonl``, by part of the run)."""
    counts = {int(key.rsplit("/", 1)[1]): _counts(curves, key) for key in curves
              if key.startswith("designer/level/")}
    return _shares(counts, levels, sorted({step for c in counts.values() for step in c}))


def frontier_shares(curves: Curves) -> np.ndarray:
    """Per scoring round, the share of the scored games in the frontier regime."""
    counts = {name: _counts(curves, f"regime/{name}")
              for name in ("frontier", "mastered", "intractable")}
    return _shares(counts, ("frontier",), sorted(counts["frontier"]))


# toy:check's frontier, known by construction: its frozen agent was taught to follow the
# hint's table up to level 4 (``toy.chain_hint_max_level``) and plays level 1 without it,
# so levels 2-4 are where the hint helps and the agent's own play does not yet succeed.
TOY_CHECK_FRONTIER_LEVELS = (2, 3, 4)


def check_designer_path(curves: Curves, config: CheckConfig = CheckConfig(),
                        min_frontier_share: float = 0.5,
                        min_frontier_rise: float = 0.25,
                        frontier_levels: Sequence[int] = TOY_CHECK_FRONTIER_LEVELS,
                        ) -> list[Finding]:
    """``toy:check``'s claims (module docstring): the programs stay valid, the hint helps
    where the designer puts its games, the designer's games move into the agent's frontier
    (``frontier_levels``), each program is trained with its own game's reward, and the
    designer trains the tokens it sampled."""
    # thirds() is NaN for fewer than 3 values, so a too-short run fails the claim
    shares = shares_at_levels(curves, frontier_levels)
    start, end = (float(shares[0]) if len(shares) else NAN), thirds(shares)[1]
    regime = frontier_shares(curves)
    regime_start, regime_end = (float(regime[0]) if len(regime) else NAN), thirds(regime)[1]
    moved = bool(end >= min_frontier_share and end - start > min_frontier_rise)
    levels = ",".join(str(n) for n in frontier_levels)
    return [_validity_floor(curves, config.validity_floor),
            _regret_positive(curves, config.min_positive_regret_share),
            Finding("designer_moves_to_frontier", moved, end,
                    f"share of the games at levels {levels}: last third >= "
                    f"{min_frontier_share} and > first regeneration {start:.2f} + "
                    f"{min_frontier_rise}; in the frontier regime {regime_start:.2f} -> "
                    f"{regime_end:.2f}"),
            _rewards_reach_programs(curves, config.min_reward_attribution),
            _tokens_sampled(curves, config.max_logp_gap, role="designer")]


def check_run(curves: Curves, config: CheckConfig = CheckConfig()) -> list[Finding]:
    """One :class:`Finding` per claim of the module docstring."""
    findings = []
    first, last = thirds(_finite(curves, "return_no_hint_mean")[1])
    rise = last - first
    findings.append(Finding("agent_return_rises", bool(rise > config.min_return_rise), rise,
                            f"last third - first third > {config.min_return_rise}"))
    _, heldout = _finite(curves, "eval/toy/pass@1")
    rise = float(heldout[-1] - heldout[0]) if len(heldout) >= 2 else float("nan")
    findings.append(Finding("heldout_rises", bool(rise > config.min_heldout_rise), rise,
                            f"last eval - first eval > {config.min_heldout_rise}"))
    findings.append(_validity_floor(curves, config.validity_floor))
    findings.append(_regret_positive(curves, config.min_positive_regret_share))
    regimes = {name: float(np.sum(_finite(curves, f"regime/{name}")[1]))
               for name in ("frontier", "mastered", "intractable")}
    fewest = min(regimes.values())
    findings.append(Finding("all_regimes_seen", bool(fewest > 0), fewest,
                            "fewest games of one regime over the run > 0 ("
                            + ", ".join(f"{k} {v:g}" for k, v in regimes.items()) + ")"))
    _, learnable = _finite(curves, "learnable_share")
    share = float(np.mean(learnable > 0)) if len(learnable) else float("nan")
    findings.append(Finding("learnable_in_most", bool(share >= config.min_learnable_share),
                            share, f"share of rounds > 0 >= {config.min_learnable_share}"))
    _, difficulty = _finite(curves, "designer/difficulty_mean")
    level_first, level_last = thirds(difficulty)
    level_rise = level_last - level_first
    findings.append(Finding("designer_level_rises", bool(level_rise > config.min_level_rise),
                            level_rise, f"last third - first third > {config.min_level_rise}"))
    frontier = agent_frontier(curves, config.frontier_pass)
    gap = abs(level_last - frontier)
    findings.append(Finding("designer_follows_agent", bool(gap <= config.max_frontier_gap), gap,
                            f"|last-third level - agent frontier {frontier:g}| <= "
                            f"{config.max_frontier_gap}"))
    findings.append(_tokens_sampled(curves, config.max_logp_gap))
    return findings


# The curves the toy report leads with: (panel title, keys drawn in it).
REPORT_PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("agent return (no hint, hint)", ("return_no_hint_mean", "return_hint_mean")),
    ("held-out pass@1 (never trained on)", ("eval/toy/pass@1",)),
    ("hint regret (raw; hinted games only)", ("regret_raw_mean", "regret_hinted_mean")),
    ("designer's mean stated level", ("designer/difficulty_mean",)),
    ("learnable share", ("learnable_share",)),
    ("validity rate (floor 0.5)", ("validity_rate",)),
)

REPORT_PARAGRAPH = (
    "What these curves can show: whether the loop's parts work together on a toy family a "
    "~1M-parameter policy trained from scratch can learn in minutes: the agent improving "
    "without the hint and on a held-out grid it never trains on, the hint helping where "
    "the designer puts its games, the designer's programs staying valid and its levels "
    "moving with the agent. What they cannot show: any of the paper's claims (a 30B "
    "model, reasoning benchmarks, a corpus-grounded designer); one run is one seed, so a "
    "rise here is a direction, not an effect size: compare seeds and ablations with "
    "`python -m spade_jax.compare` (docs/toy_world.md)."
)


def report_lead(curves: Curves, plots_dir: epath.Path) -> list[str]:
    """The toy report's first section: the claims' curves (``plots_dir/toy_claims.png``),
    what they can and cannot show, and :func:`check_run`'s findings."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(13.5, 6.4))
    for ax, (title, keys) in zip(axes.flat, REPORT_PANELS, strict=True):
        for key in keys:
            steps, values = _finite(curves, key)
            if len(values):
                ax.plot(steps, values, marker="o" if len(values) <= 40 else None,
                        markersize=3, linewidth=1.0, label=key)
        if keys == ("validity_rate",):
            ax.axhline(CheckConfig.validity_floor, color="grey", linestyle="--", linewidth=0.8)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize=7)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=90)
    plt.close(fig)
    plots_dir.mkdir(parents=True, exist_ok=True)  # may be a bucket (gs://...)
    storage.write_bytes_atomic(plots_dir / "toy_claims.png", png.getvalue())
    lines = ["## The toy world's claims", "", "![toy_claims](plots/toy_claims.png)", "",
             REPORT_PARAGRAPH, "", "| claim | verdict | value | bar |", "|---|---|---|---|"]
    lines += [f"| `{f.name}` | {'pass' if f.ok else '**fail**'} | {f.value:.3f} | "
              + f.bar.replace("|", "\\|") + " |" for f in check_run(curves)]
    return lines + [""]
