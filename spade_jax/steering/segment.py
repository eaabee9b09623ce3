"""Cutting reasoning traces into sentence/clause segments and projecting labels onto tokens.

The paper's segments are sentences or clauses (median 16 tokens, 5th/95th percentile 3/47,
cap 125). Segments are token spans ``[start, end)`` so their labels line up with the router
telemetry, which is per token. A boundary falls *after* a token that

  * contains a newline, or
  * ends (ignoring closing quotes/brackets) with a sentence or clause ender, provided the
    next token starts with whitespace or the trace ends -- so "3.5" or "e.g" followed by a
    non-space token does not split.

Whitespace-only tokens after a boundary join the segment before it. Segments longer than
the cap are cut into near-equal pieces of at most ``max_tokens``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

_CLOSERS = "\"')]}\u201d\u2019*"


@dataclasses.dataclass(frozen=True)
class SegmenterConfig:
    """Where segments end.

    Attributes:
      max_tokens: the cap on segment length (paper: 125).
      sentence_enders: characters ending a sentence.
      clause_enders: characters ending a clause (empty to cut sentences only).
      split_on_newline: whether a newline always ends a segment.
    """

    max_tokens: int = 125
    sentence_enders: str = ".!?\u3002\uff01\uff1f"
    clause_enders: str = ";:\uff1b\uff1a"
    split_on_newline: bool = True

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.sentence_enders:
            raise ValueError("sentence_enders must not be empty")


@dataclasses.dataclass(frozen=True)
class Segment:
    """Token span ``[start, end)`` of one segment within its trace."""

    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


def _ends_unit(token: str, next_token: str | None, enders: str) -> bool:
    core = token.rstrip().rstrip(_CLOSERS)
    if not core or core[-1] not in enders:
        return False
    return next_token is None or token[-1:].isspace() or next_token[:1].isspace()


def _split_long(start: int, end: int, cap: int) -> list[Segment]:
    length = end - start
    if length <= cap:
        return [Segment(start, end)]
    pieces = -(-length // cap)  # ceil: the fewest pieces that respect the cap
    bounds = np.linspace(start, end, pieces + 1).round().astype(int)
    return [Segment(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def segment_tokens(
    token_texts: Sequence[str], config: SegmenterConfig = SegmenterConfig()
) -> list[Segment]:
    """Cuts one trace, given the decoded text of each token, into segments covering it."""
    enders = config.sentence_enders + config.clause_enders
    segments: list[Segment] = []
    start, boundary_pending = 0, False
    for i, token in enumerate(token_texts):
        # A pending boundary closes only at the next token with visible text, so trailing
        # whitespace/newline tokens stay with the segment they follow (no blank segments).
        if boundary_pending and token.strip():
            segments.extend(_split_long(start, i, config.max_tokens))
            start, boundary_pending = i, False
        next_token = token_texts[i + 1] if i + 1 < len(token_texts) else None
        if (config.split_on_newline and "\n" in token) or _ends_unit(token, next_token, enders):
            boundary_pending = True
    if start < len(token_texts):
        segments.extend(_split_long(start, len(token_texts), config.max_tokens))
    return segments


def token_texts_from_offsets(text: str, offsets: Sequence[tuple[int, int]]) -> list[str]:
    """Token texts from character offsets, giving any gap characters to the next token.

    Tokenizers often report offsets that skip the whitespace before a word; attaching the gap
    to the following token restores the "next token starts with a space" cue.
    """
    texts: list[str] = []
    previous_end = 0
    for i, (begin, end) in enumerate(offsets):
        if not 0 <= begin <= end <= len(text) or begin < previous_end:
            raise ValueError(
                f"offset {i} ({begin}, {end}) is out of order or outside the text "
                f"(length {len(text)}, previous end {previous_end})"
            )
        texts.append(text[previous_end:end])
        previous_end = end
    return texts


def segment_length_stats(segments: Sequence[Segment]) -> dict[str, float]:
    """Median and 5th/95th percentiles of segment length in tokens (the paper: 16, 3/47)."""
    if not segments:
        raise ValueError("no segments to summarise")
    lengths = np.array([s.num_tokens for s in segments])
    return {
        "count": float(lengths.size),
        "median": float(np.median(lengths)),
        "p5": float(np.percentile(lengths, 5)),
        "p95": float(np.percentile(lengths, 95)),
        "max": float(lengths.max()),
    }


def token_segment_ids(segments: Sequence[Segment], num_tokens: int) -> np.ndarray:
    """Segment index per token ``[T]`` (-1 where no segment covers the token)."""
    ids = np.full(num_tokens, -1, np.int64)
    for index, segment in enumerate(segments):
        if not 0 <= segment.start < segment.end <= num_tokens:
            raise ValueError(f"segment {index} {segment} lies outside [0, {num_tokens})")
        if (ids[segment.start : segment.end] != -1).any():
            raise ValueError(f"segment {index} {segment} overlaps an earlier segment")
        ids[segment.start : segment.end] = index
    return ids


def project_labels_to_tokens(
    segments: Sequence[Segment], segment_labels: Sequence[int], num_tokens: int
) -> np.ndarray:
    """Behaviour label per token ``[T]``: each token takes its segment's label (-1 if none)."""
    if len(segments) != len(segment_labels):
        raise ValueError(f"{len(segments)} segments but {len(segment_labels)} labels")
    ids = token_segment_ids(segments, num_tokens)
    labels = np.asarray(segment_labels, np.int64)
    return np.where(ids >= 0, labels[np.maximum(ids, 0)], -1) if labels.size else ids


def index_within_segment(token_segment_ids_n: np.ndarray) -> np.ndarray:
    """Position of each token inside its segment ``[N]`` (0 = first token).

    Works on a flat token stream where a segment's tokens are contiguous; a new segment
    starts wherever the segment id changes.
    """
    ids = np.asarray(token_segment_ids_n)
    if ids.ndim != 1:
        raise ValueError(f"expected a 1-D array of segment ids, got shape {ids.shape}")
    if ids.size == 0:
        return np.zeros(0, np.int64)
    starts = np.flatnonzero(np.concatenate([[True], ids[1:] != ids[:-1]]))
    run_start = np.repeat(starts, np.diff(np.concatenate([starts, [ids.size]])))
    return np.arange(ids.size) - run_start
