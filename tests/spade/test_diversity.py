"""Vendi score against independent NumPy computations and known cases; program featuriser."""

import collections

import numpy as np
import pytest

from spade_jax.spade import (
    FeaturiserConfig,
    ProgramFeaturiser,
    normalized_vendi_score,
    vendi_score,
    vendi_score_from_similarity,
)
from spade_jax.spade.diversity import program_tokens


def _vendi_via_svd(x):
    """Reference: the nonzero eigenvalues of X X^T / n are the squared singular values of
    X / sqrt(n); exp of the Shannon entropy of that spectrum."""
    unit = x / np.linalg.norm(x, axis=1, keepdims=True)
    s = np.linalg.svd(unit / np.sqrt(len(x)), compute_uv=False)
    p = s**2
    p = p[p > 1e-15]
    return float(np.exp(-(p * np.log(p)).sum()))


def test_identical_items_score_one_and_orthogonal_items_score_n():
    assert vendi_score(np.tile([[0.3, -1.0, 2.0]], (7, 1))) == pytest.approx(1.0)
    assert vendi_score(np.eye(5) * 3.0) == pytest.approx(5.0)
    assert normalized_vendi_score(np.eye(5)) == pytest.approx(1.0)
    # Two clusters of identical items, orthogonal to each other: effectively 2 items.
    assert vendi_score(np.array([[1, 0]] * 3 + [[0, 1]] * 3, float)) == pytest.approx(2.0)


def test_two_items_closed_form():
    # K = [[1, c], [c, 1]]: eigenvalues of K/2 are (1 +- c) / 2.
    for c in (0.0, 0.3, 0.9):
        p = np.array([(1 + c) / 2, (1 - c) / 2])
        p = p[p > 0]
        want = np.exp(-(p * np.log(p)).sum())
        assert vendi_score_from_similarity(np.array([[1, c], [c, 1]])) == pytest.approx(want)


def test_matches_svd_reference_on_random_embeddings():
    rng = np.random.default_rng(0)
    for n, d in [(3, 8), (20, 5), (12, 64)]:
        x = rng.normal(size=(n, d))
        assert vendi_score(x) == pytest.approx(_vendi_via_svd(x), rel=1e-9)
        perm = rng.permutation(n)
        scale = rng.uniform(0.1, 10, size=(n, 1))
        assert vendi_score(x[perm] * scale) == pytest.approx(vendi_score(x), rel=1e-9)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="all zero"):
        vendi_score(np.array([[1.0, 0.0], [0.0, 0.0]]))
    with pytest.raises(ValueError, match="non-finite"):
        vendi_score(np.array([[np.nan, 1.0]]))
    with pytest.raises(ValueError, match=r"\(n_items, dim\)"):
        vendi_score(np.ones(3))
    with pytest.raises(ValueError, match="ones on the diagonal"):
        vendi_score_from_similarity(np.array([[2.0, 0.0], [0.0, 1.0]]))
    with pytest.raises(ValueError, match="symmetric"):
        vendi_score_from_similarity(np.array([[1.0, 0.5], [0.1, 1.0]]))


MAZE = '''
class Env:
    """A rotating maze."""
    def reset(self, seed=None):
        self.pos = (0, 0)  # start corner
        return "You are in a maze."
    def step(self, action):
        self.pos = (self.pos[0] + 1, self.pos[1])
        return "moved", 0.0, self.pos == (3, 3), False, {}
'''

PHYSICS = """
class Env:
    def reset(self, seed=None):
        self.mass, self.force = 2.0, 10.0
        return "A cart is pushed."
    def step(self, action):
        guess = float(action)
        reward = max(0.0, 1.0 - abs(guess - self.force / self.mass) / 5.0)
        return "checked", reward, True, False, {"target": self.force / self.mass}
"""

LEDGER = """
import json
class Env:
    def reset(self, seed=None):
        self.accounts = {"alice": 10, "bob": 3}
        return json.dumps(self.accounts)
    def step(self, action):
        call = json.loads(action)
        if call.get("tool") == "transfer":
            self.accounts[call["src"]] -= call["amount"]
        return json.dumps(self.accounts), 0.5, False, False, {}
"""


def test_tokens_drop_comments_and_docstrings():
    tokens = program_tokens(MAZE)
    assert "rotating" not in " ".join(tokens) and "corner" not in tokens
    assert {"class", "Env", "reset", "step", "self"} <= set(tokens)
    reworded = MAZE.replace("A rotating maze.", "Totally new prose!").replace(
        "# start corner", "# a different comment"
    )
    featuriser = ProgramFeaturiser()
    np.testing.assert_array_equal(featuriser.counts(MAZE), featuriser.counts(reworded))
    assert program_tokens("x = (1 +")  # untokenisable source falls back to the regex


def test_counts_match_an_independent_ngram_count():
    config = FeaturiserConfig(dim=2**20, max_ngram=2, use_idf=False)  # collisions ~impossible
    counts = ProgramFeaturiser(config).counts(PHYSICS)
    tokens = program_tokens(PHYSICS)
    grams = collections.Counter(
        tuple(tokens[i : i + n]) for n in (1, 2) for i in range(len(tokens) - n + 1)
    )
    assert counts.sum() == sum(grams.values())
    assert np.count_nonzero(counts) == len(grams)
    assert sorted(counts[counts > 0].tolist()) == sorted(float(v) for v in grams.values())


def test_tfidf_weighting_matches_numpy_reference():
    featuriser = ProgramFeaturiser(FeaturiserConfig(dim=512))
    sources = [MAZE, PHYSICS, LEDGER]
    counts = np.stack([featuriser.counts(s) for s in sources])
    idf = np.log((1 + 3) / (1 + (counts > 0).sum(0))) + 1
    want = np.log1p(counts) * idf
    want /= np.linalg.norm(want, axis=1, keepdims=True)
    np.testing.assert_allclose(featuriser(sources), want, atol=1e-12)


def test_vendi_of_programs_separates_duplicates_from_distinct_programs():
    featuriser = ProgramFeaturiser()
    duplicates = [MAZE.replace("(3, 3)", f"({k}, {k})") for k in range(3, 9)]
    distinct = [MAZE, PHYSICS, LEDGER, duplicates[1], PHYSICS.replace("5.0", "2.0"), LEDGER[:-40]]
    same = normalized_vendi_score(featuriser([MAZE] * 6))
    near = normalized_vendi_score(featuriser(duplicates))
    diverse = normalized_vendi_score(featuriser(distinct))
    assert same == pytest.approx(1 / 6)
    assert same < near < diverse
    with pytest.raises(TypeError, match="sequence of program sources"):
        featuriser(MAZE)
    with pytest.raises(ValueError, match="no code tokens"):
        featuriser([MAZE, "# only a comment\n"])
