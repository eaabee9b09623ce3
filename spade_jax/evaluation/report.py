"""pass@1 and its standard error, the results table (markdown + CSV), a PNG, sample dumps.

pass@1 with n samples per problem: p_i = c_i / n (c_i correct samples of problem i) and
pass@1 = mean_i p_i over the N problems. Its standard error treats problems as the sampled
unit (the clustered standard error, which also absorbs the sampling noise within each
problem): SE = std(p_i, ddof=1) / sqrt(N). With a single problem that is undefined; the
binomial SE of its n samples, sqrt(p (1 - p) / n), is reported instead.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from etils import epath

from spade_jax import storage


@dataclasses.dataclass
class SuiteResult:
    """One suite's outcome: scores[problem, sample] in {0, 1} and why samples failed."""

    name: str
    kind: str
    problem_ids: list[str]
    scores: np.ndarray
    reasons: dict[str, int]
    sample_reasons: list[list[str]]
    completions: list[list[str]]
    seconds: float = 0.0

    @property
    def pass_at_1(self) -> float:
        return pass_at_1(self.scores)[0]

    @property
    def stderr(self) -> float:
        return pass_at_1(self.scores)[1]


def pass_at_1(scores: np.ndarray) -> tuple[float, float]:
    """(pass@1, standard error) of a [problems, samples] 0/1 score matrix (see module doc)."""
    scores = np.asarray(scores, dtype=np.float64)
    if scores.ndim != 2 or scores.shape[1] < 1:
        raise ValueError(f"scores must be [problems, samples>=1], got shape {scores.shape}")
    if scores.shape[0] == 0:
        return math.nan, math.nan
    per_problem = scores.mean(axis=1)
    mean = float(per_problem.mean())
    if per_problem.size == 1:
        return mean, math.sqrt(mean * (1.0 - mean) / scores.shape[1])
    return mean, float(per_problem.std(ddof=1) / math.sqrt(per_problem.size))


def metrics(results: Sequence[SuiteResult]) -> dict[str, float]:
    out: dict[str, float] = {}
    for r in results:
        p, se = pass_at_1(r.scores)
        out[f"{r.name}/pass@1"] = p
        out[f"{r.name}/pass@1_stderr"] = se
        out[f"{r.name}/num_problems"] = float(len(r.problem_ids))
    finite = [out[f"{r.name}/pass@1"] for r in results if math.isfinite(out[f"{r.name}/pass@1"])]
    if finite:
        out["mean/pass@1"] = float(np.mean(finite))
    return out


_COLUMNS = ("suite", "kind", "problems", "samples", "pass@1", "stderr", "seconds", "failures")


def _rows(results: Sequence[SuiteResult]) -> list[dict[str, object]]:
    rows = []
    for r in results:
        p, se = pass_at_1(r.scores)
        failures = {k: v for k, v in r.reasons.items() if k != "correct"}
        rows.append({
            "suite": r.name, "kind": r.kind, "problems": len(r.problem_ids),
            "samples": int(r.scores.shape[1]), "pass@1": p, "stderr": se,
            "seconds": r.seconds,
            "failures": " ".join(f"{k}={v}" for k, v in sorted(failures.items())),
        })
    return rows


def markdown_table(results: Sequence[SuiteResult]) -> str:
    lines = ["| suite | kind | problems | n | pass@1 (%) | ± SE | failures |",
             "|---|---|---|---|---|---|---|"]
    for row in _rows(results):
        lines.append(f"| {row['suite']} | {row['kind']} | {row['problems']} | {row['samples']} "
                     f"| {100 * row['pass@1']:.1f} | {100 * row['stderr']:.1f} "
                     f"| {row['failures'] or '-'} |")
    finite = [r.pass_at_1 for r in results if math.isfinite(r.pass_at_1)]
    if finite:
        lines.append(f"| **mean** | | | | {100 * float(np.mean(finite)):.1f} | | |")
    return "\n".join(lines) + "\n"


def write_report(results: Sequence[SuiteResult], out_dir: storage.PathLike,
                 title: str = "Evaluation") -> dict[str, epath.Path]:
    """Writes results.md, results.csv, results.png and samples.jsonl to ``out_dir`` (local
    or ``gs://...``); returns their paths there."""
    names = ("results.md", "results.csv", "results.png", "samples.jsonl")
    with storage.MirroredDir(out_dir) as mirror:
        out = mirror.local
        (out / "results.md").write_text(f"# {title}\n\n{markdown_table(results)}")
        with (out / "results.csv").open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=_COLUMNS)
            writer.writeheader()
            writer.writerows(_rows(results))
        with (out / "samples.jsonl").open("w") as handle:
            for r in results:
                for i, pid in enumerate(r.problem_ids):
                    for j in range(r.scores.shape[1]):
                        handle.write(json.dumps({
                            "suite": r.name, "problem": pid, "sample": j,
                            "score": float(r.scores[i, j]), "reason": r.sample_reasons[i][j],
                            "completion": r.completions[i][j]}) + "\n")
        _plot(results, out / "results.png", title)
    return {name: storage.as_path(out_dir) / name for name in names}


def _plot(results: Sequence[SuiteResult], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.name for r in results]
    values = [100 * r.pass_at_1 for r in results]
    errors = [100 * r.stderr for r in results]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.0 + 0.9 * len(names)), 3.5))
    ax.bar(range(len(names)), values, yerr=errors, capsize=4, color="#4C72B0")
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set_ylabel("pass@1 (%)  ± SE")
    ax.set_ylim(0, 100)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
