"""The decode step's argmax and categorical draw against ``jnp.argmax`` and
``jax.random.categorical`` (the faster forms must pick exactly the same tokens)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from spade_jax.rollout import sampling


def test_argmax_last_equals_jnp_argmax_with_ties_infs_and_nans():
    rs = np.random.RandomState(0)
    x = rs.normal(size=(6, 37)).astype(np.float32)
    x[1, [3, 9, 30]] = 5.0  # a tie: the first index wins
    x[2, :] = -np.inf  # every entry masked: index 0
    x[3, [4, 20]] = np.nan  # NaN counts as the maximum: the first NaN
    x[4, :] = 1.0
    x[5, [0, 36]] = np.inf
    got = jax.jit(sampling.argmax_last)(x)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(x, axis=-1)))
    np.testing.assert_array_equal(np.asarray(got), [np.argmax(x[0]), 3, 0, 4, 0, 0])


def test_categorical_draws_the_same_tokens_as_jax_random():
    rs = np.random.RandomState(1)
    logits = rs.normal(size=(16, 300)).astype(np.float32) * 3
    logits[:, 100:] = -np.inf  # a top-k style mask
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(7), i))(jnp.arange(16))
    want = jax.vmap(jax.random.categorical)(keys, logits)
    got = jax.jit(sampling.categorical)(keys, logits)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert np.asarray(got).max() < 100
    assert len(set(np.asarray(got).tolist())) > 4  # really random, not a constant
