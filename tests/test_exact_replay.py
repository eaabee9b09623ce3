"""Batch-invariant numerics (``ModelOptions(batch_invariant=True)``): the sampler's
log-probs are reproduced bit for bit by the trainer with router replay.

The exactness checks run ``tests/support/exact_replay_driver.py`` in a fresh process with FMA
off (``numerics.EXACT_CPU_XLA_FLAG``; XLA reads flags once per process). The tests in
this process check what must hold whatever the flags: the ordered ops compute the right
values and gradients, exp/log are accurate, a batch-invariant model matches Hugging Face.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_hf
from xla_test_flags import exact_fast_compile_flags

from spade_jax.models import ModelOptions, load_hf, numerics, positions_from_mask

REPO = Path(__file__).resolve().parents[1]


def _run_driver(*args: str, flags: str = numerics.EXACT_CPU_XLA_FLAG) -> dict:
    # The run's shared compile cache: its keys include XLA_FLAGS, so the exact-math
    # programs never mix with the default ones, and the two driver runs share theirs.
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "support" / "exact_replay_driver.py"),
                           *args], env=env, capture_output=True, text=True, timeout=900,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def exact_report(tmp_path_factory):
    return _run_driver()


@pytest.mark.slow  # uses the exact-replay JAX subprocess
def test_ordered_ops_sum_left_to_right_and_ignore_batch_shape(exact_report):
    assert exact_report["exact_cpu_math"]
    assert exact_report["numerics"] == dict(
        matmul_vs_numpy=0, matmul_row_subsets=0, sum_vs_numpy=0, sum_zero_insertion=0,
        position={"exp": 0, "log": 0})


@pytest.mark.slow  # uses the exact-replay JAX subprocess
@pytest.mark.parametrize("layers", ["loop", "scan"])
def test_kv_cache_decode_is_bit_identical_to_forward(exact_report, layers):
    report = exact_report["decode"][layers]
    assert report["tokens"] > 0 and report["logits_diff"] == 0


@pytest.mark.slow  # uses the exact-replay JAX subprocess
def test_router_replay_reproduces_sampler_logprobs_exactly(exact_report):
    report = exact_report["replay"]["invariant"]
    assert report["tokens"] >= 90
    assert report["differing"] == 0 and report["max_gap"] == 0.0
    # On policy, the trainer's own routing is bit-identical too: replay changes nothing.
    assert report["differing_without_replay"] == 0
    # The real train step (two roles, two microbatches) logs the same zero gap.
    assert report["step_gap_max"] == {"agent": 0.0, "designer": 0.0}
    # Control: default numerics round differently in decode and in the training forward.
    assert exact_report["replay"]["default"]["differing"] > 0


@pytest.mark.slow  # uses the exact-replay JAX subprocess
def test_sampler_batching_does_not_change_logprobs(exact_report):
    assert exact_report["batching"] == {"tokens_equal": True, "logprob_diff": 0,
                                        "prefill_groups": 3, "groups_tokens_equal": True,
                                        "groups_logprob_diff": 0}


@pytest.mark.slow
def test_slot_engine_is_bit_exact_across_slot_counts_and_against_the_trainer(tmp_path_factory):
    """Issue 18.3: scheduling (1, 3 or 8 slots; a prefill budget splitting the admits)
    changes no bit, and turns decoded over a KV cache reused across turns are re-scored
    exactly by the trainer's forward."""
    # With the suite's compile flags (at -O0 alone: 40 s against 52 s, cold cache,
    # 2026-12-06): what this checks is the engine's scheduling and KV reuse on
    # batch-invariant numerics; those numerics at XLA's default level are the main
    # report's (`replay`, `batching`, above).
    report = _run_driver("engine", flags=exact_fast_compile_flags())
    assert report == {"streams_equal": True, "logprob_diff": 0, "split_admits": True,
                      "trainer_differing": 0, "tokens": 96}


@pytest.mark.slow  # uses the exact-replay JAX subprocess
def test_sharded_forward_is_bit_identical_to_one_device(exact_report):
    assert exact_report["sharded"] == {"1x2x2x2": 0, "2x2x2x1": 0, "8x1x1x1": 0}


# ---- values and gradients (any flags) -------------------------------------------------------


@pytest.mark.parametrize("spec, a_shape, b_shape", [
    ("md,df->mf", (7, 40), (40, 5)),
    ("btnh,nhd->btd", (2, 3, 4, 8), (4, 8, 6)),
    ("bkqh,bksh->bkqs", (2, 3, 5, 8), (2, 3, 7, 8)),
    ("ted,te->td", (9, 4, 6), (9, 4)),
    ("td,edf->tef", (5, 6), (3, 6, 4)),
])
def test_ordered_einsum_values_and_gradients(spec, a_shape, b_shape):
    rng = np.random.default_rng(1)
    a = rng.standard_normal(a_shape).astype(np.float32)
    b = rng.standard_normal(b_shape).astype(np.float32)
    out = numerics.einsum(spec, a, b, invariant=True)
    ref = np.einsum(spec, a.astype(np.float64), b.astype(np.float64))
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)

    def loss(fn):
        return lambda a, b: jnp.sum(jnp.sin(fn(a, b)))

    ours = jax.grad(loss(lambda a, b: numerics.einsum(spec, a, b, invariant=True)), (0, 1))(a, b)
    plain = jax.grad(loss(lambda a, b: jnp.einsum(spec, a, b)), (0, 1))(a, b)
    for x, y in zip(ours, plain, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)


def test_ordered_einsum_rejects_what_it_cannot_order():
    x = jnp.ones((3, 4))
    with pytest.raises(ValueError, match="summed away"):
        numerics.einsum("md,de->e", x, jnp.ones((4, 2)), invariant=True)
    with pytest.raises(ValueError, match="distinct letters"):
        numerics.einsum("mm,md->d", jnp.ones((3, 3)), x, invariant=True)


@pytest.mark.slow  # ~25 s loaded
def test_exp_and_log_are_accurate_with_correct_gradients():
    rng = np.random.default_rng(2)
    x = (rng.standard_normal(5000) * 25).astype(np.float32)
    ours = np.asarray(numerics.exp(x), np.float64)
    ref = np.exp(x.astype(np.float64))
    normal = (ref > 1.2e-38) & (ref < 3e38)
    ulp = np.spacing(ref[normal].astype(np.float32)).astype(np.float64)
    assert np.max(np.abs(ours[normal] - ref[normal]) / ulp) <= 3.0
    assert np.all(ours[x < -87.34] == 0) and np.all(np.isinf(ours[x > 88.73]))

    y = np.exp(x / 4).astype(np.float32)
    ours = np.asarray(numerics.log(y), np.float64)
    ref = np.log(y.astype(np.float64))
    ulp = np.spacing(np.abs(ref).astype(np.float32)).astype(np.float64)
    assert np.max(np.abs(ours - ref) / ulp) <= 3.0
    special = np.asarray(numerics.log(jnp.asarray([0.0, -1.0, np.inf, 1.0])))
    assert special[0] == -np.inf and np.isnan(special[1]) and special[2] == np.inf
    assert special[3] == 0.0
    assert float(jax.grad(numerics.exp)(1.5)) == pytest.approx(np.exp(1.5), rel=1e-6)
    assert float(jax.grad(numerics.log)(4.0)) == pytest.approx(0.25, rel=1e-6)
    # Masked attention scores (-1e30) give exact zeros and a finite gradient.
    g = jax.grad(lambda s: jnp.sum(numerics.exp(s)))(jnp.asarray([-1e30, 0.0]))
    assert np.array_equal(np.asarray(g), [0.0, 1.0])


@pytest.mark.slow  # ~19 s loaded
def test_token_logprobs_match_log_softmax():
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal((4, 6, 50)) * 3).astype(np.float32)
    tokens = rng.integers(0, 50, (4, 6))
    logp, lse = numerics.token_logprobs(jnp.asarray(logits), jnp.asarray(tokens), invariant=True)
    ref_lse = np.log(np.exp(logits.astype(np.float64)).sum(-1))
    ref = np.take_along_axis(logits, tokens[..., None], -1)[..., 0] - ref_lse
    np.testing.assert_allclose(np.asarray(logp), ref, atol=2e-6)
    np.testing.assert_allclose(np.asarray(lse), ref_lse, rtol=1e-6)


@pytest.mark.slow  # 30-130 s loaded: fixed-order model compiles
@pytest.mark.parametrize("kind, overrides", [
    ("moe", {}),
    ("dense", dict(tie_word_embeddings=True, num_attention_heads=8, num_key_value_heads=2)),
    ("shared", {}),
])
def test_batch_invariant_model_matches_transformers(tmp_path, kind, overrides):
    hf_model = tiny_hf.make_hf_model(kind, tmp_path, **overrides)
    with pytest.warns(UserWarning, match="FMA"):  # this process runs with FMA on
        model, config = load_hf(tmp_path, dtype=jnp.float32,
                                options=ModelOptions(batch_invariant=True))
    rng = np.random.RandomState(4)
    ids = rng.randint(0, tiny_hf.VOCAB, (3, 9))
    mask = np.ones((3, 9), np.int64)
    mask[0, :4] = 0
    pos = np.asarray(positions_from_mask(mask))
    ref = tiny_hf.hf_logits(hf_model, ids, mask, pos)
    out = model(ids, positions_bt=pos, attention_mask_bt=mask)
    real = mask.astype(bool)
    ours, theirs = np.asarray(out.logits)[real], ref.logits.numpy()[real]
    assert np.abs(ours - theirs).max() / np.abs(theirs).max() <= 1e-4
    # HF returns router logits for MoE layers only, flattened [B*T, E].
    hf_router = [z for z in (getattr(ref, "router_logits", None) or ()) if z is not None]
    ours_router = [z for z in out.router_logits if z is not None]
    assert len(hf_router) == len(ours_router) == sum(map(config.is_moe_layer,
                                                         range(config.num_layers)))
    for a, b in zip(ours_router, hf_router, strict=True):
        a = np.asarray(a)[real]
        b = b.numpy().reshape(*real.shape, -1)[real]
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_exact_cpu_flag_helpers(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert not numerics.exact_cpu_math_enabled()
    assert numerics.request_exact_cpu_math()
    assert os.environ["XLA_FLAGS"] == ("--xla_force_host_platform_device_count=8 "
                                       + numerics.EXACT_CPU_XLA_FLAG)
    assert numerics.exact_cpu_math_enabled() and not numerics.request_exact_cpu_math()
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_max_isa=AVX2")  # AVX2 has FMA
    assert not numerics.exact_cpu_math_enabled()


_TRAIN_PROBE = """
import os, sys
from absl import app
import spade_jax.run as run
from jax._src import xla_bridge
from spade_jax.models import numerics

request = numerics.request_exact_cpu_math

def probe_request():  # XLA reads XLA_FLAGS when a backend starts: none may have started
    print("REQUESTED backends_started", bool(xla_bridge._backends))
    return request()

def probe_run(config, workdir):  # stands in for the run: what it would start with
    print("FLAGS", os.environ.get("XLA_FLAGS", ""), "INVARIANT", config.model.batch_invariant)

numerics.request_exact_cpu_math = probe_request
run.run_experiment = probe_run
from spade_jax import train
app.run(train.main, argv=["train", "--workdir", sys.argv[1], *sys.argv[2:]])
"""


@pytest.mark.slow  # JAX subprocesses
@pytest.mark.parametrize("invariant", [True, False])
def test_train_cli_turns_fma_off_for_batch_invariant_experiments(tmp_path, invariant):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    proc = subprocess.run(
        [sys.executable, "-c", _TRAIN_PROBE, str(tmp_path / "run"),
         f"--set=model.batch_invariant={invariant}"],
        env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("FLAGS"))
    assert (numerics.EXACT_CPU_XLA_FLAG in line) == invariant
    assert line.endswith(f"INVARIANT {invariant}")
    assert ("REQUESTED backends_started False" in proc.stdout) == invariant
