"""First-answer detectors for the "steer only after the first answer" schedule.

The paper's cut experiment finds that suppressing planning experts acts almost entirely
after the model first states an answer (median 8-21% into the trace); before that point the
edit barely changes anything. The sampler keeps a per-sequence ``active`` flag, sets it when
a detector fires, and passes it to the steering hook. Once set it stays set: the window
experiment shows releasing the clamp brings the postponed rechecks straight back.

Two detectors:
  * :class:`FirstAnswerTracker` -- host side, regexes over decoded text, streamed chunk by
    chunk (keeps a short tail so a pattern split across chunks is still found);
  * :class:`TokenPatternDetector` -- device side, pure jnp, fires when the generated token
    ids end with one of a few token-id patterns (e.g. the ids of "\\boxed{").
"""

from __future__ import annotations

import dataclasses
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

DEFAULT_ANSWER_PATTERNS: tuple[str, ...] = (
    r"\\boxed\{",
    r"(?i)\b(?:the\s+)?final\s+answer\s*(?:is|:)",
    r"(?i)\bthe\s+answer\s+is\b",
    r"(?i)\*\*answer\*\*",
    r"(?im)^\s*answer\s*:",
)


@dataclasses.dataclass(frozen=True)
class FirstAnswerConfig:
    """Text patterns that mark a stated answer.

    Attributes:
      patterns: regular expressions; the first match anywhere in the generated text fires.
      lookback_chars: characters of previous text kept when streaming, so a pattern cut in
        half by a chunk boundary is still matched; must exceed the longest pattern match.
    """

    patterns: tuple[str, ...] = DEFAULT_ANSWER_PATTERNS
    lookback_chars: int = 64

    def __post_init__(self) -> None:
        if not self.patterns:
            raise ValueError("patterns must not be empty")
        for pattern in self.patterns:
            try:
                re.compile(pattern)
            except re.error as err:
                raise ValueError(f"invalid answer pattern {pattern!r}: {err}") from None
        if self.lookback_chars < 1:
            raise ValueError(f"lookback_chars must be >= 1, got {self.lookback_chars}")


def find_first_answer(text: str, config: FirstAnswerConfig = FirstAnswerConfig()) -> int | None:
    """Character offset just past the earliest answer marker in ``text``, or None."""
    matches = [m for p in config.patterns if (m := re.search(p, text)) is not None]
    if not matches:
        return None
    earliest = min(matches, key=lambda m: (m.start(), m.end()))
    return earliest.end()


class FirstAnswerTracker:
    """Per-sequence sticky "first answer seen" flags over streamed decoded text."""

    def __init__(self, batch_size: int, config: FirstAnswerConfig = FirstAnswerConfig()):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.config = config
        self._patterns = [re.compile(p) for p in config.patterns]
        self._tails = [""] * batch_size
        self.fired = np.zeros(batch_size, bool)

    def update(self, new_text_b: list[str]) -> np.ndarray:
        """Feeds each sequence's newly decoded text; returns the bool ``[B]`` active flags."""
        if len(new_text_b) != len(self._tails):
            raise ValueError(f"expected {len(self._tails)} texts, got {len(new_text_b)}")
        for b, new_text in enumerate(new_text_b):
            if self.fired[b]:
                continue
            window = self._tails[b] + new_text
            if any(p.search(window) for p in self._patterns):
                self.fired[b] = True
            self._tails[b] = window[-self.config.lookback_chars :]
        return self.fired.copy()


class TokenPatternState(NamedTuple):
    recent_bm: jax.Array  # last m generated token ids per sequence, newest last; -1 = none
    fired_b: jax.Array  # sticky bool flag per sequence


@dataclasses.dataclass(frozen=True)
class TokenPatternDetector:
    """Fires when a sequence's generated ids end with any of ``patterns`` (pure, jit-able).

    Attributes:
      patterns: token-id sequences, e.g. the tokenisation of "\\boxed{" and " answer is".
    """

    patterns: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if not self.patterns or any(len(p) == 0 for p in self.patterns):
            raise ValueError("patterns must be a non-empty tuple of non-empty id sequences")
        if any(t < 0 for p in self.patterns for t in p):
            raise ValueError("token ids in patterns must be >= 0")

    @property
    def window(self) -> int:
        return max(len(p) for p in self.patterns)

    def init(self, batch_size: int) -> TokenPatternState:
        return TokenPatternState(
            recent_bm=jnp.full((batch_size, self.window), -1, jnp.int32),
            fired_b=jnp.zeros((batch_size,), bool),
        )

    def update(self, state: TokenPatternState, token_b: jax.Array) -> TokenPatternState:
        """Appends one generated token per sequence and updates the sticky flags."""
        recent_bm = jnp.concatenate(
            [state.recent_bm[:, 1:], token_b.astype(jnp.int32)[:, None]], axis=1
        )
        matched_b = jnp.zeros_like(state.fired_b)
        for pattern in self.patterns:
            suffix_bp = recent_bm[:, self.window - len(pattern) :]
            matched_b |= jnp.all(suffix_bp == jnp.asarray(pattern, jnp.int32), axis=1)
        return TokenPatternState(recent_bm=recent_bm, fired_b=state.fired_b | matched_b)
