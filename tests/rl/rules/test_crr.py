"""The CRR counterfactual step credit (``rl/rules/crr.py``) from forks of the scripted
``CountEnv``: the closed form with a fixed alternative, the resampled estimate of the
advantage, the fork budget, turn choice and seeding."""

from __future__ import annotations

import numpy as np
import pytest
from rule_references import always, coin, make_count_env, played

from spade_jax import rl
from spade_jax.rl.episodes import ScriptedRollouts, StepContext, episode_batch


def test_crr_credit_equals_the_closed_form_with_a_fixed_alternative():
    """Continuation policy always plays "a"; the alternative is "b". From turn k of T:
    G^alt = 0 + (T-k-1)/T exactly, G^act = the episode's return-to-go, so
    c_k = sum_{s>=k} r_s - (T-k-1)/T; paired: c_k = r(a_k) - 0 = 1/T if a_k == "a"."""
    actions = ["a", "b", "a", "b"]
    t = len(actions)
    episode = played(actions, seed=5)
    batch = episode_batch([episode], [episode.return_], [0])
    rule = rl.step_credits.get("crr")
    for paired in (False, True):
        rollouts = ScriptedRollouts(make_count_env, always("a"))
        cfg = rule.make_config(forks=3, turns_per_episode=t, alternative="b", paired=paired,
                               clip=10.0, scale=2.0)
        adv_bt, metrics = rule.fn(batch, np.array([0.25]), cfg,
                                  StepContext(rollouts, seed_parts=(1, 2, 3)))
        for k, (start, end) in enumerate(episode.turn_spans):
            return_to_go = sum(episode.step_rewards[k:])
            credit = ((1 / t if actions[k] == "a" else 0.0) if paired
                      else return_to_go - (t - k - 1) / t)
            np.testing.assert_allclose(adv_bt[0, start:end], 0.25 + 2.0 * credit, atol=1e-12)
        assert adv_bt[0, 0] == 0.0  # observation tokens carry nothing
        forks = t * 3 * (2 if paired else 1)
        assert metrics["forks"] == forks == rollouts.forks_run
        assert metrics["fork_turns"] == rollouts.turns_run == sum(
            (t - k) * 3 * (2 if paired else 1) for k in range(t))


def test_crr_resampled_credit_estimates_the_advantage():
    """Policy "a" with probability q: V(s_k) = (T-k) q / T, so with many forks
    c_k -> return_to_go_k - (T-k) q / T (4 sigma of the fork mean)."""
    q, t, forks = 0.3, 5, 400
    episode = played(["a", "a", "b", "a", "b"], seed=2)
    batch = episode_batch([episode], [episode.return_], [0])
    rule = rl.step_credits.get("crr")
    cfg = rule.make_config(forks=forks, turns_per_episode=t, max_forks=t * forks, clip=10.0)
    adv_bt, metrics = rule.fn(batch, np.zeros(1), cfg,
                              StepContext(ScriptedRollouts(make_count_env, coin(q)),
                                          seed_parts=(0, 1)))
    for k, (start, _) in enumerate(episode.turn_spans):
        closed_form = sum(episode.step_rewards[k:]) - (t - k) * q / t
        sigma = np.sqrt((t - k) * q * (1 - q)) / t / np.sqrt(forks)
        assert abs(adv_bt[0, start] - closed_form) < 4 * sigma
    assert metrics["credited_turns"] == t


def test_crr_budget_turn_choice_and_seeding():
    episodes = [played(["a", "b", "a", "a"], seed=i) for i in range(3)]
    batch = episode_batch(episodes, [ep.return_ for ep in episodes], [0, 0, 0])
    rule = rl.step_credits.get("crr")
    cfg = rule.make_config(forks=2, turns_per_episode=2, turn_choice="random", max_forks=9)
    runs = []
    for _ in range(2):
        rollouts = ScriptedRollouts(make_count_env, coin(0.5))
        adv_bt, metrics = rule.fn(batch, np.zeros(3), cfg,
                                  StepContext(rollouts, seed_parts=(7, 1)))
        runs.append(adv_bt)
        assert metrics["forks"] == 8 == rollouts.forks_run  # 4 turns x 2 forks fit in 9
        assert metrics["credited_turns"] == 4
    np.testing.assert_array_equal(runs[0], runs[1])  # same seed parts, same credit
    with pytest.raises(ValueError, match="step credit 'crr' needs a RolloutService"):
        rule.fn(batch, np.zeros(3), cfg, StepContext())
    with pytest.raises(ValueError, match="turn_choice"):
        rule.make_config(turn_choice="last")
