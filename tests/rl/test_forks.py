"""The policy-side RolloutService (``rl/forks.py``): ``PolicyRollouts`` replays a fork's
transcript and continues it with the policy (a scripted agent loop here), giving CRR's
closed-form credit."""

from __future__ import annotations

import numpy as np
import pytest
from rule_references import always, make_count_env, played

from spade_jax import rl
from spade_jax.rl.episodes import StepContext, episode_batch

# ---- the policy-side RolloutService --------------------------------------------------------


def scripted_run_episodes(policy):
    """Stands in for the agent loop: plays each spec's env with ``policy`` to the end."""
    from spade_jax.rollout.records import EpisodeRecord as Record

    seen = []

    def run(specs, seed):
        records = []
        for j, spec in enumerate(specs):
            rng = np.random.default_rng([seed, j])
            observation, _ = spec.env.reset(seed=spec.seed)
            seen.append(observation)
            rec, actions = Record(env_id=spec.env_id, seed=spec.seed), []
            for _ in range(50):
                action = policy([observation], actions, rng)
                observation, reward, terminated, truncated, _ = spec.env.step(action)
                rec.step_rewards.append(reward)
                actions.append(action)
                rec.cost.turns += 1
                rec.cost.tokens_generated += 3
                if terminated or truncated:
                    break
            rec.return_ = float(sum(rec.step_rewards))
            records.append(rec)
        return records

    return run, seen


def test_policy_rollouts_replay_the_fork_and_match_the_closed_form():
    from spade_jax.rl.forks import PolicyRollouts

    run, seen = scripted_run_episodes(always("a"))
    service = PolicyRollouts(run_episodes=run, make_env=make_count_env)
    actions = ["a", "b", "a", "b"]
    episode = played(actions, seed=5)
    batch = episode_batch([episode], [episode.return_], [0])
    rule = rl.step_credits.get("crr")
    cfg = rule.make_config(forks=2, turns_per_episode=4, alternative="b", clip=10.0)
    adv_bt, metrics = rule.fn(batch, np.zeros(1), cfg, StepContext(service, seed_parts=(3,)))
    for k, (start, _) in enumerate(episode.turn_spans):
        credit = sum(episode.step_rewards[k:]) - (4 - k - 1) / 4
        assert adv_bt[0, start] == pytest.approx(credit)
    # Turn 3's alternative ends the episode: no policy continuation is run for it.
    assert len(seen) == 2 * 3 and metrics["fork_turns"] == 2 * (4 + 3 + 2 + 1)
    assert "Action: a\nObservation: turn 1\nAction: b" in seen[-1]  # the transcript so far
    assert metrics["fork_tokens"] == 3 * 2 * (3 + 2 + 1)
    with pytest.raises(ValueError, match="without a completion function"):
        service.complete(["q"], seed=0)
