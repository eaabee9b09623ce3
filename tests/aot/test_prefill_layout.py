"""The plan's prefill per decode layout (``prefill:<layout>``): the sampler prefills on the
decode mesh reading its own copy of the weights, beside the trainer's resident state. CPU
devices (4 of the 8 the conftest provides), the tiny MoE FSDP-sharded over 4, bf16 compute
as the recipes: the decode layout is data 2 x tensor 2 with a bf16 copy."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from spade_jax import aot
from spade_jax.aot import planner
from spade_jax.experiment import load_experiment

_OVERRIDES = ("mesh.data=1", "mesh.fsdp=4", "model.dtype='bfloat16'",
              "train.compute_dtype='bfloat16'")
_DECODE_MESH = {"data": 2, "fsdp": 1, "tensor": 2, "expert": 1}


def _config(**kw) -> aot.AotConfig:
    return aot.AotConfig(experiment="tiny", topology="v4-8", prompt_len=16, new_tokens=8,
                         overrides=_OVERRIDES, **kw)


@pytest.fixture(scope="module")
def cpu_plan():
    # 2 rows: rounded up to the batch shards of each layout's mesh (fsdp 4: 4 rows; the
    # decode mesh data 2: 2 rows).
    config = _config(programs=("prefill", "decode"), sample_batch=2)
    return config, aot.plan(config, devices=jax.devices()[:4])


def _shard_bytes(shape, dtype, sharding) -> int:
    return int(np.prod(sharding.shard_shape(shape))) * np.dtype(dtype).itemsize


@pytest.mark.slow  # compiles the tiny prefill on two meshes (~10 s loaded)
def test_layout_prefill_reads_the_decode_copy_on_the_decode_mesh():
    """The compiled prefill of layout "auto" takes the parameters in the copy's dtype (bf16,
    the MoE routers fp32) split over the decode mesh, and its arguments are that copy's
    per-chip bytes plus the prompt rows; "train" takes the fp32 master on the FSDP mesh."""
    config = _config(programs=("prefill",))
    s = planner._setting(config, jax.devices()[:4])
    sampler = dataclasses.replace(s.experiment.agent.sampler, max_new_tokens=8)
    for layout, mesh_shape, weight_dtypes in (
            ("auto", _DECODE_MESH, {np.dtype("bfloat16"), np.dtype("float32")}),
            ("train", {"data": 1, "fsdp": 4, "tensor": 1, "expert": 1}, {np.dtype("float32")})):
        mesh = planner._decode_mesh(s, layout)
        params = planner._decode_params(s, mesh)
        lowered = planner._lower_layout_prefill(s, sampler, mesh, params, rows=8, prompt_len=16)
        compiled = lowered.compile()
        infos = jax.tree.leaves(lowered.args_info[0][0])
        shardings = jax.tree.leaves(compiled.input_shardings[0][0])
        assert len(infos) == len(shardings) == len(jax.tree.leaves(s.state.params))
        assert {np.dtype(a.dtype) for a in infos} == weight_dtypes
        assert {tuple(x.mesh.shape.items()) for x in shardings} == {tuple(mesh_shape.items())}
        if layout == "auto":
            # Every float weight is bf16 but the routers (kept fp32: the forward reads them so).
            wide = [a.shape for a in infos if np.dtype(a.dtype) == np.float32]
            arch = s.arch
            assert wide == [(arch.hidden_size, arch.num_experts)] * sum(
                arch.is_moe_layer(i) for i in range(arch.num_layers))
        weights = sum(_shard_bytes(a.shape, a.dtype, x)
                      for a, x in zip(infos, shardings, strict=True))
        # The chip's prompt rows (split over data x fsdp): ids, mask [rows, P] and three
        # per-row int32s; then a few sampling scalars.
        rows = 8 // (mesh_shape["data"] * mesh_shape["fsdp"])
        prompts = rows * (2 * 16 + 3) * 4
        arguments = compiled.memory_analysis().argument_size_in_bytes
        assert weights + prompts <= arguments <= weights + prompts + 128


@pytest.mark.slow  # compiles the tiny prefill and decode on two meshes (~20 s loaded)
def test_prefill_per_decode_layout_in_the_plan(cpu_plan):
    _, result = cpu_plan
    assert [p.name for p in result.programs] == ["prefill", "decode", "prefill:auto",
                                                 "decode:auto"]
    train, decode, prefill, auto = result.programs
    assert prefill.mesh_shape == auto.mesh_shape == _DECODE_MESH and train.mesh_shape is None
    # Same resident accounting as the decode step on that layout: the Adam moments (two
    # fp32 copies of the parameters, FSDP-sharded as they are) plus the trainer's fp32
    # parameters, one more half of the moments.
    assert prefill.resident_bytes == auto.resident_bytes
    assert train.resident_bytes == decode.resident_bytes
    assert abs(2 * (prefill.resident_bytes - train.resident_bytes) - train.resident_bytes) <= 64
    slots = int(auto.shape.split("S=")[1].split()[0])
    assert (prefill.tokens, train.tokens, auto.tokens, decode.tokens) == (2 * 16, 4 * 16, 2, 4)
    assert (prefill.shape, train.shape) == (f"B=2 P=16 S={slots}", f"B=4 P=16 S={slots}")
    assert prefill.param_itemsize == auto.param_itemsize < 2.01
    assert train.param_itemsize == 4
    # The analytic counts are the prefill's on the decode mesh with the copy's bytes; off
    # FSDP the weights are not gathered over ICI per call.
    arch = load_experiment("tiny", list(_OVERRIDES)).model.architecture
    options = load_experiment("tiny", list(_OVERRIDES)).model.options()
    expected = aot.analytic_cost("prefill", arch, options, aot.parallelism(_DECODE_MESH, 4),
                                 rows=2, length=16, keys=slots,
                                 param_itemsize=prefill.param_itemsize)
    assert (prefill.hardware_flops, prefill.hbm_traffic, prefill.ici_traffic) == pytest.approx(
        (expected["hardware_flops"], expected["hbm_traffic"], expected["ici_traffic"]))
    assert prefill.ici_traffic < train.ici_traffic
    assert prefill.reshard_bytes == 0 < auto.reshard_bytes  # costed once, with decode
    assert result.fits(prefill)


@pytest.mark.slow  # uses the compiled plan
def test_prefill_layout_rows_and_round_trip(cpu_plan, tmp_path):
    config, result = cpu_plan
    rows = aot.prefill_rows(result)
    assert len(rows) == 2 and "| train | fsdp4 |" in rows[0]
    prefill = result.programs[2]
    hbm = 100 * prefill.peak_bytes / result.topology.chip.hbm_bytes
    assert "| auto | data2xtensor2 | B=2 P=16 S=" in rows[1]
    assert f"| {hbm:.1f}% (" in rows[1] and "fits)" in rows[1]
    assert "prefill:auto" not in aot.table_row(result)
    text = aot.format_plan(result)
    assert "prefill:auto B=2 P=16" in text and "the sampler's copy of the weights" in text
    aot.write_plan(result, str(tmp_path / "plan.json"))
    again = aot.recost(aot.read_plan(str(tmp_path / "plan.json")), config.overrides)
    for a, b in zip(result.programs, again.programs, strict=True):
        assert (a.hardware_flops, a.hbm_traffic, a.ici_traffic, a.peak_bytes) == pytest.approx(
            (b.hardware_flops, b.hbm_traffic, b.ici_traffic, b.peak_bytes))
    assert aot.prefill_rows(again) == rows


@pytest.mark.slow  # compiles the tiny prefill row group and decode on the decode mesh
def test_planned_prefill_is_one_row_group_within_the_budget():
    """With a prefill budget of 2 rows x 16 tokens (the agent sampler's, which the engine
    reads too), the plan's prefill of 8 rows is the 2-row group ``sample`` compiles (the
    decode mesh splits rows 2 ways), writing into the 8-row decode state; the decode step
    stays at 8."""
    config = dataclasses.replace(_config(programs=("prefill", "decode"), sample_batch=8,
                                         decode_layouts=("auto",)),
                                 overrides=(*_OVERRIDES, "agent.sampler.max_prefill_tokens=32"))
    prefill, decode = aot.plan(config, devices=jax.devices()[:4]).programs
    slots = int(decode.shape.split("S=")[1].split()[0])
    assert prefill.shape == f"B=2 of 8 P=16 S={slots}" and prefill.tokens == 2 * 16
    assert decode.shape.startswith(f"B=8 S={slots}") and decode.tokens == 8
    s = planner._setting(config, jax.devices()[:4])
    sampler = dataclasses.replace(s.experiment.agent.sampler, max_new_tokens=8)
    mesh = planner._decode_mesh(s, "auto")
    lowered = planner._lower_layout_prefill(s, sampler, mesh, planner._decode_params(s, mesh),
                                            rows=2, prompt_len=16, batch=8)
    state = lowered.out_info[0]  # the full batch's state, the group's rows written in
    assert state.row_id_b.shape == (8,) and state.cache.valid_bs.shape[0] == 8
    assert lowered.args_info[0][3].shape == (2, 16)  # the group's prompt ids
    with pytest.raises(ValueError, match="multiples of the mesh's 2 batch shards"):
        planner._lower_layout_prefill(s, sampler, mesh, planner._decode_params(s, mesh),
                                      rows=3, prompt_len=16, batch=8)
