"""Steered evaluation: tokens generated and accuracy for unmodified / steered / controls.

The paper's table compares, on one benchmark, four conditions of the same model:

  unmodified      no hook
  steered         the router hook built from the chosen expert sets
  random-control  the same hook with random expert sets of the same sizes per layer
  prompt-control  no hook, the "be concise" system prompt (CONCISE_SYSTEM_PROMPT)

and reports, per condition, mean tokens generated per completion, accuracy (pass@1 from the
evaluation harness's own scoring), the relative token change vs unmodified
``(tokens - tokens_0) / tokens_0`` and the accuracy delta ``acc - acc_0``.

Each condition samples through ``evaluation.policy.SamplerPolicy`` (the harness's policy)
with the condition's router hook and first-answer detector; its ``generated_tokens`` are
the token counts this table averages.
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

    Each marker is encoded alone and after a space (BPE merges differ at a word start). A
    marker tokenised differently inside running text is missed, so the device detector is
    an approximation of the host-side regex tracker; include the variants your model emits.
    """
    patterns = {tuple(tokenizer.encode(text)) for m in markers for text in (m, " " + m)}
    patterns.discard(())
    if not patterns:
        raise ValueError(f"no answer marker of {markers} encodes to any token")
    return tuple(sorted(patterns))


@dataclasses.dataclass(frozen=True)
class ConditionResult:
    """One row of the table: mean tokens per completion and accuracy (pass@1 +- SE)."""

    condition: str
    mean_tokens: float
    accuracy: float
    accuracy_stderr: float
    completions: int


def table_rows(results: Sequence[ConditionResult]) -> list[dict[str, object]]:
    """Rows with the relative token change and accuracy delta against ``unmodified``."""
    base = {r.condition: r for r in results}.get("unmodified")
    if base is None:
        raise ValueError("the table needs an 'unmodified' row to compare against")
    rows = []
    for r in results:
        relative = (r.mean_tokens - base.mean_tokens) / base.mean_tokens if base.mean_tokens \
            else float("nan")
        rows.append({"condition": r.condition, "mean_tokens": r.mean_tokens,
                     "accuracy": r.accuracy, "accuracy_stderr": r.accuracy_stderr,
                     "relative_token_change": relative,
                     "accuracy_delta": r.accuracy - base.accuracy,
                     "completions": r.completions})
    return rows


def markdown_table(rows: Sequence[dict[str, object]], title: str = "") -> str:
    lines = [f"## {title}", ""] if title else []
    lines += ["| condition | mean tokens | accuracy | rel. token change | accuracy delta |",
              "|---|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(
            f"| {row['condition']} | {row['mean_tokens']:.1f} | {row['accuracy']:.3f} "
            f"+- {row['accuracy_stderr']:.3f} | {row['relative_token_change']:+.1%} | "
            f"{row['accuracy_delta']:+.3f} |")
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
    ax_acc.bar(names, [float(r["accuracy_delta"]) for r in rows],
               yerr=[float(r["accuracy_stderr"]) for r in rows])
    ax_acc.set_ylabel("accuracy delta vs unmodified")
    for ax in (ax_tokens, ax_acc):
        ax.axhline(0.0, color="black", linewidth=0.8)
        ax.tick_params(axis="x", rotation=20)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out / "results.png", dpi=100)
    plt.close(fig)


def mean_tokens(counts: Sequence[int]) -> float:
    return float(np.mean(counts)) if len(counts) else 0.0
