"""Code-level difficulty stats: reward levels probed from the PROGRAM in the sandbox, the
formula-reveal heuristic on physics-style environments, and the 16-step learnable share."""

import json
import math

import numpy as np
import pytest

from spade_jax.envs import EnvPool, SandboxConfig
from spade_jax.spade import (
    LearnableShareConfig,
    LearnableShareTracker,
    env_stats,
    formula_reveal,
    formula_reveal_reason,
)
from spade_jax.spade.env_stats import (
    ProbeConfig,
    agent_return_levels,
    agent_return_strict_partial_levels,
    formula_reveal_rate,
    is_physics_environment,
    physics_formula_reveal,
    probe_program_levels,
)


def test_agent_return_levels_count_distinct_values():
    returns = [0.0, 0.25, 0.25, 1.0, 0.5, 0.1 + 0.2, 0.3, 1.0]
    assert agent_return_levels(returns) == 5  # 0, .25, .3, .5, 1 (0.1 + 0.2 merges with 0.3)
    assert agent_return_strict_partial_levels(returns) == 3
    assert agent_return_levels([0.0, 1.0]) == 2
    assert agent_return_strict_partial_levels([0.0, 1.0]) == 0
    rng = np.random.default_rng(0)
    grid = rng.integers(0, 9, size=200) / 8
    assert agent_return_levels(grid) == len(np.unique(grid))
    assert agent_return_strict_partial_levels(grid) == len(
        np.unique(grid[(grid > 0) & (grid < 1)])
    )
    with pytest.raises(ValueError, match="no reward values"):
        agent_return_levels([])
    with pytest.raises(ValueError, match="non-finite"):
        agent_return_strict_partial_levels([0.5, float("nan")])


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


# --- formula reveal on physics-style environments only ----------------------------------

PROJECTILE_SOURCE = """
class Environment:
    def reset(self, seed=None):
        return "Launch a projectile: choose the initial velocity under gravity.", {}
    def step(self, action):
        return "The trajectory lands.", 1.0, True, False, {}
"""


@pytest.mark.parametrize(
    "source, observation, skill, physics",
    [
        (PROJECTILE_SOURCE, "", None, True),  # velocity, gravity, trajectory, projectile
        (None, "A block slides with friction; its velocity and momentum decay.", None, True),
        (None, "Solve the puzzle.", "Physics", True),
        (None, "Solve the puzzle.", "classical mechanics", True),
        (None, "Use brute force to find the key.", None, False),  # one stray term
        (None, "Your energy bar is low. Use force?", "Logical Deduction", False),  # two
        (None, "Guess the number between 1 and 100.", "Mathematical Reasoning", False),
    ],
)
def test_is_physics_environment(source, observation, skill, physics):
    assert is_physics_environment(source, observation, skill) is physics


def test_formula_reveal_ignores_non_physics_environments():
    # Both observations print a formula; only the physics one counts.
    interest = "Use the formula for compound interest: A = P * (1 + r)**n."
    physics = "A cart accelerates under gravity with friction; F = m * a gives its velocity."
    assert formula_reveal(interest) and formula_reveal(physics)
    assert physics_formula_reveal(interest, skill="Mathematical Reasoning") is None
    assert physics_formula_reveal(physics) is True
    quiet = "A cart moves under gravity with friction at some velocity. Predict where it stops."
    assert physics_formula_reveal(quiet) is False
    reveals = [physics_formula_reveal(o) for o in (interest, physics, quiet, interest)]
    assert reveals == [None, True, False, None]
    assert formula_reveal_rate(reveals) == pytest.approx(0.5)  # 1 of the 2 physics envs
    assert math.isnan(formula_reveal_rate([None, None]))


# --- learnable share over a 16-step window --------------------------------------------


def test_learnable_share_pools_a_sliding_window():
    tracker = LearnableShareTracker(LearnableShareConfig(window=3))
    assert math.isnan(tracker.share())
    # record_step returns the WINDOW share (the paper's number), not the step's own.
    assert tracker.record_step([0.2, 0.8, 0.9, 0.0]) == pytest.approx(0.5)  # band inclusive
    assert tracker.record_step([0.5, 0.5]) == pytest.approx(4 / 6)
    assert tracker.step_share() == 1.0
    tracker.record_step([1.0, 1.0, 1.0, 0.1, 0.3, 0.79])  # 2 of 6
    assert tracker.share() == pytest.approx((2 + 2 + 2) / (4 + 2 + 6))
    tracker.record_step([0.0, 0.0])  # pushes out the first step
    assert tracker.share() == pytest.approx((2 + 2 + 0) / (2 + 6 + 2))
    # The loop's old name returns the window share now too.
    assert tracker.record_round([-1.0, 0.5]) == pytest.approx((2 + 0 + 1) / (6 + 2 + 2))


def test_learnable_share_matches_a_direct_recomputation_and_resumes():
    rng = np.random.default_rng(2)
    # Win rates = mean raw scores, so they may be negative under the recipe's contract.
    steps = [rng.integers(-8, 17, size=rng.integers(1, 25)) / 16 for _ in range(40)]
    tracker = LearnableShareTracker()  # window 16, band [0.2, 0.8]
    for i, rates in enumerate(steps):
        got = tracker.record_step(rates)
        window = steps[max(0, i - 15) : i + 1]
        learnable = sum(int(np.sum((r >= 0.2) & (r <= 0.8))) for r in window)
        assert got == pytest.approx(learnable / sum(len(r) for r in window))
        # Equal env counts per step: the same as the mean of the per-step shares.
        if i == 20:
            resumed = LearnableShareTracker()
            resumed.load_state_dict(json.loads(json.dumps(tracker.state_dict())))
    for rates in steps[21:]:
        resumed.record_step(rates)
    assert resumed.share() == tracker.share()
    legacy = LearnableShareTracker()
    legacy.load_state_dict({"rounds": [[1, 2], [0, 3]]})  # older checkpoints
    assert legacy.share() == pytest.approx(1 / 5)
    with pytest.raises(ValueError, match=r"in \[-1, 1\]"):
        tracker.record_step([1.5])
    with pytest.raises(ValueError, match="band"):
        LearnableShareConfig(band=(0.9, 0.1))
    with pytest.raises(ValueError, match="inconsistent"):
        legacy.load_state_dict({"steps": [[3, 2]]})


def test_learnable_share_equal_counts_is_mean_of_step_shares():
    rng = np.random.default_rng(3)
    tracker = LearnableShareTracker()
    shares = []
    for _ in range(30):
        rates = rng.uniform(-1, 1, size=24)
        shares.append(np.mean((rates >= 0.2) & (rates <= 0.8)))
        got = tracker.record_step(rates)
    assert got == pytest.approx(np.mean(shares[-16:]))


# --- reward levels measured from the program ------------------------------------------

# Reward levels known by construction: 0, 0.25, 0.5, 1 (two strictly partial).
FOUR_LEVELS = """
class Environment:
    TABLE = {"zero": 0.0, "quarter": 0.25, "half": 0.5, "full": 1.0}

    def reset(self, seed=None):
        self.tries = 0
        return "Name a prize: zero quarter half full", {}

    def step(self, action):
        self.tries += 1
        choice = action.strip()
        if choice in self.TABLE:
            return "done", self.TABLE[choice], True, False, {}
        return "not a prize, again", 0.0, False, self.tries >= 3, {}
"""

# Partial credit paid over several turns: 0.25 per "up" (at most 2), end on "stop".
SUMMED = """
class Environment:
    def reset(self, seed=None):
        self.ups, self.t = 0, 0
        return "Say up or stop", {}

    def step(self, action):
        self.t += 1
        if action.strip() == "stop":
            return "end", 0.5, True, False, {}
        reward = 0.0
        if action.strip() == "up" and self.ups < 2:
            self.ups += 1
            reward = 0.25
        return "again", reward, False, self.t >= 4, {}
"""

CRASH_ON_RESET = """
class Environment:
    def reset(self, seed=None):
        raise RuntimeError("broken")
    def step(self, action):
        return "", 0.0, True, False, {}
"""

SPIN_ON_STEP = """
class Environment:
    def reset(self, seed=None):
        return "go", {}
    def step(self, action):
        while True:
            pass
"""

NEVER_ENDS = """
class Environment:
    def reset(self, seed=None):
        return "go", {}
    def step(self, action):
        return "more", 0.0, False, False, {}
"""

ESCAPE = """
import os
class Environment:
    def reset(self, seed=None):
        return os.listdir("/")[0], {}
    def step(self, action):
        return "", 0.0, True, False, {}
"""


@pytest.fixture(scope="module")
def pool():
    with EnvPool(SandboxConfig(call_deadline_s=1.0, load_deadline_s=5.0, spare_workers=1)) as p:
        yield p


def test_probe_finds_exactly_the_programs_levels(pool):
    got = probe_program_levels(FOUR_LEVELS, seed=3, step=7, pool=pool)
    assert got.levels == (0.0, 0.25, 0.5, 1.0)
    assert (got.reward_levels, got.strict_partial_levels) == (4.0, 2.0)
    assert got.episodes_counted == ProbeConfig().episodes and got.reason is None
    assert got.opening_observation == "Name a prize: zero quarter half full"
    assert got.as_metrics() == {"program_reward_levels": 4.0, "program_strict_partial_levels": 2.0}
    # Seeded by (seed, step, Phase.PROBE, index): the same call measures the same thing.
    assert probe_program_levels(FOUR_LEVELS, seed=3, step=7, pool=pool) == got


def test_probe_sums_multi_turn_partial_rewards(pool):
    got = probe_program_levels(SUMMED, seed=0, step=0, pool=pool, config=ProbeConfig(episodes=16))
    # Every return the probe reports is one this program can produce: ups * 0.25 (+ 0.5).
    possible = {u * 0.25 + s * 0.5 for u in range(3) for s in range(2)}
    assert set(got.levels) <= possible and got.reward_levels == len(got.levels) >= 3
    assert got.strict_partial_levels == sum(1 for v in got.levels if 0 < v < 1)


@pytest.mark.parametrize(
    "source, reason",
    [
        (CRASH_ON_RESET, "program_error"),
        (SPIN_ON_STEP, "timeout"),
        (NEVER_ENDS, "no end within 4 turns"),
        (ESCAPE, "ProgramLoadError"),
        ("def broken(:", "ProgramLoadError"),
        (12345, "TypeError"),
    ],
)
def test_probe_of_hostile_or_broken_programs_is_nan_without_raising(pool, source, reason):
    got = probe_program_levels(
        source, seed=1, step=2, pool=pool, config=ProbeConfig(episodes=2, max_turns=4)
    )
    assert math.isnan(got.reward_levels) and math.isnan(got.strict_partial_levels)
    assert got.levels == () and got.episodes_counted == 0
    assert reason in got.reason


class _FakeEnv:
    """Records what the probe sends; scores 1 for a boxed "B"."""

    def __init__(self):
        self.actions, self.closed = [], False

    def reset(self, seed=None):
        return "Pick A or B", {}

    def step(self, action):
        self.actions.append(action)
        return "", float(action == "\\boxed{B}"), True, False, {}

    def close(self):
        self.closed = True


def test_probe_passes_the_contract_and_boxes_actions(monkeypatch):
    calls = []

    def fake_make_env(source, pool=None, **kwargs):
        calls.append(kwargs)
        calls.append(_FakeEnv())
        return calls[-1]

    import spade_jax.envs

    monkeypatch.setattr(spade_jax.envs, "make_env", fake_make_env)
    got = probe_program_levels("src", seed=0, step=0, contract="reference",
                               config=ProbeConfig(episodes=4))
    assert calls[0] == {"contract": "reference"}
    env = calls[1]
    assert env.closed and all(a.startswith("\\boxed{") for a in env.actions)
    assert env.actions[:3] == ["\\boxed{Pick}", "\\boxed{A}", "\\boxed{or}"]
    assert got.levels == (0.0, 1.0)  # the 4th episode's first move is B
    # Without a contract make_env is called as today (no keyword), actions unboxed.
    calls.clear()
    probe_program_levels("src", seed=0, step=0, config=ProbeConfig(episodes=2))
    assert calls[0] == {} and calls[1].actions[0] == "Pick"
    # ... unless make_env resolved the program to the recipe's contract by itself.
    calls.clear()
    _FakeEnv.contract = "reference"
    try:
        got = probe_program_levels("src", seed=0, step=0, config=ProbeConfig(episodes=4))
    finally:
        del _FakeEnv.contract
    assert calls[0] == {} and calls[1].actions[0] == "\\boxed{Pick}"
    assert got.levels == (0.0, 1.0)


def test_probe_seeds_from_the_probe_phase(monkeypatch):
    seen = []
    real_rng = env_stats.rng

    def spy(*parts):
        seen.append(parts)
        return real_rng(*parts)

    monkeypatch.setattr(env_stats, "rng", spy)
    monkeypatch.setattr("spade_jax.envs.make_env", lambda source, pool=None: _FakeEnv())
    probe_program_levels("src", seed=11, step=5, index=2, config=ProbeConfig(episodes=1))
    from spade_jax.seeding import Phase

    assert seen == [(11, 5, Phase.PROBE, 2)]


# A recipe-format game: only the terminating reward counts (clipped), so the 0.3 paid on
# non-terminating turns is not a level; a loss scores -1.
RECIPE_PRIZE = r'''
class PrizeEnv:
    def __init__(self, max_turns=25):
        self.max_turns = max_turns
        self.reset()
    def reset(self, seed=None):
        self.t = 0
        return "Name a prize in a box: zero, half, full or lose", {}
    def step(self, action):
        self.t += 1
        m = re.search(r"\\boxed\{([^}]*)\}", action)
        choice = m.group(1).strip() if m else ""
        table = {"zero": 0.0, "half": 0.5, "full": 1.0, "lose": -1.0}
        if choice in table:
            return "done", table[choice], True, False, {}
        return "again", 0.3, False, self.t >= self.max_turns, {}
'''


@pytest.mark.parametrize("contract", [None, "reference"])
def test_probe_of_a_recipe_game_under_the_reference_contract(pool, contract):
    import inspect

    from spade_jax.envs import make_env

    if "contract" not in inspect.signature(make_env).parameters:
        pytest.skip("make_env has no reference contract on this branch yet")
    got = probe_program_levels(RECIPE_PRIZE, seed=0, step=0, pool=pool, contract=contract)
    assert got.levels == (-1.0, 0.0, 0.5, 1.0) and got.reason is None
    assert (got.reward_levels, got.strict_partial_levels) == (4.0, 1.0)
