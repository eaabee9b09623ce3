"""The warm-start cache (``warm_start.cache_dir``): a hit only on the same inputs, bit-exact
weights back, a damaged entry ignored, and a run's warm start trained once."""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from spade import test_warm_start as fixtures  # tests/spade/

from spade_jax import run
from spade_jax.experiment import ExperimentConfig, WarmStartConfig
from spade_jax.rl.batch import TrainSequence
from spade_jax.spade import warm_start_cache

SETTINGS = {"steps": 2, "batch_size": 2, "learning_rate": 3e-3, "seed": 0, "pad_id": 0,
            "loss_mean": "token"}


def _params(seed: int = 0):
    return nnx.split(fixtures._tiny_moe(seed))[1]


def test_key_is_the_same_for_the_same_inputs_and_differs_for_any_change():
    seqs, params = fixtures._sequences(), _params()
    key = warm_start_cache.cache_key(seqs, params, SETTINGS)
    assert key == warm_start_cache.cache_key(fixtures._sequences(), _params(), dict(SETTINGS))
    one_token = [dataclasses.replace(seqs[0], token_ids=[3] + list(seqs[0].token_ids[1:]))]
    one_mask = [dataclasses.replace(seqs[0], loss_mask=[0, 1] + list(seqs[0].loss_mask[2:]))]
    changed = [
        warm_start_cache.cache_key(one_token + seqs[1:], params, SETTINGS),
        warm_start_cache.cache_key(one_mask + seqs[1:], params, SETTINGS),
        warm_start_cache.cache_key(seqs[::-1], params, SETTINGS),  # order is the batches'
        warm_start_cache.cache_key(seqs, _params(seed=1), SETTINGS),
        warm_start_cache.cache_key(seqs, params, {**SETTINGS, "learning_rate": 1e-3}),
        warm_start_cache.cache_key(seqs, params, {**SETTINGS, "seed": 1}),
    ]
    assert len({key, *changed}) == len(changed) + 1


def test_an_entry_comes_back_bit_exact_in_every_dtype(tmp_path):
    params = _params()
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.ndim == 2 else x, params)
    params = {"model": params, "step": jnp.int32(7)}  # a 0-d leaf too
    assert {str(x.dtype) for x in jax.tree.leaves(params)} == {"bfloat16", "float32", "int32"}
    path = warm_start_cache.save(tmp_path, "k", params, [2.5, 0.5])
    assert path.exists() and not list(tmp_path.glob(".*tmp"))  # written whole, then renamed
    hit = warm_start_cache.load(tmp_path, "k", params)
    assert (hit.first_loss, hit.last_loss) == (2.5, 0.5)
    restored = warm_start_cache.restore_like(hit.arrays, params)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(params), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
    assert warm_start_cache.load(tmp_path, "other", params) is None  # a miss


def test_a_damaged_or_mismatched_entry_is_a_miss_not_an_error(tmp_path, caplog):
    params = _params()
    warm_start_cache.save(tmp_path, "k", params, [1.0, 0.5])
    other_model = nnx.split(nnx.eval_shape(lambda: fixtures._tiny_moe()))[1]
    other_model = jax.tree.map(lambda x: jnp.zeros(x.shape[:-1] + (x.shape[-1] + 1,), x.dtype)
                               if x.ndim == 2 else jnp.zeros(x.shape, x.dtype), other_model)
    with caplog.at_level(logging.WARNING):
        assert warm_start_cache.load(tmp_path, "k", other_model) is None
    assert "unusable" in caplog.text and "cached float32" in caplog.text
    path = tmp_path / "k.npz"
    path.write_bytes(path.read_bytes()[:1000])  # a truncated file
    assert warm_start_cache.load(tmp_path, "k", params) is None


def test_cache_dir_must_be_local():
    with pytest.raises(ValueError, match="warm_start.cache_dir must be a local directory"):
        WarmStartConfig(cache_dir="gs://bucket/cache")


@pytest.mark.slow  # compiles the warm-start step of a 2-layer MoE once, ~10 s
def test_a_second_run_loads_the_first_runs_warm_start(tmp_path, monkeypatch):
    @dataclasses.dataclass
    class State:
        params: object

    class Tokenizer:
        pad_id = 0

    trained = []
    real = run.warm_start
    monkeypatch.setattr(run, "warm_start", lambda *a, **k: trained.append(1) or real(*a, **k))
    config = ExperimentConfig(name="cache_test", warm_start=WarmStartConfig(
        steps=3, batch_size=2, cache_dir=str(tmp_path)))
    graphdef, params = nnx.split(fixtures._tiny_moe())
    seqs = fixtures._sequences()
    first = run._supervised_pass(config, Tokenizer(), graphdef, State(params), seqs)
    second = run._supervised_pass(config, Tokenizer(), graphdef, State(params), seqs)
    assert len(trained) == 1 and len(list(tmp_path.glob("*.npz"))) == 1
    for got, want in zip(jax.tree.leaves(second.params), jax.tree.leaves(first.params),
                         strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # other examples: trained again, a second entry
    extra = [TrainSequence([5, 6, 7, 8], [0, 0, 1, 1], [0.0] * 4, 0.0)]
    run._supervised_pass(config, Tokenizer(), graphdef, State(params), seqs + extra)
    assert len(trained) == 2 and len(list(tmp_path.glob("*.npz"))) == 2
