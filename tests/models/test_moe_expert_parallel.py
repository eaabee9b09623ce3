"""The expert-parallel MoE dispatch (shard_map + all_to_all over the "expert" mesh axis)
against the all-experts "dense" reference, a NumPy loop for the capacity-dropping mode,
and, through the whole model, a one-device "dense" run."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spade_jax import sharding
from spade_jax.models import ModelConfig, ModelOptions, Qwen3, moe

pytestmark = pytest.mark.skipif(
    jax.device_count() < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")

D, F = 16, 12


def _problem(tokens: int, experts: int, k: int, seed: int, skew: float = 0.0):
    rs = np.random.RandomState(seed)
    x = rs.normal(size=(tokens, D)).astype(np.float32)
    wg, wu = (rs.normal(0, 0.3, (experts, D, F)).astype(np.float32) for _ in range(2))
    wd = rs.normal(0, 0.3, (experts, F, D)).astype(np.float32)
    logits = rs.normal(size=(tokens, experts)).astype(np.float32)
    logits[: 3 * tokens // 4, 0] += skew  # skew > 0: 3/4 of the tokens all pick expert 0
    weights, chosen = moe.route(jnp.asarray(logits), k, True)
    return x, wg, wu, wd, weights, chosen


def _mesh(**axes) -> jax.sharding.Mesh:
    return sharding.make_mesh(sharding.MeshConfig(data=1, **axes))


def _value_and_vjp(dispatch):
    """Forward output, gradient of <y, r> w.r.t. x, the three expert weights and the router
    weights, and the dropped count, in one jitted function (one compile per mesh).
    ``dispatch`` returns (y, dropped)."""

    def run(args, r):
        y, pullback, dropped = jax.vjp(dispatch, *args, has_aux=True)
        return y, pullback(r), dropped

    return jax.jit(run)


@pytest.mark.parametrize(
    "axes,tokens,experts,k,skew",
    [
        # 60 tokens over 8 token shards: exercises the padding of a ragged token count.
        # (Each mesh is its own ~10-15 s compile on a loaded machine: one stays fast.)
        pytest.param(dict(fsdp=2, expert=4), 60, 8, 2, 0.0, marks=pytest.mark.slow),
        # Skewed: 48 of 64 tokens route to expert 0 (all on shard 0); dropless stays exact.
        pytest.param(dict(expert=8), 64, 16, 3, 20.0, marks=pytest.mark.slow),
        # F dim split over "tensor" (partial down projections summed across it).
        (dict(fsdp=2, tensor=2, expert=2), 32, 4, 2, 0.0),
    ],
)
def test_matches_dense_forward_and_grads(axes, tokens, experts, k, skew):
    args = _problem(tokens, experts, k, seed=tokens + experts, skew=skew)
    r = jnp.asarray(np.random.RandomState(7).normal(size=(tokens, D)).astype(np.float32))
    if skew:
        assert float(jnp.mean(jnp.any(args[5] == 0, axis=1))) >= 0.75
    want_y, want_g, _ = _value_and_vjp(lambda *a: (moe.dispatch_dense(*a), 0))(args, r)
    mesh = _mesh(**axes)
    with sharding.activate(mesh):
        fn = _value_and_vjp(lambda *a: moe.expert_parallel_with_drops(*a, mesh=mesh))
        assert "all_to_all" in fn.lower(args, r).as_text()  # real routing, not the fallback
        got_y, got_g, dropped = fn(args, r)
    assert int(dropped) == 0
    np.testing.assert_allclose(np.asarray(got_y), np.asarray(want_y), rtol=1e-5, atol=1e-5)
    for name, got, want in zip(("x", "gate", "up", "down", "weights"), got_g[:5], want_g[:5],
                               strict=True):
        assert float(jnp.max(jnp.abs(want))) > 1e-2, name  # a gradient that can be wrong
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=2e-5,
                                   err_msg=name)


def _numpy_capped(x, wg, wu, wd, weights, chosen, shards_tok, shards_ep, capacity):
    """Per-token loop; per (source token shard, destination expert shard) only the first
    ``capacity`` assignments in (token, slot) order are computed, the rest dropped."""
    tokens, k = chosen.shape
    per_shard, local = tokens // shards_tok, wg.shape[0] // shards_ep
    out, dropped = np.zeros_like(x, dtype=np.float64), 0
    for src in range(shards_tok):
        used = np.zeros(shards_ep, int)
        for t in range(src * per_shard, (src + 1) * per_shard):
            for j in range(k):
                e = chosen[t, j]
                if used[e // local] >= capacity:
                    dropped += 1
                    continue
                used[e // local] += 1
                gate, up = x[t] @ wg[e], x[t] @ wu[e]
                out[t] += weights[t, j] * ((gate / (1 + np.exp(-gate)) * up) @ wd[e])
    return out, dropped


@pytest.mark.parametrize("local_impl", ["ragged", "blocked"])
def test_capacity_factor_drops_are_counted(local_impl):
    tokens, experts, k, factor = 64, 16, 2, 1.0
    args = _problem(tokens, experts, k, seed=3, skew=20.0)
    # 8 tokens per shard, 16 assignments, 8 destinations: capacity ceil(1.0 * 16 / 8) = 2.
    want, want_dropped = _numpy_capped(*(np.asarray(a) for a in args), 8, 8, capacity=2)
    assert want_dropped > 30  # the skew overflows shard 0's slots from every source
    mesh = _mesh(expert=8)
    with sharding.activate(mesh):
        got, dropped = jax.jit(lambda *a: moe.expert_parallel_with_drops(
            *a, mesh=mesh, capacity_factor=factor, local_impl=local_impl))(*args)
    assert int(dropped) == want_dropped
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_falls_back_to_ragged_without_expert_parallelism():
    args = _problem(24, 8, 2, seed=1)
    want = moe.dispatch_ragged(*args)
    np.testing.assert_array_equal(np.asarray(moe.dispatch_expert_parallel(*args)), want)
    mesh = _mesh(fsdp=8)  # a mesh, but an expert axis of size 1
    with sharding.activate(mesh):
        fn = jax.jit(lambda *a: moe.dispatch_expert_parallel(*a, mesh=mesh))
        assert "all_to_all" not in fn.lower(*args).as_text()
        np.testing.assert_allclose(np.asarray(fn(*args)), want, rtol=1e-6, atol=1e-6)


def test_bad_inputs_are_named():
    args = _problem(16, 6, 2, seed=2)  # 6 experts over an expert axis of 4
    mesh = _mesh(fsdp=2, expert=4)
    with sharding.activate(mesh):
        with pytest.raises(ValueError, match="6 experts cannot be split"):
            moe.dispatch_expert_parallel(*args, mesh=mesh)
        with pytest.raises(ValueError, match="capacity_factor"):
            moe.expert_parallel_with_drops(*_problem(16, 8, 2, seed=2), mesh=mesh,
                                           capacity_factor=0.0)
        with pytest.raises(ValueError, match="local_impl"):
            moe.expert_parallel_with_drops(*_problem(16, 8, 2, seed=2), mesh=mesh,
                                           local_impl="dense")


def test_model_logits_match_one_device_dense():
    cfg = ModelConfig(
        architecture="Qwen3MoeForCausalLM", vocab_size=128, hidden_size=32, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
        max_position_embeddings=64,
    )
    ids = np.random.RandomState(0).randint(0, cfg.vocab_size, (8, 6))

    def graph(moe_impl: str):  # abstract init: eager init compiles one RNG program per shape
        return nnx.split(nnx.eval_shape(lambda: Qwen3(cfg, ModelOptions(moe_impl=moe_impl),
                                                      rngs=nnx.Rngs(0))))

    graphdef, abstract = graph("expert_parallel")
    dense_graphdef, _ = graph("dense")
    rs = np.random.RandomState(5)
    params = jax.tree.map(  # 1-D leaves are the RMSNorm scales
        lambda a: (1.0 + 0.1 * rs.normal(size=a.shape) if len(a.shape) == 1
                   else rs.normal(0, 0.3, a.shape)).astype(a.dtype), abstract)
    want = jax.jit(lambda p, x: nnx.merge(dense_graphdef, p)(x).logits)(params, ids)
    assert want.sharding.device_set == {jax.devices()[0]}

    mesh = _mesh(fsdp=2, expert=4)
    placed = jax.device_put(params, sharding.tree_shardings(params, mesh))
    with sharding.activate(mesh):
        fwd = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x, mesh=mesh).logits)
        assert fwd.lower(placed, ids).as_text().count("all_to_all") >= 3 * cfg.num_layers
        # The dispatch gets the mesh from the model call, not from the active context.
        implicit = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x).logits)
        assert "all_to_all" not in implicit.lower(placed, ids).as_text()
        got = fwd(placed, ids)
    assert len(got.sharding.device_set) == 8
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=2e-5)


def test_sampler_lowering_entries_hand_the_mesh_to_the_dispatch():
    """``rollout.sampler.lower_prefill`` / ``lower_decode_step`` (what the AOT planner
    compiles) route tokens across the expert axis: the mesh reaches the MoE dispatch."""
    from spade_jax.rollout import sampler

    cfg = ModelConfig(
        architecture="Qwen3MoeForCausalLM", vocab_size=128, hidden_size=32, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
        max_position_embeddings=64)
    options = ModelOptions(moe_impl="expert_parallel")
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Qwen3(cfg, options, rngs=nnx.Rngs(0))))
    mesh = _mesh(fsdp=2, expert=4)
    def placed(where, variable):  # the Variable's array as an abstract, placed input
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where), variable)

    params = jax.tree.map(placed, sharding.tree_shardings(abstract, mesh), abstract,
                          is_leaf=lambda x: isinstance(x, nnx.Variable))
    config = sampler.SamplerConfig(max_new_tokens=8, temperature=1.0, new_tokens_bucket=8)
    prefill = sampler.lower_prefill(graphdef, params, options, config, rows=8, prompt_len=16,
                                    mesh=mesh)
    assert prefill.as_text().count("all_to_all") >= 3 * cfg.num_layers
    state = prefill.out_info[0]
    assert state.tokens_bn.shape == (8, 8) and state.cache.valid_bs.shape == (8, 24)
    decode = sampler.lower_decode_step(graphdef, params, options, config, state, mesh=mesh)
    assert decode.as_text().count("all_to_all") >= 3 * cfg.num_layers
    unsharded = sampler.lower_prefill(graphdef, params, options, config, rows=8, prompt_len=16)
    assert "all_to_all" not in unsharded.as_text()
