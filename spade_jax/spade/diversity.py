"""Diversity of generated environments: Vendi score and an offline program featuriser.

Vendi score (Friedman & Dieng, 2023) of n items with unit-diagonal PSD similarity K:

    lambda_i = eigenvalues of K / n           # sum to 1
    VS       = exp(-sum_i lambda_i log lambda_i)

VS is 1 when all items are identical and n when they are pairwise orthogonal; the paper
reports Vendi/n (0.68 with corpus grounding vs 0.04 without). With cosine similarity of
embeddings X (rows L2-normalised), K = X X^T.

`ProgramFeaturiser` embeds environment programs without the policy: hashed counts of
Python token uni- and bigrams, comments and docstring-only statements dropped (so a
designer cannot inflate diversity with prose), TF-IDF weighted over the batch and
L2-normalised. Identifiers are kept as tokens, so renaming variables does count as a
(small) change.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import re
import tokenize
from collections.abc import Sequence

import numpy as np

_TOKEN_PATTERN = re.compile(r"[A-Za-z_]\w*|\d+(?:\.\d+)?|==|!=|<=|>=|\*\*|//|->|[^\s\w]")


def vendi_score_from_similarity(similarity: np.ndarray) -> float:
    """Vendi score of a symmetric PSD similarity matrix with ones on the diagonal."""
    similarity = np.asarray(similarity, dtype=np.float64)
    if similarity.ndim != 2 or similarity.shape[0] != similarity.shape[1]:
        raise ValueError(f"similarity must be a square matrix, got shape {similarity.shape}")
    n = similarity.shape[0]
    if n == 0:
        raise ValueError("Vendi score of zero items is undefined")
    if not np.all(np.isfinite(similarity)):
        raise ValueError("similarity contains non-finite entries")
    if not np.allclose(similarity, similarity.T, atol=1e-8):
        raise ValueError("similarity must be symmetric")
    if not np.allclose(np.diag(similarity), 1.0, atol=1e-6):
        raise ValueError("similarity must have ones on the diagonal (k(x, x) = 1)")
    eigenvalues = np.linalg.eigvalsh(similarity / n)
    # Rounding leaves tiny negative eigenvalues on rank-deficient K; they carry no mass.
    eigenvalues = eigenvalues[eigenvalues > 1e-12]
    return float(np.exp(-np.sum(eigenvalues * np.log(eigenvalues))))


def vendi_score(embeddings: np.ndarray) -> float:
    """Vendi score of items embedded as rows of `embeddings` under cosine similarity."""
    embeddings = np.asarray(embeddings, dtype=np.float64)
    if embeddings.ndim != 2:
        raise ValueError(f"embeddings must be (n_items, dim), got shape {embeddings.shape}")
    if not np.all(np.isfinite(embeddings)):
        raise ValueError("embeddings contain non-finite values")
    norms = np.linalg.norm(embeddings, axis=1, keepdims=True)
    if np.any(norms == 0):
        raise ValueError(f"embeddings rows {np.flatnonzero(norms[:, 0] == 0)[:5]} are all zero")
    unit = embeddings / norms
    similarity = unit @ unit.T
    np.fill_diagonal(similarity, 1.0)
    return vendi_score_from_similarity(similarity)


def normalized_vendi_score(embeddings: np.ndarray) -> float:
    """Vendi score / n, the number the paper reports (in (0, 1])."""
    return vendi_score(embeddings) / np.asarray(embeddings).shape[0]


@dataclasses.dataclass(frozen=True)
class FeaturiserConfig:
    """Offline program featuriser.

    Attributes:
      dim: hashed feature dimension.
      max_ngram: token n-grams from 1 to this are counted.
      use_idf: weight counts by inverse document frequency over the featurised batch.
    """

    dim: int = 4096
    max_ngram: int = 2
    use_idf: bool = True

    def __post_init__(self) -> None:
        if self.dim < 16:
            raise ValueError(f"FeaturiserConfig.dim must be >= 16, got {self.dim}")
        if not 1 <= self.max_ngram <= 4:
            raise ValueError(f"FeaturiserConfig.max_ngram must be in [1, 4], got {self.max_ngram}")


def program_tokens(source: str) -> list[str]:
    """Python tokens of `source` without comments and bare string statements (docstrings).

    Falls back to a regex tokeniser when `source` is not tokenisable Python.
    """
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        stripped = re.sub(r"#[^\n]*", "", source)
        return _TOKEN_PATTERN.findall(stripped)
    kept: list[str] = []
    previous_type = tokenize.NEWLINE
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.ENCODING, tokenize.ENDMARKER}
    for token in tokens:
        if token.type in skip:
            continue
        # A STRING right after a NEWLINE/INDENT/DEDENT opens a bare string statement.
        statement_start = previous_type in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
        previous_type = token.type
        if token.type == tokenize.STRING and statement_start:
            continue
        if token.type in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            kept.append({tokenize.NEWLINE: "<nl>", tokenize.INDENT: "<in>"}.get(token.type, "<de>"))
            continue
        kept.append(token.string)
    return kept


def _stable_bucket(feature: str, dim: int) -> int:
    # Python's hash() is salted per process; features must land in the same bucket always.
    digest = hashlib.blake2b(feature.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % dim


class ProgramFeaturiser:
    """Hashed token n-gram TF-IDF embeddings of environment programs (no model needed)."""

    def __init__(self, config: FeaturiserConfig | None = None) -> None:
        self.config = config or FeaturiserConfig()

    def counts(self, source: str) -> np.ndarray:
        """Hashed n-gram counts of one program, shape (dim,)."""
        tokens = program_tokens(source)
        vector = np.zeros(self.config.dim, dtype=np.float64)
        for n in range(1, self.config.max_ngram + 1):
            for start in range(len(tokens) - n + 1):
                gram = "\x1f".join(tokens[start : start + n])
                vector[_stable_bucket(f"{n}:{gram}", self.config.dim)] += 1.0
        return vector

    def __call__(self, sources: Sequence[str]) -> np.ndarray:
        """Embeddings of `sources`, shape (n, dim), rows L2-normalised."""
        if isinstance(sources, str):
            raise TypeError("pass a sequence of program sources, not a single string")
        if len(sources) == 0:
            raise ValueError("no programs to featurise")
        counts = np.stack([self.counts(source) for source in sources])
        empty = np.flatnonzero(counts.sum(axis=1) == 0)
        if empty.size:
            raise ValueError(f"programs {empty[:5].tolist()} have no code tokens")
        features = np.log1p(counts)
        if self.config.use_idf:
            document_frequency = (counts > 0).sum(axis=0)
            # Smoothed IDF (as scikit-learn): a feature in every program still weighs 1.
            features = features * (np.log((1 + len(sources)) / (1 + document_frequency)) + 1.0)
        return features / np.linalg.norm(features, axis=1, keepdims=True)
