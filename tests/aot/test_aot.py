"""spade_jax.aot (compiled plan for a TPU topology on this CPU host) and
spade_jax.distributed (multi-host helpers).

The compile tests need libtpu (``pip install libtpu==0.0.42.1``) and skip without it; they
compile the tiny experiment for a 4-chip v4-8, not a 48-layer model (see docs/scale_out.md
for the full-size commands and their timings).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from spade_jax import aot, distributed
from spade_jax.experiment import load_experiment

ROOT = Path(__file__).resolve().parents[2]
needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="libtpu not installed (pip install libtpu==0.0.42.1): no TPU compiler on this host")


@pytest.mark.parametrize("name, chips, shape", [
    ("v5p-64", 32, (2, 4, 4)), ("v4-8", 4, (2, 2, 1)), ("v4-32", 16, (2, 2, 4)),
    ("v5e-16", 16, (4, 4)), ("v6e-8", 8, (2, 4)), ("v5e-256", 256, (16, 16)),
])
def test_parse_topology(name, chips, shape):
    topo = aot.parse_topology(name)
    assert (topo.chips, topo.shape) == (chips, shape)
    assert math.prod(topo.shape) == topo.chips


@pytest.mark.parametrize("bad", ["v5p64", "v7-8", "v5p-63", "v5e-12", "tpu-8"])
def test_bad_topology_is_named(bad):
    with pytest.raises(ValueError, match="topology"):
        aot.parse_topology(bad)


def test_cli_names_a_bad_topology():
    bad = "v5p-63"
    out = subprocess.run([sys.executable, "-m", "spade_jax.aot", "--experiment=tiny",
                          f"--topology={bad}"], capture_output=True, text=True, cwd=ROOT,
                         timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 2 and "topology" in out.stderr


@pytest.fixture(scope="module")
def tiny_plan():
    config = aot.AotConfig(experiment="tiny", topology="v4-8", train_batch=8, seq_len=64,
                           sample_batch=8, prompt_len=32, new_tokens=16)
    return config, aot.plan(config)


@pytest.mark.slow  # compiles the tiny plan (~35 s loaded)
@needs_libtpu
def test_tiny_plan_bytes_and_flops_match_the_model(tiny_plan):
    config, result = tiny_plan
    experiment = load_experiment("tiny")
    arch = experiment.model.architecture
    chips = result.topology.chips
    assert result.mesh_shape["data"] == chips  # tiny: pure data parallelism, params replicated
    train, prefill, decode = (p for p in result.programs if ":" not in p.name)
    # Arguments of the train step = fp32 params + two fp32 Adam moments (replicated) + the
    # chip's rows of the batch (input_ids, attention_mask int32, loss_mask, old_logp fp32).
    state_bytes = 3 * 4 * arch.param_count()
    batch_bytes = (8 // chips) * 64 * 4 * 4 + 2 * 4 * (8 // chips)
    # (TPU layouts pad minor dims to 128-lane tiles: the tiny model's 96 / 24 wide weights
    # take up to a third more.)
    assert state_bytes + batch_bytes <= train.argument_bytes <= 1.35 * (state_bytes + batch_bytes)
    assert train.alias_bytes >= 3 * 4 * arch.param_count()  # the state is donated
    # Model FLOPs (PaLM): 6 N per token plus 12 n h T per token and layer for attention.
    matmul_params = arch.param_count(active=True) - arch.vocab_size * arch.hidden_size
    assert not arch.tie_word_embeddings
    attention = 12 * arch.num_heads * arch.head_dim * 64 * arch.num_layers
    assert train.model_flops == pytest.approx((6 * matmul_params + attention) * 8 * 64)
    # XLA's FLOPs per chip (the tiny experiment has no layer scan; one microbatch) are within
    # a small factor of the analytic count (the blocked MoE dispatch pads expert blocks).
    assert 0.5 * train.hardware_flops / chips <= train.flops <= 3 * train.hardware_flops / chips
    # The sampler's KV cache: layers x (k, v) x rows x slots x kv_heads x head_dim x fp32.
    cache = arch.num_layers * 2 * (8 // chips) * (32 + 64) * arch.num_kv_heads * arch.head_dim * 4
    assert decode.argument_bytes >= cache + 4 * arch.param_count()
    moments = 2 * 4 * arch.param_count()  # (+ Adam's step counts)
    assert moments <= prefill.resident_bytes == decode.resident_bytes <= moments + 64
    assert all(result.fits(p) for p in result.programs)
    assert 0 < result.mfu(train) < 1 and result.tokens_per_second_per_chip(train) > 0
    text = aot.format_plan(result)
    assert "v4-8" in text and "fits" in text and "DOES NOT FIT" not in text
    squeezed = dataclasses.replace(result, hbm_fraction=train.peak_bytes / (2 * 32 << 30))
    assert not squeezed.fits(train)


@pytest.mark.slow  # uses the compiled tiny plan
@needs_libtpu
def test_stored_plan_renders_with_the_same_costs(tiny_plan, tmp_path):
    """--json_out / --render: the stored compile results re-costed from the experiment give
    the numbers the plan computed (the shapes round-trip through the program labels)."""
    config, result = tiny_plan
    aot.write_plan(result, str(tmp_path / "plan.json"))
    again = aot.recost(aot.read_plan(str(tmp_path / "plan.json")))
    for a, b in zip(result.programs, again.programs, strict=True):
        assert (a.hardware_flops, a.hbm_traffic, a.ici_traffic, a.peak_bytes) == pytest.approx(
            (b.hardware_flops, b.hbm_traffic, b.ici_traffic, b.peak_bytes))
    assert aot.table_row(again) == aot.table_row(result)


@pytest.mark.slow  # JAX subprocess, ~20 s loaded
@needs_libtpu
def test_cli_fails_loudly_when_it_does_not_fit():
    out = subprocess.run(
        [sys.executable, "-m", "spade_jax.aot", "--experiment=tiny", "--topology=v4-8",
         "--programs=train", "--train_batch=4", "--seq_len=32", "--hbm_fraction=0.0001"],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 1, out.stderr[-2000:]
    assert "DOES NOT FIT: train" in out.stderr and "| tiny | v4-8 |" in out.stdout


# ---- distributed ---------------------------------------------------------------------------


def test_host_seeds_are_distinct_and_reproducible():
    seeds = [distributed.host_seed(7, p) for p in range(64)]
    assert seeds[0] == 7 and len(set(seeds)) == 64
    assert seeds == [distributed.host_seed(7, p) for p in range(64)]
    assert distributed.host_seed(8, 1) != distributed.host_seed(7, 1)
    assert distributed.host_seed(7) == 7  # this (single) process is process 0
    assert distributed.is_primary()


def test_agree_on_one_host_returns_the_value():
    docs = ["corpus doc é", "memory entry"]
    assert distributed.agree(docs) == docs
    tree = {"order": np.arange(5)}
    np.testing.assert_array_equal(distributed.agree(tree)["order"], np.arange(5))
    assert jax.process_count() == 1


# ---- the analytic cost model against XLA's own count --------------------------------------

_DENSE_EXPERIMENT = '''
import dataclasses
from spade_jax.experiment import load_experiment
from spade_jax.models import ModelConfig


def get_config():
    base = load_experiment("tiny")
    arch = ModelConfig(architecture="Qwen3ForCausalLM", vocab_size=512, hidden_size=128,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                       intermediate_size=256, max_position_embeddings=4096)
    return dataclasses.replace(base, model=dataclasses.replace(base.model, architecture=arch))
'''


# (A query-chunked attention is a loop too, so XLA cannot check its recompute term.)
@pytest.mark.slow  # 30-50 s loaded per policy
@pytest.mark.parametrize("remat, chunk", [("none", 0), ("full", 0), ("dots", 0)])
def test_analytic_flops_match_xla_where_xla_sees_every_op(remat, chunk, tmp_path):
    """Without loops (no layer scan, one microbatch, no attention blocks) XLA:CPU's cost
    analysis counts every op, so it checks the analytic count, recomputation included. With
    the layer scan XLA counts the loop body once, which is why the plan uses the analytic
    count."""
    path = tmp_path / "dense.py"
    path.write_text(_DENSE_EXPERIMENT)
    devices = jax.devices()[:1]
    sets = (f"model.remat={remat!r}", f"model.attention_chunk={chunk}", "train.logit_chunk=0")

    def train_cost(*extra):
        config = aot.AotConfig(experiment=str(path), topology="v4-8", train_batch=4,
                               seq_len=128, programs=("train",), overrides=sets + extra)
        return aot.plan(config, devices=devices).programs[0]

    looped = train_cost("model.scan_layers=False")
    assert looped.hardware_flops == pytest.approx(looped.flops, rel=0.15)
    if remat == "full":
        assert looped.hardware_flops > looped.model_flops
    scanned = train_cost("model.scan_layers=True")
    assert scanned.hardware_flops == looped.hardware_flops
    assert scanned.flops < 0.8 * looped.flops  # XLA: the scanned layer body counted once


def test_render_names_a_file_that_is_not_a_plan(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    for path in (bad, tmp_path / "missing.json"):
        out = subprocess.run([sys.executable, "-m", "spade_jax.aot", f"--render={path}"],
                             capture_output=True, text=True, cwd=ROOT, timeout=120,
                             env={**os.environ, "JAX_PLATFORMS": "cpu"})
        assert out.returncode == 2 and f"{path} is not a readable --json_out plan" in out.stderr


@pytest.mark.slow  # two CPU plans of the sampler programs (~25 s loaded)
def test_sampler_programs_lower_through_the_public_entries_on_cpu():
    """The prefill and decode programs come from ``rollout.sampler.lower_prefill`` /
    ``lower_decode_step`` (no libtpu: one CPU device); the decode step's arguments hold the
    KV cache the shapes imply."""
    config = aot.AotConfig(experiment="tiny", topology="v4-8", sample_batch=2, prompt_len=16,
                           new_tokens=8, programs=("prefill", "decode"))
    result = aot.plan(config, devices=jax.devices()[:1])
    prefill, decode, auto_prefill, auto = result.programs
    # One device: no FSDP axis for the decode layout to re-purpose, the same programs.
    assert auto.name == "decode:auto" and auto.mesh_shape is None and auto.reshard_bytes == 0
    assert auto_prefill.name == "prefill:auto" and auto_prefill.mesh_shape is None
    assert (auto_prefill.argument_bytes, auto_prefill.temp_bytes, auto_prefill.resident_bytes) == (
        prefill.argument_bytes, prefill.temp_bytes, prefill.resident_bytes)
    assert auto.ici_traffic == decode.ici_traffic == 0
    sampler = load_experiment("tiny").agent.sampler
    slots = 16 + -(-8 // sampler.new_tokens_bucket) * sampler.new_tokens_bucket
    assert (prefill.name, prefill.tokens, decode.name, decode.tokens) == ("prefill", 32, "decode", 2)
    assert prefill.shape == f"B=2 P=16 S={slots}"
    arch = load_experiment("tiny").model.architecture
    cache = arch.num_layers * 2 * 2 * slots * arch.num_kv_heads * arch.head_dim * 4
    assert decode.argument_bytes >= cache + 4 * arch.param_count()
    assert decode.alias_bytes >= cache  # the decode state is donated
    # tiny runs router replay: the decode state carries the experts-only recording, uint8
    # [B, N, L, X] (2 MoE layers x top-2 = 4 B/token), and nothing else (no router logits):
    # the replay-off plan's decode arguments are exactly that buffer smaller.
    moe_layers = sum(arch.is_moe_layer(i) for i in range(arch.num_layers))
    per_token = moe_layers * arch.num_experts_per_tok
    assert decode.shape == f"B=2 S={slots} (1 token) replay {per_token} B/token in the decode state"
    off = aot.plan(dataclasses.replace(config, overrides=("train.router_replay=False",)),
                   devices=jax.devices()[:1])
    buffer = 2 * (slots - 16) * per_token
    assert off.programs[1].shape == f"B=2 S={slots} (1 token)"
    assert decode.argument_bytes - off.programs[1].argument_bytes == buffer


@pytest.mark.slow  # one TPU prefill plan of the tiny model (~20 s loaded)
@needs_libtpu
def test_every_program_lowers_for_a_tpu_topology_with_a_row_group_prefill():
    """A prefill budget smaller than the batch's prompts makes the plan lower the row-group
    prefill (``lower_prefill(batch=...)``); its row offset must be abstract, or lowering for a
    TPU topology fails on a CPU-committed scalar (the 30B plan did)."""
    config = aot.AotConfig(experiment="tiny", topology="v4-8", sample_batch=8, prompt_len=32,
                           new_tokens=8, programs=("prefill",),
                           overrides=("agent.sampler.max_prefill_tokens=64",))
    result = aot.plan(config)
    prefill = next(p for p in result.programs if p.name == "prefill")
    assert prefill.tokens < 8 * 32  # a row group, not the whole batch
    assert prefill.temp_bytes >= 0
