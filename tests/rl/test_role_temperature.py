"""Per-role sampling temperatures reach the trainer's log-probs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spade_jax.models import ModelConfig, ModelOptions, Qwen3
from spade_jax.rl.batch import TrainSequence, pack_sequences
from spade_jax.rl.train_step import policy_logprobs


@pytest.mark.slow  # > 5 s quiet (fast-tier budget)
def test_per_row_temperature_matches_reference():
    cfg = ModelConfig(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                      head_dim=8, intermediate_size=24)
    model = Qwen3(cfg, ModelOptions(), rngs=nnx.Rngs(0))
    rng = np.random.RandomState(0)
    seqs = [TrainSequence(list(rng.randint(0, 32, 6)), [0, 1, 1, 1, 1, 1], [0.0] * 6, 1.0, role)
            for role in ("agent", "designer")]
    batch = pack_sequences(seqs)
    temps = jnp.asarray([1.0, 0.25])[batch.role_id]
    logp, _, _ = policy_logprobs(model, batch, False, 0, temps)
    logits = np.asarray(model(batch.input_ids).logits, np.float64)
    for row, t in enumerate([1.0, 0.25]):
        ref = jax.nn.log_softmax(logits[row, :-1] / t, axis=-1)
        want = np.take_along_axis(np.asarray(ref), np.asarray(batch.input_ids)[row, 1:, None], -1)[:, 0]
        np.testing.assert_allclose(np.asarray(logp)[row, 1:6], want[:5], atol=1e-5)


@pytest.mark.slow  # > 5 s quiet (fast-tier budget)
def test_step_uses_the_roles_temperature_when_both_roles_agree():
    """Both roles sampled at 0.5: the step's log-probs are of softmax(logits / 0.5), so the
    logged gap to the sampler's is ~0. (Regression: equal role temperatures used to fall
    back to a TrainConfig-wide temperature, since removed.)"""
    from spade_jax.rl.train_step import RoleConfig, TrainConfig, init_train_state, make_train_step

    cfg = ModelConfig(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                      head_dim=8, intermediate_size=24)
    model = Qwen3(cfg, ModelOptions(), rngs=nnx.Rngs(0))
    rng = np.random.RandomState(1)
    ids = [list(rng.randint(0, 32, 6)) for _ in range(2)]
    logits = np.asarray(model(np.asarray(ids)).logits, np.float64)
    seqs = []
    for row, role in enumerate(("agent", "designer")):
        ref = np.asarray(jax.nn.log_softmax(logits[row, :-1] / 0.5, axis=-1))
        sampler_logp = np.take_along_axis(ref, np.asarray(ids[row])[1:, None], -1)[:, 0]
        seqs.append(TrainSequence(ids[row], [0, 1, 1, 1, 1, 1], [0.0, *sampler_logp], 1.0, role))
    config = TrainConfig(agent=RoleConfig(temperature=0.5), designer=RoleConfig(temperature=0.5))
    graphdef, state = init_train_state(model, config)
    _, metrics = make_train_step(graphdef, config)(state, pack_sequences(seqs))
    for role in ("agent", "designer"):
        assert float(metrics[f"{role}/logp_gap_max"]) < 1e-5
