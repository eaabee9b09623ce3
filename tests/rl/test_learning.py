"""End-to-end checks of the train step with a real sampler: router replay reproduces the
rollout's log-probs, and GRPO teaches a tiny MoE policy a toy text task.

The sampler here is a small KV-cache sampler written for the tests (prefill the prompt,
then decode one token at a time), recording each token's sampling log-prob and the experts
every MoE layer chose for it, as a rollout engine does.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spade_jax import rl
from spade_jax.models import ModelConfig, ModelOptions, Qwen3
from spade_jax.rl.batch import PackConfig, TrainSequence, pack_sequences
from spade_jax.rl.optim import OptimizerConfig
from spade_jax.rl.train_step import (
    RoleConfig,
    TrainConfig,
    init_train_state,
    make_train_step,
    policy_logprobs,
)

# ~30 s each on a loaded machine: a compiled sampler and dozens of train steps.
pytestmark = pytest.mark.slow

VOCAB, BOS = 16, 1
ROLE_TOKENS = (2, 3)  # prompt token that tells the policy which role it plays
TARGETS = (5, 7)  # agent is rewarded for emitting 5, designer for 7
PROMPT_LEN, GEN_LEN = 2, 4
GROUP_SIZE, PER_ROLE = 8, 16  # two groups of 8 samples per role and rollout


def tiny_moe(seed: int = 0) -> Qwen3:
    config = ModelConfig(
        architecture="Qwen3MoeForCausalLM", vocab_size=VOCAB, hidden_size=32, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
        mlp_only_layers=(0,),  # one dense and one MoE layer: replay has a None entry
    )
    return Qwen3(config, ModelOptions(moe_impl="ragged"), rngs=nnx.Rngs(seed))


def make_sampler(graphdef: nnx.GraphDef, gen_len: int):
    """jit(params, prompts [B, P], key) -> (tokens [B, P + G], logp [B, G], experts per
    layer [B, P + G, X] or None)."""

    @jax.jit
    def sample(params, prompts_bp, key):
        model = nnx.merge(graphdef, params)
        b, p = prompts_bp.shape
        prefill = model(prompts_bp, cache=model.init_cache(b, p + gen_len + 1))

        def decode(carry, step_key):
            cache, logits_bv = carry
            token_b = jax.random.categorical(step_key, logits_bv)
            logp_b = jnp.take_along_axis(jax.nn.log_softmax(logits_bv), token_b[:, None], 1)[:, 0]
            out = model(token_b[:, None], cache=cache)  # feeds the token: records its routing
            return (out.cache, out.logits[:, -1]), (token_b, logp_b, out.selected_experts)

        keys = jax.random.split(key, gen_len)
        _, (tokens_gb, logp_gb, experts) = jax.lax.scan(
            decode, (prefill.cache, prefill.logits[:, -1]), keys
        )
        routing = [
            None if pre is None else jnp.concatenate([pre, dec[:, :, 0].swapaxes(0, 1)], axis=1)
            for pre, dec in zip(prefill.selected_experts, experts, strict=True)
        ]
        tokens = jnp.concatenate([prompts_bp, tokens_gb.T], axis=1)
        return tokens, logp_gb.T, routing

    return sample


def rollout_sequences(sample, params, key, per_role: int):
    """Samples ``per_role`` episodes of each role; returns (TrainSequences without
    advantages, rewards [2 * per_role], tokens)."""
    role_b = np.repeat(np.arange(2), per_role)
    prompts = np.stack([np.full(2 * per_role, BOS), np.asarray(ROLE_TOKENS)[role_b]], 1)
    tokens, logp, routing = jax.device_get(sample(params, jnp.asarray(prompts, jnp.int32), key))
    generated = tokens[:, PROMPT_LEN:]
    rewards = np.mean(generated == np.asarray(TARGETS)[role_b][:, None], axis=1)
    mask = np.r_[np.zeros(PROMPT_LEN), np.ones(GEN_LEN)]
    seqs = [
        dict(
            token_ids=tokens[i].tolist(),
            loss_mask=mask,
            logprobs=np.r_[np.zeros(PROMPT_LEN), logp[i]],
            role=int(role_b[i]),
            routing=[None if r is None else r[i] for r in routing],
        )
        for i in range(len(role_b))
    ]
    return seqs, rewards.astype(np.float32)


@pytest.fixture(scope="module")
def sampler():
    """One compiled sampler for both tests (same graph, same shapes; params differ)."""
    graphdef, _ = nnx.split(tiny_moe())
    return make_sampler(graphdef, GEN_LEN)


def test_router_replay_reproduces_rollout_logprobs(sampler):
    graphdef, params = nnx.split(tiny_moe(seed=3))
    seqs, _ = rollout_sequences(sampler, params, jax.random.key(0), PER_ROLE)
    batch = pack_sequences(
        [TrainSequence(advantage=0.0, **s) for s in seqs], PackConfig(buckets=(8,))
    )
    assert batch.routing_replay[0] is None
    assert batch.routing_replay[1].shape == (2 * PER_ROLE, 8, 2)

    @jax.jit
    def trainer_logp(params, batch, replay_shift):
        batch = batch.replace(routing_replay=tuple(
            None if r is None else (r + replay_shift) % 4 for r in batch.routing_replay
        ))
        model = nnx.merge(graphdef, params)
        logp, _, _ = policy_logprobs(model, batch, router_replay=True)
        hot_logp, _, _ = policy_logprobs(model, batch, router_replay=True, temperature=2.0)
        logits = model(batch.input_ids, routing_replay=list(batch.routing_replay)).logits
        return logp, hot_logp, logits

    mask = batch.loss_mask > 0
    replayed, hot, logits = map(np.asarray, trainer_logp(params, batch, 0))
    # The KV-cache decode and the one-shot training forward compute the same function with
    # different matmul shapes, so agreement is to fp32 rounding, not bit-for-bit (that needs
    # ModelOptions(batch_invariant=True): tests/test_exact_replay.py).
    np.testing.assert_allclose(replayed[mask], batch.old_logp[mask], atol=2e-6, rtol=0)
    # temperature: log-probs of softmax(logits / 2), as a sampler at temperature 2 reports.
    scaled = logits[:, :-1].astype(np.float64) / 2.0
    scaled -= scaled.max(-1, keepdims=True)
    hot_ref = scaled - np.log(np.exp(scaled).sum(-1, keepdims=True))
    hot_ref = np.take_along_axis(hot_ref, batch.input_ids[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(hot[:, 1:][mask[:, 1:]], hot_ref[mask[:, 1:]], atol=2e-6)
    # Replay is really used: other experts give other log-probs.
    shifted = np.asarray(trainer_logp(params, batch, 1)[0])
    assert np.max(np.abs(shifted[mask] - batch.old_logp[mask])) > 1e-3


def test_grpo_learns_toy_pattern_for_both_roles(sampler):
    """Chance is 1/16 per token; both roles must reach mean reward >= 0.9. Sampling and
    training are on-policy with router replay, so the logged sampler/trainer gap is ~0."""
    model = tiny_moe(seed=0)
    config = TrainConfig(
        optimizer=OptimizerConfig(learning_rate=2e-2, warmup_steps=2, clip_norm=1.0),
        agent=RoleConfig(policy_loss="grpo"),
        designer=RoleConfig(policy_loss="gspo", loss=dict(clip_eps_low=0.2,
                                                                 clip_eps_high=0.2)),
        router_replay=True,
        microbatches=2,
    )
    graphdef, state = init_train_state(model, config, seed=0)
    step = make_train_step(graphdef, config)
    advantage_rule = rl.advantage_estimators.get("grpo")
    advantage_cfg = advantage_rule.make_config()

    start, history = time.perf_counter(), []
    key = jax.random.key(1)
    for _ in range(60):
        key, sample_key = jax.random.split(key)
        seqs, rewards = rollout_sequences(sampler, state.params, sample_key, PER_ROLE)
        history.append(rewards.reshape(2, -1).mean(axis=1))
        if min(history[-1]) >= 0.95:
            break
        # Groups are contiguous: role 0's groups, then role 1's.
        advantages, _ = advantage_rule.fn(jnp.asarray(rewards), GROUP_SIZE, advantage_cfg)
        batch = pack_sequences(
            [TrainSequence(advantage=float(a), **s) for s, a in zip(seqs, advantages, strict=True)],
            PackConfig(buckets=(8,)),
        )
        state, metrics = step(state, batch)
        assert int(metrics["skipped"]) == 0
        for role in ("agent", "designer"):
            assert float(metrics[f"{role}/logp_gap_max"]) < 2e-6
            assert float(metrics[f"{role}/tokens"]) == PER_ROLE * GEN_LEN
    elapsed = time.perf_counter() - start
    print(f"GRPO toy: {len(history)} rollouts, {elapsed:.1f}s, rewards {history[0]} -> {history[-1]}")
    assert max(history[0]) < 0.35, f"starting rewards {history[0]} should be near chance 1/16"
    final = np.mean([  # 4 fresh rollouts of the same shape (no recompilation)
        rollout_sequences(sampler, state.params, k, PER_ROLE)[1].reshape(2, -1).mean(axis=1)
        for k in jax.random.split(key, 4)
    ], axis=0)
    assert min(final) >= 0.9, f"final rewards per role {final} after {len(history)} steps"
