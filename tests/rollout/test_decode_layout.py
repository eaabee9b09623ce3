"""The sampler's decode layout (``MeshConfig.decode_layout``): the trained weights resharded
once per step onto a mesh without FSDP give the tokens and log-probs of the trainer's
layout, on 8 simulated CPU devices; the copy in the compute dtype
(``MeshConfig.decode_param_dtype``) gives exactly the master parameters' tokens and
log-probs."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
import tiny_hf
from flax import nnx

from spade_jax import sharding
from spade_jax.models import ModelOptions, abstract_model, load_hf, preset
from spade_jax.rl.trainer import DecodeCopy, decode_cast_dtype
from spade_jax.rollout import SamplerConfig
from spade_jax.rollout.engine import Request, SlotEngine
from spade_jax.rollout.sampler import sample

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
    with pytest.raises(ValueError, match="decode_param_dtype"):
        sharding.MeshConfig(decode_param_dtype="bfloat16")


def _dtypes(params) -> dict[str, str]:
    return {"/".join(map(str, k)): np.dtype(v.get_value().dtype).name
            for k, v in nnx.to_flat_state(params)}


@pytest.mark.parametrize("compute, stored, want", [
    ("bfloat16", "float32", "bfloat16"),  # the recipes: bf16 compute, fp32 master
    ("float32", "float32", "float32"),  # nothing narrower to read
    ("float32", "bfloat16", "bfloat16"),  # never widened
])
def test_cast_for_decode_stores_what_the_forward_reads(compute, stored, want):
    """Every weight in its read dtype; the MoE router, read in fp32 (``x.astype(float32) @
    router.astype(float32)``), keeps its stored dtype. Tied and untied heads, scanned and
    listed layers, a shared expert and biases."""
    moe = preset("bench_moe_17m")
    for arch, scan in ((moe, True),
                       (moe.replace(shared_expert_intermediate_size=64, qkv_bias=True), False),
                       (preset("qwen3_4b"), False)):  # dense, tied embeddings (abstract)
        options = ModelOptions(dtype=compute, param_dtype=stored, scan_layers=scan)
        params = nnx.split(abstract_model(arch, options))[1]
        got = _dtypes(jax.eval_shape(lambda p: sharding.cast_for_decode(p, compute), params))
        router = {k for k in got if k.endswith("router_de")}
        assert len(router) == (arch.num_layers if arch.is_moe and not scan else int(arch.is_moe))
        assert {got[k] for k in router} <= {stored}
        assert {v for k, v in got.items() if k not in router} == {want}
        assert _dtypes(sharding.cast_for_decode(params, None)) == _dtypes(params)


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
def test_decode_copy_reshards_once_per_train_state(placed):
    graphdef, params, train_mesh, _, mesh = placed
    cfg = nnx.merge(graphdef, params).config
    copy = DecodeCopy(TRAIN, train_mesh, graphdef, params, cfg)
    assert dict(copy.mesh.shape) == dict(mesh.shape)
    first = nnx.split(copy.policy(params))[1]
    again = nnx.split(copy.policy(params))[1]
    leaf = jax.tree.leaves(first)[0]
    assert leaf is jax.tree.leaves(again)[0]  # no reshard within a step
    assert leaf.sharding.mesh.shape == copy.mesh.shape
    next_params = jax.tree.map(lambda x: x, params)  # the next step's parameters
    assert jax.tree.leaves(nnx.split(copy.policy(next_params))[1])[0] is not leaf
    same = DecodeCopy(dataclasses.replace(TRAIN, decode_layout="train"), train_mesh, graphdef,
                      params, cfg)
    assert same.mesh is train_mesh
    assert jax.tree.leaves(nnx.split(same.policy(params))[1])[0] is jax.tree.leaves(params)[0]


def _tiny_on_train_mesh(kind: str, tmp_path, options: ModelOptions):
    """A tiny HF model (fp32 master weights) on the trainer's mesh, built for ``options``."""
    tiny_hf.make_hf_model(kind, tmp_path, eos_token_id=None, num_hidden_layers=2)
    train_mesh = sharding.make_mesh(TRAIN)
    model, cfg = load_hf(tmp_path, mesh=train_mesh, options=options)
    graphdef = nnx.graphdef(abstract_model(cfg, options))  # compute in options.dtype
    return graphdef, nnx.split(model)[1], train_mesh, cfg


@pytest.mark.slow  # ~30 s per model: compiles the sampler twice on the decode mesh
@needs_8
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_compute_dtype_copy_samples_exactly_as_the_master(kind, tmp_path):
    """The recipes' options (bf16 compute, fp32 master; the 30B recipe's expert-parallel
    dispatch): the run's decode copy in bf16 (router fp32) samples the same tokens and the
    same log-probs, bit for bit, as the fp32 master parameters on the same decode mesh."""
    options = ModelOptions(dtype="bfloat16", param_dtype="float32", moe_impl="expert_parallel")
    graphdef, params, train_mesh, cfg = _tiny_on_train_mesh(kind, tmp_path, options)
    copies = {name: DecodeCopy(dataclasses.replace(TRAIN, decode_param_dtype=name),
                               train_mesh, graphdef, params, cfg)
              for name in ("compute", "master")}
    mesh, master_mesh = copies["compute"].mesh, copies["master"].mesh

    def compute():
        return copies["compute"].policy(params)

    def master():
        return copies["master"].policy(params)
    assert dict(mesh.shape) == dict(master_mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 2,
                                                           "expert": 2}
    copy = _dtypes(nnx.split(compute())[1])
    assert set(_dtypes(nnx.split(master())[1]).values()) == {"float32"}
    assert {k: v for k, v in copy.items() if v != "bfloat16"} == (
        {f"layers/{i}/moe/router_de": "float32" for i in range(2)} if kind == "moe" else {})
    config = SamplerConfig(max_new_tokens=12, temperature=1.0, top_p=0.95, seed=3,
                           chunk_steps=0, compact_batch=False)
    got = sample(compute(), PROMPTS, config, mesh=mesh)
    want = sample(master(), PROMPTS, config, mesh=master_mesh)
    assert got.tokens == want.tokens and all(len(t) == 12 for t in got.tokens)
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        np.testing.assert_array_equal(a, b)
    # the copy really is what sampled: its bf16 weights are the master's, rounded
    for a, b in zip(jax.tree.leaves(nnx.split(compute())[1]), jax.tree.leaves(params),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b).astype(a.dtype))


@needs_8
def test_mixed_or_fp32_compute_model_keeps_the_master_dtype(tmp_path):
    """fp32 compute: nothing to narrow. A mixed model (built in fp32, then its top-level
    ``options.dtype`` set to bf16, as ``run.build_model`` does for a checkpoint: its layers
    still read their weights in fp32) keeps every weight fp32, values unchanged."""
    fp32 = ModelOptions(moe_impl="expert_parallel")
    graphdef, params, train_mesh, cfg = _tiny_on_train_mesh("moe", tmp_path, fp32)
    mixed = nnx.merge(graphdef, params)
    mixed.options = dataclasses.replace(mixed.options, dtype="bfloat16")
    bf16 = abstract_model(cfg, dataclasses.replace(fp32, dtype="bfloat16"))
    assert decode_cast_dtype(bf16, TRAIN) == np.dtype("bfloat16")
    assert decode_cast_dtype(bf16, dataclasses.replace(TRAIN, decode_param_dtype="master")) is None
    assert decode_cast_dtype(mixed, TRAIN) is None
    assert decode_cast_dtype(nnx.merge(graphdef, params), TRAIN) == np.dtype("float32")
    for graph in (graphdef, nnx.graphdef(mixed)):
        copy = nnx.split(DecodeCopy(TRAIN, train_mesh, graph, params, cfg).policy(params))[1]
        assert set(_dtypes(copy).values()) == {"float32"}
        for a, b in zip(jax.tree.leaves(copy), jax.tree.leaves(params), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
