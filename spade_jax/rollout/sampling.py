"""Next-token sampling math: temperature, top-k, top-p (nucleus), greedy.

Everything here is a pure function of a [B, V] fp32 logits array, jit-friendly.

The log-probability recorded for a sampled token is taken under the **untruncated,
temperature-scaled** policy, ``log_softmax(logits / T)[token]`` (``T = 1`` for greedy),
never under the top-k/top-p renormalised distribution: that is the density GRPO's
importance ratio is computed against when the trainer recomputes ``log pi(token)`` with a
full forward pass (it applies the same temperature and no truncation).

Legend: B batch rows, V vocab.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from spade_jax.models import numerics

_MASKED = -jnp.inf


def argmax_last(x_bv: jax.Array) -> jax.Array:
    """``jnp.argmax(x_bv, axis=-1)`` as int32 (the first maximum; a NaN counts as the
    maximum), computed as a max and a min reduction. XLA:CPU runs argmax's fused
    (value, index) reduction unvectorised: 1.7 ms for [64, 8192] against 0.5 ms for this,
    once per decode step."""
    best_b1 = jnp.max(x_bv, axis=-1, keepdims=True)
    hit_bv = (x_bv == best_b1) | jnp.isnan(x_bv)
    index_bv = jax.lax.broadcasted_iota(jnp.int32, x_bv.shape, x_bv.ndim - 1)
    return jnp.min(jnp.where(hit_bv, index_bv, x_bv.shape[-1]), axis=-1)


def categorical(keys_b: jax.Array, logits_bv: jax.Array) -> jax.Array:
    """``jax.vmap(jax.random.categorical)(keys_b, logits_bv)``, the same tokens (the same
    Gumbel draw per row's key), with :func:`argmax_last` in place of argmax."""
    gumbel_bv = jax.vmap(lambda key: jax.random.gumbel(key, logits_bv.shape[-1:],
                                                       logits_bv.dtype))(keys_b)
    return argmax_last(gumbel_bv + logits_bv)


def scaled_logits(logits_bv: jax.Array, temperature: float | jax.Array) -> jax.Array:
    """``logits / T``; ``T <= 0`` (greedy) leaves the logits as they are (``T = 1``)."""
    temperature = jnp.asarray(temperature, jnp.float32)
    safe_t = jnp.where(temperature > 0, temperature, 1.0)
    return logits_bv.astype(jnp.float32) / safe_t


def top_k_mask(logits_bv: jax.Array, top_k: int) -> jax.Array:
    """Keeps the ``top_k`` largest logits per row (ties at the k-th value are kept)."""
    if top_k <= 0 or top_k >= logits_bv.shape[-1]:
        return logits_bv
    kth_b1 = jax.lax.top_k(logits_bv, top_k)[0][:, -1:]
    return jnp.where(logits_bv >= kth_b1, logits_bv, _MASKED)


def top_p_mask(logits_bv: jax.Array, top_p: float | jax.Array) -> jax.Array:
    """Nucleus filter: keeps the smallest prefix (by descending probability) whose mass
    reaches ``top_p``. The most likely token is always kept."""
    order_bv = jnp.argsort(-logits_bv, axis=-1)
    sorted_bv = jnp.take_along_axis(logits_bv, order_bv, axis=-1)
    probs_bv = jax.nn.softmax(sorted_bv, axis=-1)
    mass_before_bv = jnp.cumsum(probs_bv, axis=-1) - probs_bv
    keep_sorted_bv = mass_before_bv < top_p
    keep_sorted_bv = keep_sorted_bv.at[:, 0].set(True)
    # Scatter the keep flags back to vocabulary order.
    rows_b1 = jnp.arange(logits_bv.shape[0])[:, None]
    keep_bv = jnp.zeros_like(keep_sorted_bv).at[rows_b1, order_bv].set(keep_sorted_bv)
    return jnp.where(keep_bv, logits_bv, _MASKED)


def filtered_logits(
    logits_bv: jax.Array, temperature: float | jax.Array, top_k: int, top_p: float | jax.Array,
    use_top_p: bool,
) -> jax.Array:
    """The distribution tokens are drawn from: scale, then top-k, then top-p."""
    out = top_k_mask(scaled_logits(logits_bv, temperature), top_k)
    return top_p_mask(out, top_p) if use_top_p else out


def sample_tokens(
    logits_bv: jax.Array,
    keys_b: jax.Array,
    *,
    temperature: float | jax.Array,
    top_k: int,
    top_p: float | jax.Array,
    greedy: bool,
    use_top_p: bool,
    invariant: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Draws one token per row; returns (tokens [B] int32, logprobs [B] fp32).

    ``keys_b`` holds one PRNG key per row, so a row's draw does not depend on which other
    rows share the batch (or on how the batch is sharded). ``invariant``: the log-prob is
    :func:`numerics.token_logprobs` in its fixed summation order, the one the trainer of a
    batch-invariant model re-scores with.
    """
    scaled_bv = scaled_logits(logits_bv, temperature)
    if greedy:
        tokens_b = argmax_last(scaled_bv)
    else:
        masked_bv = filtered_logits(logits_bv, temperature, top_k, top_p, use_top_p)
        tokens_b = categorical(keys_b, masked_bv)
    if invariant:
        return tokens_b, numerics.token_logprobs(scaled_bv, tokens_b, invariant=True)[0]
    logprobs_bv = jax.nn.log_softmax(scaled_bv, axis=-1)
    logprobs_b = jnp.take_along_axis(logprobs_bv, tokens_b[:, None], axis=-1)[:, 0]
    return tokens_b, logprobs_b
