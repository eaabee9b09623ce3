"""Filter outputs: tasks split by regime (three JSONL files), summary.json and a PNG.

Each output line is the task's original record plus `filter_stats` (per-arm returns and
means with standard errors, regret and its SE, win rates, regime). The PNG is a 2-D
histogram of regret against no-hint win rate with each task marked by its regime; the line
regret = frontier_regret separates the frontier (above) from mastered / intractable.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from spade_jax import storage
from spade_jax.hint_filter.runner import FilterConfig
from spade_jax.hint_filter.tasks import FilterTask

REGIMES = ("frontier", "mastered", "intractable")
_COLORS = {"frontier": "#2ca02c", "mastered": "#1f77b4", "intractable": "#d62728"}


def write_outputs(tasks: Sequence[FilterTask], stats: Sequence[dict[str, Any]],
                  out_dir: storage.PathLike, config: FilterConfig) -> dict[str, Any]:
    """Writes <regime>.jsonl, summary.json and regret_vs_win_rate.png to ``out_dir`` (local
    or ``gs://...``); returns the summary."""
    with storage.MirroredDir(out_dir) as mirror:
        return _write_outputs(tasks, stats, mirror.local, config)


def _write_outputs(tasks: Sequence[FilterTask], stats: Sequence[dict[str, Any]], out: Path,
                   config: FilterConfig) -> dict[str, Any]:
    by_id = {t.id: t for t in tasks}
    lines: dict[str, list[str]] = {r: [] for r in REGIMES}
    for entry in stats:
        record = dict(by_id[entry["id"]].record, filter_stats={
            k: v for k, v in entry.items() if k not in ("id", "line")})
        lines[entry["regime"]].append(json.dumps(record) + "\n")
    for regime in REGIMES:
        (out / f"{regime}.jsonl").write_text("".join(lines[regime]))
    scored = [s for s in stats if "broken" not in s]
    regrets = np.array([s["regret"] for s in scored], dtype=np.float64)
    counts, edges = np.histogram(regrets, bins=20, range=(-1.0, 1.0))
    summary = {
        "num_tasks": len(stats),
        "counts": {r: len(lines[r]) for r in REGIMES},
        "fractions": {r: len(lines[r]) / max(1, len(stats)) for r in REGIMES},
        "broken": dict(collections.Counter(s["broken"].split(":")[0] for s in stats
                                           if "broken" in s)),
        "mean_regret": float(regrets.mean()) if regrets.size else None,
        "share_negative_regret": float((regrets < 0).mean()) if regrets.size else None,
        "regret_histogram": {"edges": edges.tolist(), "counts": counts.tolist()},
        "config": config.fingerprint_fields(),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    _plot(scored, out / "regret_vs_win_rate.png", config)
    return summary


def _plot(scored: Sequence[dict[str, Any]], path: Path, config: FilterConfig) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    if scored:
        win = np.array([s["win_rate"] for s in scored])
        regret = np.array([s["regret"] for s in scored])
        ax.hist2d(win, regret, bins=(10, 20), range=((0, 1), (-1, 1)), cmap="Greys", cmin=1)
        for regime in REGIMES:
            mask = np.array([s["regime"] == regime for s in scored])
            if mask.any():
                ax.scatter(win[mask], regret[mask], s=14, alpha=0.8, color=_COLORS[regime],
                           label=f"{regime} ({int(mask.sum())})")
        ax.legend(loc="upper right", fontsize=8)
    ax.axhline(config.reward.frontier_regret, color="k", lw=0.8, ls="--")
    ax.text(0.01, config.reward.frontier_regret + 0.02, "frontier above", fontsize=8)
    ax.set_xlim(0, 1)
    ax.set_ylim(-1, 1)
    ax.set_xlabel("no-hint win rate")
    ax.set_ylabel("regret = mean return with hint - without")
    ax.set_title("hint-regret filter")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
