"""The rollout's safe points (``spade_jax.preemption``): a stop requested while the agent
loop or the sampler runs ends the call at its next tick / decode chunk with
``Preempted``; outside an interruptible block, or after ``commit()``, nothing changes."""

from __future__ import annotations

import gymnasium
import pytest

from spade_jax import preemption
from spade_jax.preemption import Preempted, PreemptionGuard
from spade_jax.rollout import SamplerConfig
from spade_jax.rollout.agent_loop import AgentLoopConfig, EpisodeSpec, run_episodes
from spade_jax.rollout.sampler import sample

TURN_TOKENS = 4


class _SignalAtStep(gymnasium.Env):
    """Four turns; its ``at``-th step requests the stop (the SIGTERM of a preemption)."""

    def __init__(self, guard: PreemptionGuard | None, at: int):
        self.guard, self.at, self.steps = guard, at, 0

    def reset(self, *, seed=None, options=None):
        return "alpha start seed", {}

    def step(self, action):
        self.steps += 1
        if self.guard is not None and self.steps == self.at:
            self.guard.request()
        return f"obs {self.steps}", 0.0, self.steps == 4, False, {}


@pytest.fixture
def guard(monkeypatch):
    """A fresh process guard (no signal handler: ``request()`` stands in for SIGTERM)."""
    guard = PreemptionGuard()
    monkeypatch.setattr(preemption, "_active", guard)
    return guard


def _config() -> AgentLoopConfig:
    return AgentLoopConfig(max_turns=4, max_turn_tokens=TURN_TOKENS,
                           sampler=SamplerConfig(max_new_tokens=TURN_TOKENS, seed=1,
                                                 prompt_bucket_min=128, chunk_steps=2))


@pytest.mark.slow  # two compiled agent-loop runs (~10 s)
def test_a_stop_requested_mid_play_ends_the_batch_at_the_next_tick(chat_model, chat_tokenizer,
                                                                    guard):
    env = _SignalAtStep(guard, at=2)
    with guard.interruptible(), pytest.raises(Preempted):
        run_episodes(chat_model, chat_tokenizer, [EpisodeSpec(env, "alpha", seed=0)], _config())
    assert env.steps == 2  # no turn was generated, and no step taken, after the request
    # Committed (the update has started): the request waits for the end of the step.
    env = _SignalAtStep(guard, at=2)
    with guard.interruptible():
        guard.commit()
        records = run_episodes(chat_model, chat_tokenizer, [EpisodeSpec(env, "alpha", seed=0)],
                               _config())
    assert env.steps == 4 and records[0].end_reason == "terminated"


def test_a_stop_requested_before_a_sample_call_ends_it_at_its_first_chunk(chat_model, guard):
    config = SamplerConfig(max_new_tokens=8, chunk_steps=2, seed=3, prompt_bucket_min=16,
                           compact_batch=False)
    prompts = [[5, 6, 7], [8, 9]]
    full = sample(chat_model, prompts, config)  # nothing requested: all 8 tokens
    assert [len(t) for t in full.tokens] == [8, 8]
    guard.request()
    with guard.interruptible(), pytest.raises(Preempted):
        sample(chat_model, prompts, config)
    again = sample(chat_model, prompts, config)  # outside the block: unaffected
    assert again.tokens == full.tokens
