"""The jitted sampler against transformers, a full-forward recomputation and NumPy.

Compiles are the cost on CPU, so the tests share one tiny MoE checkpoint and reuse shapes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_hf
import torch
from flax import nnx

from spade_jax import sharding
from spade_jax.models import load_hf
from spade_jax.rollout import SamplerConfig, generate, sampling
from spade_jax.rollout import sampler as sampler_lib
from spade_jax.rollout.sampler import sample

NEW = 64
WIDTH = 80
LENGTHS = (3, 7, 5, 11)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe")
    hf = tiny_hf.make_hf_model("moe", path, eos_token_id=None, num_hidden_layers=2)
    model, _ = load_hf(path)
    rs = np.random.RandomState(0)
    prompts = [rs.randint(0, tiny_hf.VOCAB, n).tolist() for n in LENGTHS]
    return hf, path, model, prompts


@pytest.fixture(scope="module")
def greedy(checkpoint):
    _, _, model, prompts = checkpoint
    return generate(model, prompts, NEW)


def _full_forward_logprobs(model, prompts, generated, temperature, router_hook=None):
    """log_softmax(logits / T) of every generated token, from one uncached jitted forward
    over right-padded prompt+generated rows (padding after a row cannot affect it)."""
    rows = [p + g for p, g in zip(prompts, generated, strict=True)]
    ids = np.zeros((len(rows), WIDTH), np.int32)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
    graphdef, state = nnx.split(model)
    out = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x, router_hook=router_hook))(state, ids)
    logits = np.asarray(out.logits, np.float64) / (temperature or 1.0)
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    lps = [logits[i, np.arange(len(p) - 1, len(r) - 1), g] - logz[i, len(p) - 1:len(r) - 1]
           for i, (p, g, r) in enumerate(zip(prompts, generated, rows, strict=True))]
    return lps, out


def test_greedy_matches_transformers_generate(checkpoint, greedy):
    hf, _, _, prompts = checkpoint
    width = max(LENGTHS)
    ids = np.zeros((len(prompts), width), np.int64)
    mask = np.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    with torch.no_grad():
        ref = hf.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), do_sample=False,
                          max_new_tokens=NEW, pad_token_id=0, eos_token_id=None)
    ref = ref[:, width:].numpy()
    assert [len(t) for t in greedy.tokens] == [NEW] * 4
    np.testing.assert_array_equal(np.asarray(greedy.tokens), ref)
    assert greedy.done_reasons == ["max_tokens"] * 4
    # Greedy log-probs are those of the T=1 policy, recomputed without a cache.
    ref_lps, _ = _full_forward_logprobs(checkpoint[2], prompts, greedy.tokens, 0.0)
    for lps, ref_lp in zip(greedy.logprobs, ref_lps, strict=True):
        assert np.abs(np.asarray(lps) - ref_lp).max() <= 1e-4


@pytest.mark.slow  # over 5 s with a cold compile cache (fast tier < 5 min)
def test_sampled_logprobs_and_router_record_equal_full_forward(checkpoint):
    _, _, model, prompts = checkpoint

    def boost_expert_3(logits_btE, layer_idx):
        return logits_btE.at[..., 3].add(2.0 * (layer_idx + 1))

    out = generate(model, prompts, 24, temperature=0.7, top_p=0.9, top_k=20, seed=3,
                   return_router=True, router_hook=boost_expert_3)
    assert out.moe_layers == (0, 1)
    ref_lps, ref = _full_forward_logprobs(model, prompts, out.tokens, 0.7,
                                          router_hook=boost_expert_3)
    for i, (p, toks, lps) in enumerate(zip(prompts, out.tokens, out.logprobs, strict=True)):
        assert np.abs(np.asarray(lps) - ref_lps[i]).max() <= 1e-4
        fed = len(p) + len(toks) - 1  # the last sampled token was never fed to the model
        want_logits = np.stack([np.asarray(ref.router_logits[j][i, :fed]) for j in (0, 1)], 1)
        want_experts = np.stack([np.asarray(ref.selected_experts[j][i, :fed]) for j in (0, 1)], 1)
        assert out.router_logits[i].shape == (fed, 2, 8)
        np.testing.assert_allclose(out.router_logits[i], want_logits, atol=1e-4)
        np.testing.assert_array_equal(np.sort(out.selected_experts[i], -1), np.sort(want_experts, -1))
    # Sampling is reproducible per seed and differs across seeds.
    again = generate(model, prompts, 24, temperature=0.7, top_p=0.9, top_k=20, seed=3,
                     return_router=True, router_hook=boost_expert_3)
    assert again.tokens == out.tokens


@pytest.mark.slow  # two sampler compiles (~30 s on the shared CPU)
def test_experts_only_recording_equals_the_logits_modes_experts(checkpoint):
    """``return_router="experts"`` (router replay's mode) records exactly the experts that
    ``return_router=True`` records, in the compact dtype, and its decode state holds no
    router-logits buffer. Rows end at different lengths, so batch compaction gathers the
    compact buffer too."""
    _, _, model, prompts = checkpoint

    def boost_expert_3(logits_btE, layer_idx):
        return logits_btE.at[..., 3].add(2.0 * (layer_idx + 1))

    config = SamplerConfig(24, temperature=0.7, top_p=0.9, seed=5, chunk_steps=4)
    kwargs = dict(router_hook=boost_expert_3, max_new_per_seq=[24, 3, 9, 2], stop_tokens=[])
    full = sample(model, prompts, dataclasses.replace(config, return_router=True), **kwargs)
    compact = sample(model, prompts, dataclasses.replace(config, return_router="experts"),
                     **kwargs)
    assert compact.stats["compactions"] >= 1
    assert compact.tokens == full.tokens and compact.router_logits is None
    assert [len(t) for t in compact.tokens] == [24, 3, 9, 2]
    np.testing.assert_array_equal(np.concatenate([np.asarray(x) for x in compact.logprobs]),
                                  np.concatenate([np.asarray(x) for x in full.logprobs]))
    for p, toks, got, want in zip(prompts, full.tokens, compact.selected_experts,
                                  full.selected_experts, strict=True):
        assert got.dtype == np.uint8 and want.dtype == np.int32
        assert got.shape == want.shape == (len(p) + len(toks) - 1, 2, 2)
        np.testing.assert_array_equal(got, want)
    # The decode state as the jitted prefill returns it (lowered abstractly, no compile).
    graphdef, params = nnx.split(model)

    def state_of(mode):
        lowered = sampler_lib.lower_prefill(graphdef, params, model.options, dataclasses.replace(
            config, return_router=mode), rows=4, prompt_len=16)
        return lowered.out_info[0]

    experts_only, with_logits = state_of("experts"), state_of(True)
    assert experts_only.router_bnle is None
    assert (experts_only.experts_bnlx.shape, experts_only.experts_bnlx.dtype) == (
        (4, 64, 2, 2), jnp.uint8)
    assert (with_logits.router_bnle.shape, with_logits.experts_bnlx.dtype) == (
        (4, 64, 2, 8), jnp.int32)
    with pytest.raises(ValueError, match="return_router must be True, False or \"experts\""):
        SamplerConfig(8, return_router="logits")


class _CharTokenizer:
    """Id i decodes to one letter, so stop strings can be planted in the greedy output."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def test_stop_tokens_stop_strings_and_batch_compaction(checkpoint, greedy):
    _, _, model, prompts = checkpoint
    ref = greedy.tokens
    # Row 0 stops at its 5th token (a stop id), row 1 at a stop string spanning tokens 9-10.
    stop_ids = [[ref[0][4]], [], [], []]
    text1 = _CharTokenizer().decode(ref[1])
    stop_str = [[], [text1[8:10]], [], []]
    cut1 = next(n for n in range(1, NEW + 1) if text1[8:10] in text1[:n])
    out = generate(model, prompts, NEW, stop_tokens=stop_ids, stop_strings=stop_str,
                   tokenizer=_CharTokenizer(), config=SamplerConfig(NEW, chunk_steps=8))
    first0 = ref[0].index(ref[0][4]) + 1
    assert out.tokens[0] == ref[0][:first0] and out.done_reasons[0] == "eos"
    assert out.tokens[1] == ref[1][:cut1] and out.done_reasons[1] == "stop_string"
    assert out.tokens[2:] == ref[2:] and out.done_reasons[2:] == ["max_tokens"] * 2
    np.testing.assert_allclose(out.logprobs[3], greedy.logprobs[3], atol=1e-5)
    assert out.stats["compactions"] >= 1  # 4 rows -> 2 once rows 0 and 1 finished
    # Three prompts pad the batch to 4 with an empty row; the real rows are unaffected.
    assert generate(model, prompts[:3], NEW).tokens == ref[:3]


def test_bf16_cache_stays_close_to_the_fp32_policy(checkpoint):
    _, _, model, prompts = checkpoint
    out = generate(model, prompts, 8, cache_dtype="bfloat16")
    assert out.stats["cache_dtype"] == "bfloat16"
    ref_lps, _ = _full_forward_logprobs(model, prompts, out.tokens, 0.0)
    for lps, ref_lp in zip(out.logprobs, ref_lps, strict=True):
        assert len(lps) == 8 and np.abs(np.asarray(lps) - ref_lp).max() < 5e-2


def test_sharded_generation_equals_single_device(checkpoint, greedy):
    if jax.device_count() < 8:
        pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
    _, path, _, prompts = checkpoint
    mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=1, tensor=2, expert=2))
    model, _ = load_hf(path, mesh=mesh)
    out = generate(model, prompts, NEW, mesh=mesh)
    assert out.tokens == greedy.tokens
    assert out.stats["batch_bucket"] == 4


def test_config_and_input_validation(checkpoint):
    _, _, model, _ = checkpoint
    with pytest.raises(ValueError, match="top_p"):
        SamplerConfig(8, top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplerConfig(8, temperature=-1.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplerConfig(0)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(model, [[1], []], 4)
    with pytest.raises(ValueError, match="outside"):
        generate(model, [[1, 10_000]], 4)
    with pytest.raises(ValueError, match="tokenizer"):
        generate(model, [[1]], 4, stop_strings=["x"])


# --- sampling math against a NumPy reference distribution ---------------------------------

def _reference_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float):
    z = logits.astype(np.float64) / temperature
    if top_k:
        z = np.where(z >= np.sort(z)[-top_k], z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    before = np.cumsum(p[order]) - p[order]
    keep = np.zeros_like(p, bool)
    keep[order[(before < top_p) | (np.arange(len(p)) == 0)]] = True
    p = np.where(keep, p, 0.0)
    return p / p.sum()


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.5, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.7), (0.8, 6, 0.8),
])
def test_sampling_matches_reference_distribution(temperature, top_k, top_p):
    vocab, draws = 12, 40_000
    logits = np.random.RandomState(7).normal(0, 1.5, vocab).astype(np.float32)
    want = _reference_probs(logits, temperature, top_k, top_p)
    keys = jax.random.split(jax.random.key(11), draws)
    tokens, logprobs = jax.jit(lambda k: sampling.sample_tokens(
        jnp.broadcast_to(jnp.asarray(logits), (draws, vocab)), k, temperature=temperature,
        top_k=top_k, top_p=top_p, greedy=False, use_top_p=top_p < 1))(keys)
    counts = np.bincount(np.asarray(tokens), minlength=vocab)
    assert counts[want == 0].sum() == 0, "a filtered-out token was drawn"
    support = want > 0
    expected = want[support] * draws
    chi2 = float((((counts[support] - expected) ** 2) / expected).sum())
    dof = int(support.sum()) - 1
    # chi-square 99.9% quantile via the Wilson-Hilferty approximation
    crit = dof * (1 - 2 / (9 * dof) + 3.09 * np.sqrt(2 / (9 * dof))) ** 3 if dof else 0.0
    assert chi2 <= crit, (chi2, crit, counts, want)
    # the recorded log-prob is the untruncated, temperature-scaled one
    z = logits.astype(np.float64) / temperature
    full = z - np.log(np.exp(z - z.max()).sum()) - z.max()
    np.testing.assert_allclose(np.asarray(logprobs), full[np.asarray(tokens)], atol=1e-5)


def test_greedy_sampling_is_argmax_with_t1_logprob():
    logits = jnp.asarray(np.random.RandomState(1).normal(size=(3, 9)), jnp.float32)
    tokens, logprobs = sampling.sample_tokens(
        logits, jax.random.split(jax.random.key(0), 3), temperature=0.0, top_k=0, top_p=1.0,
        greedy=True, use_top_p=False)
    np.testing.assert_array_equal(np.asarray(tokens), np.argmax(np.asarray(logits), -1))
    np.testing.assert_allclose(np.asarray(logprobs),
                               np.asarray(jax.nn.log_softmax(logits))[np.arange(3), tokens],
                               atol=1e-6)


@pytest.mark.slow  # over 5 s with a cold compile cache (fast tier < 5 min)
def test_after_first_answer_steering_starts_at_the_detected_token(checkpoint, greedy):
    """The steering hook's "after_first_answer" schedule driven by a device-side detector:
    rows are untouched until the trigger token is sampled, then every later input token is
    routed with the edit, exactly as a full forward that steers those positions."""
    from spade_jax.steering.operator import make_steering_hook
    from spade_jax.steering.schedule import TokenPatternDetector

    _, _, model, prompts = checkpoint
    ref = greedy.tokens
    trigger = ref[0][5]
    activate, suppress = np.zeros(8, bool), np.zeros(8, bool)
    activate[3] = True
    hook = make_steering_hook({0: (activate, suppress), 1: (activate, suppress)}, k=2,
                              schedule="after_first_answer")
    out = generate(model, prompts, NEW, router_hook=hook,
                   answer_detector=TokenPatternDetector(patterns=((trigger,),)))
    steer_from = np.full((len(prompts), WIDTH), False)
    for i, (p, toks) in enumerate(zip(prompts, out.tokens, strict=True)):
        fired = toks.index(trigger) if trigger in toks else None
        if fired is None:
            assert toks == ref[i]
            continue
        assert toks[:fired + 1] == ref[i][:fired + 1]  # unsteered up to the trigger
        steer_from[i, len(p) + fired:] = True  # the trigger is the first steered input
    assert steer_from[0].any() and out.tokens != ref

    def steer_positions(logits_btE, layer_idx):
        edited = hook(logits_btE, layer_idx, active=np.ones(len(prompts), bool))
        return jnp.where(steer_from[:, :, None], edited, logits_btE)

    ref_lps, _ = _full_forward_logprobs(model, prompts, out.tokens, 0.0, steer_positions)
    for lps, ref_lp in zip(out.logprobs, ref_lps, strict=True):
        assert np.abs(np.asarray(lps) - ref_lp).max() <= 1e-4
    # Prefilled one row at a time, the detector's per-row state is written in with the rows.
    rows = generate(model, prompts, NEW, router_hook=hook, config=SamplerConfig(
        NEW, max_prefill_tokens=16), answer_detector=TokenPatternDetector(patterns=((trigger,),)))
    assert rows.tokens == out.tokens and rows.stats["prefill_calls"] == 4


@pytest.mark.slow  # over 5 s with a cold compile cache (fast tier < 5 min)
def test_max_rows_batches_give_the_same_samples(checkpoint):
    """Prompts generated 2 at a time (3 batches) equal one batch: same tokens, stop reasons,
    routing and log-probs, per-prompt budgets and stop lists included."""
    model = checkpoint[2]
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10], [11, 12], [13, 14, 15]]
    kwargs = dict(stop_tokens=[[3], [5], [], [7], [9], [11]], max_new_per_seq=[6, 5, 4, 6, 3, 6],
                  router_hook=None)
    config = SamplerConfig(max_new_tokens=6, temperature=1.0, seed=3, return_router=True)
    whole = sample(model, prompts, config, **kwargs)
    split = sample(model, prompts, dataclasses.replace(config, max_rows=2), **kwargs)
    assert split.tokens == whole.tokens and split.done_reasons == whole.done_reasons
    # (a different batch shape changes float summation order: log-probs to rounding)
    np.testing.assert_allclose(np.concatenate([np.asarray(x) for x in split.logprobs]),
                               np.concatenate([np.asarray(x) for x in whole.logprobs]), atol=1e-5)
    for a, b in zip(split.selected_experts, whole.selected_experts, strict=True):
        np.testing.assert_array_equal(a, b)
    assert len(split.stats["batches"]) == 3
    with pytest.raises(ValueError, match="max_rows"):
        SamplerConfig(max_new_tokens=4, max_rows=-1)


# --- the prefill in row groups (SamplerConfig.max_prefill_tokens) -------------------------

def _spy_prefills(monkeypatch) -> list[tuple[str, int, int]]:
    """Records (program, rows, prompt bucket) of every jitted prefill call ``sample`` makes."""
    calls = []
    for name in ("_prefill", "_prefill_rows"):
        real = getattr(sampler_lib, name)
        at = 2 if name == "_prefill" else 3  # the ids [rows, P] argument

        def spy(*args, _real=real, _name=name, _at=at, **kwargs):
            calls.append((_name, *args[_at].shape))
            return _real(*args, **kwargs)

        monkeypatch.setattr(sampler_lib, name, spy)
    return calls


@pytest.mark.slow  # over 5 s with a cold compile cache (fast tier < 5 min)
def test_prefill_budget_row_groups_give_the_same_samples(checkpoint, monkeypatch):
    """Six ragged prompts (an 8-row batch, 16-token bucket) prefilled 3 rows at a time
    (budget 3 x 16; the last group moved back to rows 5-7) equal one prefill: sampled
    tokens, stop reasons (a stop id, a stop string, per-row budgets, the limit), log-probs
    to rounding, router logits and experts; with ``max_rows`` too. Each call stays within
    the budget."""
    model = checkpoint[2]
    rs = np.random.RandomState(7)
    prompts = [rs.randint(0, tiny_hf.VOCAB, n).tolist() for n in (3, 16, 9, 1, 12, 6)]
    config = SamplerConfig(max_new_tokens=12, temperature=1.0, seed=3, return_router=True,
                           chunk_steps=4)
    free = sample(model, prompts, config, stop_tokens=[])
    text = _CharTokenizer().decode(free.tokens[4])
    kwargs = dict(stop_tokens=[[free.tokens[0][4]], [], [], [], [], []],
                  stop_strings=[[], [], [], [], [text[6:8]], []], tokenizer=_CharTokenizer(),
                  max_new_per_seq=[12, 12, 5, 12, 12, 2])
    whole = sample(model, prompts, config, **kwargs)
    assert {"eos", "stop_string", "max_tokens"} <= set(whole.done_reasons)
    assert whole.stats["prefill_calls"] == 1
    calls = _spy_prefills(monkeypatch)
    budget = 3 * 16
    for max_rows, want_calls in ((0, [3]), (4, [2, 1])):  # 4 rows: 2 groups; 2 rows: fits
        calls.clear()
        split = sample(model, prompts, dataclasses.replace(
            config, max_prefill_tokens=budget, max_rows=max_rows), **kwargs)
        assert split.tokens == whole.tokens and split.done_reasons == whole.done_reasons
        np.testing.assert_allclose(np.concatenate([np.asarray(x) for x in split.logprobs]),
                                   np.concatenate([np.asarray(x) for x in whole.logprobs]),
                                   atol=1e-5)
        for a, b in zip(split.selected_experts, whole.selected_experts, strict=True):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(split.router_logits, whole.router_logits, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5)
        assert all(rows * p <= budget for _, rows, p in calls) and len(calls) == sum(want_calls)
        stats = split.stats.get("batches", [split.stats])
        assert [b["prefill_calls"] for b in stats] == want_calls
        assert split.stats["prefill_calls"] == sum(want_calls)
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        SamplerConfig(4, max_prefill_tokens=-1)


def test_prefill_chunk_rows_round_to_the_batch_shards():
    rows = sampler_lib.prefill_chunk_rows
    assert rows(256, 32768, 0, 8) == 256  # no budget
    assert rows(256, 32768, 8 * 32768, 8) == 8
    assert rows(256, 32768, 12 * 32768, 8) == 8  # rounded down to the 8 shards
    assert rows(256, 32768, 100, 8) == 8  # under one row: one row per shard
    assert rows(16, 1024, 8 * 32768, 8) == 16  # fits: one call
    groups = sampler_lib._row_groups(8, 6, 2)  # blocks of 4 rows, 3 per group per block
    assert [lo for lo, _ in groups] == [0, 1]
    np.testing.assert_array_equal(groups[1][1], [1, 2, 3, 5, 6, 7])


@pytest.mark.slow  # over 5 s with a cold compile cache (fast tier < 5 min)
def test_sharded_prefill_row_groups_equal_single_device(checkpoint, monkeypatch):
    """On a data 2 x tensor 2 x expert 2 mesh (rows split 4 ways: data x expert), a budget
    of 6 rows rounds down to 4 (one row per shard a call): 8 prompts take 2 calls and
    generate the single-device greedy tokens."""
    if jax.device_count() < 8:
        pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
    _, path, single, prompts = checkpoint
    prompts = prompts + [p[::-1][:4] for p in prompts]
    want = generate(single, prompts, 16)
    mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=1, tensor=2, expert=2))
    model, _ = load_hf(path, mesh=mesh)
    assert sampler_lib.batch_shards(mesh) == 4
    calls = _spy_prefills(monkeypatch)
    out = generate(model, prompts, 16, mesh=mesh,
                   config=SamplerConfig(16, max_prefill_tokens=6 * 16))
    assert out.tokens == want.tokens
    np.testing.assert_allclose(np.concatenate([np.asarray(x) for x in out.logprobs]),
                               np.concatenate([np.asarray(x) for x in want.logprobs]),
                               atol=1e-5)
    assert calls == [("_prefill_rows", 4, 16)] * 2 and out.stats["prefill_calls"] == 2
