"""The plan's decode layouts (``--decode_layouts``): the decode step compiled with the
sampler's weights in the trainer's FSDP layout and in the decode layout, the per-step
resharding cost, the HLO collective count, and the RL step estimate."""

from __future__ import annotations

import importlib.util
import math

import pytest

from spade_jax import aot, sharding
from spade_jax.aot import cost, hlo
from spade_jax.experiment import load_experiment
from spade_jax.models import preset

needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="libtpu not installed (pip install libtpu==0.0.42.1): no TPU compiler on this host")

_HLO = """
  %all-gather.2 = bf16[96,2,24]{2,0,1:T(8,128)(2,1)S(3)} all-gather(%copy.161), dimensions={0}
  %ag-start = (f32[4,8]{1,0}, f32[16,8]{1,0}) all-gather-start(%p), dimensions={0}
  %ag-done = f32[16,8]{1,0} all-gather-done(%ag-start)
  %all-reduce.1 = f32[2,32]{1,0} all-reduce(%x), to_apply=%add
  %a2a = (s32[8]{0}, s32[8]{0}) all-to-all(%a, %b), dimensions={0}
  %fusion.3 = f32[2,2]{0,1} fusion(%all-gather.2), kind=kOutput
"""


def test_hlo_collective_bytes_by_kind():
    got = hlo.collective_bytes(_HLO)
    assert got == {"all-gather": 96 * 2 * 24 * 2 + 16 * 8 * 4, "all-reduce": 2 * 32 * 4,
                   "all-to-all": 2 * 8 * 4, "reduce-scatter": 0, "collective-permute": 0}


def _par(mesh_config: sharding.MeshConfig, chips: int, arch) -> cost.Parallelism:
    shape = sharding.decode_mesh_config(mesh_config, chips, arch).shape(chips)
    return cost.parallelism(dict(zip(sharding.MESH_AXES, shape, strict=True)), chips)


def test_30b_decode_layout_is_hbm_bound_by_the_cost_model():
    """30B-A3B on 32 chips (fsdp 4 x expert 8), 256 rows: FSDP
    re-gathers the weights per token (ICI-bound); the decode layout (tensor 4 x expert 8)
    moves only activations and tokens and is HBM-bound. An 8k-slot bf16 cache (the RL step
    estimate's); at 40k slots the KV cache alone makes both layouts HBM-bound. Bytes
    recomputed here by hand."""
    arch = preset("qwen3_30b_a3b_instruct_2507")
    options = load_experiment("qwen3_30b_a3b").model.options()
    train = dict(mesh=sharding.MeshConfig(1, -1, 1, 8, decode_layout="train"))
    train_par = _par(train["mesh"], 32, arch)
    decode_par = _par(sharding.MeshConfig(1, -1, 1, 8), 32, arch)
    assert (train_par.fsdp, train_par.tensor, train_par.batch) == (4, 1, 32)
    assert (decode_par.fsdp, decode_par.tensor, decode_par.expert, decode_par.batch) == (1, 4, 8, 8)
    kw = dict(rows=256, length=1, keys=8192, cache_itemsize=2, param_itemsize=4)
    before = cost.analytic_cost("decode", arch, options, train_par, **kw)
    after = cost.analytic_cost("decode", arch, options, decode_par, **kw)
    d, layers, e = arch.hidden_size, arch.num_layers, arch.num_experts
    experts = layers * e * 3 * d * arch.moe_intermediate_size
    dense = arch.param_count() - experts
    # FSDP: each chip receives 3/4 of the bf16 weights it multiplies through (experts: 1/8).
    assert before["ici_traffic"] >= 0.75 * 2 * (dense + experts / 8)
    # Decode layout, per chip: fp32 shard read once + 32 rows' KV of 1 of 4 kv heads.
    shard = dense / 4 + experts / 32
    kv = 32 * 8192 * layers * 2 * 1 * arch.head_dim * 2
    assert after["hbm_traffic"] == pytest.approx(4 * shard + kv)
    # ... and over ICI only tokens and activations: the dropless all-to-all (32 rows per
    # expert shard, 8 slots per row and destination, there and back, 7/8 leave the chip),
    # two all-reduces per layer and one for the embedding (ring: 2 x 3/4 received), and
    # the fp32 logits all-gather (3/4 received).
    a2a = layers * 2 * (32 * 8 * 8) * d * 2 * 7 / 8
    allreduce = (2 * layers + 1) * 2 * 3 / 4 * 32 * d * 2
    logits = 32 * arch.vocab_size * 4 * 3 / 4
    assert after["ici_traffic"] == pytest.approx(a2a + allreduce + logits)
    assert after["ici_traffic"] < 0.1 * before["ici_traffic"]
    chip = aot.CHIPS["v5p"]
    assert after["hbm_traffic"] / chip.hbm_bandwidth > after["ici_traffic"] / chip.ici_bandwidth
    assert before["ici_traffic"] / chip.ici_bandwidth > before["hbm_traffic"] / chip.hbm_bandwidth
    # Resharding once per step: 3/4 of the fp32 decode shard (a chip held one embed slice).
    assert cost.reshard_bytes(arch, train_par, decode_par, 4) == pytest.approx(4 * shard * 3 / 4)
    assert cost.reshard_bytes(arch, train_par, train_par, 4) == 0


def test_rl_step_estimate_adds_up():
    experiment = load_experiment("qwen3_30b_a3b")
    arch = preset(experiment.model.preset)
    options = experiment.model.options()
    train_par = _par(sharding.MeshConfig(1, -1, 1, 8, decode_layout="train"), 32, arch)
    decode_par = _par(sharding.MeshConfig(1, -1, 1, 8), 32, arch)
    episode = aot.EpisodeShape(turns=4, turn_tokens=1024, prompt_tokens=1000,
                               observation_tokens=100)
    chip = aot.CHIPS["v5p"]
    r = aot.estimate_rl_step(experiment, arch, options, layout="auto", train_par=train_par,
                             decode_par=decode_par, chip=chip, reshard_bytes=6e9,
                             param_itemsize=4, cache_itemsize=2, episode=episode)
    spade = experiment.spade
    episodes = spade.envs_per_round * spade.plays_per_game + math.ceil(
        spade.envs_per_round * spade.hint_plays / spade.regeneration_interval)
    assert r.episodes == episodes == 24 * 8 + 96
    assert r.generated_tokens == episodes * 4096 and r.slots == episodes  # divisible by 8
    assert r.cache_len == 8192  # next power of two >= 1000 + 4096 + 300
    assert r.decode_steps == 4096  # every slot busy for the whole episode
    assert r.reshard_seconds == pytest.approx(6e9 / chip.ici_bandwidth)
    assert r.seconds == pytest.approx(r.decode_seconds + r.prefill_seconds + r.reshard_seconds
                                      + r.train_seconds)
    assert r.tokens_per_second_per_chip == pytest.approx(episodes * 4096 / r.seconds / 32)
    assert r.train_shape == "B=512 T=8192 M=16" and r.decode_bound == "HBM"


@pytest.fixture(scope="module")
def fsdp_plan():
    """The tiny MoE with its parameters FSDP-sharded over a 4-chip v4-8, computing in bf16
    as the recipes do: decode compiled in the train layout and the decode layout."""
    config = aot.AotConfig(experiment="tiny", topology="v4-8", sample_batch=8, prompt_len=32,
                           new_tokens=16, programs=("decode",),
                           overrides=("mesh.data=1", "mesh.fsdp=4", "model.dtype='bfloat16'",
                                      "train.compute_dtype='bfloat16'"))
    return config, aot.plan(config)


@pytest.mark.slow  # compiles two tiny decode steps for a TPU (~15 s)
@needs_libtpu
def test_decode_layout_gathers_no_weights_per_token(fsdp_plan):
    _, result = fsdp_plan
    train, auto = result.programs
    assert (train.name, auto.name) == ("decode", "decode:auto")
    assert result.mesh_shape["fsdp"] == 4 and train.mesh_shape is None
    assert auto.mesh_shape == {"data": 2, "fsdp": 1, "tensor": 2, "expert": 1}
    arch = load_experiment("tiny").model.architecture
    # Train layout: the compiled step all-gathers (bf16) weights for every token: at least
    # 3/4 of its attention projections alone.
    attention = arch.num_layers * arch.hidden_size * arch.head_dim * (
        2 * arch.num_heads + 2 * arch.num_kv_heads)
    assert train.collectives["all-gather"] >= 0.75 * 2 * attention
    # Decode layout: no weight gathers (a few bytes of bookkeeping at most); its
    # collectives are activation all-reduces.
    assert auto.collectives["all-gather"] < 0.01 * train.collectives["all-gather"]
    assert auto.collectives["all-reduce"] > 0
    assert auto.ici_traffic < 0.1 * train.ici_traffic
    assert result.bound(train) == "ICI" and result.bound(auto) == "HBM"
    # The compiled copy's collectives return at least what the analytic bound receives.
    assert auto.reshard_hlo_bytes >= auto.reshard_bytes > 0 == train.reshard_hlo_bytes
    assert result.reshard_seconds(auto) == pytest.approx(
        auto.reshard_bytes / result.topology.chip.ici_bandwidth)
    # The sampler's copy in the compute dtype (``mesh.decode_param_dtype="compute"``): bf16
    # but the MoE routers (read in fp32); the train layout reads the fp32 master. The
    # compiled copy's arguments are its bf16 shard: half the master's bytes on the chip.
    router = arch.num_layers * arch.hidden_size * arch.num_experts
    total = arch.param_count()
    assert auto.param_itemsize == pytest.approx((2 * total + 2 * router) / total)
    assert train.param_itemsize == 4
    assert auto.reshard_bytes == pytest.approx(cost.reshard_bytes(
        arch, cost.parallelism(result.mesh_shape, 4), cost.parallelism(auto.mesh_shape, 4),
        auto.param_itemsize))
    assert [r.layout for r in result.rl_steps] == ["train", "auto"]
    text = aot.format_plan(result)
    assert "decode mesh data2xtensor2" in text and "RL step estimate (auto layout" in text
    rows = aot.decode_rows(result)
    assert len(rows) == 2 and "| auto | data2xtensor2 |" in rows[1] and "(HBM)" in rows[1]


@pytest.mark.slow  # uses the compiled plan
@needs_libtpu
def test_decode_plan_round_trips_through_json(fsdp_plan, tmp_path):
    config, result = fsdp_plan
    aot.write_plan(result, str(tmp_path / "plan.json"))
    again = aot.recost(aot.read_plan(str(tmp_path / "plan.json")), config.overrides)
    for a, b in zip(result.programs, again.programs, strict=True):
        assert (a.hbm_traffic, a.ici_traffic, a.reshard_bytes) == pytest.approx(
            (b.hbm_traffic, b.ici_traffic, b.reshard_bytes))
        assert a.collectives == b.collectives and a.mesh_shape == b.mesh_shape
    assert again.rl_steps == result.rl_steps
    assert aot.decode_rows(again) == aot.decode_rows(result)
