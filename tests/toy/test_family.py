"""The key-digit family: programs validate in the recipe's contract, gymnasium's checker
passes, levels read back, and the family's difficulty and hint work as documented
(scripted agents on the program itself, run in this process: it is the project's own code)."""

import random
import re

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from spade_jax.envs import EnvPool, make_env, validate_program
from spade_jax.envs.config import SandboxConfig
from spade_jax.toy.family import (
    LEVELS,
    RULES,
    hint_for,
    key_digit,
    program_level,
    program_rule,
    render_program,
)


def _game(level, rule):
    namespace = {"random": random, "re": re}
    exec(render_program(level, rule), namespace)  # noqa: S102 - the project's own program
    return namespace["KeyDigitEnv"]()


@pytest.mark.parametrize("level,rule", [(1, "first"), (5, "last"), (9, "first")])
def test_programs_pass_the_recipe_contracts_validation(level, rule):
    report = validate_program(render_program(level, rule), contract="reference")
    assert report.ok, report


def test_gymnasium_checker_passes_on_the_sandboxed_game():
    with EnvPool(SandboxConfig(call_deadline_s=3.0, spare_workers=1)) as pool:
        env = make_env(render_program(4, "last"), pool, contract="reference", max_turns=2)
        check_env(env, skip_render_check=True)
        observation, _ = env.reset(seed=5)
        assert observation.startswith("Digits: ") and len(observation.split(".")[0].split()) == 5
        env.close()


def test_level_and_rule_read_back_and_bad_values_are_refused():
    for level in LEVELS:
        for rule in RULES:
            source = render_program(level, rule)
            assert program_level(source) == level and program_rule(source) == rule
    assert program_level("class XEnv:\n    pass\n") is None
    with pytest.raises(ValueError, match="level"):
        render_program(10, "first")
    with pytest.raises(ValueError, match="rule"):
        render_program(3, "middle")


def test_an_agent_that_knows_the_rule_wins_first_try_and_feedback_states_the_rule():
    for rule in RULES:
        game = _game(6, rule)
        for seed in range(20):
            game.reset(seed=seed)
            key = key_digit(game.digits, rule)
            assert game.step(f"\\boxed{{{key}}}")[1:3] == (1.0, True)
        game.reset(seed=0)
        wrong = game.digits[1]
        observation, reward, terminated, _, _ = game.step(f"\\boxed{{{wrong}}}")
        assert (reward, terminated) == (0.0, False)
        assert observation.endswith(hint_for(rule))  # the hint's words, as feedback
        assert game.step(f"\\boxed{{{key_digit(game.digits, rule)}}}")[1:3] == (0.5, True)


def test_difficulty_grows_with_the_level_and_no_digit_value_is_a_good_guess():
    """Random copy wins 1/L first try; answering any fixed digit wins ~1/10 at every level."""
    rng = np.random.default_rng(0)
    for level in (2, 4, 8):
        game = _game(level, "last")
        copy_wins = nine_wins = 0
        for seed in range(900):
            game.reset(seed=seed)
            assert len(set(game.digits)) == level
            key = key_digit(game.digits, "last")
            copy_wins += key == game.digits[rng.integers(level)]
            nine_wins += key == 9
        assert abs(copy_wins / 900 - 1 / level) < 0.06
        assert abs(nine_wins / 900 - 1 / 10) < 0.04


def test_the_constant_key_variant_rewards_its_digit_whatever_is_shown():
    namespace = {"random": random, "re": re}
    exec(render_program(5, "first", constant_key=7), namespace)  # noqa: S102
    game = namespace["KeyDigitEnv"]()
    for seed in range(10):
        game.reset(seed=seed)
        assert game.step("\\boxed{7}")[1] == 1.0
    with pytest.raises(ValueError, match="constant_key"):
        render_program(3, "last", constant_key=12)
