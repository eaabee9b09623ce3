"""Code-level difficulty stats, the formula-reveal heuristic, and the learnable share."""

import json
import math

import numpy as np
import pytest

from spade_jax.spade import (
    LearnableShareConfig,
    LearnableShareTracker,
    formula_reveal,
    formula_reveal_reason,
    reward_levels,
    strict_partial_levels,
)


def test_reward_levels_count_distinct_values():
    returns = [0.0, 0.25, 0.25, 1.0, 0.5, 0.1 + 0.2, 0.3, 1.0]
    assert reward_levels(returns) == 5  # 0, .25, .3, .5, 1 (0.1 + 0.2 merges with 0.3)
    assert strict_partial_levels(returns) == 3
    assert reward_levels([0.0, 1.0]) == 2 and strict_partial_levels([0.0, 1.0]) == 0
    rng = np.random.default_rng(0)
    grid = rng.integers(0, 9, size=200) / 8
    assert reward_levels(grid) == len(np.unique(grid))
    assert strict_partial_levels(grid) == len(np.unique(grid[(grid > 0) & (grid < 1)]))
    with pytest.raises(ValueError, match="no reward values"):
        reward_levels([])
    with pytest.raises(ValueError, match="non-finite"):
        strict_partial_levels([0.5, float("nan")])


@pytest.mark.parametrize(
    "text, reason",
    [
        ("A cart of mass m is pushed. Its acceleration obeys F = m * a.", "equation"),
        ("Kinetic energy: E_k = 0.5*m*v**2. Find v.", "equation"),
        ("Position x(t) = x0 + v*t where t is time in s.", "equation"),
        ("The period is T = 2*pi*sqrt(L/g).", "equation"),
        ("Use the formula for compound interest to answer.", "keyword"),
        ("The pressure is given by the ideal gas law.", "keyword"),
        (r"Recall that $E = mc^2$ holds.", "latex"),
        (r"The drag is \frac{1}{2} \rho v^2 C_d A.", "latex"),
        ("A ball is dropped from 20 m. Gravity g = 9.81 m/s^2. Predict the landing time.", None),
        ("You have 3 moves left. Score = 0", None),
        ("Mass m = 2.5 kg, speed v = 4 m/s. What happens next?", None),
        ("Guess the hidden number between 1 and 100.", None),
        ("if a == b + c then the door opens", None),
    ],
)
def test_formula_reveal_heuristic(text, reason):
    assert formula_reveal_reason(text) == reason
    assert formula_reveal(text) is (reason is not None)


def test_formula_reveal_rejects_non_text():
    with pytest.raises(TypeError, match="must be str"):
        formula_reveal(None)


def test_learnable_share_pools_a_sliding_window():
    tracker = LearnableShareTracker(LearnableShareConfig(window=3))
    assert math.isnan(tracker.share())
    assert tracker.record_round([0.2, 0.8, 0.9, 0.0]) == pytest.approx(0.5)  # band inclusive
    tracker.record_round([0.5, 0.5])  # 2 of 2
    tracker.record_round([1.0, 1.0, 1.0, 0.1, 0.3, 0.79])  # 2 of 6
    assert tracker.share() == pytest.approx((2 + 2 + 2) / (4 + 2 + 6))
    tracker.record_round([0.0, 0.0])  # pushes out the first round
    assert tracker.share() == pytest.approx((2 + 2 + 0) / (2 + 6 + 2))


def test_learnable_share_matches_a_direct_recomputation_and_resumes():
    rng = np.random.default_rng(2)
    rounds = [rng.integers(0, 17, size=rng.integers(1, 25)) / 16 for _ in range(40)]
    tracker = LearnableShareTracker()  # window 16, band [0.2, 0.8]
    for i, rates in enumerate(rounds):
        tracker.record_round(rates)
        pooled = np.concatenate(rounds[max(0, i - 15) : i + 1])
        assert tracker.share() == pytest.approx(np.mean((pooled >= 0.2) & (pooled <= 0.8)))
        if i == 20:
            resumed = LearnableShareTracker()
            resumed.load_state_dict(json.loads(json.dumps(tracker.state_dict())))
    for rates in rounds[21:]:
        resumed.record_round(rates)
    assert resumed.share() == tracker.share()
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        tracker.record_round([1.5])
    with pytest.raises(ValueError, match="band"):
        LearnableShareConfig(band=(0.9, 0.1))
