"""Steered evaluation: tokens generated and accuracy for unmodified / steered / controls.

The paper's table compares, on one benchmark, four conditions of the same model:

  unmodified      no hook
  steered         the router hook built from the chosen expert sets
  random-control  the same hook with random expert sets of the same sizes per layer
  prompt-control  no hook, the "be concise" system prompt (CONCISE_SYSTEM_PROMPT)

and reports, per condition, mean tokens generated per completion, accuracy (pass@1 from the
evaluation harness's own scoring), the relative token change vs unmodified
``(tokens - tokens_0) / tokens_0`` and the accuracy delta ``acc - acc_0``.

:class:`SteeredSamplerPolicy` is the harness's ``TextPolicy`` over ``rollout.generate`` with
the router hook and first-answer detector passed through, counting generated tokens.
"""

from __future__ import annotations

import csv
import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from spade_jax.seeding import derive_seed

CONDITIONS = ("unmodified", "steered", "random-control", "prompt-control")
ANSWER_MARKERS = ("\\boxed{", "<answer>", "answer is", "Answer:")


@dataclasses.dataclass(frozen=True)
class SteeredPolicyConfig:
    """Attributes:
    temperature: sampling temperature (0 = greedy).
    top_p: nucleus mass in (0, 1].
    top_k: 0 = off.
    batch_size: prompts per ``generate`` call at most.
    enable_thinking: passed to the chat template's generation prompt.
    system_prompt: system turn put before every conversation lacking one.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    batch_size: int = 64
    enable_thinking: bool = False
    system_prompt: str | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError(f"bad sampling settings: {self}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")


class SteeredSamplerPolicy:
    """``TextPolicy`` over ``rollout.generate`` with a router hook; counts generated tokens.

    ``generated_tokens`` collects, per completion in call order, the number of tokens the
    sampler generated (a stop token that ended the row counts).
    """

    def __init__(self, model: Any, tokenizer: Any, config: SteeredPolicyConfig | None = None,
                 *, router_hook: Callable | None = None, answer_detector: Any = None) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.config = config or SteeredPolicyConfig()
        self.router_hook, self.answer_detector = router_hook, answer_detector
        self.generated_tokens: list[int] = []

    def _messages(self, conversation: list[dict[str, str]]) -> list[dict[str, str]]:
        messages = [dict(m) for m in conversation]
        if self.config.system_prompt is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.config.system_prompt})
        return messages

    def complete(self, conversations: Sequence[list[dict[str, str]]], *, n: int, seed: int,
                 max_new_tokens: int) -> list[list[str]]:
        from spade_jax.rollout import generate

        if n < 1 or max_new_tokens < 1:
            raise ValueError(f"need n >= 1 and max_new_tokens >= 1, got {n}, {max_new_tokens}")
        prompts = [list(self.tokenizer.apply_chat_template(
            self._messages(list(c)), add_generation_prompt=True,
            enable_thinking=self.config.enable_thinking)) for c in conversations]
        rows = [p for p in prompts for _ in range(n)]  # row = conversation * n + sample
        texts: list[str] = []
        size = self.config.batch_size
        for start in range(0, len(rows), size):
            result = generate(
                self.model, rows[start : start + size], max_new_tokens,
                temperature=self.config.temperature, top_p=self.config.top_p,
                top_k=self.config.top_k, seed=derive_seed(seed, start),
                stop_tokens=sorted(self.tokenizer.eos_ids), router_hook=self.router_hook,
                answer_detector=self.answer_detector)
            self.generated_tokens.extend(len(t) for t in result.tokens)
            texts.extend(self.tokenizer.decode(t, skip_special_tokens=True) for t in result.tokens)
        return [texts[i * n : (i + 1) * n] for i in range(len(conversations))]


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


def write_table(rows: Sequence[dict[str, object]], out_dir: str | Path, title: str) -> None:
    """``results.md``, ``results.csv`` and ``results.png`` (token change and accuracy delta)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
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
