"""The one definition of regret and of a window's win rate (spade/regret.py), and that every
user (the reward rules, the loop's game_stats) agrees with it; the designer rewards as a
category of the one rule registry (rl/registry.py)."""

import dataclasses

import numpy as np
import pytest

from spade_jax.rl import registry
from spade_jax.spade.regret import flatten_steps, mean_return, regret, window_win_rate
from spade_jax.spade.reward import (
    DESIGNER_REWARDS,
    BlendConfig,
    DesignerRewardConfig,
    HintRegretConfig,
    blend_reward,
    designer_reward,
    make_designer_reward,
)
from spade_jax.spade.window import Game, game_stats


def test_definitions_hand_computed():
    assert mean_return([]) == 0.0  # the recipe: an empty set has mean 0
    assert mean_return([1.0, 0.0, -1.0, 0.5]) == pytest.approx(0.125)
    assert regret([1.0, 1.0], [0.0, 1.0, 0.0, 0.0]) == pytest.approx(0.75)
    assert regret([0.0], [1.0]) == -1.0  # signed: the hint can hurt
    assert regret([], []) == 0.0 and regret([0.5], []) == 0.5
    # Every play of the window weighs the same: a step with more plays weighs more.
    assert window_win_rate([[1.0], [], [0.0, 0.0, 0.0]]) == pytest.approx(0.25)
    assert window_win_rate([]) == 0.0 and window_win_rate([[], []]) == 0.0
    np.testing.assert_array_equal(flatten_steps([[1.0], [], [0.5, -1.0]]), [1.0, 0.5, -1.0])
    with pytest.raises(ValueError, match="1-D"):
        mean_return([[1.0], [0.0]])


def test_every_user_calls_the_one_definition():
    rng = np.random.default_rng(3)
    for _ in range(50):
        hint = rng.choice([-1.0, 0.0, 1.0, 0.5], size=rng.integers(0, 9)).tolist()
        steps = [rng.choice([-1.0, 0.0, 1.0, 0.25], size=rng.integers(0, 6)).tolist()
                 for _ in range(rng.integers(1, 5))]
        blend = blend_reward(hint, steps)
        assert blend.regret == regret(hint, steps[0])  # matched timing: offset 0
        assert blend.win_rate == window_win_rate(steps)
        window = make_designer_reward("regret").score(hint, steps, skill="a")
        assert window.regret == regret(hint, flatten_steps(steps))  # the whole window
        stats = game_stats(Game("e", 0, "a", "", "h", (), steps, hint_returns=hint))
        assert (stats.regret, stats.mean_return) == (blend.regret, blend.win_rate)
        paper_hint, paper_no_hint = np.abs(hint or [1.0]), np.abs(flatten_steps(steps) + 0.0)
        if paper_no_hint.size:
            paper = designer_reward(paper_hint, paper_no_hint)
            assert paper.regret == regret(paper_hint, paper_no_hint)


def test_designer_rewards_are_a_category_of_the_rule_registry():
    assert set(DESIGNER_REWARDS) == set(registry.designer_rewards.names())
    rule = registry.designer_rewards.get("blend")
    assert rule.fn is DESIGNER_REWARDS["blend"] and rule.config_cls is BlendConfig
    # One resolver: None, a dict, the dataclass, or a base dataclass upgraded field by field.
    hint_regret = registry.designer_rewards.get("hint_regret")
    assert hint_regret.resolve_config(None) == HintRegretConfig()
    assert hint_regret.resolve_config({"success_threshold": 0.5}).success_threshold == 0.5
    upgraded = hint_regret.resolve_config(DesignerRewardConfig(frontier_regret=0.3))
    assert upgraded == HintRegretConfig(frontier_regret=0.3)
    assert make_designer_reward("hint_regret", upgraded).config is upgraded
    # A config of the wrong kind is both a TypeError (RoleConfig's callers) and a
    # ValueError (make_designer_reward's).
    for kind in (TypeError, ValueError):
        with pytest.raises(kind, match="takes None, a dict of overrides or a BlendConfig"):
            rule.resolve_config(HintRegretConfig(), field="spade.designer_reward_config")
    # The update rules resolve the same way.
    grpo = registry.policy_losses.get("grpo")
    config = grpo.make_config(clip_eps=0.1)
    assert grpo.resolve_config({"clip_eps": 0.1}) == config == grpo.resolve_config(config)
    assert grpo.resolve_config(None) == grpo.make_config()
    assert dataclasses.is_dataclass(config)


def test_regret_hinted_mean_leaves_out_games_without_a_hint_arm():
    """The recipe's regret scores a game with no hint arm as hint mean 0 (regret = minus its
    no-hint return); ``regret_hinted_mean`` averages only the games that had hint plays."""
    from spade_jax.spade.step_metrics import window_metrics
    from spade_jax.spade.window import Window

    hinted = Game("a", 0, "chain", "LEVEL = 3", "Next: ...", (), [[0.0, 1.0]],
                  hint_returns=[1.0, 1.0])
    hintless = Game("b", 1, "chain", "LEVEL = 2", None, (), [[1.0, 1.0]])
    metrics = window_metrics(Window(0, [hinted, hintless]), step=0)
    # Hinted game: 1 - 0.5; hintless: 0 - 1 (the recipe's convention).
    assert metrics["regret_raw_mean"] == pytest.approx(np.mean([0.5, -1.0]))
    assert metrics["regret_hinted_mean"] == pytest.approx(0.5)
    assert np.isnan(window_metrics(Window(0, [hintless]), step=0)["regret_hinted_mean"])
