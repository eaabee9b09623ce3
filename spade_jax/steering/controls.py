"""Control features for the Read probes: could a surface shortcut explain the router signal?

The paper's controls (Qwen3-30B-A3B): router features 0.709 macro-F1 vs input embeddings
0.624, TF-IDF of segment text 0.566, trace position 0.124; dropping each segment's first
five tokens still gives 0.677 (vs 0.626 using only the first five) -- the signal is not in
openers like "Wait" or "Let me". And a width-matched residual control: the nine-layer
residual window projected to the router window's 1,152 dims still reads 0.657, so the
router's 0.659 is not a matter of having fewer features.

Input embeddings are looked up in the model's own table (:func:`input_embedding_features`,
duck-typed on ``model.embed_vd``, so no model code is imported here); the rest is built from
plain arrays.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

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


PROJECTION_KINDS = ("orthonormal", "gaussian")


def width_matched_projection(
    input_width: int,
    num_experts: int,
    num_router_layers: int,
    seed: int = 0,
    kind: str = "orthonormal",
) -> np.ndarray:
    """A fixed random ``[input_width, num_experts * num_router_layers]`` float32 projection:
    residual features (one layer's D, or a window's ``W * D``) brought down to the width of
    the router features they are compared with (E per layer times the window's layers), so
    router vs residual is a comparison at equal width.

    ``kind``: "orthonormal" (orthonormal columns: the QR factor of a Gaussian matrix, signs
    fixed so the result depends on the seed only; needs ``input_width >= output width``) or
    "gaussian" (i.i.d. N(0, 1 / output width), Johnson-Lindenstrauss style). The same seed
    gives the same matrix: the control must not be re-drawn between the probe's train and
    test features. The probe standardises features, so the scale does not matter.
    """
    width = num_experts * num_router_layers
    if input_width < 1 or width < 1:
        raise ValueError(f"need input_width >= 1 and num_experts * num_router_layers >= 1, "
                         f"got {input_width}, {num_experts} x {num_router_layers}")
    if kind not in PROJECTION_KINDS:
        raise ValueError(f"kind must be one of {PROJECTION_KINDS}, got {kind!r}")
    gaussian = np.random.default_rng(seed).standard_normal((input_width, width))
    if kind == "gaussian":
        return (gaussian / np.sqrt(width)).astype(np.float32)
    if width > input_width:
        raise ValueError(f"an orthonormal projection cannot widen {input_width} dims to {width}")
    q, r = np.linalg.qr(gaussian)
    return (q * np.where(np.diag(r) < 0, -1.0, 1.0)).astype(np.float32)


def project_features(x_nd: np.ndarray, projection_dk: np.ndarray) -> np.ndarray:
    """``[N, K]`` = ``x_nd @ projection_dk`` in float32 (apply chunk by chunk when streaming)."""
    x = np.asarray(x_nd, np.float32)
    if x.ndim != 2 or x.shape[1] != projection_dk.shape[0]:
        raise ValueError(f"need x [N, {projection_dk.shape[0]}], got {x.shape}")
    return x @ projection_dk


def input_embedding_features(model: Any, token_ids_n: np.ndarray) -> np.ndarray:
    """``[N, D]`` float32: the model's own input-embedding rows of ``token_ids_n`` (the
    "input embeddings" control; equal to the residual entering layer 0). The lookup runs
    where the table lives, so only N rows, not the V x D table, come to the host."""
    import jax.numpy as jnp  # only here: the rest of this module is plain NumPy

    ids = np.asarray(token_ids_n)
    table = model.embed_vd[...]
    if ids.ndim != 1 or (ids.size and (ids.min() < 0 or ids.max() >= table.shape[0])):
        raise ValueError(f"token ids must be a 1-D array in [0, {table.shape[0]})")
    return np.asarray(jnp.take(table, jnp.asarray(ids, jnp.int32), axis=0), np.float32)
