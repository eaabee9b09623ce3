"""Overlays several training runs with seed bands and tabulates first- vs last-third change.

    python -m spade_jax.compare runs/toy_s0 runs/toy_s1 runs/toy_s2 'runs/spade_s*' --out cmp/
    python -m spade_jax.compare --label baseline=runs/b0,runs/b1 --label 'spade=runs/s*' \\
        --keys return_no_hint_mean,eval/toy/pass@1 --out cmp/

Each RUN is a local run directory holding ``metrics.jsonl`` and ``config.json``; RUN and the
directories of a ``--label`` may be globs. Runs are grouped into *arms*: by default the runs
whose ``config.json`` ``name`` is equal form one arm (the seeds of one experiment);
``--label NAME=DIR[,DIR...]`` names an arm explicitly (its runs need no ``config.json``).

``--out DIR`` receives:

* ``compare.png``: one panel per key; per arm the mean over seeds at each logged step (only
  the seeds with a finite value at that step count) and a band of +- one standard error
  where at least two seeds logged the step. NaN ("not measured this round") is skipped, so a
  metric logged every k steps still draws as a line through its points.
* ``compare.md`` / ``compare.csv``: per (key, arm) the number of seeds and, across seeds, the
  mean +- standard error of each seed's first-third mean, last-third mean and their
  difference, with a verdict: "rises" / "falls" when the difference is beyond two standard
  errors, else "no clear change" ("n/a" with fewer than two seeds). A seed's thirds are its
  finite points of that key split by position into three near-equal parts
  (``numpy.array_split``); a seed with fewer than three finite points does not count.

The markdown table is also printed. Keys default to :data:`DEFAULT_KEYS`; a key that no run
logs is skipped with a warning.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import glob
import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from spade_jax.metrics import METRICS_FILE, read_metrics

DEFAULT_KEYS: tuple[str, ...] = (
    "return_no_hint_mean",
    "eval/toy/pass@1",
    "regret_raw_mean",
    "designer/difficulty_mean",
    "learnable_share",
    "validity_rate",
)
CONFIG_FILE = "config.json"
PNG_FILE = "compare.png"
MARKDOWN_FILE = "compare.md"
CSV_FILE = "compare.csv"
# The verdict threshold, in standard errors of the across-seed mean difference.
VERDICT_SE = 2.0
# Below this many points a curve also gets markers, so a sparse eval series stays readable.
_MARKER_MAX_POINTS = 40


class CompareError(ValueError):
    """Bad input to the comparison (a missing run, a malformed --label, ...)."""


@dataclasses.dataclass(frozen=True, eq=False)  # eq would compare arrays elementwise
class RunCurves:
    """One run's metrics. ``name``/``seed`` come from its ``config.json`` (None without one)."""

    path: str
    name: str | None
    seed: int | None
    metrics: Mapping[str, tuple[np.ndarray, np.ndarray]]

    def finite(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """The (steps, values) of ``key`` where the value is finite; empty when not logged."""
        if key not in self.metrics:
            return np.zeros(0, np.int64), np.zeros(0, np.float64)
        steps, values = self.metrics[key]
        keep = np.isfinite(values)
        return steps[keep], values[keep]


@dataclasses.dataclass(frozen=True)
class Row:
    """One (key, arm) line of the table; means and standard errors are across seeds."""

    key: str
    arm: str
    seeds: int
    first_mean: float
    first_se: float
    last_mean: float
    last_se: float
    diff_mean: float
    diff_se: float
    verdict: str


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def _expand(pattern: str) -> list[str]:
    """A RUN argument as directories: a glob expands (sorted), a plain path stays itself so
    that a missing one is reported by name rather than silently dropped."""
    if glob.has_magic(pattern):
        matches = sorted(glob.glob(pattern))
        if not matches:
            raise CompareError(f"{pattern!r} matches no run directory")
        return matches
    return [pattern]


def _read_config(run: Path, required: bool) -> tuple[str | None, int | None]:
    path = run / CONFIG_FILE
    if not path.is_file():
        if required:
            raise CompareError(f"{run} has no {CONFIG_FILE}, so its experiment name is unknown; "
                               "name its arm with --label NAME=DIR")
        return None, None
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CompareError(f"{path} is not valid JSON: {err}") from err
    name = config.get("name") if isinstance(config, dict) else None
    if required and not isinstance(name, str):
        raise CompareError(f"{path} has no string 'name' to group runs by; use --label NAME=DIR")
    seed = config.get("seed") if isinstance(config, dict) else None
    return (name if isinstance(name, str) else None,
            seed if isinstance(seed, int) and not isinstance(seed, bool) else None)


def load_run(path: str, *, need_name: bool = True) -> RunCurves:
    """Reads one run directory; ``need_name`` demands a ``config.json`` with a ``name``."""
    run = Path(path)
    if not run.is_dir():
        raise CompareError(f"{path} is not a directory")
    if not (run / METRICS_FILE).is_file():
        raise CompareError(f"{path} has no {METRICS_FILE}")
    name, seed = _read_config(run, need_name)
    return RunCurves(path=str(run), name=name, seed=seed, metrics=read_metrics(run))


def _parse_label(label: str) -> tuple[str, list[str]]:
    name, sep, dirs = label.partition("=")
    name = name.strip()
    if not sep:
        raise CompareError(f"--label {label!r} has no '=': write --label NAME=DIR[,DIR...]")
    if not name:
        raise CompareError(f"--label {label!r} has an empty arm name")
    patterns = [d.strip() for d in dirs.split(",") if d.strip()]
    if not patterns:
        raise CompareError(f"--label {label!r} names no run directory")
    return name, patterns


def _add(arms: dict[str, list[RunCurves]], arm: str, run: RunCurves) -> None:
    # The same directory twice (overlapping globs) would count one seed twice and shrink the
    # standard error, so it is kept once.
    if any(Path(r.path).resolve() == Path(run.path).resolve() for r in arms.get(arm, [])):
        _warn(f"{run.path} is given twice for arm {arm!r}; counted once")
        return
    arms.setdefault(arm, []).append(run)


def load_arms(runs: Sequence[str], labels: Sequence[str] = ()) -> dict[str, list[RunCurves]]:
    """Groups run directories into arms: ``runs`` by their config name, then one arm per
    ``labels`` entry (``"NAME=DIR[,DIR...]"``). Globs expand. Arms keep first-seen order.

    Raises:
      CompareError: no runs, a run that is not a directory or lacks ``metrics.jsonl`` (or,
        for an unlabelled run, ``config.json`` with a ``name``), a malformed label, or a
        label whose name is used twice or is also an experiment name.
    """
    # Label syntax first: a typo there is reported as such, not as a missing run directory.
    parsed = [_parse_label(label) for label in labels]
    arms: dict[str, list[RunCurves]] = {}
    for pattern in runs:
        for path in _expand(pattern):
            run = load_run(path)
            assert run.name is not None  # load_run demands it for unlabelled runs
            _add(arms, run.name, run)
    grouped = set(arms)
    for name, patterns in parsed:
        if name in arms:
            what = "an experiment name of a RUN" if name in grouped else "given twice"
            raise CompareError(f"--label arm name {name!r} is {what}; pick another name")
        for pattern in patterns:
            for path in _expand(pattern):
                _add(arms, name, load_run(path, need_name=False))
    if not arms:
        raise CompareError("no runs given: pass RUN directories or --label NAME=DIR")
    for arm, members in arms.items():
        seeds = [r.seed for r in members if r.seed is not None]
        if len(seeds) != len(set(seeds)):
            _warn(f"arm {arm!r} has runs with the same seed {sorted(seeds)}; "
                  "they may not be independent")
    return arms


def _mean_se(samples: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error (ddof=1); NaN where undefined (no or one sample)."""
    x = np.asarray(samples, dtype=np.float64)
    if x.size == 0:
        return math.nan, math.nan
    if x.size == 1:
        return float(x[0]), math.nan
    return float(x.mean()), float(x.std(ddof=1) / math.sqrt(x.size))


def seed_thirds(run: RunCurves, key: str) -> tuple[float, float] | None:
    """(first-third mean, last-third mean) of ``run``'s finite ``key`` points; None with
    fewer than three, where the thirds would be empty or the same point."""
    _, values = run.finite(key)
    if values.size < 3:
        return None
    parts = np.array_split(values, 3)
    return float(parts[0].mean()), float(parts[-1].mean())


def _verdict(seeds: int, diff_mean: float, diff_se: float) -> str:
    if seeds < 2:
        # One seed has no spread to judge the change against.
        return "n/a (no data)" if seeds == 0 else "n/a (1 seed)"
    if diff_mean > VERDICT_SE * diff_se:
        return "rises"
    if diff_mean < -VERDICT_SE * diff_se:
        return "falls"
    return "no clear change"


def present_keys(arms: Mapping[str, Sequence[RunCurves]], keys: Sequence[str]) -> list[str]:
    """The ``keys`` (in order) that at least one run logs a finite value of."""
    return [k for k in keys
            if any(r.finite(k)[1].size for runs in arms.values() for r in runs)]


def thirds_table(arms: Mapping[str, Sequence[RunCurves]], keys: Sequence[str]) -> list[Row]:
    """One :class:`Row` per (key, arm), key-major, for the keys some run logs; an arm that
    lacks a logged key gets a row with 0 seeds."""
    rows = []
    for key in present_keys(arms, keys):
        for arm, runs in arms.items():
            thirds = [t for t in (seed_thirds(r, key) for r in runs) if t is not None]
            first_mean, first_se = _mean_se([f for f, _ in thirds])
            last_mean, last_se = _mean_se([last for _, last in thirds])
            diff_mean, diff_se = _mean_se([last - f for f, last in thirds])
            rows.append(Row(key=key, arm=arm, seeds=len(thirds), first_mean=first_mean,
                            first_se=first_se, last_mean=last_mean, last_se=last_se,
                            diff_mean=diff_mean, diff_se=diff_se,
                            verdict=_verdict(len(thirds), diff_mean, diff_se)))
    return rows


def seed_band(runs: Sequence[RunCurves], key: str) -> tuple[np.ndarray, ...]:
    """(steps, mean, se, count) over the union of steps at which any run logged a finite
    ``key``; at each step only the runs with a finite value there count (se NaN below 2)."""
    per_run = []
    for run in runs:
        steps, values = run.finite(key)
        per_run.append(dict(zip(steps.tolist(), values.tolist(), strict=True)))
    steps = np.asarray(sorted(set().union(*per_run)), dtype=np.int64)
    mean, se, count = (np.full(steps.size, math.nan) for _ in range(3))
    for i, step in enumerate(steps.tolist()):
        mean[i], se[i] = _mean_se([p[step] for p in per_run if step in p])
        count[i] = sum(step in p for p in per_run)
    return steps, mean, se, count


def plot_arms(arms: Mapping[str, Sequence[RunCurves]], keys: Sequence[str],
              path: str | Path) -> None:
    """Writes one panel per key (the keys some run logs) with each arm's seed mean and band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = present_keys(arms, keys)
    if not keys:
        raise CompareError("none of the keys is logged by any run")
    columns = min(3, len(keys))
    rows = math.ceil(len(keys) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.4 * rows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, key in zip(axes.flat, keys, strict=False):
        # Colors follow the arm's position among all arms, so an arm is one color in every
        # panel even where another arm lacks the key.
        for index, (arm, runs) in enumerate(arms.items()):
            have = [r for r in runs if r.finite(key)[1].size]
            if not have:
                continue
            steps, mean, se, count = seed_band(have, key)
            color = colors[index % len(colors)]
            seeds = f"{len(have)} seed{'s' if len(have) != 1 else ''}"
            ax.plot(steps, mean, color=color, linewidth=1.2, label=f"{arm} ({seeds})",
                    marker="o" if steps.size <= _MARKER_MAX_POINTS else None, markersize=2.5)
            band = count >= 2
            if band.any():
                ax.fill_between(steps, mean - se, mean + se, where=band, color=color,
                                alpha=0.2, linewidth=0, interpolate=False)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=90)
    plt.close(fig)


def _fmt(mean: float, se: float) -> str:
    if math.isnan(mean):
        return "n/a"
    return f"{mean:.4g} ± {'n/a' if math.isnan(se) else f'{se:.2g}'}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_table(rows: Sequence[Row]) -> str:
    """The table and, per key, each arm's verdict, as markdown."""
    lines = [
        "| key | arm | seeds | first third | last third | last − first | verdict |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(f"| `{r.key}` | {_cell(r.arm)} | {r.seeds} | {_fmt(r.first_mean, r.first_se)}"
                     f" | {_fmt(r.last_mean, r.last_se)} | {_fmt(r.diff_mean, r.diff_se)}"
                     f" | {r.verdict} |")
    lines += ["", f"Change (last-third minus first-third mean, beyond {VERDICT_SE:g} standard "
              "errors across seeds):", ""]
    for key in dict.fromkeys(r.key for r in rows):
        verdicts = "; ".join(f"{_cell(r.arm)} {r.verdict}" for r in rows if r.key == key)
        lines.append(f"- `{key}`: {verdicts}")
    return "\n".join(lines) + "\n"


def write_csv(rows: Sequence[Row], path: str | Path) -> None:
    """The rows as CSV, full precision; NaN written as ``nan``."""
    fields = [f.name for f in dataclasses.fields(Row)]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(fields)
        for row in rows:
            writer.writerow([repr(v) if isinstance(v, float) else v
                             for v in dataclasses.astuple(row)])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m spade_jax.compare", description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example: python -m spade_jax.compare 'runs/toy_s*' 'runs/spade_s*' --out cmp/")
    parser.add_argument("runs", nargs="*", metavar="RUN",
                        help="run directory or glob; grouped into arms by config.json 'name'")
    parser.add_argument("--label", action="append", default=[], metavar="NAME=DIR[,DIR...]",
                        help="an arm named explicitly (repeatable; DIR may be a glob)")
    parser.add_argument("--keys", default=",".join(DEFAULT_KEYS),
                        help="comma-separated metric names (default: %(default)s)")
    parser.add_argument("--out", required=True, help="output directory (created)")
    args = parser.parse_args(argv)
    keys = [k.strip() for k in args.keys.split(",") if k.strip()]
    if not keys:
        parser.error("--keys names no metric")
    try:
        arms = load_arms(args.runs, args.label)
    except (CompareError, FileNotFoundError) as err:
        parser.error(str(err))
    present = present_keys(arms, keys)
    for key in keys:
        if key not in present:
            _warn(f"key {key!r} is logged by no run; skipped")
    if not present:
        logged = sorted({k for runs in arms.values() for r in runs for k in r.metrics})
        parser.error(f"none of the keys {keys} is logged by any run; pick --keys from: "
                     + ", ".join(logged[:40]) + (" ..." if len(logged) > 40 else ""))
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        parser.error(f"cannot create --out {out}: {err}")
    rows = thirds_table(arms, present)
    table = markdown_table(rows)
    plot_arms(arms, present, out / PNG_FILE)
    (out / MARKDOWN_FILE).write_text(table)
    write_csv(rows, out / CSV_FILE)
    print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
