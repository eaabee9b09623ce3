"""The Cliff step credit (``rl/rules/cliff.py``): the first mistake located by a judge (a
user callable, or the policy through a RolloutService) against a NumPy re-derivation."""

from __future__ import annotations

import numpy as np
import pytest
from rule_references import always, make_count_env, played

from spade_jax import rl
from spade_jax.rl.episodes import ScriptedRollouts, StepContext, episode_batch


def first_b_judge(episodes, context):
    """A user-supplied judge: the first "b" is the mistake."""
    return [ep.actions.index("b") if "b" in ep.actions else None for ep in episodes]


def np_cliff(outcome, mistakes, episodes, length, prefix_scale):
    out = np.zeros((len(episodes), length))
    for i, ep in enumerate(episodes):
        for k, (start, end) in enumerate(ep.turn_spans):
            m = mistakes[i]
            if m is not None and k < m:
                out[i, start:end] = prefix_scale * abs(outcome[i])
            else:
                out[i, start:end] = outcome[i]
    return out


@pytest.mark.parametrize("judge", ["callable", "policy"])
def test_cliff_matches_numpy_with_a_judge(judge):
    episodes = [played(a) for a in (["a", "a", "b", "a"], ["b", "a"], ["a", "a"],
                                    ["a", "b", "b"])]
    outcome = np.array([-0.5, -1.0, -0.2, 0.8])  # the last is a success: never judged
    batch = episode_batch(episodes, outcome, range(4))
    rule = rl.step_credits.get("cliff")
    asked = []

    def reply(prompt):  # the policy as judge: answers the first "b" step, 1-based
        asked.append(prompt)
        actions = [line.split("Action: ")[1] for line in prompt.splitlines() if "Action: " in line]
        return f"Step {actions.index('b') + 1}" if "b" in actions else "0"

    if judge == "callable":
        cfg = rule.make_config(judge=f"{__name__}:first_b_judge", prefix_scale=0.5)
        context = StepContext()
    else:
        cfg = rule.make_config(judge="policy", prefix_scale=0.5)
        context = StepContext(rollouts=ScriptedRollouts(make_count_env, always("a"), reply))
    adv_bt, metrics = rule.fn(batch, outcome, cfg, context)
    mistakes = [2, 0, None, None]
    np.testing.assert_allclose(adv_bt, np_cliff(outcome, mistakes, episodes,
                                                adv_bt.shape[1], 0.5))
    assert metrics["judged"] == 3 and metrics["located_frac"] == pytest.approx(2 / 3)
    if judge == "policy":
        assert len(asked) == 3 and "Step 3. Action: b" in asked[0]
    with pytest.raises(ValueError, match="needs a RolloutService"):
        rule.fn(batch, outcome, rule.make_config(judge="policy"), StepContext())
    with pytest.raises(ValueError, match="could not be loaded"):
        rule.fn(batch, outcome, rule.make_config(judge="no_such_mod:judge"), StepContext())
