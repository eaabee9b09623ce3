"""Prints a tiny Qwen3-MoE's logits and one loss gradient (as JSON lists) under whatever
XLA_FLAGS the process starts with; ``tests/models/test_opt_level.py`` runs it with the
suite's compile flags (LLVM -O0 and more, tests/conftest.py) and with XLA's default flags
and compares."""

import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from spade_jax.models import ModelConfig, abstract_model

config = ModelConfig(architecture="Qwen3MoeForCausalLM", vocab_size=97, hidden_size=32,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                     intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=16, norm_topk_prob=True)
graphdef, shapes = nnx.split(abstract_model(config))
rs = np.random.RandomState(0)
params = jax.tree.map(lambda x: jnp.asarray(rs.normal(0, 0.3, x.shape).astype(x.dtype)), shapes)
ids = jnp.asarray(rs.randint(0, 97, (3, 11)))


def loss(p):
    logits = nnx.merge(graphdef, p)(ids).logits
    return jax.nn.log_softmax(logits).mean(), logits


(value, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
print(json.dumps({"loss": float(value), "logits": np.asarray(logits).ravel().tolist(),
                  "grads": np.concatenate([np.asarray(g).ravel()
                                           for g in jax.tree.leaves(grads)]).tolist()}))
