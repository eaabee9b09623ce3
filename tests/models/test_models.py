"""Qwen3-family model core against Hugging Face transformers on the same random weights."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_hf
import torch
from flax import nnx

from spade_jax import sharding
from spade_jax.models import (
    CheckpointError,
    ConfigError,
    ModelConfig,
    ModelOptions,
    load_balancing_loss,
    load_hf,
    positions_from_mask,
    preset,
    save_hf,
)
from spade_jax.models.safetensors_io import TensorIndex, write_safetensors

CASES = {
    "dense_untied_gqa2": ("dense", {}),
    "dense_tied_gqa4": ("dense", dict(tie_word_embeddings=True, num_attention_heads=8,
                                      num_key_value_heads=2)),
    "dense_mha_gqa1": ("dense", dict(num_key_value_heads=4)),
    "moe_norm_topk": ("moe", {}),
    "moe_no_norm_topk_tied": ("moe", dict(norm_topk_prob=False, tie_word_embeddings=True)),
    "moe_sparse_step2_mlp_only": ("moe", dict(num_hidden_layers=4, decoder_sparse_step=2,
                                              mlp_only_layers=[3])),
    "moe_mlp_only_gqa4": ("moe", dict(num_hidden_layers=3, mlp_only_layers=[0],
                                      num_attention_heads=8, num_key_value_heads=2)),
    "qwen2moe_shared_expert": ("shared", {}),
}


def _rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each case: (hf model, directory it was saved to)."""
    out = {}
    for name, (kind, overrides) in CASES.items():
        path = tmp_path_factory.mktemp(name)
        out[name] = (tiny_hf.make_hf_model(kind, path, **overrides), path)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_router_logits_match_transformers(checkpoints, case):
    hf_model, path = checkpoints[case]
    model, config = load_hf(path, dtype=jnp.float32)
    ids = np.random.RandomState(1).randint(0, tiny_hf.VOCAB, (3, 11))
    ref = tiny_hf.hf_logits(hf_model, ids)
    out = model(ids)
    assert out.logits.shape == (3, 11, tiny_hf.VOCAB)
    assert _rel_err(out.logits, ref.logits.numpy()) <= 1e-4
    moe_layers = [i for i in range(config.num_layers) if config.is_moe_layer(i)]
    assert [i for i, z in enumerate(out.router_logits) if z is not None] == moe_layers
    ref_router = [z for z in (getattr(ref, "router_logits", None) or ()) if z is not None]
    if moe_layers:
        # HF returns router logits for MoE layers only, flattened [B*T, E].
        ours = [out.router_logits[i].reshape(-1, config.num_experts) for i in moe_layers]
        assert len(ref_router) == len(ours)
        for a, b in zip(ours, ref_router, strict=True):
            assert _rel_err(a, b.numpy()) <= 1e-4
        assert all(out.selected_experts[i].shape == (3, 11, config.num_experts_per_tok)
                   for i in moe_layers)


@pytest.mark.parametrize("case", ["moe_norm_topk", "qwen2moe_shared_expert", "dense_tied_gqa4"])
def test_left_padded_batch_matches_transformers(checkpoints, case):
    hf_model, path = checkpoints[case]
    model, _ = load_hf(path)
    rng = np.random.RandomState(2)
    ids = rng.randint(0, tiny_hf.VOCAB, (3, 9))
    mask = np.ones((3, 9), np.int64)
    mask[0, :4] = 0
    mask[2, :1] = 0
    pos = np.asarray(positions_from_mask(mask))
    ref = tiny_hf.hf_logits(hf_model, ids, mask, pos).logits.numpy()
    ours = np.asarray(model(ids, positions_bt=pos, attention_mask_bt=mask).logits)
    real = mask.astype(bool)
    assert _rel_err(ours[real], ref[real]) <= 1e-4


@pytest.mark.slow  # ~11 s loaded: eager MoE forward, aux loss
def test_aux_loss_matches_transformers(checkpoints):
    hf_model, path = checkpoints["moe_sparse_step2_mlp_only"]
    model, config = load_hf(path)
    ids = np.random.RandomState(3).randint(0, tiny_hf.VOCAB, (2, 8))
    with torch.no_grad():
        ref = hf_model(torch.tensor(ids), labels=torch.tensor(ids), output_router_logits=True)
    ours = load_balancing_loss(model(ids).router_logits, config.num_experts_per_tok)
    np.testing.assert_allclose(float(ours), float(ref.aux_loss), rtol=1e-5)


@pytest.mark.parametrize("case", ["moe_norm_topk", "qwen2moe_shared_expert", "dense_tied_gqa4",
                                  "moe_sparse_step2_mlp_only"])
def test_round_trip_hf_ours_hf_is_bit_identical(checkpoints, case, tmp_path):
    _, path = checkpoints[case]
    model, config = load_hf(path)
    save_hf(model, config, tmp_path)
    a, b = TensorIndex(path), TensorIndex(tmp_path)
    assert a.names() == b.names()
    for name in a.names():
        x, y = a.get(name), b.get(name)
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), name
    # and transformers itself loads the export to the same function
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = np.random.RandomState(4).randint(0, tiny_hf.VOCAB, (2, 6))
    np.testing.assert_array_equal(tiny_hf.hf_logits(reloaded, ids).logits.numpy(),
                                  tiny_hf.hf_logits(checkpoints[case][0], ids).logits.numpy())


@pytest.mark.slow  # ~11 s loaded: eager MoE forward twice
def test_fused_expert_layout_loads(checkpoints, tmp_path):
    """transformers>=5 in-memory layout: experts.gate_up_proj [E,2F,D], experts.down_proj [E,D,F]."""
    hf_model, path = checkpoints["moe_norm_topk"]
    state = {k: v.numpy() for k, v in hf_model.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    write_safetensors(tmp_path / "model.safetensors", sorted(state.items()))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    fused, _ = load_hf(tmp_path)
    per_expert, _ = load_hf(path)
    ids = np.random.RandomState(5).randint(0, tiny_hf.VOCAB, (2, 5))
    np.testing.assert_array_equal(np.asarray(fused(ids).logits), np.asarray(per_expert(ids).logits))


@pytest.mark.slow  # 13-17 s per case (eager decode compiles every op shape); the sampler
# tests keep cached decode == full forward in the fast tier
@pytest.mark.parametrize("case", ["moe_sparse_step2_mlp_only", "qwen2moe_shared_expert"])
def test_kv_cache_decode_equals_full_forward(checkpoints, case):
    _, path = checkpoints[case]
    model, _ = load_hf(path)
    rng = np.random.RandomState(6)
    ids = rng.randint(0, tiny_hf.VOCAB, (2, 12))
    mask = np.ones((2, 12), np.int32)
    mask[1, :3] = 0  # left padding in the prompt
    pos = np.asarray(positions_from_mask(mask))
    full = np.asarray(model(ids, positions_bt=pos, attention_mask_bt=mask).logits)

    prompt = 7
    cache = model.init_cache(batch=2, max_len=16)
    out = model(ids[:, :prompt], pos[:, :prompt], mask[:, :prompt], cache=cache)
    steps = [np.asarray(out.logits)]
    cache = out.cache
    for t in range(prompt, 12):
        out = model(ids[:, t:t + 1], pos[:, t:t + 1], mask[:, t:t + 1], cache=cache)
        cache = out.cache
        steps.append(np.asarray(out.logits))
    decoded = np.concatenate(steps, axis=1)
    real = mask.astype(bool)
    np.testing.assert_allclose(decoded[real], full[real], atol=1e-5, rtol=1e-5)
    assert int(cache.index) == 12


@pytest.mark.parametrize("case", ["moe_norm_topk", "moe_sparse_step2_mlp_only", "qwen2moe_shared_expert"])
def test_ragged_dispatch_equals_dense_dispatch(checkpoints, case):
    _, path = checkpoints[case]
    ragged, _ = load_hf(path, options=ModelOptions(moe_impl="ragged"))
    dense, _ = load_hf(path, options=ModelOptions(moe_impl="dense"))
    ids = np.random.RandomState(7).randint(0, tiny_hf.VOCAB, (4, 10))
    a, b = ragged(ids), dense(ids)
    np.testing.assert_allclose(np.asarray(a.logits), np.asarray(b.logits), atol=1e-5, rtol=1e-5)
    for x, y in zip(a.selected_experts, b.selected_experts, strict=True):
        if x is not None:
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow  # ~5 s for the first mesh shape's compiles (fast tier < 5 min)
@pytest.mark.parametrize("shape", [(1, 2, 2, 2), (1, 1, 2, 4), (2, 2, 2, 1)])
def test_sharded_forward_equals_single_device(checkpoints, shape):
    if jax.device_count() < 8:
        pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
    _, path = checkpoints["moe_mlp_only_gqa4"]
    ids = np.random.RandomState(8).randint(0, tiny_hf.VOCAB, (8, 6))
    single, _ = load_hf(path)
    ref = np.asarray(single(ids).logits)
    mesh = sharding.make_mesh(sharding.MeshConfig(*shape))
    model, _ = load_hf(path, mesh=mesh)
    state = nnx.state(model, nnx.Param)
    specs = {str(v.get_value().sharding.spec) for _, v in nnx.to_flat_state(state)}
    assert len(specs) > 1, "parameters should actually be sharded"
    with sharding.activate(mesh):
        graphdef, params = nnx.split(model)
        out = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x).logits)(params, ids)
    np.testing.assert_allclose(np.asarray(out), ref, atol=2e-5, rtol=1e-5)


@pytest.mark.slow  # ~5.5 s: several MoE forwards with hooks
def test_router_hook_and_replay(checkpoints):
    _, path = checkpoints["moe_norm_topk"]
    model, config = load_hf(path)
    ids = np.random.RandomState(9).randint(0, tiny_hf.VOCAB, (2, 5))
    base = model(ids)
    # A hook that makes expert 3 win everywhere: it must always be selected.
    boosted = model(ids, router_hook=lambda z, layer: z.at[..., 3].add(100.0))
    for e in boosted.selected_experts:
        assert bool(jnp.all(jnp.any(e == 3, axis=-1)))
    # Replaying the recorded experts reproduces the logits exactly.
    replayed = model(ids, routing_replay=base.selected_experts)
    np.testing.assert_array_equal(np.asarray(replayed.logits), np.asarray(base.logits))
    # Replaying other experts changes them.
    other = [None if e is None else (e + 1) % config.num_experts for e in base.selected_experts]
    assert not np.allclose(np.asarray(model(ids, routing_replay=other).logits),
                           np.asarray(base.logits))


@pytest.mark.slow  # > 5 s quiet (fast-tier budget)
def test_bf16_mode_runs_close_to_fp32(checkpoints):
    _, path = checkpoints["moe_norm_topk"]
    fp32, _ = load_hf(path)
    bf16, _ = load_hf(path, dtype=jnp.bfloat16)
    ids = np.random.RandomState(10).randint(0, tiny_hf.VOCAB, (2, 8))
    out = bf16(ids)
    assert out.logits.dtype == jnp.float32  # logits always fp32
    assert _rel_err(out.logits, fp32(ids).logits) < 5e-2


_SLOW = pytest.mark.slow  # a second preset of an architecture already counted fast


@pytest.mark.parametrize("name,total,published", [
    ("qwen3_4b", 4_022_468_096, 4.0e9),
    pytest.param("qwen3_8b", 8_190_735_360, 8.2e9, marks=_SLOW),
    ("qwen3_30b_a3b", 30_532_122_624, 30.5e9),
    pytest.param("qwen3_30b_a3b_instruct_2507", 30_532_122_624, 30.5e9, marks=_SLOW),
    pytest.param("qwen3_4b_instruct_2507", 4_022_468_096, 4.0e9, marks=_SLOW),
])
def test_presets_match_published_parameter_counts(name, total, published):
    from spade_jax.models import abstract_model

    cfg = preset(name)
    assert cfg.param_count() == total
    assert abs(total - published) / published < 0.02
    state = nnx.state(abstract_model(cfg), nnx.Param)
    assert sum(int(np.prod(v.get_value().shape)) for _, v in nnx.to_flat_state(state)) == total
    if cfg.is_moe:
        assert abs(cfg.param_count(active=True) - 3.3e9) / 3.3e9 < 0.03


def test_conversion_errors_name_the_problem(checkpoints, tmp_path):
    _, path = checkpoints["moe_norm_topk"]
    tensors = TensorIndex(path)

    def write(dirname, items, config=None):
        d = tmp_path / dirname
        d.mkdir()
        write_safetensors(d / "model.safetensors", items)
        (d / "config.json").write_text(config or (path / "config.json").read_text())
        return d

    all_items = [(n, tensors.get(n)) for n in sorted(tensors.names())]
    missing = write("missing", [(n, a) for n, a in all_items if "layers.1.self_attn.k_proj" not in n])
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_hf(missing)

    bad_shape = write("shape", [(n, a[:-1] if n == "model.norm.weight" else a) for n, a in all_items])
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*shape"):
        load_hf(bad_shape)

    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["model_type"] = "llama"
    unknown = write("arch", all_items, json.dumps(cfg))
    with pytest.raises(ConfigError, match="LlamaForCausalLM"):
        load_hf(unknown)

    corrupt = write("corrupt", all_items)
    blob = (corrupt / "model.safetensors").read_bytes()
    (corrupt / "model.safetensors").write_bytes(blob[: len(blob) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*(truncated|corrupt)"):
        load_hf(corrupt)

    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "model.safetensors").write_bytes(b"\xff" * 64)
    (garbage / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_hf(garbage)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_hf(tmp_path / "nope")


def test_model_config_rejects_inconsistent_shapes():
    with pytest.raises(ConfigError, match="num_kv_heads"):
        ModelConfig(num_heads=6, num_kv_heads=4)
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        ModelConfig(architecture="Qwen3MoeForCausalLM", num_experts=4, num_experts_per_tok=5,
                    moe_intermediate_size=8)
    with pytest.raises(ValueError, match="moe_impl"):
        ModelOptions(moe_impl="magic")
