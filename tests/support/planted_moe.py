"""The hand-built Qwen3 MoE with a planted behaviour (shared by the steering tests and the
steer CLI test).

The planted model (``planted_moe``) is built by hand so every claim has a known answer:

* attention output projections are zero, so each position sees only its own token;
* token ``t``'s embedding is ``a * e_0 * (+1 if t in B else -1) + e_2 + e_{3+t}`` (one-hot);
* layer 0's router puts ``+c * e_0`` on the planted experts P, so they are selected exactly
  on behaviour tokens B; the other experts get small random weights on the one-hot dims;
* only the planted experts have non-zero outputs: a large vector along ``e_1`` (their SwiGLU
  input is the constant ``e_2`` feature), and the LM head maps ``e_1`` to the target token X;
* otherwise the LM head maps token t's one-hot dim to ``successor[t]``.

So greedy decoding emits X right after a B token and ``successor[t]`` after any other token;
suppressing P removes X from the output, activating P makes every token X. Layer 1 is inert
(zero router, zero experts).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from spade_jax.models import ModelConfig, Qwen3, abstract_model

NUM_EXPERTS, TOP_K = 8, 2
PLANTED = (2, 5)


def planted_moe(vocab_size: int, behaviour: set[int], target: int,
                successor: dict[int, int], seed: int = 0) -> Qwen3:
    """The hand-built MoE of the module docstring (hidden size = vocab + 3)."""
    d = vocab_size + 3
    cfg = ModelConfig(architecture="Qwen3MoeForCausalLM", vocab_size=vocab_size, hidden_size=d,
                      num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8,
                      intermediate_size=16, num_experts=NUM_EXPERTS,
                      num_experts_per_tok=TOP_K, moe_intermediate_size=4, norm_topk_prob=True,
                      max_position_embeddings=512)
    # Built from the abstract structure: eager random init of every tensor costs ~10 s on
    # CPU and every weight is overwritten anyway (attention q/k/v do not matter: o = 0).
    graphdef, abstract = nnx.split(abstract_model(cfg))
    zeros_or_ones = jax.tree_util.tree_map_with_path(
        lambda path, leaf: (jnp.ones if "weight" in jax.tree_util.keystr(path) else jnp.zeros)(
            leaf.shape, leaf.dtype), abstract)
    model = nnx.merge(graphdef, zeros_or_ones)
    rng = np.random.default_rng(seed)
    embed = np.zeros((vocab_size, d), np.float32)
    embed[:, 0] = np.where(np.isin(np.arange(vocab_size), list(behaviour)), 2.0, -2.0)
    embed[:, 2] = 1.0
    embed[np.arange(vocab_size), 3 + np.arange(vocab_size)] = 1.0
    router = np.zeros((d, NUM_EXPERTS), np.float32)
    router[3:] = 0.3 * rng.normal(size=(vocab_size, NUM_EXPERTS))
    router[:, list(PLANTED)] = 0.0
    router[0, list(PLANTED)] = 4.0
    gate = np.zeros((NUM_EXPERTS, d, 4), np.float32)
    down = np.zeros((NUM_EXPERTS, 4, d), np.float32)
    for e in PLANTED:
        gate[e, 2, :] = 3.0
        down[e, :, 1] = 5.0
    head = np.zeros((d, vocab_size), np.float32)
    head[1, target] = 1.0
    for t, nxt in successor.items():
        head[3 + t, nxt] = 1.0

    def put(param, value):
        param[...] = jnp.asarray(value, param[...].dtype)

    put(model.embed_vd, embed)
    put(model.lm_head_dv, head)
    for i, layer in enumerate(model.layers):
        put(layer.moe.router_de, router if i == 0 else np.zeros_like(router))
        put(layer.moe.gate_edf, gate if i == 0 else np.zeros_like(gate))
        put(layer.moe.up_edf, gate if i == 0 else np.zeros_like(gate))
        put(layer.moe.down_efd, down if i == 0 else np.zeros_like(down))
    return model
