"""The learning signal end to end (issue 37): one SPADE round with the real agent loop
(``run_episodes`` on a tiny policy, sandboxed programs) and the real jitted train step,
both roles in one update. Every trained sequence with a positive advantage must become
more likely under the policy, and every one with a negative advantage less likely: the
log-prob of exactly its trained tokens (loss mask), before vs after the update.

The designer's replies are scripted (a random 1M-parameter policy writes no program that
validates): two fixed programs, their tokens scored by the policy itself, so the recorded
log-probs are the policy's own, as a sampler would record them. The agent's episodes are
the policy's own samples. The game "even" pays 1 when the agent's reply has an even
number of characters, so its plays differ and carry GRPO advantages; the game "always"
pays 1 every time: its zero-variance group trains with advantage exactly 0 (item 3), and
the solve-rate designer reward ranks the two programs apart (win rate ~0.5 vs 1).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_loop import pool  # noqa: F401  (fixture: one sandbox pool)

from spade_jax.models import ModelConfig, abstract_model
from spade_jax.rl.batch import ROLES, PackConfig, TrainSequence, pack_sequences
from spade_jax.rl.optim import OptimizerConfig
from spade_jax.rl.train_step import (
    RoleConfig,
    TrainConfig,
    init_train_state,
    make_train_step,
    policy_logprobs,
)
from spade_jax.rollout import SamplerConfig
from spade_jax.rollout.agent_loop import AgentLoopConfig, run_episodes
from spade_jax.spade.config import SpadeConfig
from spade_jax.spade.loop import SpadeLoop
from spade_jax.spade.memory import EnvironmentMemory, MemoryConfig
from spade_jax.spade.reward import make_designer_reward

pytestmark = pytest.mark.slow  # a sampler, a scorer and the train step compile (~40 s)

EVEN = '''class Environment:
    def reset(self, seed=None):
        return "Reply.", {}

    def step(self, action):
        return "Done.", float(len(action) % 2 == 0), True, False, {}
'''
ALWAYS = '''class Environment:
    """Anyone wins."""

    def reset(self, seed=None):
        self.turns = 0
        return "Type anything at all to win this round.", {}

    def step(self, action):
        self.turns += 1
        return "You win!", 1.0, True, False, {"turns": self.turns}
'''
BUCKETS = (64, 1024)
# The recipe's update (grpo at eps 1e-8 over a game's plays, designer centred per skill
# and scaled, TIS clamp 2, one pooled mean), at a learning rate a tiny model moves under.
TRAIN = TrainConfig(
    optimizer=OptimizerConfig(learning_rate=3e-4, weight_decay=0.0), loss_aggregation="pooled",
    agent=RoleConfig(advantage=dict(eps=1e-8), importance_correction="tis",
                     loss=dict(clip_eps=0.2, clip_eps_high=0.28)),
    designer=RoleConfig(advantage_estimator="dr_grpo", importance_correction="tis",
                        loss=dict(clip_eps=0.2, clip_eps_high=0.28)))


def _policy(vocab: int):
    """A random 2-layer dense Qwen3, filled from NumPy (eager nnx init is slow)."""
    config = ModelConfig(vocab_size=vocab, hidden_size=32, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, intermediate_size=48)
    graphdef, shapes = nnx.split(abstract_model(config))
    rs = np.random.RandomState(0)

    def fill(x):
        noise = rs.normal(0, 0.1, x.shape)
        return jnp.asarray((1 + noise if len(x.shape) == 1 else noise).astype(x.dtype))

    return nnx.merge(graphdef, jax.tree.map(fill, shapes))


class Trainer:
    """The run's update (pack, the jitted step) plus the measurement: each trained
    sequence's log-prob summed over its loss mask, under the policy before and after."""

    def __init__(self, tokenizer, sign: float = 1.0):
        model = _policy(tokenizer.vocab_size)
        self.graphdef, self.state = init_train_state(model, TRAIN)
        self.step = make_train_step(self.graphdef, TRAIN)
        self.pack = PackConfig(buckets=BUCKETS, pad_id=tokenizer.pad_id)
        self.score_fn = jax.jit(lambda params, batch: policy_logprobs(
            nnx.merge(self.graphdef, params), batch, False)[0])
        self.tokenizer, self.sign, self.rows, self.skipped = tokenizer, sign, [], []

    def policy(self):
        return nnx.merge(self.graphdef, self.state.params)

    def sequence_logp(self, batch) -> np.ndarray:
        logp = np.asarray(self.score_fn(self.state.params, batch), np.float64)
        return (logp * np.asarray(batch.loss_mask)).sum(axis=1)

    def generate(self, prompts, *, seed, purpose):
        """The scripted designer: slot i writes program i, scored by the policy itself."""
        assert purpose == "design"
        outputs = [self.tokenizer.encode(f"```python\n{program}```") + [min(self.tokenizer.eos_ids)]
                   for program in (EVEN, ALWAYS)[: len(prompts)]]
        seqs = [TrainSequence(list(p) + o, [0] * len(p) + [1] * len(o), [0.0] * (len(p) + len(o)),
                              0.0) for p, o in zip(prompts, outputs, strict=True)]
        logp = np.asarray(self.score_fn(self.state.params, pack_sequences(seqs, self.pack)))
        return outputs, [logp[i, len(p):len(p) + len(o)].tolist()
                         for i, (p, o) in enumerate(zip(prompts, outputs, strict=True))]

    def update(self, seqs: list[TrainSequence]) -> dict[str, float]:
        seqs = [dataclasses.replace(s, advantage=self.sign * s.advantage) for s in seqs]
        batch = pack_sequences(seqs, self.pack)
        before = self.sequence_logp(batch)
        self.state, metrics = self.step(self.state, batch)
        self.skipped.append(int(metrics["skipped"]))
        after = self.sequence_logp(batch)
        for seq, b, a in zip(seqs, before, after, strict=True):
            self.rows.append((seq.role, self.sign * seq.advantage, b, a))
        return {k: float(v) for k, v in jax.device_get(metrics).items() if np.ndim(v) == 0}


def _round(tokenizer, pool, sign: float = 1.0) -> Trainer:  # noqa: F811
    trainer = Trainer(tokenizer, sign)
    agent = AgentLoopConfig(max_turns=1, max_turn_tokens=6,
                            sampler=SamplerConfig(max_new_tokens=6, temperature=1.0))

    def episodes(specs, *, seed):
        return run_episodes(trainer.policy(), tokenizer, specs, agent, seed=seed)

    config = SpadeConfig(
        rounds=1, envs_per_round=2, regeneration_interval=1, plays_per_game=6, hint_mode="none",
        designer_delay=0, max_design_attempts=1, skills_per_window=1, use_corpus=False,
        use_memory=False, designer_reward="solve_rate", contract="paper", prompt_style="compact",
        probe_episodes=0, eval_every=0)
    loop = SpadeLoop(config, tokenizer=tokenizer, pool=pool, generate=trainer.generate,
                     run_episodes=episodes, update=trainer.update, corpus_sampler=None,
                     memory=EnvironmentMemory(MemoryConfig()),
                     reward_rule=make_designer_reward("solve_rate", None), seed=0,
                     max_turns=1, rules=TRAIN.roles)
    loop.run_step(0)
    return trainer


def test_positive_advantage_episodes_become_more_likely_for_both_roles(chat_tokenizer, pool):  # noqa: F811
    trainer = _round(chat_tokenizer, pool)
    assert trainer.skipped == [0]  # one update, applied
    rows = trainer.rows
    for role in ROLES:
        signed = [(adv, after - before) for r, adv, before, after in rows if r == role and adv]
        assert {np.sign(adv) for adv, _ in signed} == {-1.0, 1.0}, role  # both signs trained
        for adv, change in signed:
            assert np.sign(change) == np.sign(adv), (role, adv, change)
    # The "always" game's plays (all paid 1) trained with advantage exactly 0.
    assert sum(1 for r, adv, _, _ in rows if r == "agent" and adv == 0.0) == 6
