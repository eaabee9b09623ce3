"""Scan over layers (stacked parameters + jax.lax.scan) and remat policies.

The reference is the plain Python loop over per-layer modules loaded from the same Hugging
Face checkpoint (itself checked against transformers in test_models.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_hf
from flax import nnx

from spade_jax import sharding
from spade_jax.models import ModelOptions, load_hf, positions_from_mask, save_hf
from spade_jax.models.qwen3 import REMAT_POLICIES, Qwen3
from spade_jax.models.safetensors_io import TensorIndex
from spade_jax.rollout.sampler import generate


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe")
    tiny_hf.make_hf_model("moe", path, num_hidden_layers=3)
    return path


@pytest.fixture(scope="module")
def dense_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("dense")
    tiny_hf.make_hf_model("dense", path, num_hidden_layers=3)
    return path


def _pair(path, **options):
    looped, _ = load_hf(path, options=ModelOptions(**options))
    scanned, _ = load_hf(path, options=ModelOptions(scan_layers=True, **options))
    return looped, scanned


def _ids(seed, shape=(3, 9)):
    return np.random.RandomState(seed).randint(0, tiny_hf.VOCAB, shape)


@pytest.mark.slow  # over 5 s with a cold compile cache (fast tier < 5 min)
@pytest.mark.parametrize("kind", ["moe", "dense"])
def test_scanned_forward_equals_python_loop(kind, moe_path, dense_path):
    looped, scanned = _pair(moe_path if kind == "moe" else dense_path)
    params = dict(nnx.to_flat_state(nnx.state(scanned, nnx.Param)))
    assert params[("layers", "attn", "q_dnh")].get_value().shape[0] == 3
    assert params[("layers", "attn", "q_dnh")].get_metadata()["axes"][0] == "layers"
    ids = _ids(0)
    mask = np.ones_like(ids)
    mask[1, :4] = 0
    pos = positions_from_mask(mask)
    a = looped(ids, pos, mask)
    b = scanned(ids, pos, mask)
    np.testing.assert_allclose(np.asarray(b.logits), np.asarray(a.logits), atol=1e-5, rtol=1e-5)
    assert len(b.router_logits) == len(a.router_logits) == 3
    for x, y, ex, ey in zip(a.router_logits, b.router_logits, a.selected_experts,
                            b.selected_experts, strict=True):
        if kind == "dense":
            assert x is None and y is None and ex is None and ey is None
        else:
            np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=1e-5, rtol=1e-5)
            np.testing.assert_array_equal(np.asarray(ey), np.asarray(ex))


def test_scanned_save_hf_round_trip_is_bit_identical(moe_path, tmp_path):
    _, scanned = _pair(moe_path)
    save_hf(scanned, scanned.config, tmp_path)
    a, b = TensorIndex(moe_path), TensorIndex(tmp_path)
    assert a.names() == b.names()
    for name in a.names():
        assert a.get(name).tobytes() == b.get(name).tobytes(), name


def _layer_grads(model: Qwen3, ids):
    """Gradient of a next-token loss, flattened to {(layer, *field): array}."""

    def loss(model):
        logp = jax.nn.log_softmax(model(ids).logits[:, :-1])
        return -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1).mean()

    grads = nnx.grad(loss)(model)
    out = {}
    for path, g in nnx.to_flat_state(grads):
        g = np.asarray(g.get_value() if hasattr(g, "get_value") else g)
        if path[0] != "layers":
            out[path] = g
        elif isinstance(path[1], int):  # looped: ("layers", i, ...)
            out[path] = g
        else:  # scanned: ("layers", ...) stacked over i
            for i in range(g.shape[0]):
                out[("layers", i, *path[1:])] = g[i]
    return out


@pytest.fixture(scope="module")
def reference_grads(moe_path):
    reference, _ = load_hf(moe_path)  # Python loop, no remat
    return _layer_grads(reference, _ids(1, (2, 8)))


# Every policy is covered scanned; the Python loop is checked with one policy (same code).
@pytest.mark.slow  # the reference backward plus one per policy (~15 s for the first)
@pytest.mark.parametrize("scan,remat", [(True, "none"), (True, "full"), (True, "dots"),
                                        (True, "dots_no_batch"), (False, "full")])
def test_gradients_equal_across_scan_and_remat_policies(scan, remat, moe_path, reference_grads):
    assert {r for s, r in [(True, "none"), (True, "full"), (True, "dots"),
                           (True, "dots_no_batch")]} == set(REMAT_POLICIES)
    model, _ = load_hf(moe_path, options=ModelOptions(scan_layers=scan, remat=remat))
    got = _layer_grads(model, _ids(1, (2, 8)))
    assert set(got) == set(reference_grads)
    for path, g in reference_grads.items():
        np.testing.assert_allclose(got[path], g, atol=1e-6, rtol=1e-4,
                                   err_msg=f"scan={scan} remat={remat} {path}")


@pytest.mark.slow  # compiles the backward twice
def test_remat_policy_changes_the_compiled_backward(moe_path):
    """The policies are not all the same program: "full" saves fewer residuals than "none"."""
    ids = _ids(2, (2, 8))

    def temp_bytes(remat):
        model, _ = load_hf(moe_path, options=ModelOptions(scan_layers=True, remat=remat))
        graphdef, params = nnx.split(model)

        def loss(p):
            return nnx.merge(graphdef, p)(ids).logits.sum()

        compiled = jax.jit(jax.grad(loss)).lower(params).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    none_bytes = temp_bytes("none")
    full_bytes = temp_bytes("full")
    assert full_bytes < none_bytes


@pytest.mark.slow  # ~30 s loaded
def test_scanned_kv_cache_decode_and_generate_equal_python_loop(moe_path):
    looped, scanned = _pair(moe_path)
    cache = scanned.init_cache(batch=2, max_len=12)
    assert cache.stacked and cache.k.shape[0] == 3
    ids = _ids(3, (2, 10))
    full = np.asarray(scanned(ids).logits)
    out = scanned(ids[:, :6], cache=cache)
    steps = [np.asarray(out.logits)]
    for t in range(6, 10):
        out = scanned(ids[:, t:t + 1], cache=out.cache)
        steps.append(np.asarray(out.logits))
    np.testing.assert_allclose(np.concatenate(steps, 1), full, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="stacked KVCache"):
        scanned(ids[:, :2], cache=looped.init_cache(2, 12))

    # Greedy generation with the stacked cache: every token is the argmax of a full
    # (cache-free) forward over the prompt and the tokens before it.
    prompt = [5, 6, 7, 9, 10]
    tokens = list(generate(scanned, [prompt], max_new_tokens=6).tokens[0])
    assert len(tokens) == 6
    logits = np.asarray(scanned(np.asarray([prompt + tokens])).logits[0])
    assert tokens == list(np.argmax(logits[len(prompt) - 1:-1], axis=-1))


def test_router_hook_sees_each_layer_index_when_scanned(moe_path):
    """A hook that edits only layer 1 changes the same outputs scanned and looped."""
    looped, scanned = _pair(moe_path)

    def hook(logits_btE, layer_idx):
        bump = jnp.where(layer_idx == 1, 50.0, 0.0)
        return logits_btE.at[..., 3].add(bump)

    ids = _ids(4)
    a = looped(ids, router_hook=hook)
    b = scanned(ids, router_hook=hook)
    assert (np.asarray(b.selected_experts[1]) == 3).any(axis=-1).all()
    assert not (np.asarray(b.selected_experts[0]) == 3).any(axis=-1).all()
    np.testing.assert_allclose(np.asarray(b.logits), np.asarray(a.logits), atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # ~10 s loaded: sharded compile
def test_scanned_sharded_load_equals_single_device(moe_path):
    if jax.device_count() < 8:
        pytest.skip("needs 8 host devices")
    mesh = sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=2, tensor=1, expert=4))
    single, _ = load_hf(moe_path, options=ModelOptions(scan_layers=True))
    model, _ = load_hf(moe_path, mesh=mesh, options=ModelOptions(scan_layers=True))
    gate = nnx.state(model, nnx.Param)["layers"]["moe"]["gate_edf"].get_value()
    assert gate.sharding.spec[:2] == (None, "expert")  # layers replicated, experts sharded
    np.testing.assert_array_equal(np.asarray(gate),
                                  np.asarray(single.layers.moe.gate_edf.get_value()))
    ids = _ids(5, (8, 6))
    with sharding.activate(mesh):
        graphdef, params = nnx.split(model)
        out = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x).logits)(params, ids)
    np.testing.assert_allclose(np.asarray(out), np.asarray(single(ids).logits), atol=2e-5,
                               rtol=1e-5)


def test_scan_layers_rejects_mixed_layer_kinds(tmp_path):
    tiny_hf.make_hf_model("moe", tmp_path, num_hidden_layers=2, mlp_only_layers=[0])
    with pytest.raises(ValueError, match="every decoder layer of one kind"):
        load_hf(tmp_path, options=ModelOptions(scan_layers=True))
    with pytest.raises(ValueError, match="remat must be"):
        ModelOptions(remat="sometimes")


@pytest.mark.slow  # ~27 s loaded
def test_chunked_attention_equals_full_attention(moe_path):
    """Query blocks of 4 over 9 positions (one padded block), with left padding, through the
    forward, the gradient and a KV-cache prefill."""
    full, _ = load_hf(moe_path)
    chunked, _ = load_hf(moe_path, options=ModelOptions(attention_chunk=4, scan_layers=True,
                                                        remat="full"))
    ids = _ids(6)
    mask = np.ones_like(ids)
    mask[0, :3] = 0
    pos = positions_from_mask(mask)
    np.testing.assert_allclose(np.asarray(chunked(ids, pos, mask).logits),
                               np.asarray(full(ids, pos, mask).logits), atol=1e-5, rtol=1e-5)
    prefill = chunked(ids, pos, mask, cache=chunked.init_cache(3, 16))
    real = mask.astype(bool)  # padded query rows attend to nothing; their output is unused
    np.testing.assert_allclose(np.asarray(prefill.logits)[real],
                               np.asarray(full(ids, pos, mask).logits)[real], atol=1e-5, rtol=1e-5)
    ref, got = _layer_grads(full, ids), _layer_grads(chunked, ids)
    for path, g in ref.items():
        np.testing.assert_allclose(got[path], g, atol=1e-6, rtol=1e-4, err_msg=str(path))
    with pytest.raises(ValueError, match="attention_chunk"):
        ModelOptions(attention_chunk=-1)
