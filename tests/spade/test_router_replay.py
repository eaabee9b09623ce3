"""Router replay in the SPADE run (issue 22): recorded routing is compact, survives the
loop's queues (delayed designer batches, regeneration windows, resume from the JSON run
state), is packed, and makes the trainer's log-probs equal the sampler's; steered
routing is what gets replayed; the telemetry counts what it says."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from test_loop import (  # the loop's scripted policy and fixtures
    ALL_VALID,
    BROKEN_PROGRAM,
    WINDOW,
    ScriptedPolicy,
    _loop,
    _text,
    pool,  # noqa: F401  (fixture)
)
from xla_test_flags import exact_fast_compile_flags

from spade_jax.models import ModelConfig, Qwen3
from spade_jax.rl.batch import PackConfig, TrainSequence, pack_sequences
from spade_jax.rl.replay_stats import replay_telemetry
from spade_jax.rl.train_step import RoleConfig, TrainConfig
from spade_jax.rollout.routing import (
    bytes_per_token,
    compact_routing,
    decode_routing,
    encode_routing,
    extend_routing,
    routing_per_layer,
)

REPO = Path(__file__).resolve().parents[2]
LAYERS, K = 3, 2


def fake_routing(ids) -> np.ndarray:
    """A routing that is a pure function of the token stream ([len - 1, L, K] uint8)."""
    rng = np.random.default_rng(zlib.crc32(np.asarray(ids, np.int64).tobytes()))
    return compact_routing(rng.integers(0, 128, (len(ids) - 1, LAYERS, K)), 128)


class RoutedPolicy(ScriptedPolicy):
    """The scripted policy, recording routing for designer outputs and episodes."""

    def generate(self, prompts, *, seed, purpose):
        tokens, logprobs = super().generate(prompts, seed=seed, purpose=purpose)
        return tokens, logprobs, [fake_routing(list(p) + t) for p, t in zip(prompts, tokens,
                                                                            strict=True)]

    def run_episodes(self, specs, *, seed):
        records = super().run_episodes(specs, seed=seed)
        for rec in records:
            rec.routing = fake_routing(rec.token_ids)
        return records


def _routes(seqs):
    return [(s.role, list(s.token_ids), s.routing.tobytes(), s.routing.shape) for s in seqs]


def test_routing_codec_extend_and_pack():
    rng = np.random.default_rng(0)
    rec = compact_routing(rng.integers(0, 128, (7, 2, 8)), 128)
    assert rec.dtype == np.uint8 and compact_routing(np.zeros((1, 1, 1)), 300).dtype == np.uint16
    blob = encode_routing(rec)
    assert isinstance(blob["data"], str) and len(blob["data"]) == 4 * -(-rec.size // 3)
    assert np.array_equal(decode_routing(json.loads(json.dumps(blob))), rec)
    assert decode_routing(None) is None and encode_routing(None) is None
    with pytest.raises(ValueError, match="outside"):
        compact_routing(np.full((1, 1, 1), 128), 128)
    # A later call's re-computed prefix never overwrites the first-fed routing.
    later = np.concatenate([np.zeros_like(rec), rec[:3]])
    grown = extend_routing(rec, later)
    assert np.array_equal(grown[:7], rec) and np.array_equal(grown[7:], rec[:3])
    with pytest.raises(ValueError, match="fewer"):
        extend_routing(rec, rec[:2])
    # Qwen3-30B-A3B: 48 MoE layers x top-8 of 128 experts, one byte each.
    assert bytes_per_token(48, 8, 128) == 384
    # A [T, L, X] recording packs as the per-layer form it expands to.
    seq = dict(token_ids=list(range(2, 10)), loss_mask=[0] * 4 + [1] * 4,
               logprobs=[-1.0] * 8, advantage=1.0)
    moe = (0, 2)
    recording = compact_routing(rng.integers(0, 4, (7, 2, 2)), 4)
    packed = pack_sequences([TrainSequence(**seq, routing=recording)],
                            PackConfig(buckets=(16,), moe_layers=moe, num_layers=3))
    per_layer = routing_per_layer(recording, moe, 3)
    reference = pack_sequences([TrainSequence(**seq, routing=per_layer)], PackConfig(buckets=(16,)))
    assert packed.routing_replay[1] is None
    for a, b, layer in zip(packed.routing_replay, reference.routing_replay, range(3),
                           strict=True):
        if layer in moe:
            np.testing.assert_array_equal(a, b)
            np.testing.assert_array_equal(np.asarray(a)[0, :7], recording[:, moe.index(layer)])
    with pytest.raises(ValueError, match="moe_layers"):
        pack_sequences([TrainSequence(**seq, routing=recording)], PackConfig(buckets=(16,)))


@pytest.mark.parametrize("cut", [1, pytest.param(5, marks=pytest.mark.slow)])
def test_recorded_routing_survives_designer_delay_windows_and_resume(pool, cut):  # noqa: F811
    """Designer samples wait ``designer_delay`` rounds across windows; the run is cut and
    resumed from the JSON run state (what a checkpoint stores) with samples in flight;
    every trained sequence carries exactly the routing recorded for its tokens."""
    config = dataclasses.replace(WINDOW, rounds=8, designer_delay=2, memory_train_envs=1)
    texts = ALL_VALID + [_text(BROKEN_PROGRAM)]
    straight = RoutedPolicy(texts)
    loop = _loop(pool, straight, config)
    for step in range(config.rounds):
        loop.run_step(step)
    first = RoutedPolicy(texts)
    loop_a = _loop(pool, first, config)
    for step in range(cut):
        loop_a.run_step(step)
    state = json.loads(json.dumps(loop_a.state_dict()))
    in_flight = [s for p in state["pending"] for s in p["samples"]]
    assert in_flight  # designer samples with routing cross the cut
    for sample in in_flight:  # compact: base64 of uint8 bytes, not JSON lists of ints
        assert sample["routing"]["dtype"] == "|u1" and isinstance(sample["routing"]["data"], str)
    resumed = RoutedPolicy(texts)
    resumed.design_calls = [None] * len(first.design_calls)
    loop_b = _loop(pool, resumed, config)
    loop_b.load_state_dict(state)
    for step in range(cut, config.rounds):
        loop_b.run_step(step)
    designer_batches = 0
    for seqs in straight.updates:
        for s in seqs:
            assert s.routing is not None and s.routing.dtype == np.uint8
            np.testing.assert_array_equal(s.routing, fake_routing(s.token_ids))
        designer_batches += any(s.role == "designer" for s in seqs)
    assert designer_batches == 2  # window 0 trained at round 2, window 4 at round 6
    assert [_routes(u) for u in resumed.updates] == [_routes(u) for u in straight.updates[cut:]]
    assert loop_b.state_dict() == loop.state_dict()


def _moe_model(seed=0) -> Qwen3:
    config = ModelConfig(architecture="Qwen3MoeForCausalLM", vocab_size=64, hidden_size=32,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                         intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=16, norm_topk_prob=True)
    return Qwen3(config, rngs=nnx.Rngs(seed))


@pytest.mark.slow  # over 5 s with a cold compile cache (fast tier < 5 min)
def test_telemetry_counts_flips_gaps_and_clips_against_numpy():
    """Recorded routes equal the model's own except at chosen (token, layer) pairs; the
    flip rate, log-prob gaps and clip fractions match a NumPy count over the same
    forward passes."""
    model = _moe_model()
    rng = np.random.default_rng(1)
    ids = rng.integers(2, 64, (2, 12)).astype(np.int32)
    out = jax.jit(lambda i: model(i).selected_experts)(ids)
    own = [np.asarray(x) for x in out]
    recorded = [x.copy() for x in own]
    flips = {(0, 3, 0), (1, 5, 1), (1, 5, 0), (0, 10, 1)}  # (row, token, layer)
    for b, t, layer in flips:
        missing = sorted(set(range(4)) - set(recorded[layer][b, t]))
        recorded[layer][b, t, 0] = missing[0]  # a different expert set
    seqs = []
    for b in range(2):
        old = rng.normal(-2.0, 1.0, 12)
        seqs.append(TrainSequence(ids[b].tolist(), [0] * 4 + [1] * 8, old.tolist(), 1.0,
                                  role=b, routing=[r[b] for r in recorded]))
    batch = pack_sequences(seqs, PackConfig(buckets=(12,)))
    config = TrainConfig(agent=RoleConfig(importance_correction="tis",
                                          importance=dict(clamp=1.5)))
    graphdef, params = nnx.split(model)
    got = jax.device_get(jax.jit(lambda p, bt: replay_telemetry(
        p, bt, graphdef=graphdef, config=config))(params, batch))
    from spade_jax.rl.train_step import policy_logprobs

    for mode, replay in (("replay", True), ("free", False)):
        logp, _, logits = jax.jit(lambda p, bt, r=replay: policy_logprobs(
            nnx.merge(graphdef, p), bt, r))(params, batch)
        logp, logits = np.asarray(logp), [np.asarray(x) for x in logits]
        for b, role in enumerate(("agent", "designer")):
            mask = np.asarray(batch.loss_mask[b]) > 0
            gap = np.abs(logp[b] - np.asarray(batch.old_logp[b]))[mask]
            ratio = np.exp(logp[b] - np.asarray(batch.old_logp[b]))[mask]
            clamp = 1.5 if role == "agent" else 2.0
            key = f"replay/{role}/"
            np.testing.assert_allclose(got[key + f"logp_gap_{mode}"], gap.mean(), rtol=1e-5)
            np.testing.assert_allclose(got[key + f"tis_clip_{mode}"], np.mean(ratio > clamp))
            np.testing.assert_allclose(got[key + f"ratio_dev_{mode}"], np.mean(np.abs(ratio - 1)),
                                       rtol=1e-5)
            # Flips: top-2 sets of this pass's router logits vs the recording, tokens 0..10.
            count = sum(set(np.argsort(-logits[layer][b, t])[:2]) != set(recorded[layer][b, t])
                        for layer in range(2) for t in range(11))
            suffix = "" if replay else "_free"
            np.testing.assert_allclose(got[key + "flip_rate" + suffix], count / 22, rtol=1e-6)
    # Free running, the trainer's routing is the model's own: exactly the planted flips
    # (replayed, a planted flip in layer 0 may also move layer 1's router logits).
    for role in ("agent", "designer"):
        assert got[f"replay/{role}/flip_rate_free"] == pytest.approx(2 / 22)
        assert got[f"replay/{role}/flip_rate"] >= 2 / 22 - 1e-6


def _driver(*flags: str, exact: bool) -> dict:
    # The exact run with the suite's compile flags (at -O0 alone: 104 s against 139 s,
    # cold cache, 2026-12-06): what it checks is the loop's routing plumbing (recorded,
    # stored, replayed) on batch-invariant numerics, which tests/test_exact_replay.py
    # checks at XLA's default level.
    # The default-numerics run measures the bound docs/trainer.md states for users' runs:
    # it keeps the default level.
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=exact_fast_compile_flags() if exact else "")
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "support" / "routing_replay_driver.py"),
                           *flags], env=env, capture_output=True, text=True, timeout=1800,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


@pytest.mark.slow
@pytest.mark.timeout(1900)
def test_replay_through_episodes_and_designer_queue_is_bit_exact_and_steering_is_replayed():
    report = _driver(exact=True)
    for path in ("episodes", "designer"):  # multi-turn agent loop; designer via run state
        r = report[path]
        assert r["tokens"] >= 30 and r["differing_replay"] == 0 and r["max_gap_replay"] == 0.0
        assert r["telemetry"][f"{'agent' if path == 'episodes' else 'designer'}/flip_rate"] == 0
    assert report["designer_state_bytes"] > 0
    steered = report["steered"]
    # The hook allowed experts {0, 1} only: that is what was recorded (post-hook top-k) ...
    assert steered["recorded_experts"] == [0, 1]
    # ... and replaying it reproduces the steered log-probs up to the router weights'
    # renormalisation (the trainer has no hook: p_i / (p_0 + p_1) from unedited logits),
    # while the trainer's own routing is far off and flips most decisions.
    assert steered["max_gap_replay"] < 1e-5 < steered["max_gap_free"]
    assert steered["max_gap_free"] > 100 * steered["max_gap_replay"]
    assert steered["telemetry"]["agent/flip_rate_free"] > 0.3


@pytest.mark.slow
@pytest.mark.timeout(1900)
def test_replay_with_default_numerics_is_within_the_documented_bound():
    report = _driver("--default", exact=False)
    for path in ("episodes", "designer"):
        assert report[path]["max_gap_replay"] < 2e-5, report[path]  # docs/trainer.md


def test_report_tabulates_and_plots_replay_telemetry(tmp_path):
    from spade_jax.metrics import MetricsWriter
    from spade_jax.spade.report import write_report

    with MetricsWriter(tmp_path) as writer:
        for step, (flip, free) in enumerate(((0.01, 0.10), (0.03, 0.20))):
            writer.write(step, {"validity_rate": 1.0,
                                "train/replay/agent/flip_rate": flip,
                                "train/replay/agent/flip_rate_free": free,
                                "train/replay/agent/logp_gap_replay": 1e-6,
                                "train/replay/agent/logp_gap_free": 1e-3,
                                "train/replay/agent/tis_clip_replay": 0.0,
                                "train/replay/agent/tis_clip_free": 0.25,
                                "train/replay/agent/ratio_dev_replay": 1e-6,
                                "train/replay/agent/ratio_dev_free": 1e-3})
    report = write_report(tmp_path).read_text()
    assert "| agent | routing flip rate (token x layer) | 0.02 | 0.15 |" in report
    assert "| agent | TIS clip fraction | 0 | 0.25 |" in report
    assert "designer |" not in report  # no designer telemetry logged
    assert "![router_replay](plots/router_replay.png)" in report
    assert (tmp_path / "plots" / "router_replay.png").read_bytes()[:4] == b"\x89PNG"
