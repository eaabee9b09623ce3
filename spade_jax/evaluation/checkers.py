"""Answer checkers: (completion text, reference answer) -> Verdict(score, reason).

Registered by name so data files and the hint filter can pick one (`"checker": "math"`):
  math             math-verify (Hugging Face's maintained checker): extracts the final
                   answer (last \\boxed{...}, else a trailing expression) and compares it
                   symbolically / numerically with the reference.
  multiple_choice  the chosen letter, read from the last <answer>X</answer>, else the last
                   "answer is X" / "Answer: X" / "(X)"-style statement; compared to the key.
  exact            the text inside the last <answer>...</answer> (else the whole completion),
                   whitespace-trimmed, equals the reference exactly.
Reasons are stable strings: "correct", "wrong", "no_answer".
"""

from __future__ import annotations

import dataclasses
import re
import string
import threading
from collections.abc import Callable

CORRECT, WRONG, NO_ANSWER = "correct", "wrong", "no_answer"
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class Verdict:
    score: float  # 1.0 correct, 0.0 otherwise
    reason: str  # CORRECT / WRONG / NO_ANSWER (or a suite-specific failure reason)

    @property
    def correct(self) -> bool:
        return self.reason == CORRECT


Checker = Callable[[str, str], Verdict]
CHECKERS: dict[str, Checker] = {}


def register_checker(name: str):
    """Decorator adding a checker to `CHECKERS`; a duplicate name is an error."""

    def decorator(fn: Checker) -> Checker:
        if name in CHECKERS:
            raise ValueError(f"checker {name!r} is already registered")
        CHECKERS[name] = fn
        return fn

    return decorator


def get_checker(name: str) -> Checker:
    if name not in CHECKERS:
        raise KeyError(f"unknown checker {name!r}; known: {sorted(CHECKERS)}")
    return CHECKERS[name]


def visible_text(completion: str) -> str:
    """The completion without <think>...</think> (an unclosed <think> hides everything)."""
    text = _THINK.sub("", completion)
    return "" if "<think>" in text else text


def _verdict(ok: bool) -> Verdict:
    return Verdict(1.0, CORRECT) if ok else Verdict(0.0, WRONG)


@register_checker("math")
def check_math(completion: str, answer: str) -> Verdict:
    """math-verify: gold parsed from `answer` (wrapped in $...$ if it has no delimiters)."""
    from math_verify import parse, verify

    # math-verify's timeouts use SIGALRM, which only the main thread may set.
    timeout = 5 if threading.current_thread() is threading.main_thread() else 0
    gold_text = answer if any(d in answer for d in ("$", "\\(", "\\[", "\\boxed")) else f"${answer}$"
    gold = parse(gold_text, parsing_timeout=timeout)
    if not gold:
        raise ValueError(f"math-verify cannot parse the reference answer {answer!r}")
    predicted = parse(visible_text(completion), parsing_timeout=timeout)
    if not predicted:
        return Verdict(0.0, NO_ANSWER)
    return _verdict(verify(gold, predicted, timeout_seconds=timeout))


_CHOICE_PATTERNS = (
    re.compile(r"answer\s*(?:is|:)?\s*[:\-]?\s*\(?\**([A-Z])\b\)?", re.IGNORECASE),
    re.compile(r"^\s*\(?([A-Z])\)?[.:)]?\s*$", re.MULTILINE),
)


def extract_choice(completion: str) -> str | None:
    """The chosen option letter, or None if the completion commits to none."""
    text = visible_text(completion)
    tags = _ANSWER_TAG.findall(text)
    if tags:
        letter = tags[-1].strip().strip("()*. ").upper()
        return letter if len(letter) == 1 and letter in string.ascii_uppercase else None
    for pattern in _CHOICE_PATTERNS:
        found = pattern.findall(text)
        if found:
            return found[-1].upper()
    return None


@register_checker("multiple_choice")
def check_multiple_choice(completion: str, answer: str) -> Verdict:
    choice = extract_choice(completion)
    if choice is None:
        return Verdict(0.0, NO_ANSWER)
    return _verdict(choice == answer.strip().upper())


@register_checker("exact")
def check_exact(completion: str, answer: str) -> Verdict:
    text = visible_text(completion)
    tags = _ANSWER_TAG.findall(text)
    given = tags[-1].strip() if tags else text.strip()
    if not given:
        return Verdict(0.0, NO_ANSWER)
    return _verdict(given == answer.strip())
