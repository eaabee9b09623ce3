"""A run's report: ``report.md`` with the paper's evidence metrics, beside PNG curves.

    python -m spade_jax.spade.report RUN_DIR
"""

from __future__ import annotations

import io
import math
import sys
from collections.abc import Sequence

import numpy as np
from etils import epath

from spade_jax import storage
from spade_jax.metrics import read_metrics
from spade_jax.plot import plot_run

# (metric, what it is) in the order the report lists them.
HEADLINE = (
    ("validity_rate", "share of designer programs that pass sandbox validation"),
    ("regret_raw_mean", "mean hint regret, raw (can be negative: the model cannot use hints)"),
    ("regret_clipped_mean", "mean hint regret clipped to [0, 1]"),
    ("regret_negative_share", "share of environments with negative regret"),
    ("regret_hinted_mean", "mean hint regret over the games that had a hint arm"),
    ("return_hint_mean", "agent return with the hint"),
    ("return_no_hint_mean", "agent return without the hint"),
    ("learnable_share", "environments with no-hint win rate in [0.2, 0.8], 16-round window"),
    ("vendi_per_n", "diversity: Vendi score / n over program embeddings"),
    ("program_reward_levels_mean", "distinct episode returns a new program can emit (probed)"),
    ("program_strict_partial_levels_mean", "of those, strictly inside (0, 1) (probed)"),
    ("formula_reveal_rate", "opening observations that print the governing formula"),
    ("designer/anchor_mean", "difficulty anchor (flat-top on win rate)"),
    ("designer/reward_mean", "designer reward incl. invalid-program penalties"),
    ("train/agent/logp_gap_mean", "agent: |trainer - sampler| log-prob gap"),
    ("train/designer/logp_gap_mean", "designer: |trainer - sampler| log-prob gap"),
)
PHASES = ("design", "validate", "rollout", "update")
# Router replay telemetry (spade_jax.rl.replay_stats), logged per role as
# train/replay/<role>/<stat>: (panel title, stat with replay, stat without).
REPLAY_PANELS = (
    ("routing flip rate (token x layer)", "flip_rate", "flip_rate_free"),
    ("mean |trainer - sampler| log-prob", "logp_gap_replay", "logp_gap_free"),
    ("TIS clip fraction", "tis_clip_replay", "tis_clip_free"),
    ("mean |ratio - 1|", "ratio_dev_replay", "ratio_dev_free"),
)


def _fmt(x: float) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4g}"


def write_report(run_dir: storage.PathLike, title: str = "SPADE run",
                 lead: Sequence[str] = ()) -> epath.Path:
    """Writes ``run_dir/report.md`` (and PNGs under ``run_dir/plots``); returns its path.
    ``run_dir`` may be remote (``gs://...``). ``lead``: markdown lines placed first, under
    the title (the toy world's claims: ``spade_jax.toy.check.report_lead``)."""
    run_dir = storage.as_path(run_dir)
    metrics = read_metrics(run_dir)
    if not metrics:
        raise ValueError(f"{run_dir} has no metrics.jsonl to report on")
    pngs = plot_run(run_dir)
    rounds = max(int(steps.max()) for steps, _ in metrics.values()) + 1
    lines = [f"# {title}", "", f"{rounds} rounds, metrics from `{run_dir / 'metrics.jsonl'}`.", "",
             *lead]
    lines += ["## Evidence metrics", "", "| metric | first | last | mean | what |", "|---|---|---|---|---|"]
    for name, what in HEADLINE:
        if name in metrics:
            values = metrics[name][1].astype(float)
            finite = values[np.isfinite(values)]
            mean = float(finite.mean()) if finite.size else float("nan")
            lines.append(f"| `{name}` | {_fmt(values[0])} | {_fmt(values[-1])} | {_fmt(mean)} | {what} |")
    invalid = sorted(n for n in metrics if n.startswith("invalid/"))
    if invalid:
        lines += ["", "## Invalid programs by reason (total over the run)", "",
                  "| reason | count |", "|---|---|"]
        lines += [f"| `{n.split('/', 1)[1]}` | {int(np.nansum(metrics[n][1]))} |" for n in invalid]
    phases = [p for p in PHASES if f"time/{p}" in metrics]
    if phases:
        lines += ["", "## Time per phase (seconds, total over the run)", "",
                  "| " + " | ".join(phases) + " |", "|" + "---|" * len(phases),
                  "| " + " | ".join(f"{np.nansum(metrics[f'time/{p}'][1]):.1f}" for p in phases) + " |"]
    evals = sorted(n for n in metrics if n.startswith("eval/"))
    if evals:
        lines += ["", "## Held-out evaluation (last)", "", "| suite | value |", "|---|---|"]
        lines += [f"| `{n}` | {_fmt(float(metrics[n][1][-1]))} |" for n in evals]
    replay_lines, replay_png = _replay_section(metrics, run_dir / "plots")
    lines += replay_lines
    pngs = [*pngs, replay_png] if replay_png is not None else pngs
    lines += ["", "## Curves", ""] + [f"![{p.stem}](plots/{p.name})" for p in pngs]
    path = run_dir / "report.md"
    storage.write_bytes_atomic(path, ("\n".join(lines) + "\n").encode())
    return path


def _replay_series(metrics, role: str, stat: str):
    return metrics.get(f"train/replay/{role}/{stat}")


def _replay_section(metrics, plots_dir: epath.Path) -> tuple[list[str], epath.Path | None]:
    """Router replay: a with/without table per role and ``plots/router_replay.png`` (one
    panel per statistic, replay and no-replay curves of each role); nothing if the run
    logged no replay telemetry."""
    roles = [r for r in ("agent", "designer") if _replay_series(metrics, r, "flip_rate")]
    if not roles:
        return [], None
    lines = ["", "## Router replay (mean over the run)", "",
             "| role | statistic | with replay | without |", "|---|---|---|---|"]
    for role in roles:
        for title, on, off in REPLAY_PANELS:
            means = [float(np.nanmean(_replay_series(metrics, role, k)[1])) for k in (on, off)]
            lines.append(f"| {role} | {title} | {_fmt(means[0])} | {_fmt(means[1])} |")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(REPLAY_PANELS), figsize=(4.5 * len(REPLAY_PANELS), 3.2))
    for ax, (title, on, off) in zip(axes, REPLAY_PANELS, strict=True):
        for role in roles:
            for stat, style, label in ((on, "-", "replay"), (off, "--", "own routing")):
                steps, values = _replay_series(metrics, role, stat)
                ax.plot(steps, values, style, marker="o", markersize=3, label=f"{role}, {label}")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=90)
    plt.close(fig)
    plots_dir.mkdir(parents=True, exist_ok=True)
    path = plots_dir / "router_replay.png"
    storage.write_bytes_atomic(path, png.getvalue())
    return lines, path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m spade_jax.spade.report RUN_DIR")
    print(write_report(sys.argv[1]))
