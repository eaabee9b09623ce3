"""Control features for the Read probes: could a surface shortcut explain the router signal?

The paper's controls (Qwen3-30B-A3B): router features 0.709 macro-F1 vs input embeddings
0.624, TF-IDF of segment text 0.566, trace position 0.124; dropping each segment's first
five tokens still gives 0.677 (vs 0.626 using only the first five) -- the signal is not in
openers like "Wait" or "Let me". Input embeddings come from the model as plain arrays; this
module builds the rest.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Sequence

import numpy as np

from spade_jax.steering.segment import index_within_segment

_WORD = re.compile(r"\w+|[^\w\s]")


def position_features(positions_n: np.ndarray, trace_lengths_n: np.ndarray | None = None) -> np.ndarray:
    """``[N, F]`` position-only features: position, log(1 + position), and, when trace
    lengths are given, the relative position in the trace."""
    positions = np.asarray(positions_n, np.float64)
    if positions.ndim != 1 or (positions < 0).any():
        raise ValueError("positions must be a 1-D array of non-negative token positions")
    columns = [positions, np.log1p(positions)]
    if trace_lengths_n is not None:
        lengths = np.asarray(trace_lengths_n, np.float64)
        if lengths.shape != positions.shape or (lengths <= positions).any():
            raise ValueError("trace_lengths must match positions and exceed every position")
        columns.append(positions / lengths)
    return np.stack(columns, axis=1).astype(np.float32)


def prefix_mask(token_segment_ids_n: np.ndarray, num_prefix: int = 5) -> np.ndarray:
    """True for each segment's first ``num_prefix`` tokens (negate it to drop them)."""
    if num_prefix < 0:
        raise ValueError(f"num_prefix must be >= 0, got {num_prefix}")
    return index_within_segment(token_segment_ids_n) < num_prefix


def tokenize_words(text: str) -> list[str]:
    """Lower-cased words and single punctuation marks."""
    return _WORD.findall(text.lower())


@dataclasses.dataclass(frozen=True)
class TfidfConfig:
    """Attributes:
    max_features: keep this many terms, those in the most training documents.
    min_df: drop terms seen in fewer training documents than this.
    """

    max_features: int = 2000
    min_df: int = 1

    def __post_init__(self) -> None:
        if self.max_features < 1 or self.min_df < 1:
            raise ValueError(f"max_features and min_df must be >= 1, got {self}")


@dataclasses.dataclass(frozen=True)
class TfidfModel:
    """A fitted vocabulary: ``vocabulary[term] = column`` and smoothed ``idf`` per column."""

    vocabulary: dict[str, int]
    idf: np.ndarray

    def transform(self, texts: Sequence[str]) -> np.ndarray:
        """``[num_texts, V]`` rows: raw term counts times idf, L2-normalised."""
        matrix = np.zeros((len(texts), len(self.vocabulary)), np.float32)
        for row, text in enumerate(texts):
            for term, count in Counter(tokenize_words(text)).items():
                column = self.vocabulary.get(term)
                if column is not None:
                    matrix[row, column] = count
        matrix *= self.idf
        norms = np.linalg.norm(matrix, axis=1, keepdims=True)
        return matrix / np.where(norms > 0, norms, 1.0)


def fit_tfidf(texts: Sequence[str], config: TfidfConfig = TfidfConfig()) -> TfidfModel:
    """Fits on training segment texts only; idf = ln((1 + n) / (1 + df)) + 1 (smoothed)."""
    if not texts:
        raise ValueError("need at least one training text")
    document_frequency = Counter(term for text in texts for term in set(tokenize_words(text)))
    kept = [term for term, df in document_frequency.items() if df >= config.min_df]
    kept.sort(key=lambda term: (-document_frequency[term], term))
    kept = sorted(kept[: config.max_features])
    if not kept:
        raise ValueError("no term passes min_df; the TF-IDF vocabulary would be empty")
    df = np.array([document_frequency[term] for term in kept], np.float64)
    idf = np.log((1.0 + len(texts)) / (1.0 + df)) + 1.0
    return TfidfModel({term: i for i, term in enumerate(kept)}, idf.astype(np.float32))


def segment_features_to_tokens(segment_features_sd: np.ndarray, token_segment_ids_n: np.ndarray) -> np.ndarray:
    """Gives every token its segment's feature row ``[N, D]`` (the TF-IDF control)."""
    ids = np.asarray(token_segment_ids_n)
    if (ids < 0).any() or (ids >= len(segment_features_sd)).any():
        raise ValueError("every token needs a segment id in [0, num_segments)")
    return np.asarray(segment_features_sd)[ids]
