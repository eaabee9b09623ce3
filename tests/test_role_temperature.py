"""Per-role sampling temperatures reach the trainer's log-probs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from spade_jax.models import ModelConfig, ModelOptions, Qwen3
from spade_jax.rl.batch import TrainSequence, pack_sequences
from spade_jax.rl.train_step import policy_logprobs


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
