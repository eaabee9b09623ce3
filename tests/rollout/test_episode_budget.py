"""An episode's token budget equal to the largest pack bucket (issue 37 item 1).

The 30B / 8B recipes set ``max_episode_tokens=32768``, the largest of the default pack
buckets. An episode that reaches its budget at an observation must end before the
observation is appended: appended, the record overshoots the budget (packing then raises:
longer than the largest bucket) and, with router replay, has more tokens than routing
rows (packing raises again). Here the same at CPU size: budget == largest bucket == 96.
"""

from __future__ import annotations

import gymnasium
import jax
import numpy as np
import pytest
from flax import nnx

from spade_jax.models import ModelConfig, abstract_model
from spade_jax.rl.batch import PackConfig, TrainSequence, pack_sequences
from spade_jax.rl.optim import OptimizerConfig
from spade_jax.rl.train_step import TrainConfig, init_train_state, make_train_step
from spade_jax.rollout import SamplerConfig
from spade_jax.rollout.agent_loop import AgentLoopConfig, ChatTurns, EpisodeSpec, run_episodes

pytestmark = pytest.mark.slow  # a sampler and two train steps compile (~30 s loaded)

BUDGET = 96  # == the largest bucket, as 32768 is in the recipes
BUCKETS = (32, 64, BUDGET)
TURN_TOKENS = 8


class EndlessEnv(gymnasium.Env):
    """Never ends by itself, so every episode runs into the budget; observations (30 to 60
    tokens with their template pieces) differ in length per seed, so some episodes reach
    it mid-turn and some at an observation."""

    def reset(self, *, seed=None, options=None):
        self.words = seed % 4
        return f"start seed {seed}", {}

    def step(self, action):
        return "obs " + "alpha beta " * self.words, 0.25, False, False, {}


def _moe(vocab: int):
    """A random 2-layer MoE (one dense, one MoE layer), filled from NumPy (eager nnx init
    compiles op by op: slow)."""
    config = ModelConfig(
        architecture="Qwen3MoeForCausalLM", vocab_size=vocab, hidden_size=32, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
        mlp_only_layers=(0,))
    graphdef, shapes = nnx.split(abstract_model(config))
    rs = np.random.RandomState(0)

    def fill(x):
        noise = rs.normal(0, 0.1, x.shape)
        return jax.numpy.asarray((1 + noise if len(x.shape) == 1 else noise).astype(x.dtype))

    return nnx.merge(graphdef, jax.tree.map(fill, shapes))


@pytest.fixture(scope="module")
def episodes(chat_tokenizer):
    model = _moe(chat_tokenizer.vocab_size)
    config = AgentLoopConfig(
        max_turns=20, max_turn_tokens=TURN_TOKENS, max_episode_tokens=BUDGET,
        sampler=SamplerConfig(max_new_tokens=TURN_TOKENS, temperature=1.0, seed=1,
                              return_router="experts"))
    specs = [EpisodeSpec(EndlessEnv(), "long", seed=i) for i in range(8)]
    return model, run_episodes(model, chat_tokenizer, specs, config, seed=3)


def test_an_episode_never_exceeds_its_budget(episodes, chat_tokenizer):
    _, records = episodes
    turns = ChatTurns(chat_tokenizer, None, False)
    at_observation = 0
    for rec in records:
        assert rec.end_reason == "max_tokens" and rec.truncated
        assert len(rec.token_ids) <= BUDGET
        assert len(rec.routing) == len(rec.token_ids) - 1  # one row per fed token
        # The stream ends with the last turn: no observation after it.
        assert rec.turn_spans[-1][1] == len(rec.token_ids)
        closed = rec.token_ids[-1] in turns.eos_ids
        piece = turns.after_policy(rec.observations[-1], closed)
        if len(rec.observations) == len(rec.turn_spans) + 1:  # stepped after the last turn
            assert len(rec.token_ids) + len(piece) >= BUDGET  # ended for want of room
            at_observation += len(rec.token_ids) < BUDGET
    assert at_observation > 0  # the case that overshot: an observation crossing the budget


@pytest.mark.parametrize("replay", [False, True])
def test_budget_equal_to_the_largest_bucket_packs_and_trains(episodes, replay):
    model, records = episodes
    cfg = model.config
    moe = tuple(i for i in range(cfg.num_layers) if cfg.is_moe_layer(i))
    seqs = [TrainSequence(r.token_ids, r.loss_mask, r.logprobs, float(i % 2) - 0.5, "agent",
                          routing=r.routing if replay else None)
            for i, r in enumerate(records)]
    batch = pack_sequences(seqs, PackConfig(buckets=BUCKETS, moe_layers=moe,
                                            num_layers=cfg.num_layers))
    assert batch.shape == (len(records), BUDGET)
    train = TrainConfig(optimizer=OptimizerConfig(learning_rate=1e-3), router_replay=replay)
    graphdef, state = init_train_state(model, train)
    state, metrics = make_train_step(graphdef, train)(state, batch)
    assert int(metrics["skipped"]) == 0 and np.isfinite(float(metrics["loss"]))
    assert float(metrics["agent/tokens"]) == sum(sum(r.loss_mask) for r in records)
    if replay:  # replayed routing reproduces the sampler's log-probs (default numerics)
        assert float(metrics["agent/logp_gap_max"]) < 1e-3
