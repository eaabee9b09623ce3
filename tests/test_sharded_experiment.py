"""The 30B-A3B experiment's sharding, shrunk to a tiny MoE on 8 simulated CPU devices,
computes what one device computes: forward logits, sampler prefill, and one train step.

The mesh shape, the rule table, the MoE dispatch, remat, layer scan, attention blocks and
the microbatch count all come from ``experiments/qwen3_30b_a3b.py`` (the expert axis capped at the tiny model's expert
count), so a change to that experiment's parallelism is exercised here.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from spade_jax import sharding
from spade_jax.experiment import load_experiment
from spade_jax.models import ModelConfig, Qwen3
from spade_jax.rl.batch import TrainBatch
from spade_jax.rl.train_step import init_train_state, make_train_step, shard_batch
from spade_jax.rollout.sampler import SamplerConfig, sample

pytestmark = [
    pytest.mark.skipif(jax.device_count() < 8,
                       reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8"),
    pytest.mark.slow,  # expert-parallel compiles of the forward, sampler and train step
]

TINY_MOE = ModelConfig(
    architecture="Qwen3MoeForCausalLM", vocab_size=128, hidden_size=32, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64, num_experts=4,
    num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
    max_position_embeddings=256,
)


@pytest.fixture(scope="module")
def setup():
    big = load_experiment("qwen3_30b_a3b")
    mesh_config = dataclasses.replace(big.mesh, expert=min(big.mesh.expert, TINY_MOE.num_experts))
    assert mesh_config.expert > 1, "the 30B-A3B experiment should use expert parallelism"
    # The experiment's own model options (dispatch, remat, layer scan, attention blocks,
    # shrunk to the tiny sequence so the blocked path runs), in fp32 for exact comparison.
    options = dataclasses.replace(
        big.model.options(), dtype="float32",
        attention_chunk=min(big.model.attention_chunk, 4) if big.model.attention_chunk else 0)
    # Router replay is off in the recipe (its launch leaves it off) and one --set away; the
    # sharded replay path stays covered here.
    train = dataclasses.replace(big.train, compute_dtype="float32", microbatches=2,
                                router_replay=True)
    return options, mesh_config, train


def _batch(rows: int, length: int, seed: int) -> TrainBatch:
    rng = np.random.RandomState(seed)
    loss_mask = (rng.rand(rows, length) < 0.7).astype(np.float32)
    loss_mask[:, 0] = 0
    return TrainBatch(
        input_ids=rng.randint(0, TINY_MOE.vocab_size, (rows, length)).astype(np.int32),
        loss_mask=loss_mask,
        old_logp=(-rng.rand(rows, length) * 3).astype(np.float32) * loss_mask,
        advantages=rng.randn(rows).astype(np.float32),
        role_id=(np.arange(rows) % 2).astype(np.int32),
        # Replayed routing (router replay on): distinct experts per (token, layer).
        routing_replay=tuple(
            np.argsort(rng.rand(rows, length, TINY_MOE.num_experts), -1)[
                ..., : TINY_MOE.num_experts_per_tok].astype(np.int32)
            if TINY_MOE.is_moe_layer(i) else None for i in range(TINY_MOE.num_layers)),
    )


def test_expert_parallel_forward_and_sampler_match_one_device(setup):
    options, mesh_config, _ = setup
    # Inference never differentiates; remat around a layer that writes the KV cache fails to
    # trace in nnx (reported), so the sampler side runs without it.
    model = Qwen3(TINY_MOE, dataclasses.replace(options, remat=False), rngs=nnx.Rngs(3))
    mesh = sharding.make_mesh(mesh_config)
    assert mesh.shape["expert"] > 1 and mesh.shape["fsdp"] > 1
    ids = np.random.RandomState(0).randint(0, TINY_MOE.vocab_size, (8, 12))
    want = np.asarray(model(ids).logits)

    graphdef, params = nnx.split(model)
    placed = jax.device_put(params, sharding.tree_shardings(params, mesh))
    expert_specs = {str(v.sharding.spec) for k, v in nnx.to_flat_state(placed)
                    if k[-1] in ("gate_edf", "up_edf", "down_efd")}
    assert all("expert" in s for s in expert_specs), expert_specs
    with sharding.activate(mesh):
        forward = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x, mesh=mesh).logits)
        got = forward(placed, ids)
        hlo = forward.lower(placed, ids).compile().as_text()
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=2e-5)
    if options.moe_impl == "expert_parallel":  # tokens really move across the expert axis
        assert "all-to-all" in hlo

    prompts = [list(r) for r in np.random.RandomState(1).randint(1, TINY_MOE.vocab_size, (5, 7))]
    config = SamplerConfig(max_new_tokens=6, temperature=0.0, chunk_steps=0, compact_batch=False)
    single = sample(model, prompts, config, stop_tokens=[0])
    sharded = sample(nnx.merge(graphdef, placed), prompts, config, stop_tokens=[0], mesh=mesh)
    assert sharded.tokens == single.tokens
    np.testing.assert_allclose(np.concatenate(sharded.logprobs), np.concatenate(single.logprobs),
                               rtol=1e-4, atol=1e-5)


def test_expert_parallel_train_step_matches_one_device(setup):
    options, mesh_config, train = setup
    model = Qwen3(TINY_MOE, options, rngs=nnx.Rngs(3))
    batch = _batch(8, 16, seed=2)
    graphdef, state = init_train_state(model, train, seed=0)
    single, single_metrics = make_train_step(graphdef, train)(state, batch)

    mesh = sharding.make_mesh(mesh_config)
    graphdef, state = init_train_state(model, train, seed=0, mesh=mesh)
    sharded, metrics = make_train_step(graphdef, train, mesh)(state, shard_batch(batch, mesh))
    for got, want in zip(jax.tree.leaves(sharded.params), jax.tree.leaves(single.params),
                         strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    for key in ("loss", "grad_norm", "agent/tokens", "designer/tokens"):
        assert float(metrics[key]) == pytest.approx(float(single_metrics[key]), rel=1e-5), key
    assert float(metrics["grad_norm"]) > 0
