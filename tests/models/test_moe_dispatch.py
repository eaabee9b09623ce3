"""The block-sorted MoE dispatch against a per-token NumPy loop."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spade_jax.models import ModelOptions, Qwen3, moe, preset
from spade_jax.models.moe import dispatch_blocked


def _numpy_moe(x, wg, wu, wd, weights, experts):
    out = np.zeros_like(x, dtype=np.float64)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], experts[t], strict=True):
            gate, up = x[t] @ wg[e], x[t] @ wu[e]
            out[t] += w * ((gate / (1 + np.exp(-gate)) * up) @ wd[e])
    return out


def _skewed_problem(tokens: int, skew: float):
    """(rng, tokens [T, D], gate / up / down weights, route weights, experts) of 8 experts
    top-3, the routing skewed as the tests below describe; the rng continues for more."""
    rs = np.random.RandomState(tokens)
    d, f, e, k = 16, 12, 8, 3
    x = rs.normal(size=(tokens, d)).astype(np.float32)
    wg, wu = (rs.normal(0, 0.3, (e, d, f)).astype(np.float32) for _ in range(2))
    wd = rs.normal(0, 0.3, (e, f, d)).astype(np.float32)
    logits = rs.normal(size=(tokens, e)).astype(np.float32)
    if skew > 0:
        logits[:, :k] += skew
    elif skew < 0:
        logits[:, [0, 3, 4, 6]] -= 100.0
    weights, experts = moe.route(jax.numpy.asarray(logits), k, True)
    return rs, x, wg, wu, wd, weights, experts


@pytest.mark.parametrize("tokens,skew", [(1, 0.0), (5, 0.0), (64, 0.0), (40, 8.0), (23, -1.0),
                                         (200, 0.0), (200, 8.0), (200, -1.0)])
def test_blocked_dispatch_matches_numpy(tokens, skew):
    """skew > 0: every token picks experts 0..k-1 (one huge group each, the rest empty);
    skew < 0: only experts 1, 2, 5 and 7 are picked (groups of uneven sizes, not multiples
    of the block rows, with empty experts between them: a group's last block runs into the
    rows of the next non-empty expert, which must be recomputed after it). Up to 64 tokens
    the capacity layout runs (40 and 23 tokens overflow its capacity into the block loop),
    200 tokens run as blocks only."""
    _, x, wg, wu, wd, weights, experts = _skewed_problem(tokens, skew)
    got = jax.jit(dispatch_blocked)(x, wg, wu, wd, weights, experts)
    want = _numpy_moe(x, wg, wu, wd, np.asarray(weights), np.asarray(experts))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)
    assert "blocked" in moe.DISPATCH


@pytest.mark.parametrize("tokens,skew", [(40, 8.0), (23, -1.0), (64, 0.0), (200, -1.0),
                                         (200, 8.0)])
def test_blocked_dispatch_gradients_match_dense(tokens, skew):
    """The trainer differentiates the blocked dispatch (the CPU default): its gradients with
    respect to the tokens, the router weights and the expert weights equal the dense
    reference's, on the capacity layout with overflow (40, 23), without (64) and on blocks
    (200). The block loop's backward is hand-written (custom_vjp): a block that runs past
    its group into the next expert's rows must give those rows no gradient (skew -1: empty
    experts between uneven groups), and one expert's many blocks must add up (skew 8)."""
    rs, x, wg, wu, wd, weights, experts = _skewed_problem(tokens, skew)
    probe = rs.normal(size=x.shape).astype(np.float32)

    def loss(dispatch):
        return lambda *a: jax.numpy.sum(dispatch(*a, experts) * probe)

    args = (x, wg, wu, wd, weights)
    got = jax.jit(jax.grad(loss(dispatch_blocked), argnums=range(5)))(*args)
    want = jax.grad(loss(moe.dispatch_dense), argnums=range(5))(*args)
    for g, w in zip(got, want, strict=True):
        assert np.abs(np.asarray(w)).max() > 0
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("batch,seq,skew", [(2, 20, 8.0), (2, 100, -1.0)])
def test_blocked_model_loss_and_gradients_match_dense(batch, seq, skew):
    """The trainer's path end to end: value_and_grad of a language-model loss of a small MoE
    model built with moe_impl="blocked" equals the one with the dense reference dispatch,
    for every parameter, under a skewed router (a router hook: 8 favours experts 0..2, -1
    leaves experts 1, 2, 5, 7 only). 40 tokens run the capacity layout with overflow, 200
    run as blocks."""
    cfg = preset("bench_moe_17m").replace(
        num_layers=2, vocab_size=64, hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16,
        num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24)
    bias_E = np.zeros(8, np.float32)
    if skew > 0:
        bias_E[:3] = skew
    else:
        bias_E[[0, 3, 4, 6]] = -100.0
    ids = jnp.asarray(np.random.RandomState(seq).randint(0, cfg.vocab_size, (batch, seq)))

    def value_and_grad(impl):
        graphdef, params = nnx.split(Qwen3(cfg, ModelOptions(moe_impl=impl), rngs=nnx.Rngs(0)))

        def loss(params):
            out = nnx.merge(graphdef, params)(ids, router_hook=lambda z, _: z + bias_E)
            logp = jax.nn.log_softmax(out.logits[:, :-1])
            return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], -1))

        return jax.jit(jax.value_and_grad(loss))(params)

    (got_loss, got), (want_loss, want) = value_and_grad("blocked"), value_and_grad("dense")
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-6)
    leaves = jax.tree.leaves_with_path(want)
    assert len(leaves) == len(jax.tree.leaves(got))
    for (path, w), g in zip(leaves, jax.tree.leaves(got), strict=True):
        scale = float(np.abs(np.asarray(w)).max())
        assert scale > 0, jax.tree_util.keystr(path)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5 * scale, rtol=1e-4,
                                   err_msg=jax.tree_util.keystr(path))
