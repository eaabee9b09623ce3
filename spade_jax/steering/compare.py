"""Steered evaluation: tokens generated and accuracy for unmodified / steered / controls.

The paper's table compares, on one benchmark, four conditions of the same model:

  unmodified      no hook
  steered         the router hook built from the chosen expert sets
  random-control  the same hook with random expert sets of the same sizes per layer
  prompt-control  no hook, the "be concise" system prompt (CONCISE_SYSTEM_PROMPT)

and reports, per condition, mean tokens generated per completion, accuracy (pass@1 from the
evaluation harness's own scoring), the relative token change vs unmodified
``(tokens - tokens_0) / tokens_0`` and the accuracy delta ``acc - acc_0``. A dose sweep
(``steer run --dose=1,2,4``) has one steered and one random-control row per dose n
("steered n=2", ...; the ``dose`` column holds n) and adds ``dose.png``.

Standard errors treat problems as the sampling unit (samples of one problem are averaged
first, as ``evaluation.report.pass_at_1`` does): ``tokens_stderr`` is the SE of the mean of
per-problem mean tokens; deltas against unmodified are paired per problem (the same
problems in every condition): ``token_delta_stderr`` / ``accuracy_delta_stderr`` are the SE
of the mean per-problem difference, ``relative_token_change_stderr`` the delta-method SE
of the ratio of means, ``std(t_p - R t0_p) / (mean(t0) sqrt(P))`` with ``R = mean(t) /
mean(t0)``. With one problem they are NaN (``tokens_stderr`` falls back to the samples).

Each condition samples through ``evaluation.policy.SamplerPolicy`` (the harness's policy)
with the condition's router hook and schedule detector; its ``generated_tokens`` are the
token counts this table averages.
"""

from __future__ import annotations

import csv
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from spade_jax import storage

CONDITIONS = ("unmodified", "steered", "random-control", "prompt-control")
ANSWER_MARKERS = ("\\boxed{", "<answer>", "answer is", "Answer:")


def answer_token_patterns(tokenizer: Any, markers: Sequence[str] = ANSWER_MARKERS
                          ) -> tuple[tuple[int, ...], ...]:
    """Token-id patterns of answer markers for ``TokenPatternDetector``.

    Each marker is encoded alone, after a space and after a newline (BPE merges differ at
    a word start). A marker tokenised differently inside running text is missed, so this is
    an approximation of the host-side regex tracker; the ``run`` command uses
    :func:`answer_detector` instead, which does not depend on the tokenisation.
    """
    patterns = {tuple(tokenizer.encode(text)) for m in markers
                for text in (m, " " + m, "\n" + m)}
    patterns.discard(())
    if not patterns:
        raise ValueError(f"no answer marker of {markers} encodes to any token")
    return tuple(sorted(patterns))


def answer_detector(tokenizer: Any, vocab_size: int | None = None):
    """The ``run`` command's device first-answer detector: the text tracker's markers
    (``schedule.DEVICE_ANSWER_PATTERNS``) matched in the generated text, token by token
    (``schedule.TextMarkerDetector``), whatever the tokenisation of the marker."""
    from spade_jax.steering.schedule import TextMarkerDetector

    return TextMarkerDetector.from_tokenizer(tokenizer, vocab_size=vocab_size)


@dataclasses.dataclass(frozen=True)
class ConditionResult:
    """One row of the table: mean tokens per completion and accuracy (pass@1 +- SE).

    ``tokens_ps`` / ``scores_ps``: per problem and sample, the tokens generated and the 0/1
    scores (the standard errors and paired deltas need them; None leaves those NaN).
    ``dose``: n of a dose-sweep row (top-n experts per layer), else None.
    """

    condition: str
    mean_tokens: float
    accuracy: float
    accuracy_stderr: float
    completions: int
    tokens_ps: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)
    scores_ps: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)
    dose: int | None = None


def _se(values_p: np.ndarray) -> float:
    values_p = np.asarray(values_p, np.float64)
    if values_p.size < 2:
        return float("nan")
    return float(values_p.std(ddof=1) / np.sqrt(values_p.size))


def _per_problem(matrix: np.ndarray | None, problems: int | None = None) -> np.ndarray | None:
    if matrix is None:
        return None
    matrix = np.asarray(matrix, np.float64)
    if matrix.ndim != 2 or (problems is not None and matrix.shape[0] != problems):
        return None
    return matrix.mean(axis=1)


def _tokens_stderr(r: ConditionResult) -> float:
    if r.tokens_ps is None:
        return float("nan")
    tokens = np.asarray(r.tokens_ps, np.float64)
    if tokens.shape[0] == 1:  # one problem: the SE over its samples
        return _se(tokens[0])
    return _se(tokens.mean(axis=1))


def table_rows(results: Sequence[ConditionResult]) -> list[dict[str, object]]:
    """Rows with the relative token change and accuracy delta against ``unmodified``, their
    standard errors (paired per problem, see the module doc) and the dose of sweep rows.

    The first seven columns are the table's original ones, in their original order."""
    base = {r.condition: r for r in results}.get("unmodified")
    if base is None:
        raise ValueError("the table needs an 'unmodified' row to compare against")
    nan = float("nan")
    base_tok = _per_problem(base.tokens_ps)
    base_acc = _per_problem(base.scores_ps)
    rows = []
    for r in results:
        relative = (r.mean_tokens - base.mean_tokens) / base.mean_tokens if base.mean_tokens \
            else nan
        tok = _per_problem(r.tokens_ps, None if base_tok is None else base_tok.size)
        acc = _per_problem(r.scores_ps, None if base_acc is None else base_acc.size)
        token_delta_se = relative_se = accuracy_delta_se = nan
        if tok is not None and base_tok is not None:
            token_delta_se = _se(tok - base_tok)
            if base_tok.mean():
                ratio = tok.mean() / base_tok.mean()
                relative_se = _se((tok - ratio * base_tok) / base_tok.mean())
        if acc is not None and base_acc is not None:
            accuracy_delta_se = _se(acc - base_acc)
        rows.append({"condition": r.condition, "mean_tokens": r.mean_tokens,
                     "accuracy": r.accuracy, "accuracy_stderr": r.accuracy_stderr,
                     "relative_token_change": relative,
                     "accuracy_delta": r.accuracy - base.accuracy,
                     "completions": r.completions,
                     "dose": "" if r.dose is None else r.dose,
                     "problems": "" if tok is None else tok.size,
                     "tokens_stderr": _tokens_stderr(r),
                     "token_delta": r.mean_tokens - base.mean_tokens,
                     "token_delta_stderr": token_delta_se,
                     "relative_token_change_stderr": relative_se,
                     "accuracy_delta_stderr": accuracy_delta_se})
    return rows


def markdown_table(rows: Sequence[dict[str, object]], title: str = "") -> str:
    lines = [f"## {title}", ""] if title else []
    lines += ["| condition | mean tokens | accuracy | rel. token change | accuracy delta |",
              "|---|---:|---:|---:|---:|"]
    for row in rows:
        nan = float("nan")
        lines.append(
            f"| {row['condition']} | {row['mean_tokens']:.1f} +- "
            f"{row.get('tokens_stderr', nan):.1f} | {row['accuracy']:.3f} "
            f"+- {row['accuracy_stderr']:.3f} | {row['relative_token_change']:+.1%} +- "
            f"{row.get('relative_token_change_stderr', nan):.1%} | "
            f"{row['accuracy_delta']:+.3f} +- {row.get('accuracy_delta_stderr', nan):.3f} |")
    lines += ["", "Mean +- standard error over problems; deltas vs unmodified are paired per "
              "problem."]
    return "\n".join(lines) + "\n"


def write_table(rows: Sequence[dict[str, object]], out_dir: storage.PathLike,
                title: str) -> None:
    """``results.md``, ``results.csv`` and ``results.png`` (token change and accuracy delta)
    in ``out_dir``, a local folder or ``gs://...``."""
    with storage.MirroredDir(out_dir) as mirror:
        _write_table_files(rows, mirror.local, title)


def _write_table_files(rows: Sequence[dict[str, object]], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    (out / "results.md").write_text(markdown_table(rows, title))
    with (out / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    names = [str(r["condition"]) for r in rows]
    fig, (ax_tokens, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    ax_tokens.bar(names, [100 * float(r["relative_token_change"]) for r in rows])
    ax_tokens.set_ylabel("token change vs unmodified (%)")
    ax_tokens.errorbar(names, [100 * float(r["relative_token_change"]) for r in rows],
                       yerr=[100 * _finite(r.get("relative_token_change_stderr")) for r in rows],
                       fmt="none", ecolor="black", capsize=3)
    ax_acc.bar(names, [float(r["accuracy_delta"]) for r in rows],
               yerr=[_finite(r.get("accuracy_delta_stderr", r["accuracy_stderr"]))
                     for r in rows])
    ax_acc.set_ylabel("accuracy delta vs unmodified")
    for ax in (ax_tokens, ax_acc):
        ax.axhline(0.0, color="black", linewidth=0.8)
        ax.tick_params(axis="x", rotation=20)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out / "results.png", dpi=100)
    plt.close(fig)
    dosed = [r for r in rows if r.get("dose", "") != ""]
    if dosed:
        fig, ax = plt.subplots(figsize=(5, 4))
        for prefix in ("steered", "random-control"):
            series = sorted((int(r["dose"]), r) for r in dosed
                            if str(r["condition"]).startswith(prefix))
            if series:
                ax.errorbar([n for n, _ in series],
                            [100 * float(r["relative_token_change"]) for _, r in series],
                            yerr=[100 * float(r["relative_token_change_stderr"])
                                  for _, r in series], marker="o", capsize=3, label=prefix)
        ax.axhline(0.0, color="black", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("experts per layer (n)")
        ax.set_ylabel("token change vs unmodified (%)")
        ax.legend()
        ax.set_title(title, fontsize=9)
        fig.tight_layout()
        fig.savefig(out / "dose.png", dpi=100)
        plt.close(fig)


def mean_tokens(counts: Sequence[int]) -> float:
    return float(np.mean(counts)) if len(counts) else 0.0


def _finite(value: object) -> float:
    """A plotted error bar: NaN (no SE) draws none."""
    try:
        value = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0.0
    return value if np.isfinite(value) else 0.0
