"""The sampler's decode layout (``MeshConfig.decode_layout``): the trained weights resharded
once per step onto a mesh without FSDP give the tokens and log-probs of the trainer's
layout, on 8 simulated CPU devices."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
import tiny_hf
from flax import nnx

from spade_jax import sharding
from spade_jax.models import ModelOptions, load_hf, preset
from spade_jax.rollout import SamplerConfig
from spade_jax.rollout.engine import Request, SlotEngine
from spade_jax.rollout.sampler import sample
from spade_jax.run import decode_policy

needs_8 = pytest.mark.skipif(
    jax.device_count() < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
TRAIN = sharding.MeshConfig(data=1, fsdp=4, tensor=1, expert=2)
PROMPTS = [[5, 17, 3], [9, 1, 44, 2, 70, 8, 31], [60, 61, 62, 63, 64], [2] * 11]


@pytest.mark.parametrize("name, mesh, decode, want", [
    # 30B-A3B on v5p-64: 4 kv heads -> tensor 4; experts stay over the expert axis.
    ("qwen3_30b_a3b_instruct_2507", sharding.MeshConfig(1, -1, 1, 8), "auto", (1, 1, 4, 8)),
    # 8B / 4B on 32 chips: 8 kv heads -> tensor 8, the other 4 ways take rows.
    ("qwen3_8b", sharding.MeshConfig(1, -1, 1, 1), "auto", (4, 1, 8, 1)),
    ("qwen3_4b_instruct_2507", sharding.MeshConfig(1, -1, 1, 1), "tensor", (4, 1, 8, 1)),
    ("qwen3_8b", sharding.MeshConfig(1, -1, 1, 1), "replicated", (32, 1, 1, 1)),
    ("qwen3_8b", sharding.MeshConfig(1, -1, 1, 1), "train", (1, 32, 1, 1)),
    ("qwen3_8b", sharding.MeshConfig(-1, 1, 1, 1), "auto", (32, 1, 1, 1)),  # no FSDP
])
def test_decode_mesh_shapes(name, mesh, decode, want):
    config = dataclasses.replace(mesh, decode_layout=decode)
    got = sharding.decode_mesh_config(config, 32, preset(name))
    assert got.shape(32) == want and got.decode_layout == decode


def test_bad_decode_layout_is_named():
    with pytest.raises(ValueError, match="decode_layout"):
        sharding.MeshConfig(decode_layout="fast")


@pytest.fixture(scope="module")
def placed(tmp_path_factory):
    """A tiny MoE on the trainer's FSDP x expert mesh and its copy on the decode mesh."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices")
    path = tmp_path_factory.mktemp("moe")
    tiny_hf.make_hf_model("moe", path, eos_token_id=None, num_hidden_layers=2)
    train_mesh = sharding.make_mesh(TRAIN)
    options = ModelOptions(moe_impl="expert_parallel")
    model, cfg = load_hf(path, mesh=train_mesh, options=options)
    mesh = sharding.decode_mesh(train_mesh, TRAIN, cfg)
    graphdef, params = nnx.split(model)
    decode_params = sharding.reshard(params, mesh)
    return graphdef, params, train_mesh, decode_params, mesh


@needs_8
def test_decode_copy_is_tensor_parallel_without_fsdp(placed):
    graphdef, params, train_mesh, decode_params, mesh = placed
    assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 2, "expert": 2}
    assert mesh.devices.size == train_mesh.devices.size == 8
    specs = {tuple(k): v.sharding.spec for k, v in nnx.to_flat_state(decode_params)}
    train_specs = {tuple(k): v.sharding.spec for k, v in nnx.to_flat_state(params)}
    assert any("fsdp" in jax.tree.leaves(tuple(s)) for s in train_specs.values())
    assert not any("fsdp" in jax.tree.leaves(tuple(s)) for s in specs.values())
    assert any("tensor" in jax.tree.leaves(tuple(s)) for s in specs.values())
    for a, b in zip(jax.tree.leaves(decode_params), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # same values, new place


@pytest.mark.slow  # ~25 s per temperature: compiles the sampler under both meshes
@needs_8
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sample_is_the_same_under_both_layouts(placed, temperature):
    graphdef, params, train_mesh, decode_params, mesh = placed
    config = SamplerConfig(max_new_tokens=12, temperature=temperature, seed=3, chunk_steps=0,
                           compact_batch=False)
    train = sample(nnx.merge(graphdef, params), PROMPTS, config, mesh=train_mesh)
    decode = sample(nnx.merge(graphdef, decode_params), PROMPTS, config, mesh=mesh)
    assert decode.tokens == train.tokens
    for a, b in zip(decode.logprobs, train.logprobs, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # ~55 s: compiles the engine under both meshes
@needs_8
def test_slot_engine_is_the_same_under_both_layouts(placed):
    """The engine run_episodes drives, with the expert-parallel dispatch under each mesh."""
    graphdef, params, train_mesh, decode_params, mesh = placed
    config = SamplerConfig(max_new_tokens=8)

    def run(p, m):
        engine = SlotEngine(nnx.merge(graphdef, p), 4, config, stop_tokens=[], mesh=m,
                            cache_len=32)
        engine.admit([Request(slot=i, tokens=t, fresh=True, limit=8, seed=i)
                      for i, t in enumerate(PROMPTS)])
        while engine.generating:
            engine.decode(4)
            done = engine.finished()
            if done:
                return done
        return []

    train, decode = run(params, train_mesh), run(decode_params, mesh)
    assert [f.tokens for f in decode] == [f.tokens for f in train] and len(train) == 4
    for a, b in zip(decode, train, strict=True):
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-5)


@needs_8
def test_decode_policy_reshards_once_per_train_state(placed):
    graphdef, params, train_mesh, _, mesh = placed

    class State:  # a train state: only .params is read
        def __init__(self, p):
            self.params = p

    holder = {"state": State(params)}
    cfg = nnx.merge(graphdef, params).config
    policy, sample_mesh = decode_policy(TRAIN, train_mesh, graphdef, holder, cfg)
    assert dict(sample_mesh.shape) == dict(mesh.shape)
    first = nnx.split(policy())[1]
    again = nnx.split(policy())[1]
    leaf = jax.tree.leaves(first)[0]
    assert leaf is jax.tree.leaves(again)[0]  # no reshard within a step
    assert leaf.sharding.mesh.shape == sample_mesh.shape
    holder["state"] = State(params)  # the next step's state
    assert jax.tree.leaves(nnx.split(policy())[1])[0] is not leaf
    same, same_mesh = decode_policy(dataclasses.replace(TRAIN, decode_layout="train"),
                                    train_mesh, graphdef, holder, cfg)
    assert same_mesh is train_mesh
    assert jax.tree.leaves(nnx.split(same())[1])[0] is jax.tree.leaves(params)[0]
