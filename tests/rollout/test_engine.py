"""The slot engine and the continuous-batching agent loop (issue 18 items 1-3, 6).

The reference is the plain sampler on the *whole* stream: ``sample`` with one prompt and
the request's seed re-prefills everything from token 0 each turn. The engine keeps each
episode's KV cache from turn to turn (prefilling only what was added), schedules rows into
slots in whatever order env results arrive, and shares the prefill of identical openings;
none of that may change a token, and log-probs agree to float rounding (bit for bit with a
batch-invariant model: ``exact_replay_driver.engine_checks``).
"""

from __future__ import annotations

import dataclasses
import random
import time

import numpy as np
import pytest
from test_agent_loop import ScriptedEnv, model, tokenizer  # noqa: F401 (fixtures)

from spade_jax.rollout import SamplerConfig, sample
from spade_jax.rollout import engine as engine_module
from spade_jax.rollout.agent_loop import AgentLoopConfig, ChatTurns, EpisodeSpec, run_episodes
from spade_jax.rollout.engine import Request, SlotEngine
from spade_jax.seeding import derive_seed

TURN_TOKENS = 6
LOGPROB_TOL = 2e-5


def _sampler(temperature: float, max_new: int = TURN_TOKENS) -> SamplerConfig:
    return SamplerConfig(max_new_tokens=max_new, temperature=temperature, top_p=0.95,
                         prompt_bucket_min=16, chunk_steps=3, compact_batch=False)


def _reference_episode(model, tokenizer, spec: EpisodeSpec, index: int, config, base_seed):  # noqa: F811
    """One episode the slow way: every turn re-prefills the whole stream (``sample`` on one
    prompt, seeded ``derive_seed(base, episode, turn)``). Returns (stream, logprobs, actions)."""
    turns = ChatTurns(tokenizer, None, config.enable_thinking)
    obs, _ = spec.env.reset(seed=spec.seed)
    stream, logprobs, actions = list(turns.first_prompt(obs)), [], []
    for turn in range(config.max_turns):
        budget = min(config.max_turn_tokens, config.max_episode_tokens - len(stream))
        cfg = SamplerConfig(**{**_sampler(config.sampler.temperature).__dict__,
                               "seed": derive_seed(base_seed, index, turn)})
        out = sample(model, [stream], cfg, stop_tokens=sorted(turns.eos_ids),
                     max_new_per_seq=[budget])
        stream += out.tokens[0]
        logprobs.append(out.logprobs[0])
        action = tokenizer.decode(out.tokens[0], skip_special_tokens=True).strip()
        actions.append(action)
        if out.done_reasons[0] != "eos" and len(stream) >= config.max_episode_tokens:
            break
        obs, _, terminated, truncated, _ = spec.env.step(action)
        if terminated or truncated or turn + 1 == config.max_turns:
            break
        closed = stream[-1] in turns.eos_ids
        piece = turns.after_policy(obs, closed)
        # Issue 37: an observation that leaves no room for a policy token ends the episode
        # before it is appended (it used to be appended first, overshooting the budget).
        if len(stream) + len(piece) >= config.max_episode_tokens:
            break
        stream += piece
    return stream, logprobs, actions


class SlowEnv(ScriptedEnv):
    """Steps take a seeded random time, so results arrive in a shuffled order."""

    def __init__(self, *args, delay_seed: int = 0):
        super().__init__(*args)
        self.delays = random.Random(delay_seed)

    def step(self, action):
        time.sleep(self.delays.uniform(0, 0.05))
        return super().step(action)


def _specs(delay_seed: int | None = None):
    """Skewed episodes: 1 to 4 turns, observations of different lengths; two pairs share
    their opening (same env name and reset seed: prefix sharing)."""
    plan = [("alpha", [0.0] * 4, None, 1), ("beta gamma beta", [1.0], "terminated", 2),
            ("alpha", [0.0] * 4, None, 1), ("gamma", [0.5, 0.5], "truncated", 3),
            ("beta", [0.0, 0.0, 1.0], "terminated", 4), ("gamma", [0.5, 0.5], "truncated", 3)]
    out = []
    for k, (name, rewards, end, seed) in enumerate(plan):
        env = (ScriptedEnv(name, rewards, end) if delay_seed is None
               else SlowEnv(name, rewards, end, delay_seed=delay_seed * 100 + k))
        out.append(EpisodeSpec(env, name, seed))
    return out


def _loop_config(temperature: float, slots: int = 0, max_episode_tokens: int = 4096):
    return AgentLoopConfig(max_turns=4, max_turn_tokens=TURN_TOKENS, enable_thinking=True,
                           max_episode_tokens=max_episode_tokens, decode_slots=slots,
                           sampler=_sampler(temperature))


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_kv_reuse_across_turns_equals_a_full_reprefill(model, tokenizer, temperature):  # noqa: F811
    config = _loop_config(temperature)
    stats: dict = {}
    records = run_episodes(model, tokenizer, _specs(), config, seed=11, stats=stats,
                           parser=lambda text: (text.strip(), True))
    for i, (rec, spec) in enumerate(zip(records, _specs(), strict=True)):
        stream, logprobs, actions = _reference_episode(model, tokenizer, spec, i, config, 11)
        assert rec.token_ids == stream
        assert rec.actions == actions
        got = [rec.logprobs[a:b] for a, b in rec.turn_spans]
        for g, want in zip(got, logprobs, strict=True):
            np.testing.assert_allclose(g, want, atol=LOGPROB_TOL)
        assert rec.sampler_seeds == [derive_seed(11, i, t) for t in range(len(rec.turn_spans))]
    # Each turn after the first prefilled only the tokens added since the last one: the
    # stream but its decoded tokens (all generated ones but each turn's last) and its very
    # last token; the twins' openings (episodes 2 and 5) were copied, not prefilled.
    fed = sum(len(r.token_ids) - 1 - r.cost.tokens_generated + r.cost.turns for r in records)
    openings = sum(records[i].turn_spans[0][0] for i in (2, 5))
    assert stats["prefill_tokens"] == fed - openings
    assert stats["shared_prefills"] == 2
    assert [r.cost.turns for r in records] == [4, 1, 4, 2, 3, 2]


@pytest.mark.slow
@pytest.mark.parametrize("slots", [1, 3, 8])
def test_slot_count_and_arrival_order_do_not_change_records(model, tokenizer, slots):  # noqa: F811
    """Greedy and sampled runs with 1, 3 or 8 slots, env results arriving in a shuffled
    order (random step delays), give the records of the one-slot-per-episode run."""
    for temperature in (0.0, 0.9):
        base = run_episodes(model, tokenizer, _specs(), _loop_config(temperature), seed=3)
        stats: dict = {}
        got = run_episodes(model, tokenizer, _specs(delay_seed=slots),
                           _loop_config(temperature, slots), seed=3, stats=stats)
        assert stats["slots"] == min(slots, 6)
        for a, b in zip(base, got, strict=True):
            assert (a.token_ids, a.actions, a.end_reason, a.turn_done_reasons) == (
                b.token_ids, b.actions, b.end_reason, b.turn_done_reasons)
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=LOGPROB_TOL)


@pytest.mark.slow  # over 5 s with a cold compile cache (fast tier < 5 min)
def test_episode_token_budget_ends_rows_mid_turn(model, tokenizer):  # noqa: F811
    """Rows that run into the episode budget end on "max_tokens", as in the reference."""
    config = _loop_config(0.9, slots=2, max_episode_tokens=40)
    records = run_episodes(model, tokenizer, _specs(), config, seed=5)
    assert {r.end_reason for r in records} >= {"max_tokens"}
    for i, (rec, spec) in enumerate(zip(records, _specs(), strict=True)):
        stream, _, _ = _reference_episode(model, tokenizer, spec, i, config, 5)
        assert rec.token_ids == stream and len(stream) <= config.max_episode_tokens


# Picked from the fixture model's own continuations of these prompts (checked below: each
# ending occurs): "ۓ" and "מ" are two-byte characters whose bytes come from two tokens.
STOP_STRINGS = ["ۓ", "מ", "mm", ".."]
STOP_TOKENS = [150, 299]


def _engine_jobs():
    """Six two-turn jobs: prompts of 2 to 30 tokens, then an observation of 1 to 7 tokens
    after the first turn; per-turn budgets from 3 to 8."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 200, size=n).tolist() for n in (5, 17, 2, 9, 30, 12)]
    extras = [rng.integers(3, 200, size=n).tolist() for n in (3, 1, 7, 2, 4, 1)]
    return prompts, extras, [[8, 3, 8, 6, 8, 5], [4, 8, 2, 8, 6, 8]]


def _drive_engine(model, tokenizer, config, slots: int, order_seed: int) -> dict:  # noqa: F811
    """Runs every job's two turns through a ``slots``-slot engine; new jobs and
    continuations arrive in a seeded random order and in random waves, decode chunks are
    1 to 3 steps. Returns {(job, turn): Finished}."""
    prompts, extras, limits = _engine_jobs()
    engine = SlotEngine(model, slots, config, stop_tokens=STOP_TOKENS,
                        stop_strings=STOP_STRINGS, tokenizer=tokenizer, cache_len=16)
    order = random.Random(order_seed)
    pending = list(range(len(prompts)))
    order.shuffle(pending)
    ready, holder, streams, results = [], {}, {}, {}  # holder: slot -> (job, turn)
    while pending or ready or engine.generating:
        order.shuffle(ready)
        wave = []
        for _ in range(order.randint(0 if engine.generating else 1, len(ready)) if ready else 0):
            j, slot, last = ready.pop()
            holder[slot] = (j, 1)
            wave.append(Request(slot, [last] + extras[j], False, limits[1][j], 200 + j))
            streams[j] += extras[j]
        free = [s for s in range(engine.num_slots) if s not in holder]
        order.shuffle(free)
        for slot in free[:order.randint(0, len(pending))]:
            j = pending.pop()
            holder[slot], streams[j] = (j, 0), list(prompts[j])
            wave.append(Request(slot, prompts[j], True, limits[0][j], 100 + j))
        for r in wave:
            engine.ensure_cache(len(streams[holder[r.slot][0]]) + r.limit)
        engine.admit(wave)
        engine.decode(order.randint(1, 3))
        for done in engine.finished():
            j, turn = holder[done.slot]
            results[(j, turn)] = done
            streams[j] += done.tokens
            if turn == 0:  # the slot stays the job's: its cache holds the stream
                ready.append((j, done.slot, done.tokens[-1]))
                holder[done.slot] = (j, -1)
            else:
                del holder[done.slot]
    assert engine.cache_len == 64  # grown from 16 by doubling
    assert engine.stats["partial_calls"] > 0  # some calls ran on a window or fewer rows
    if slots == 8:
        assert engine.stats["decode_row_steps"] < 8 * engine.stats["decode_steps"]
    return results


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_engine_matches_the_sampler_on_stop_strings_eos_budgets_and_slots(model, tokenizer,  # noqa: F811
                                                                           temperature,
                                                                           monkeypatch):
    """Two turns per job (the second continues the first's KV cache) through 1, 3 and 8
    slots with shuffled arrivals: each turn equals ``sample`` on the whole stream with that
    turn's seed, whether it ended on a stop token, a stop string (the cache rolled back to
    the cut) or its budget. Calls run on the slots involved (``row_bucket`` rows) and, with
    the smallest window lowered to 16 slots, on the part of the cache they fill; admits
    feed their tokens packed."""
    monkeypatch.setattr(engine_module, "_MIN_WINDOW", 16)
    config = _sampler(temperature, 8)
    prompts, extras, limits = _engine_jobs()
    runs = {slots: _drive_engine(model, tokenizer, config, slots, slots) for slots in (1, 3, 8)}
    reasons = {turn: set() for turn in (0, 1)}
    for j, prompt in enumerate(prompts):
        stream = list(prompt)
        for turn in (0, 1):
            want = sample(model, [stream], dataclasses.replace(config, seed=100 * (turn + 1) + j),
                          stop_tokens=STOP_TOKENS, stop_strings=STOP_STRINGS,
                          tokenizer=tokenizer, max_new_per_seq=[limits[turn][j]])
            for slots, results in runs.items():
                got = results[(j, turn)]
                assert (got.tokens, got.reason) == (want.tokens[0], want.done_reasons[0]), (
                    slots, j, turn)
                np.testing.assert_allclose(got.logprobs, want.logprobs[0], atol=LOGPROB_TOL)
            reasons[turn].add(want.done_reasons[0])
            stream += want.tokens[0] + extras[j]
    assert reasons[0] == {"eos", "stop_string", "max_tokens"}  # continued after each kind


def test_moe_impl_auto_is_the_backends_fastest_and_explicit_values_win():
    """Issue 18.4: "auto" (the default) becomes "blocked" on CPU, the grouped-matmul
    dispatch on TPU and "dense" on GPU when the model is built; an explicit choice is
    kept."""
    from flax import nnx

    from spade_jax.models import ModelConfig, ModelOptions, Qwen3
    from spade_jax.models.qwen3 import auto_moe_impl

    assert ModelOptions().moe_impl == "auto"
    assert [auto_moe_impl(b) for b in ("cpu", "tpu", "gpu")] == [
        "blocked", "expert_parallel", "dense"]
    cfg = ModelConfig(architecture="Qwen3MoeForCausalLM", vocab_size=32, hidden_size=16,
                      num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                      intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=8)
    built = nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0)))
    assert built.options.moe_impl == auto_moe_impl() == "blocked"  # the test box is a CPU
    explicit = nnx.eval_shape(lambda: Qwen3(cfg, ModelOptions(moe_impl="ragged"),
                                            rngs=nnx.Rngs(0)))
    assert explicit.options.moe_impl == "ragged"
    with pytest.raises(ValueError, match="moe_impl must be 'auto' or one of"):
        ModelOptions(moe_impl="fast")


def _tiny_moe():
    """A random 2-layer MoE (4 experts, top 2), filled from NumPy like ``chat_model``."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from spade_jax.models import ModelConfig, abstract_model

    cfg = ModelConfig(architecture="Qwen3MoeForCausalLM", vocab_size=64, hidden_size=32,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                      intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=16)
    graphdef, shapes = nnx.split(abstract_model(cfg))
    rs = np.random.RandomState(1)

    def fill(x):
        noise = rs.normal(0, 0.3, x.shape)
        return jnp.asarray((1 + noise if len(x.shape) == 1 else noise).astype(x.dtype))

    return nnx.merge(graphdef, jax.tree.map(fill, shapes))


@pytest.mark.slow
@pytest.mark.parametrize("groups", [1, 2])
def test_packed_prefill_equals_the_padded_prefill(groups):
    """``Packing``: the admitted rows' added tokens fed back to back ([G, N], padding only
    at the end of a group) give, at every real token, the hidden state and routing of the
    padded [B, T] forward over the same per-row cache, and the same cache (keys, values,
    valid slots, indices). Rows continue caches of different lengths (one starts fresh);
    G = 2 splits the rows into two groups, as the engine does per batch shard."""
    import jax.numpy as jnp

    from spade_jax.models.qwen3 import Packing

    moe = _tiny_moe()
    rng = np.random.default_rng(0)
    rows, width = 4, 8
    cache = moe.init_cache(rows, 32, per_row=True)
    before = [5, 0, 11, 2]  # tokens already cached per row
    history = jnp.asarray(rng.integers(1, 64, size=(rows, 11)), jnp.int32)
    cache = moe(history, attention_mask_bt=jnp.arange(11)[None] < jnp.asarray(before)[:, None],
                  cache=cache).cache
    added = [rng.integers(1, 64, size=n).tolist() for n in (3, 8, 1, 6)]
    ids_bt = np.zeros((rows, width), np.int32)
    for b, tokens in enumerate(added):
        ids_bt[b, :len(tokens)] = tokens
    mask_bt = np.arange(width)[None] < np.array([len(a) for a in added])[:, None]
    padded = moe(jnp.asarray(ids_bt), attention_mask_bt=mask_bt, cache=cache)

    packed_host = engine_module._pack(added, rows, width, groups, floor=4)
    assert packed_host.ids_gn.shape[1] == engine_module.packed_bucket(
        max(sum(len(a) for a in added[g * 2:g * 2 + 2]) for g in range(groups))
        if groups == 2 else sum(len(a) for a in added), 4)
    packing = Packing(slot_gn=jnp.asarray(packed_host.slot_gn),
                      token_gr=jnp.asarray(packed_host.token_gr))
    packed = moe(jnp.asarray(packed_host.ids_gn), attention_mask_bt=mask_bt, cache=cache,
                   packing=packing)
    for j, tokens in enumerate(added):
        g, lo = packed_host.group[j], packed_host.start[j]
        got = slice(lo, lo + len(tokens))
        np.testing.assert_allclose(packed.hidden[g, got], padded.hidden[j, :len(tokens)],
                                   atol=1e-5)
        np.testing.assert_allclose(packed.logits[g, got], padded.logits[j, :len(tokens)],
                                   atol=1e-4)
        for layer in range(2):
            np.testing.assert_array_equal(packed.selected_experts[layer][g, got],
                                          padded.selected_experts[layer][j, :len(tokens)])
        assert packed_host.last_gu[g, j % (rows // groups)] == lo + len(tokens) - 1
    np.testing.assert_array_equal(packed.cache.index, padded.cache.index)
    np.testing.assert_array_equal(packed.cache.valid_bs, padded.cache.valid_bs)
    for a, b in zip(packed.cache.k + packed.cache.v, padded.cache.k + padded.cache.v,
                    strict=True):
        np.testing.assert_allclose(np.where(padded.cache.valid_bs[..., None, None], a, 0),
                                   np.where(padded.cache.valid_bs[..., None, None], b, 0),
                                   atol=1e-5)


def test_packed_bucket_pads_at_most_a_quarter_with_four_shapes_per_octave():
    """Packed admit lengths: never below the tokens, at most 25% above them (4 buckets per
    power of two, so few shapes compile), and at least the floor."""
    buckets = {engine_module.packed_bucket(n, 16) for n in range(1, 2049)}
    for n in range(1, 2049):
        got = engine_module.packed_bucket(n, 16)
        assert n <= got and (got <= 16 or got <= 1.25 * n), n
    assert len({b for b in buckets if 256 < b <= 512}) == 4
    assert engine_module.packed_bucket(3, 16) == 16


@pytest.mark.slow
def test_a_second_run_of_the_same_episodes_compiles_nothing(model, tokenizer):  # noqa: F811
    """A new engine (one per ``run_episodes`` call) reuses every compiled program of the
    first run on the same episodes: the empty-state init included (it was a fresh closure,
    compiled again by every engine). Counted: XLA compiles (as the benchmark counts them)
    and lowerings, which a program traced again pays even when the persistent compile
    cache then spares its XLA compile."""
    import jax

    specs = _specs()[:4]
    config = AgentLoopConfig(max_turns=3, max_turn_tokens=TURN_TOKENS, max_episode_tokens=200,
                             sampler=_sampler(0.9), decode_slots=3)
    counted = {"on": False, "compiles": 0}
    events = ("/jax/core/compile/backend_compile_duration",
              "/jax/core/compile/jaxpr_to_mlir_module_duration")

    def count(event: str, seconds: float, **_) -> None:
        if counted["on"] and event in events:
            counted["compiles"] += 1

    jax.monitoring.register_event_duration_secs_listener(count)
    first = run_episodes(model, tokenizer, specs, config, seed=5)
    counted["on"] = True
    second = run_episodes(model, tokenizer, _specs()[:4], config, seed=5)
    counted["on"] = False
    assert [r.token_ids for r in second] == [r.token_ids for r in first]
    assert counted["compiles"] == 0


def test_row_bucket_leaves_at_most_a_third_of_the_rows_idle():
    """Working-set rows: powers of two and their halfway points, a multiple of the shards."""
    assert [engine_module.row_bucket(n) for n in (1, 2, 3, 4, 5, 7, 9, 13, 18, 25, 33)] == [
        1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48]
    for n in range(1, 300):
        got = engine_module.row_bucket(n)
        assert n <= got and 3 * (got - n) < got + 1, n
        assert engine_module.row_bucket(n, 4) % 4 == 0 and engine_module.row_bucket(n, 4) >= n


@pytest.mark.slow
def test_a_prefill_budget_splits_admits_without_changing_records(model, tokenizer,  # noqa: F811
                                                                 monkeypatch):
    """A prefill budget of two first-prompt rows (the loop's sampler's
    ``max_prefill_tokens``, which bounds the engine's admits and `sample` alike): the first
    tick's six openings (and
    later turns) are prefilled in several calls, each within the budget (rows x prompt
    bucket of the jitted call, read off its mask), the twins' openings still shared, and
    the records equal the unlimited one-slot-per-episode run's (greedy and sampled; with 3
    slots, env results arriving shuffled)."""
    turns = ChatTurns(tokenizer, None, enable_thinking=True)
    longest = max(len(turns.first_prompt(s.env.reset(seed=s.seed)[0])) for s in _specs())
    budget = 2 * max(16, 1 << (longest - 1).bit_length())  # two rows of the opening bucket
    calls = []
    admit = engine_module._admit

    def spy(graphdef, params, state, home_u, fresh_u, ids_gn, packing, mask_ut, *args,
            **kwargs):
        calls.append(mask_ut.shape)
        return admit(graphdef, params, state, home_u, fresh_u, ids_gn, packing, mask_ut,
                     *args, **kwargs)

    monkeypatch.setattr(engine_module, "_admit", spy)
    for temperature in (0.0, 0.9):
        base_stats: dict = {}
        base = run_episodes(model, tokenizer, _specs(), _loop_config(temperature), seed=3,
                            stats=base_stats)
        assert base_stats["shared_prefills"] == 2
        for slots in (0, 3):
            stats: dict = {}
            calls.clear()
            config = _loop_config(temperature, slots)
            config = dataclasses.replace(config, sampler=dataclasses.replace(
                config.sampler, max_prefill_tokens=budget))
            got = run_episodes(model, tokenizer, _specs(delay_seed=slots), config, seed=3,
                               stats=stats)
            for a, b in zip(base, got, strict=True):
                assert (a.token_ids, a.actions, a.end_reason, a.turn_done_reasons) == (
                    b.token_ids, b.actions, b.end_reason, b.turn_done_reasons)
                np.testing.assert_allclose(a.logprobs, b.logprobs, atol=LOGPROB_TOL)
            assert stats["prefill_calls"] == len(calls) > base_stats["prefill_calls"]
            assert all(rows * t <= budget for rows, t in calls), (budget, calls)
            if slots == 0:  # all openings admitted at the first tick, as in the base run
                assert stats["shared_prefills"] == 2
                assert stats["prefill_tokens"] == base_stats["prefill_tokens"]


def test_prefill_calls_keep_shared_prompts_together_and_run_an_oversized_request_alone(
        model):  # noqa: F811
    """The split of one admit (prompt bucket 16 and up, budget 64): a shared prompt's
    requests join one call, calls keep the order of first appearance, a request over the
    budget runs alone, and a shared group too large for the budget is cut to fit."""
    engine = SlotEngine(model, 8, _sampler(0.0), stop_tokens=[0], max_prefill_tokens=64)

    def fresh(slot, token, n):
        return Request(slot, [token] * n, True, 2, slot)

    a0, a1, a2 = (fresh(s, 5, 10) for s in (0, 1, 2))  # one prompt: 1 row of 16 each
    b = Request(3, [9, 9, 9], False, 2, 3)  # a continuation: 16
    c, d = fresh(4, 6, 40), fresh(5, 8, 100)  # buckets 64 (fits alone) and 128 (over)
    e0, e1 = fresh(6, 7, 5), fresh(7, 7, 5)
    assert [engine.prefill_size(x) for x in ([a0, a1, a2], [d], [a0, c])] == [48, 128, 128]
    split = engine._prefill_calls([a0, b, a1, c, a2, d, e0, e1])
    assert split == [[a0, a1, a2, b], [c], [d], [e0, e1]]
    engine.max_prefill_tokens = 32  # the shared group alone (48) is over: cut to 2 + 1
    assert engine._prefill_calls([a0, a1, a2, b]) == [[a0, a1], [a2, b]]
    engine.max_prefill_tokens = 0
    assert engine._prefill_calls([a0, b, d]) == [[a0, b, d]]
    with pytest.raises(ValueError, match="max_prefill_tokens must be >= 0"):
        SlotEngine(model, 2, _sampler(0.0), stop_tokens=[0], max_prefill_tokens=-1)
    with pytest.raises(TypeError, match="max_prefill_tokens"):  # the sampler's, not the loop's
        AgentLoopConfig(max_prefill_tokens=-1)
