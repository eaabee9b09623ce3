"""Designer rewards: the recipe's blend and variants and the paper-text forms, each against
hand-computed cases and an independent re-derivation; validation; the registry."""

import json
import math

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
from spade_jax.spade.reward import (
    BlendConfig,
    MicroLPConfig,
    blend_reward,
    env_reward_scale,
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
    assert set(DESIGNER_REWARDS) >= {
        "blend", "solve_rate", "learning_potential", "regret", "micro_lp",
        "hint_regret", "ema_learning_potential",
    }
    rule = make_designer_reward("hint_regret")
    # hint_regret flattens the window's no-hint steps into one arm.
    scored = rule.score([1, 1, 1, 0], [[1, 0, 0, 0], [], [0, 0, 0, 1]], skill="math")
    assert scored == designer_reward([1, 1, 1, 0], [1, 0, 0, 0, 0, 0, 0, 1])
    with pytest.raises(ValueError, match="unknown designer reward 'paired'"):
        make_designer_reward("paired")
    with pytest.raises(ValueError, match="already registered"):
        register_designer_reward("hint_regret")(object)


def test_make_designer_reward_configs():
    # None, a dict of overrides and the rule's own dataclass build the same rule.
    via_dict = make_designer_reward("blend", {"regret_weight": 0.0, "plateau_weight": 1.0})
    via_class = make_designer_reward("blend", BlendConfig(regret_weight=0.0, plateau_weight=1.0))
    assert via_dict.config == via_class.config
    assert make_designer_reward("blend").config == BlendConfig()
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['gamma'\]"):
        make_designer_reward("blend", {"gamma": 0.5})
    with pytest.raises(ValueError, match="takes None, a dict"):
        make_designer_reward("blend", MicroLPConfig())
    with pytest.raises(ValueError, match="regret_scale"):
        make_designer_reward("blend", {"regret_scale": 0.0})
    with pytest.raises(ValueError, match="estimator"):
        make_designer_reward("micro_lp", {"estimator": "fit"})
    # The paper-text rule still takes a plain DesignerRewardConfig (upgraded field by field).
    paper = make_designer_reward("hint_regret", DesignerRewardConfig(frontier_regret=0.6))
    assert paper.config.frontier_regret == 0.6 and paper.config.success_threshold == 1.0


def test_ema_learning_potential_hand_computed():
    rule = make_designer_reward(
        "ema_learning_potential", config=EMALearningPotentialConfig(decay=0.5)
    )
    first = rule.score([], [[0.5], [0.5]], skill="math")
    assert first.total == 0.0  # no history: the first environment seeds the mean
    second = rule.score([1.0], [[1.0, 1.0]], skill="math")  # mean .5 -> |1 - .5|
    assert second.moving_mean == pytest.approx(0.5)
    assert second.total == pytest.approx(0.5)
    third = rule.score([], [[0.0]], skill="math")  # mean .75 after the second
    assert third.total == pytest.approx(0.75)
    # Unsigned: a mastered (1.0) and a hopeless (0.0) environment score alike around 0.5.
    other = make_designer_reward("ema_learning_potential", {"initial_mean": 0.5})
    assert other.score([], [[1.0]], skill="logic").total == pytest.approx(0.5)
    assert other.score([], [[0.0]], skill="science").total == pytest.approx(0.5)


def test_ema_state_survives_json_round_trip():
    rng = np.random.default_rng(1)
    episodes = [(s, [rng.uniform(size=4)]) for s in ["math", "logic", "math", "code"] * 3]
    uninterrupted = EMALearningPotential()
    totals = [uninterrupted.score([], r, skill=s).total for s, r in episodes]

    first_half = EMALearningPotential()
    for skill, returns in episodes[:6]:
        first_half.score([], returns, skill=skill)
    resumed = EMALearningPotential()
    resumed.load_state_dict(json.loads(json.dumps(first_half.state_dict())))
    resumed_totals = [resumed.score([], r, skill=s).total for s, r in episodes[6:]]
    assert resumed_totals == totals[6:]
    with pytest.raises(ValueError, match="moving_means"):
        resumed.load_state_dict({})


# ----------------------------------------------------------------------------------------
# The recipe's blend reward and variants against independent re-derivations.
# Each reference below is plain Python written from the recipe's description, not a call
# into the module under test.
# ----------------------------------------------------------------------------------------


def _py_mean(xs):
    xs = list(xs)
    return sum(xs) / len(xs) if xs else 0.0


def _ref_blend(hint, steps, regret_scale, regret_weight, plateau_weight, band, ramp, floor):
    regret = _py_mean(hint) - _py_mean(steps[0] if steps else [])
    norm = regret / regret_scale
    if floor:
        norm = min(1.0, max(0.0, norm))
    win = _py_mean([r for step in steps for r in step])
    lo, hi = band
    # The plateau as a piecewise-linear interpolation, clipped at 0.
    plateau = float(np.interp(win, [lo - ramp, lo, hi, hi + ramp], [0.0, 1.0, 1.0, 0.0]))
    return regret, norm, win, plateau, regret_weight * norm + plateau_weight * plateau


def _random_window(rng, max_steps=6, p_empty=0.3, grid=True):
    """Per-step no-hint returns in [-1, 1], some steps empty (incl. possibly offset 0)."""
    steps = []
    for _ in range(rng.integers(0, max_steps + 1)):
        n = 0 if rng.uniform() < p_empty else int(rng.integers(1, 10))
        values = rng.integers(-4, 5, size=n) / 4 if grid else rng.uniform(-1, 1, size=n)
        steps.append(values.tolist())
    return steps


def test_blend_hand_computed_recipe_defaults():
    # hint mean .5; offset-0 mean .25 -> regret .25 -> norm 1.667 clipped to 1;
    # window mean (0.5 + 0 + 1 + 1 + 0) / 5 = .5, on the band -> plateau 1.
    r = blend_reward([1, 0, 1, 0], [[0.5, 0.0], [1.0, 1.0], [0.0]])
    assert r.regret == pytest.approx(0.25)
    assert r.regret_norm == 1.0
    assert r.win_rate == pytest.approx(0.5)
    assert r.plateau == 1.0
    assert r.total == pytest.approx(0.4 * 1.0 + 0.6 * 1.0)
    # Win rate .75: 0.15 above the band -> plateau 1 - .15 / .25 = .4; regret -.5 floored.
    r = blend_reward([0.0], [[1.0, 0.5], [1.0, 0.5]])
    assert r.regret == pytest.approx(-0.75)
    assert r.regret_norm == 0.0
    assert r.plateau == pytest.approx(0.4)
    assert r.total == pytest.approx(0.24)


def test_blend_empty_offset0_and_empty_window_mean_zero():
    # Offset 0 without plays: its mean is 0, so regret = the hint mean.
    r = blend_reward([0.15, 0.15], [[], [0.5, 0.5]])
    assert r.regret == pytest.approx(0.15) and r.regret_norm == pytest.approx(1.0)
    assert r.mean_no_hint_offset0 == 0.0 and r.win_rate == pytest.approx(0.5)
    # Nothing at all: regret 0, win rate 0, plateau 0 (0 is 0.4 below the band > ramp).
    r = blend_reward([], [])
    assert (r.regret, r.win_rate, r.plateau, r.total) == (0.0, 0.0, 0.0, 0.0)
    r = blend_reward([], [[], [], []])
    assert (r.regret, r.win_rate, r.total, r.num_no_hint) == (0.0, 0.0, 0.0, 0)


@pytest.mark.parametrize(
    "win_rate, plateau",
    [(0.15, 0.0), (0.1, 0.0), (0.2, 0.2), (0.4, 1.0), (0.5, 1.0), (0.6, 1.0), (0.7, 0.6),
     (0.85, 0.0), (0.95, 0.0), (-1.0, 0.0)],
)
def test_blend_plateau_band_edges_and_ramp(win_rate, plateau):
    # One play with return = win_rate: the window mean is exactly that value.
    r = blend_reward([], [[win_rate]])
    assert r.plateau == pytest.approx(plateau, abs=1e-12)


def test_blend_matches_reference_on_random_windows():
    rng = np.random.default_rng(0)
    for case in range(400):
        lo = float(rng.uniform(-0.5, 0.8))
        band = (lo, float(rng.uniform(lo, 1.0)))
        kwargs = dict(
            regret_scale=float(rng.uniform(0.05, 0.5)),
            regret_weight=float(rng.uniform(0, 1)),
            plateau_weight=float(rng.uniform(0, 1)),
            band=band,
            ramp=float(rng.uniform(0.05, 0.5)),
            floor=bool(case % 2),
        )
        hint = (rng.integers(-4, 5, size=rng.integers(0, 17)) / 4).tolist()
        steps = _random_window(rng, grid=bool(case % 3))
        got = blend_reward(hint, steps, **kwargs)
        want = _ref_blend(hint, steps, **kwargs)
        np.testing.assert_allclose(
            [got.regret, got.regret_norm, got.win_rate, got.plateau, got.total], want,
            atol=1e-12, err_msg=f"case {case}: {hint} {steps} {kwargs}",
        )


def test_blend_floor_off_gives_negative_totals():
    r = blend_reward([0.0] * 4, [[1.0] * 4], floor=False)  # regret -1 -> norm -6.67
    assert r.regret_norm == pytest.approx(-1 / 0.15)
    assert r.total == pytest.approx(0.4 * -1 / 0.15 + 0.6 * 0.0)
    assert r.total < 0


@pytest.mark.parametrize(
    "hint, steps, match",
    [
        ([float("nan")], [[0.5]], "hint_returns contains non-finite"),
        ([0.5], [[0.5], [float("inf")]], r"no_hint_returns_by_step\[1\] contains non-finite"),
        ([1.5], [[0.5]], r"hint_returns must lie in \[-1.0, 1.0\]"),
        ([0.5], [[-1.5]], r"must lie in \[-1.0, 1.0\]"),
        ([0.5], [0.5, 0.5], r"no_hint_returns_by_step\[0\] must be a 1-D"),
        ([[0.5]], [[0.5]], "hint_returns must be a 1-D"),
        ([0.5], "abc", "must be a list over the window's steps"),
    ],
)
def test_blend_bad_inputs_raise_naming_the_problem(hint, steps, match):
    with pytest.raises(ValueError, match=match):
        blend_reward(hint, steps)


def test_blend_bad_settings_raise():
    with pytest.raises(ValueError, match="regret_scale"):
        blend_reward([0.5], [[0.5]], regret_scale=float("nan"))
    with pytest.raises(ValueError, match="ramp"):
        blend_reward([0.5], [[0.5]], ramp=0.0)
    with pytest.raises(ValueError, match="band"):
        blend_reward([0.5], [[0.5]], band=(0.6, 0.4))
    with pytest.raises(ValueError, match="plateau_weight"):
        blend_reward([0.5], [[0.5]], plateau_weight=float("inf"))


def _ref_center(totals, skills, scale):
    advantages, kept = [], []
    for total, skill in zip(totals, skills, strict=True):
        if total < 0:
            advantages.append(0.0)
            kept.append(False)
            continue
        same = [t for t, s in zip(totals, skills, strict=True) if s == skill and t >= 0]
        advantages.append((total - sum(same) / len(same)) * scale)
        kept.append(True)
    return advantages, kept


def _loop_designer_advantages(totals, skills, num_agent):
    """The designer advantages a SPADE run trains on: the loop's skill groups (totals < 0
    dropped) under the designer's default rule, times the env reward scale."""
    from spade.test_loop import ALL_VALID, WINDOW, ScriptedPolicy, _loop  # tests/spade/

    from spade_jax.spade.window import DesignerSample

    loop = _loop(None, ScriptedPolicy(ALL_VALID), WINDOW, corpus=False)
    samples = [(0, DesignerSample(i, skill, [1, 2], [3, 4], [-1.0, -1.0], f"env{i}"))
               for i, skill in enumerate(skills)]
    sequences = loop.designer_sequences(samples, list(totals), num_agent, step=0)
    return [s.advantage for s in sequences]


def test_loop_centres_designer_totals_per_skill_hand_computed():
    # skill a: the dropped -0.2 is not in the mean (0.75); skill b mean 0.1. Scale:
    # min(10 agent / 5 designer samples x interval 4, 50) = 8.
    adv = _loop_designer_advantages([1.0, 0.5, -0.2, 0.2, 0.0], ["a", "a", "a", "b", "b"], 10)
    np.testing.assert_allclose(adv, [2.0, -2.0, 0.8, -0.8], rtol=1e-6)


def test_loop_centres_designer_totals_per_skill_like_the_reference():
    rng = np.random.default_rng(1)
    for _ in range(30):
        n = int(rng.integers(1, 20))
        totals = rng.uniform(-0.5, 1.0, size=n).tolist()
        skills = rng.choice(["math", "logic", "space"], size=n).tolist()
        num_agent = int(rng.integers(1, 400))
        scale = env_reward_scale(n, num_agent, 4, 50.0)
        want_adv, want_kept = _ref_center(totals, skills, scale)
        adv = _loop_designer_advantages(totals, skills, num_agent)
        np.testing.assert_allclose(adv, [a for a, k in zip(want_adv, want_kept, strict=True)
                                         if k], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "env, actor, interval, max_scale, want",
    [
        (24, 192, 4, 50.0, 32.0),  # the recipe
        (24, 192, 8, 50.0, 50.0),  # capped: 64 -> 50
        (10, 192, 4, 100.0, 76.8),
        (0, 192, 4, 50.0, 1.0),
        (24, 0, 4, 50.0, 1.0),
        (-3, 192, 4, 50.0, 1.0),
        (24, -1, 4, 50.0, 1.0),
        (3, 1, 1, 50.0, 1 / 3),
    ],
)
def test_env_reward_scale(env, actor, interval, max_scale, want):
    assert env_reward_scale(env, actor, interval, max_scale) == pytest.approx(want)


def test_env_reward_scale_random_and_default_cap():
    rng = np.random.default_rng(2)
    for _ in range(100):
        env, actor, interval = (int(v) for v in rng.integers(-2, 300, size=3))
        want = 1.0 if env <= 0 or actor <= 0 else min(actor * interval / env, 50.0)
        assert env_reward_scale(env, actor, interval) == pytest.approx(want)
    with pytest.raises(ValueError, match="max_scale"):
        env_reward_scale(24, 192, 4, float("nan"))


def test_solve_rate_is_the_plateau_alone():
    rule = make_designer_reward("solve_rate")
    rng = np.random.default_rng(3)
    for _ in range(100):
        hint = (rng.integers(-4, 5, size=rng.integers(0, 8)) / 4).tolist()
        steps = _random_window(rng)
        got = rule.score(hint, steps, skill="math")
        want = _ref_blend(hint, steps, 0.15, 0.0, 1.0, (0.4, 0.6), 0.25, True)
        assert got.total == pytest.approx(want[3], abs=1e-12)  # plateau only
    narrow = make_designer_reward("solve_rate", {"band": (0.5, 0.5), "ramp": 0.5})
    assert narrow.score([], [[0.25]], skill="x").total == pytest.approx(0.5)


def test_blend_rule_equals_blend_reward():
    rule = make_designer_reward("blend", {"floor": False, "regret_scale": 0.3})
    hint, steps = [1.0, 0.0], [[], [0.5, -1.0], [1.0]]
    assert rule.score(hint, steps, skill="a") == blend_reward(
        hint, steps, floor=False, regret_scale=0.3
    )
    assert rule.state_dict() == {}
    with pytest.raises(ValueError, match="stateless"):
        rule.load_state_dict({"x": 1})


def _ref_variance_bonus(values):
    if len(values) < 2:
        return 0.0
    m = _py_mean(values)
    var = sum((v - m) ** 2 for v in values) / len(values)
    return math.exp(-((var - 0.25) ** 2) / 0.02)


def test_regret_variant_matches_reference():
    plain = make_designer_reward("regret")
    bonus = make_designer_reward("regret", {"variance_bonus": True})
    rng = np.random.default_rng(4)
    for _ in range(200):
        hint = (rng.integers(-4, 5, size=rng.integers(0, 8)) / 4).tolist()
        steps = _random_window(rng)
        flat = [r for step in steps for r in step]
        regret = _py_mean(hint) - _py_mean(flat)
        got = plain.score(hint, steps, skill="a")
        assert got.regret == pytest.approx(regret, abs=1e-12)
        assert got.total == pytest.approx(max(0.0, regret), abs=1e-12)
        assert bonus.score(hint, steps, skill="a").total == pytest.approx(
            max(0.0, regret) + _ref_variance_bonus(flat), abs=1e-12
        )
    # A 50/50 win/loss window has variance exactly .25: the bonus peaks at 1.
    assert bonus.score([0.0], [[1.0, 0.0]], skill="a").total == pytest.approx(1.0)


def _ref_micro_lp(steps, estimator, signed):
    played = [(j, s) for j, s in enumerate(steps) if s]
    if len(played) < 2:
        return 0.0
    if estimator == "twobucket":
        mid = len(played) // 2
        early = [r for _, s in played[:mid] for r in s]
        late = [r for _, s in played[mid:] for r in s]
        value = _py_mean(late) - _py_mean(early)
    else:
        xs = np.array([j for j, _ in played], dtype=float)
        ys = np.array([_py_mean(s) for _, s in played])
        # np.polyfit weights multiply residuals: sqrt(n) residual weight = weight n per step.
        slope = np.polyfit(xs, ys, 1, w=np.sqrt([len(s) for _, s in played]))[0]
        value = slope * (xs[-1] - xs[0])
    return value if signed else max(0.0, value)


def test_micro_lp_hand_computed():
    rule = make_designer_reward("micro_lp")
    # Per-step means 0, .5, 1 with equal plays: the line rises .5 per step -> 1.0 over 2.
    assert rule.score([], [[0.0, 0.0], [0.5, 0.5], [1.0, 1.0]], skill="a").total == (
        pytest.approx(1.0)
    )
    # An empty middle step is left out and the later step keeps its offset (3, not 2).
    got = rule.score([], [[0.0], [], [], [0.75]], skill="a")
    assert got.total == pytest.approx(0.75) and got.steps_with_plays == 2
    # Getting worse is negative (signed), floored at 0 unsigned; one step -> 0.
    assert rule.score([], [[1.0], [0.0]], skill="a").total == pytest.approx(-1.0)
    unsigned = make_designer_reward("micro_lp", {"signed": False})
    assert unsigned.score([], [[1.0], [0.0]], skill="a").total == 0.0
    assert rule.score([], [[], [1.0], []], skill="a").total == 0.0
    # Weights: the step with 3 plays pulls the fit (weighted, not plain, least squares).
    weighted = rule.score([], [[0.0] * 3, [1.0], [0.0] * 3], skill="a").total
    assert weighted == pytest.approx(0.0)
    skewed = rule.score([], [[0.0] * 3, [1.0], [1.0]], skill="a").total
    assert skewed == pytest.approx(_ref_micro_lp([[0.0] * 3, [1.0], [1.0]], "slope", True))
    plain_ols = np.polyfit([0, 1, 2], [0, 1, 1], 1)[0] * 2
    assert skewed != pytest.approx(plain_ols)


@pytest.mark.parametrize("estimator", ["slope", "twobucket"])
@pytest.mark.parametrize("signed", [True, False])
def test_micro_lp_matches_reference(estimator, signed):
    rule = make_designer_reward("micro_lp", {"estimator": estimator, "signed": signed})
    rng = np.random.default_rng(5)
    for _ in range(200):
        steps = _random_window(rng, max_steps=8, grid=False)
        got = rule.score([], steps, skill="a").total
        assert got == pytest.approx(_ref_micro_lp(steps, estimator, signed), abs=1e-9), steps


class _RefLP:
    """The recipe's tracker written out: gamma weighs the NEWEST value, update then score."""

    def __init__(self, gamma_slow, gamma_fast):
        self.g_slow, self.g_fast, self.slow, self.fast = gamma_slow, gamma_fast, {}, {}

    def score(self, steps, skill, bonus):
        flat = [r for s in steps for r in s]
        if flat:
            mean = _py_mean(flat)
            if skill not in self.slow:
                self.slow[skill] = self.fast[skill] = mean
            else:
                self.slow[skill] = (1 - self.g_slow) * self.slow[skill] + self.g_slow * mean
                self.fast[skill] = (1 - self.g_fast) * self.fast[skill] + self.g_fast * mean
        raw = abs(_py_mean(flat) - self.slow.get(skill, 0.0)) if flat else 0.0
        return raw + (_ref_variance_bonus(flat) if bonus else 0.0)


def test_learning_potential_hand_computed():
    rule = make_designer_reward("learning_potential", {"gamma_slow": 0.5, "gamma_fast": 0.9})
    # First window initialises the baseline with its own mean -> 0.
    assert rule.score([], [[1.0, 0.0]], skill="m").total == 0.0
    # Updated BEFORE scoring: mu_slow = .5 * .5 + .5 * 1 = .75 -> |1 - .75|.
    second = rule.score([], [[1.0], [1.0]], skill="m")
    assert second.baseline == pytest.approx(0.75) and second.total == pytest.approx(0.25)
    assert second.mu_fast == pytest.approx(0.1 * 0.5 + 0.9 * 1.0)
    # A game without plays scores 0 and leaves the tracker alone; other skills are separate.
    assert rule.score([], [[], []], skill="m").total == 0.0
    assert rule.state_dict()["means"]["m"]["mu_slow"] == pytest.approx(0.75)
    assert rule.score([], [[-1.0]], skill="other").total == 0.0
    with pytest.raises(ValueError, match="gamma_slow < gamma_fast"):
        make_designer_reward("learning_potential", {"gamma_slow": 0.9, "gamma_fast": 0.9})


@pytest.mark.parametrize("bonus", [False, True])
def test_learning_potential_matches_reference_and_resumes(bonus):
    config = {"gamma_slow": 0.85, "gamma_fast": 0.98, "variance_bonus": bonus}
    rng = np.random.default_rng(6)
    calls = [(str(rng.choice(["m", "l", "s"])), _random_window(rng)) for _ in range(60)]
    reference = _RefLP(0.85, 0.98)
    want = [reference.score(steps, skill, bonus) for skill, steps in calls]
    rule = make_designer_reward("learning_potential", config)
    got = [rule.score([], steps, skill=skill).total for skill, steps in calls[:30]]
    resumed = make_designer_reward("learning_potential", config)
    resumed.load_state_dict(json.loads(json.dumps(rule.state_dict())))
    got += [resumed.score([], steps, skill=skill).total for skill, steps in calls[30:]]
    np.testing.assert_allclose(got, want, atol=1e-12)
    with pytest.raises(ValueError, match="'means'"):
        resumed.load_state_dict({})
    with pytest.raises(ValueError, match="malformed"):
        resumed.load_state_dict({"means": {"m": {"mu_slow": 0.1}}})


def test_every_rule_rejects_non_finite_and_honours_the_protocol():
    for name in DESIGNER_REWARDS:
        rule = make_designer_reward(name)
        with pytest.raises(ValueError, match="non-finite"):
            rule.score([0.5], [[0.5], [float("nan")]], skill="a")
        scored = rule.score([0.5, 1.0], [[0.5, 0.0], [1.0]], skill="a")
        assert math.isfinite(scored.total)
        assert scored.as_metrics()["total"] == scored.total
        # State round-trips through JSON for every rule (stateful or not).
        clone = make_designer_reward(name)
        clone.load_state_dict(json.loads(json.dumps(rule.state_dict())))
        assert clone.state_dict() == rule.state_dict()


EMPTY_OFFSET0_HINT = [1.0, -1.0, 0.5, 1.0]
EMPTY_OFFSET0_STEPS = [[], [-1.0, 1.0, 0.5], [], [-0.5, 1.0]]


@pytest.mark.parametrize(
    "name, reference",
    [
        ("blend", lambda h, s: _ref_blend(h, s, 0.15, 0.4, 0.6, (0.4, 0.6), 0.25, True)[4]),
        ("solve_rate", lambda h, s: _ref_blend(h, s, 0.15, 0.0, 1.0, (0.4, 0.6), 0.25, True)[3]),
        ("regret", lambda h, s: max(0.0, _py_mean(h) - _py_mean([r for x in s for r in x]))),
        ("micro_lp", lambda h, s: _ref_micro_lp(s, "slope", True)),
        ("learning_potential", lambda h, s: _RefLP(0.85, 0.98).score(s, "a", False)),
    ],
)
def test_each_recipe_rule_on_an_empty_offset0_step_and_negative_returns(name, reference):
    got = make_designer_reward(name).score(EMPTY_OFFSET0_HINT, EMPTY_OFFSET0_STEPS, skill="a")
    assert got.total == pytest.approx(reference(EMPTY_OFFSET0_HINT, EMPTY_OFFSET0_STEPS),
                                      abs=1e-12)
