"""The FAULT step credit (``rl/rules/fault.py``) against a NumPy re-derivation on played
episodes of the scripted ``CountEnv``: each episode's outcome is conserved across its
steps."""

from __future__ import annotations

import numpy as np
import pytest
from rule_references import played

from spade_jax import rl
from spade_jax.rl.episodes import StepContext, episode_batch


def np_fault(outcome, step_rewards, step_mask, temperature, mix):
    out = np.zeros_like(step_rewards)
    for i in range(len(outcome)):
        steps = np.flatnonzero(step_mask[i])
        logits = np.sign(outcome[i]) * step_rewards[i, steps] / temperature
        w = np.exp(logits - logits.max())
        w /= w.sum()
        for j, s in enumerate(steps):
            out[i, s] = (1 - mix) * outcome[i] + mix * len(steps) * w[j] * outcome[i]
    return out


@pytest.mark.parametrize("temperature,mix", [(1.0, 1.0), (0.3, 0.5)])
def test_fault_matches_numpy_and_conserves_the_outcome(temperature, mix):
    rng = np.random.default_rng(3)
    episodes = [played(list(rng.choice(["a", "b"], size=n)), seed=i)
                for i, n in enumerate([1, 3, 4, 4, 2])]
    # Partial rewards that differ per step, so the softmax has something to move.
    for ep in episodes:
        ep.step_rewards = list(rng.normal(0, 1, len(ep.actions)))
    outcome = np.array([0.7, -1.2, 0.0, 2.0, -0.3])
    batch = episode_batch(episodes, outcome, range(5))
    rule = rl.step_credits.get("fault")
    cfg = rule.make_config(temperature=temperature, mix=mix)
    adv_bt, _ = rule.fn(batch, outcome, cfg, StepContext())
    want_bs = np_fault(outcome, batch.step_rewards_bs, batch.step_mask_bs, temperature, mix)
    for i, ep in enumerate(episodes):
        for k, (start, end) in enumerate(ep.turn_spans):
            np.testing.assert_allclose(adv_bt[i, start:end], want_bs[i, k], rtol=1e-12)
        policy = np.zeros(adv_bt.shape[1], bool)
        policy[: len(ep.loss_mask)] = np.asarray(ep.loss_mask, bool)
        assert np.all(adv_bt[i][~policy] == 0)
        # Conservation: the steps' credits sum to S_i * A_i.
        step_credit = [adv_bt[i, start] for start, _ in ep.turn_spans]
        assert sum(step_credit) == pytest.approx(len(ep.actions) * outcome[i])
    # A success credits its best step most, a failure blames its worst step most.
    best = int(np.argmax(episodes[3].step_rewards))
    assert adv_bt[3, episodes[3].turn_spans[best][0]] == max(
        adv_bt[3, s] for s, _ in episodes[3].turn_spans)
    worst = int(np.argmin(episodes[1].step_rewards))
    assert adv_bt[1, episodes[1].turn_spans[worst][0]] == min(
        adv_bt[1, s] for s, _ in episodes[1].turn_spans)
