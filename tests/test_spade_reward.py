"""Designer reward: hand-computed cases, a NumPy re-derivation, validation, the registry."""

import json

import numpy as np
import pytest

from spade_jax.spade import (
    DESIGNER_REWARDS,
    DesignerRewardConfig,
    EMALearningPotential,
    EMALearningPotentialConfig,
    Regime,
    designer_reward,
    make_designer_reward,
    register_designer_reward,
)


def test_frontier_hand_computed():
    # hint mean .75, no-hint mean .25 (8 episodes: k = 2), 2 of 8 no-hint wins.
    r = designer_reward([1, 1, 1, 0], [1, 0, 0, 0, 0, 0, 0, 1])
    assert r.regret == pytest.approx(0.5)
    assert r.clipped == pytest.approx(0.5)
    assert r.win_rate == pytest.approx(0.25)
    assert r.anchor == pytest.approx(0.25 / 0.4)  # rising edge of the flat top
    assert r.total == pytest.approx(0.4 * 0.5 + 0.6 * 0.625)  # 0.575
    assert r.regime is Regime.FRONTIER
    assert (r.num_hint, r.num_no_hint) == (4, 8)
    assert r.win_rate_hint == pytest.approx(0.75)


def test_mastered_hand_computed():
    r = designer_reward([1, 1, 1, 1], [1, 1, 1, 0.5])
    assert r.regret == pytest.approx(0.125)
    assert r.win_rate == pytest.approx(0.75)
    assert r.anchor == pytest.approx(0.25 / 0.4)  # falling edge: (1 - .75) / (1 - .6)
    assert r.total == pytest.approx(0.4 * 0.125 + 0.6 * 0.625)  # 0.425
    assert r.regime is Regime.MASTERED


def test_intractable_hand_computed():
    r = designer_reward([0, 0.2, 0, 0.2], [0, 0, 0, 0])
    assert r.regret == pytest.approx(0.1)
    assert r.win_rate == 0.0
    assert r.anchor == 0.0
    assert r.total == pytest.approx(0.04)
    assert r.regime is Regime.INTRACTABLE


def test_negative_regret_is_logged_raw_and_clipped_to_zero():
    # The hint misleads the agent: raw regret -0.375 stays visible, the reward part is 0.
    r = designer_reward([0, 0, 0, 0.5], [1, 0, 1, 0])
    assert r.regret == pytest.approx(-0.375)
    assert r.clipped == 0.0
    assert r.win_rate == pytest.approx(0.5)
    assert r.anchor == 1.0
    assert r.total == pytest.approx(0.6)
    # Solved half the time without the hint: the better arm decides, so not "intractable".
    assert r.regime is Regime.MASTERED
    assert r.as_metrics()["regret"] == pytest.approx(-0.375)


@pytest.mark.parametrize(
    "win_rate, anchor",
    [(0.0, 0.0), (0.2, 0.5), (0.4, 1.0), (0.5, 1.0), (0.6, 1.0), (0.8, 0.5), (1.0, 0.0)],
)
def test_flat_top_anchor_at_band_points(win_rate, anchor):
    wins = int(round(win_rate * 10))
    no_hint = [1.0] * wins + [0.0] * (10 - wins)
    assert designer_reward([1.0], no_hint).anchor == pytest.approx(anchor)


def test_success_threshold_counts_partial_returns_as_wins():
    r = designer_reward([1.0], [0.9, 0.95, 0.5, 0.0], success_threshold=0.9)
    assert r.win_rate == pytest.approx(0.5)
    assert designer_reward([1.0], [0.9, 0.95, 0.5, 0.0]).win_rate == 0.0


def _reference(hint, no_hint, threshold, regret_weight, anchor_weight, lo, hi):
    """Independent re-derivation: the anchor as a piecewise-linear interpolation."""
    regret = np.mean(hint) - np.mean(no_hint)
    clipped = np.clip(regret, 0.0, 1.0)
    win = np.mean(np.asarray(no_hint) >= threshold)
    anchor = np.interp(win, [0.0, lo, hi, 1.0], [0.0, 1.0, 1.0, 0.0])
    return regret, clipped, win, anchor, regret_weight * clipped + anchor_weight * anchor


def test_matches_numpy_reference_on_random_arms():
    rng = np.random.default_rng(0)
    for _ in range(200):
        lo = rng.uniform(0.05, 0.5)
        hi = rng.uniform(lo, 0.95)
        config = DesignerRewardConfig(
            regret_weight=rng.uniform(0, 1), anchor_weight=rng.uniform(0, 1), band=(lo, hi)
        )
        threshold = rng.choice([1.0, 0.8])
        # Returns on a grid so wins (return >= threshold) actually occur.
        hint = rng.integers(0, 6, size=rng.integers(1, 20)) / 5
        no_hint = rng.integers(0, 6, size=rng.integers(1, 40)) / 5
        got = designer_reward(hint, no_hint, threshold, config)
        want = _reference(
            hint, no_hint, threshold, config.regret_weight, config.anchor_weight, lo, hi
        )
        np.testing.assert_allclose(
            [got.regret, got.clipped, got.win_rate, got.anchor, got.total], want, atol=1e-12
        )


def test_regime_thresholds_are_configurable():
    hint, no_hint = [1, 1, 1, 0], [1, 0, 0, 0]  # regret .5, better arm .75
    assert designer_reward(hint, no_hint).regime is Regime.FRONTIER
    raised = DesignerRewardConfig(frontier_regret=0.6)
    assert designer_reward(hint, no_hint, config=raised).regime is Regime.MASTERED
    strict = DesignerRewardConfig(frontier_regret=0.6, mastered_return=0.9)
    assert designer_reward(hint, no_hint, config=strict).regime is Regime.INTRACTABLE


def test_regime_boundaries():
    # Dyadic returns so the regret lands exactly on the threshold.
    config = DesignerRewardConfig(frontier_regret=0.25, mastered_return=0.5)
    # regret exactly at the threshold is not frontier; better arm .75 -> mastered
    assert designer_reward([0.75], [0.5], config=config).regime is Regime.MASTERED
    assert designer_reward([0.375], [0.125], config=config).regime is Regime.INTRACTABLE
    assert designer_reward([0.5], [0.125], config=config).regime is Regime.FRONTIER
    assert designer_reward([0.5], [0.25], config=config).regime is Regime.MASTERED  # best = .5


@pytest.mark.parametrize(
    "hint, no_hint, match",
    [
        ([], [0.5], "returns_hint is empty"),
        ([0.5], [], "returns_no_hint is empty"),
        ([float("nan")], [0.5], "non-finite"),
        ([0.5], [float("inf")], "non-finite"),
        ([1.5], [0.5], r"\[0, 1\]"),
        ([0.5], [-0.1], r"\[0, 1\]"),
        ([[0.5]], [0.5], "1-D"),
    ],
)
def test_bad_returns_raise_clear_errors(hint, no_hint, match):
    with pytest.raises(ValueError, match=match):
        designer_reward(hint, no_hint)


def test_bad_threshold_and_config_raise():
    with pytest.raises(ValueError, match="success_threshold"):
        designer_reward([1.0], [1.0], success_threshold=0.0)
    with pytest.raises(ValueError, match="band"):
        DesignerRewardConfig(band=(0.7, 0.3))
    with pytest.raises(ValueError, match="regret_weight"):
        DesignerRewardConfig(regret_weight=-0.1)
    with pytest.raises(ValueError, match="invalid_penalty"):
        DesignerRewardConfig(invalid_penalty=float("nan"))
    assert DesignerRewardConfig().invalid_penalty == -1.0


def test_degenerate_bands_do_not_divide_by_zero():
    zero_band = DesignerRewardConfig(band=(0.0, 0.0))
    assert designer_reward([1.0], [0.0], config=zero_band).anchor == 1.0
    assert designer_reward([1.0], [1.0, 0.0], config=zero_band).anchor == pytest.approx(0.5)
    one_band = DesignerRewardConfig(band=(1.0, 1.0))
    assert designer_reward([1.0], [1.0], config=one_band).anchor == 1.0


def test_registry_picks_rules_by_name():
    assert {"hint_regret", "ema_learning_potential"} <= set(DESIGNER_REWARDS)
    rule = make_designer_reward("hint_regret")
    scored = rule.score([1, 1, 1, 0], [1, 0, 0, 0, 0, 0, 0, 1], skill="math")
    assert scored == designer_reward([1, 1, 1, 0], [1, 0, 0, 0, 0, 0, 0, 1])
    with pytest.raises(KeyError, match="unknown designer reward 'paired'"):
        make_designer_reward("paired")
    with pytest.raises(ValueError, match="already registered"):
        register_designer_reward("hint_regret")(object)


def test_ema_learning_potential_hand_computed():
    rule = make_designer_reward(
        "ema_learning_potential", config=EMALearningPotentialConfig(decay=0.5)
    )
    first = rule.score(None, [0.5, 0.5], skill="math")
    assert first.total == 0.0  # no history: the first environment seeds the mean
    second = rule.score([1.0], [1.0, 1.0], skill="math")  # mean .5 -> |1 - .5|
    assert second.moving_mean == pytest.approx(0.5)
    assert second.total == pytest.approx(0.5)
    third = rule.score(None, [0.0], skill="math")  # mean .75 after the second
    assert third.total == pytest.approx(0.75)
    # Unsigned: a mastered (1.0) and a hopeless (0.0) environment score alike around 0.5.
    other = make_designer_reward(
        "ema_learning_potential", config=EMALearningPotentialConfig(initial_mean=0.5)
    )
    assert other.score(None, [1.0], skill="logic").total == pytest.approx(0.5)
    assert other.score(None, [0.0], skill="science").total == pytest.approx(0.5)


def test_ema_state_survives_json_round_trip():
    rng = np.random.default_rng(1)
    episodes = [(s, rng.uniform(size=4)) for s in ["math", "logic", "math", "code"] * 3]
    uninterrupted = EMALearningPotential()
    totals = [uninterrupted.score(None, r, skill=s).total for s, r in episodes]

    first_half = EMALearningPotential()
    for skill, returns in episodes[:6]:
        first_half.score(None, returns, skill=skill)
    resumed = EMALearningPotential()
    resumed.load_state_dict(json.loads(json.dumps(first_half.state_dict())))
    resumed_totals = [resumed.score(None, r, skill=s).total for s, r in episodes[6:]]
    assert resumed_totals == totals[6:]
    with pytest.raises(ValueError, match="moving_means"):
        resumed.load_state_dict({})
