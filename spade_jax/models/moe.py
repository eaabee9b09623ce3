"""MoE routing and expert dispatch.

Shape legend: T tokens (batch and time flattened), D hidden, F expert hidden, E experts,
X = k selected experts per token, M = T * X token-expert assignments.

Two dispatch implementations compute the same thing:
  ``ragged``  dropless: sort the M assignments by expert, run grouped matmuls with
              ``jax.lax.ragged_dot``, unsort. FLOPs scale with k, not E. The default.
  ``dense``   every expert on every token, combined with a [T, E] weight matrix that is
              zero off the selected experts. FLOPs scale with E; the reference for tests.
  ``blocked`` dropless block-sorted dispatch with a lax.map over expert blocks; FLOPs
              scale with k; the fast path on CPU (NB blocks of BS rows in its legend).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

# A pure function that may edit router logits (fp32, [..., E]) before softmax/top-k.
# It receives the decoder-layer index so per-layer expert sets are possible.
RouterHook = Callable[[jax.Array, int], jax.Array]


def route(
    logits_tE: jax.Array,
    k: int,
    norm_topk_prob: bool,
    replay_tX: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Softmax (fp32) -> top-k -> optional renormalisation, as Hugging Face Qwen-MoE does.

    With ``replay_tX`` the selected experts are taken from a recording (router replay)
    instead of top-k; their weights still come from the current probabilities.
    Returns (weights_tX fp32, experts_tX int32).
    """
    probs_tE = jax.nn.softmax(logits_tE.astype(jnp.float32), axis=-1)
    if replay_tX is None:
        weights_tX, experts_tX = jax.lax.top_k(probs_tE, k)
    else:
        experts_tX = replay_tX.astype(jnp.int32)
        weights_tX = jnp.take_along_axis(probs_tE, experts_tX, axis=-1)
    if norm_topk_prob:
        weights_tX = weights_tX / jnp.sum(weights_tX, axis=-1, keepdims=True)
    return weights_tX, experts_tX.astype(jnp.int32)


def _swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    return jax.nn.silu(gate) * up


def dispatch_dense(
    x_tD: jax.Array,
    w_gate_EDF: jax.Array,
    w_up_EDF: jax.Array,
    w_down_EFD: jax.Array,
    weights_tX: jax.Array,
    experts_tX: jax.Array,
) -> jax.Array:
    """Reference path: all experts on all tokens, weighted by a sparse [T, E] combine."""
    num_tokens, num_experts = x_tD.shape[0], w_gate_EDF.shape[0]
    combine_tE = jnp.zeros((num_tokens, num_experts), jnp.float32)
    combine_tE = combine_tE.at[jnp.arange(num_tokens)[:, None], experts_tX].add(weights_tX)
    h_tEF = _swiglu(
        jnp.einsum("td,edf->tef", x_tD, w_gate_EDF), jnp.einsum("td,edf->tef", x_tD, w_up_EDF)
    )
    y_tED = jnp.einsum("tef,efd->ted", h_tEF, w_down_EFD)
    return jnp.einsum("ted,te->td", y_tED, combine_tE.astype(y_tED.dtype))


def dispatch_ragged(
    x_tD: jax.Array,
    w_gate_EDF: jax.Array,
    w_up_EDF: jax.Array,
    w_down_EFD: jax.Array,
    weights_tX: jax.Array,
    experts_tX: jax.Array,
) -> jax.Array:
    """Dropless grouped-matmul path: sort assignments by expert, ragged_dot, unsort."""
    order_M, group_sizes_E = _sort_by_expert(experts_tX, w_gate_EDF.shape[0])
    x_MD = x_tD[order_M // experts_tX.shape[1]]
    h_MF = _swiglu(
        jax.lax.ragged_dot(x_MD, w_gate_EDF, group_sizes_E),
        jax.lax.ragged_dot(x_MD, w_up_EDF, group_sizes_E),
    )
    y_sorted_MD = jax.lax.ragged_dot(h_MF, w_down_EFD, group_sizes_E)
    return _unsort_and_combine(y_sorted_MD, order_M, weights_tX)


def _sort_by_expert(experts_tX: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """(order_M: assignment slots grouped by expert, stable; group_sizes_E int32)."""
    experts_M = experts_tX.reshape(-1)
    order_M = jnp.argsort(experts_M, stable=True)
    return order_M, jnp.bincount(experts_M, length=num_experts).astype(jnp.int32)


def _unsort_and_combine(y_sorted_MD: jax.Array, order_M: jax.Array,
                        weights_tX: jax.Array) -> jax.Array:
    """Expert outputs back in assignment order, summed per token with the router weights."""
    y_MD = jnp.zeros_like(y_sorted_MD).at[order_M].set(y_sorted_MD)
    y_tXD = y_MD.reshape(*weights_tX.shape, -1)
    return jnp.einsum("txd,tx->td", y_tXD, weights_tX.astype(y_tXD.dtype))


# ---- blocked: dropless and fast where ragged_dot is not (XLA:CPU lowers ragged_dot to a
# loop over groups that costs about E full matmuls). Assignments are sorted by expert and
# cut into blocks of ``bs`` rows that each belong to one expert (groups padded to a
# multiple of bs); a lax.map over blocks runs one small SwiGLU per block.
_MAX_BLOCK_ROWS = 16


def _block_rows(num_assignments: int, num_experts: int) -> int:
    """Rows per block: about the mean group size, so padding stays below half the work."""
    return max(1, min(_MAX_BLOCK_ROWS, num_assignments // num_experts))


def dispatch_blocked(
    x_tD: jax.Array,
    w_gate_EDF: jax.Array,
    w_up_EDF: jax.Array,
    w_down_EFD: jax.Array,
    weights_tX: jax.Array,
    experts_tX: jax.Array,
) -> jax.Array:
    num_tokens, k = experts_tX.shape
    num_experts, m = w_gate_EDF.shape[0], num_tokens * k
    bs = _block_rows(m, num_experts)
    # Each non-empty group wastes < bs padded rows: a static bound on the block count.
    nb = -(-(m + min(num_experts, m) * (bs - 1)) // bs)
    order_M, group_E = _sort_by_expert(experts_tX, num_experts)
    sorted_experts_M = experts_tX.reshape(-1)[order_M]
    padded_E = -(-group_E // bs) * bs
    group_start_E = jnp.cumsum(group_E) - group_E
    padded_start_E = jnp.cumsum(padded_E) - padded_E
    # Row of sorted assignment j in the padded layout.
    row_M = padded_start_E[sorted_experts_M] + jnp.arange(m) - group_start_E[sorted_experts_M]
    block_expert_NB = jnp.searchsorted(jnp.cumsum(padded_E) // bs, jnp.arange(nb), side="right")
    block_expert_NB = jnp.minimum(block_expert_NB, num_experts - 1)  # trailing empty blocks
    x_rows = jnp.zeros((nb * bs, x_tD.shape[1]), x_tD.dtype).at[row_M].set(x_tD[order_M // k])

    def expert_block(args):
        x_bsD, e = args
        h_bsF = jax.nn.silu(x_bsD @ w_gate_EDF[e]) * (x_bsD @ w_up_EDF[e])
        return h_bsF @ w_down_EFD[e]

    y_rows = jax.lax.map(expert_block, (x_rows.reshape(nb, bs, -1), block_expert_NB))
    y_sorted_MD = y_rows.reshape(nb * bs, -1)[row_M]
    return _unsort_and_combine(y_sorted_MD, order_M, weights_tX)


DISPATCH: dict[str, Callable[..., jax.Array]] = {
    "ragged": dispatch_ragged,
    "dense": dispatch_dense,
    "blocked": dispatch_blocked,
}


def load_balancing_loss(
    router_logits: Sequence[jax.Array | None],
    k: int,
    attention_mask_bt: jax.Array | None = None,
) -> jax.Array:
    """Switch-style auxiliary loss, Hugging Face's formula for Qwen-MoE.

    aux = E * sum_e f_e * P_e, with f_e the share of top-k assignments that go to expert e
    and P_e its mean router probability, both pooled over every MoE layer and every
    (unmasked) token.
    """
    layers = [z for z in router_logits if z is not None]
    if not layers:
        return jnp.zeros((), jnp.float32)
    num_experts = layers[0].shape[-1]
    counts_E = jnp.zeros((num_experts,), jnp.float32)
    prob_sum_E = jnp.zeros((num_experts,), jnp.float32)
    rows = jnp.zeros((), jnp.float32)
    for logits_btE in layers:
        logits_tE = logits_btE.reshape(-1, num_experts).astype(jnp.float32)
        mask_t = (
            jnp.ones(logits_tE.shape[0], jnp.float32)
            if attention_mask_bt is None
            else attention_mask_bt.reshape(-1).astype(jnp.float32)
        )
        probs_tE = jax.nn.softmax(logits_tE, axis=-1)
        _, experts_tX = jax.lax.top_k(probs_tE, k)
        onehot_tE = jax.nn.one_hot(experts_tX, num_experts, dtype=jnp.float32).sum(axis=1)
        counts_E += jnp.sum(onehot_tE * mask_t[:, None], axis=0)
        prob_sum_E += jnp.sum(probs_tE * mask_t[:, None], axis=0)
        rows += jnp.sum(mask_t)
    return num_experts * jnp.sum((counts_E / rows) * (prob_sum_E / rows))
