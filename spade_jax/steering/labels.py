"""The six reasoning behaviours: label import from JSONL and a pluggable LLM judge.

Labels describe a segment's *functional role*, not its surface form: the same equation can
be a new derivation (execution), a cited theorem (fact) or a repeat of an earlier result
(restatement). The judge sees the whole trace and labels every segment in one call, with a
frozen codebook prompt (:data:`CODEBOOK_PROMPT`). The policy-backed judge (the policy itself
through the sampler) plugs in as any callable ``prompt -> completion``.

JSONL format, one segment per line::

    {"trace_id": "gsm8k-17", "segment": 3, "label": "planning"}

``segment`` is the segment's index within its trace (as produced by the segmenter); other
keys (``text``, ``start``, ``end``) are allowed and ignored.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

BEHAVIOURS: tuple[str, ...] = (
    "planning",
    "execution",
    "restatement",
    "fact",
    "reflection",
    "conclusion",
)
BEHAVIOUR_INDEX: dict[str, int] = {name: i for i, name in enumerate(BEHAVIOURS)}

BEHAVIOUR_DEFINITIONS: dict[str, str] = {
    "planning": (
        "decides what to do next: proposes an approach, a step, a new angle, or another "
        "round of checking (\"Let me try...\", \"Next I'll verify...\")"
    ),
    "execution": "carries out a step: a new derivation, computation or case analysis",
    "restatement": (
        "repeats or paraphrases the problem or an earlier result without adding anything new"
    ),
    "fact": "recalls or cites a known fact, definition, formula or theorem",
    "reflection": (
        "doubts, checks or evaluates earlier work (\"Wait, is that right?\", noticing an error)"
    ),
    "conclusion": "states a result or the final answer, or wraps the reasoning up",
}

CODEBOOK_PROMPT = (
    "You label the segments of a reasoning trace by their functional role (not by their "
    "surface wording; the same equation can be a new derivation, a cited fact or a repeat). "
    "Use exactly one of these six labels per segment:\n"
    + "\n".join(f"- {name}: {BEHAVIOUR_DEFINITIONS[name]}" for name in BEHAVIOURS)
    + "\n\nThe whole trace is given below as numbered segments. Answer with one line per "
    "segment, in order, formatted exactly as `<number>: <label>`, and nothing else.\n"
)


@dataclasses.dataclass(frozen=True)
class SegmentLabel:
    """One labelled segment: behaviour index into :data:`BEHAVIOURS`."""

    trace_id: str
    segment: int
    label: int


def load_labels_jsonl(path: str | Path) -> list[SegmentLabel]:
    """Reads segment labels from JSONL; errors name the file and line of the problem."""
    path = Path(path)
    records: list[SegmentLabel] = []
    seen: dict[tuple[str, int], int] = {}
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {line_no}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: invalid JSON ({err.msg})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            missing = [key for key in ("trace_id", "segment", "label") if key not in obj]
            if missing:
                raise ValueError(f"{where}: missing key(s) {missing}")
            segment = obj["segment"]
            if not isinstance(segment, int) or isinstance(segment, bool) or segment < 0:
                raise ValueError(f"{where}: 'segment' must be an int >= 0, got {segment!r}")
            label = str(obj["label"]).strip().lower()
            if label not in BEHAVIOUR_INDEX:
                raise ValueError(
                    f"{where}: unknown label {obj['label']!r}; expected one of {BEHAVIOURS}"
                )
            key = (str(obj["trace_id"]), segment)
            if key in seen:
                raise ValueError(
                    f"{where}: duplicate label for trace {key[0]!r} segment {segment} "
                    f"(first on line {seen[key]})"
                )
            seen[key] = line_no
            records.append(SegmentLabel(key[0], segment, BEHAVIOUR_INDEX[label]))
    return records


def labels_for_trace(records: Sequence[SegmentLabel], trace_id: str, num_segments: int) -> list[int]:
    """Behaviour index per segment of one trace; errors if a segment is unlabelled or extra."""
    by_segment = {r.segment: r.label for r in records if r.trace_id == trace_id}
    missing = [i for i in range(num_segments) if i not in by_segment]
    if missing:
        raise ValueError(f"trace {trace_id!r}: no label for segment(s) {missing}")
    extra = sorted(s for s in by_segment if s >= num_segments)
    if extra:
        raise ValueError(
            f"trace {trace_id!r}: labels for segment(s) {extra} but the trace has "
            f"{num_segments} segments"
        )
    return [by_segment[i] for i in range(num_segments)]


class Judge(Protocol):
    """Anything that answers a prompt with text (an API client, or the policy's sampler)."""

    def __call__(self, prompt: str) -> str: ...


def build_judge_prompt(segment_texts: Sequence[str]) -> str:
    """The codebook prompt followed by the whole trace as numbered segments."""
    if not segment_texts:
        raise ValueError("a trace must have at least one segment")
    numbered = "\n".join(
        f"[{i}] {' '.join(text.split())}" for i, text in enumerate(segment_texts)
    )
    return f"{CODEBOOK_PROMPT}\n{numbered}\n"


# "<number> <separator/markup> <label>": leading bullets, brackets and bold markers allowed.
_JUDGE_LINE = re.compile(r"^\W*(\d+)\W+([A-Za-z]+)\b")


def parse_judge_output(text: str, num_segments: int) -> list[int]:
    """Parses ``<number>: <label>`` lines into one behaviour index per segment.

    Tolerates markdown decoration (``**3**: Planning``, ``- [3] planning``) and extra chatter
    lines; raises ValueError naming the segments that are missing, duplicated, out of range
    or carry an unknown label.
    """
    labels: dict[int, int] = {}
    for line_no, line in enumerate(text.splitlines(), start=1):
        match = _JUDGE_LINE.match(line.strip())
        if match is None:
            continue
        index, label = int(match.group(1)), match.group(2).lower()
        if index >= num_segments:
            raise ValueError(
                f"judge line {line_no}: segment {index} out of range (trace has "
                f"{num_segments} segments)"
            )
        if label not in BEHAVIOUR_INDEX:
            raise ValueError(
                f"judge line {line_no}: unknown label {match.group(2)!r} for segment {index}; "
                f"expected one of {BEHAVIOURS}"
            )
        if index in labels and labels[index] != BEHAVIOUR_INDEX[label]:
            raise ValueError(f"judge line {line_no}: segment {index} labelled twice")
        labels[index] = BEHAVIOUR_INDEX[label]
    missing = [i for i in range(num_segments) if i not in labels]
    if missing:
        raise ValueError(f"judge output has no label for segment(s) {missing}")
    return [labels[i] for i in range(num_segments)]


def label_trace_with_judge(judge: Judge, segment_texts: Sequence[str]) -> list[int]:
    """Labels every segment of one trace with one judge call."""
    return parse_judge_output(judge(build_judge_prompt(segment_texts)), len(segment_texts))


@dataclasses.dataclass(frozen=True)
class PolicyJudgeConfig:
    """Attributes:
    max_new_tokens: budget for the judge's answer (one short line per segment).
    seed: sampling seed for every call (a greedy policy ignores it).
    """

    max_new_tokens: int = 1024
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


class PolicyJudge:
    """The :class:`Judge` backed by a text policy (the policy itself through the sampler).

    ``policy`` is anything with the evaluation harness's ``TextPolicy.complete`` method
    (``spade_jax.evaluation.SamplerPolicy`` for the model, ``ScriptedPolicy`` in tests). The
    frozen codebook prompt goes in as the single user turn; the one completion comes back
    as text for :func:`parse_judge_output`.
    """

    def __init__(self, policy: object, config: PolicyJudgeConfig = PolicyJudgeConfig()) -> None:
        if not callable(getattr(policy, "complete", None)):
            raise TypeError("policy must have a TextPolicy-style complete() method")
        self.policy, self.config = policy, config

    def __call__(self, prompt: str) -> str:
        out = self.policy.complete([[{"role": "user", "content": prompt}]], n=1,
                                   seed=self.config.seed,
                                   max_new_tokens=self.config.max_new_tokens)
        return out[0][0]
