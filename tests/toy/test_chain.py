"""The chain family (spade_jax/toy/chain.py) and its toy world (toy/chain_world.py):
programs validate in the recipe's contract and pass gymnasium's checker, the score is as
documented, difficulty grows with the level under the warm start's policy, and the warm
start's agent targets carry no successor information above level 1."""

import random
import re

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from spade_jax.envs import EnvPool, make_env, validate_program
from spade_jax.envs.config import SandboxConfig
from spade_jax.spade.extraction import recipe_program
from spade_jax.toy import chain
from spade_jax.toy.family import render_program as family_render_program
from spade_jax.toy.world import (
    ToyConfig,
    _agent_examples,
    designer_pairs,
    fixed_pool,
    heldout_grid,
    heldout_metrics,
    hint_pairs,
    tokenizer_text,
)

CONFIG = ToyConfig(enabled=True, family="chain")


def _game(level, base=5):
    namespace = {"random": random, "re": re}
    exec(chain.render_program(level, base), namespace)  # noqa: S102 - the project's own program
    return namespace["ChainEnv"]()


@pytest.mark.parametrize("base", [3, 5])
def test_every_levels_program_passes_the_recipe_contracts_validation(base):
    for level in chain.LEVELS:
        source = chain.render_program(level, base)
        report = validate_program(source, contract="reference")
        assert report.ok, (level, report)
        assert chain.program_level(source) == level and chain.program_base(source) == base


def test_gymnasium_checker_passes_on_the_sandboxed_game():
    with EnvPool(SandboxConfig(call_deadline_s=3.0, spare_workers=1)) as pool:
        env = make_env(chain.render_program(4), pool, contract="reference", max_turns=1)
        check_env(env, skip_render_check=True)
        observation, _ = env.reset(seed=5)
        assert re.fullmatch(r"Start: [0-4]\. Length: 4\.", observation)
        env.close()


def test_the_score_is_the_share_of_right_leading_digits():
    game = _game(4)
    for seed in range(10):
        observation, _ = game.reset(seed=seed)
        start = int(re.match(r"Start: (\d)", observation).group(1))
        right = chain.target(start, 4)
        assert game.step(chain.answer_text(right))[:3] == ("Correct.", 1.0, True)
        wrong_third = right[:2] + [(right[2] + 1) % 5, right[3]]
        assert game.step(chain.answer_text(wrong_third))[1] == 0.5
        assert game.step(chain.answer_text(right + [0, 0]))[1] == pytest.approx(4 / 6)
        assert game.step("42")[1] == 0.0 and game.step("\\boxed{x}")[1] == 0.0
        for answer in (right, wrong_third, right[:1], right + [1]):
            assert game.step(chain.answer_text(answer))[1] == pytest.approx(
                chain.score(answer, start, 4))
    with pytest.raises(ValueError, match="level"):
        chain.render_program(10)
    with pytest.raises(ValueError, match="base"):
        chain.render_program(3, base=2)


def test_difficulty_grows_with_the_level_under_the_warm_starts_policy():
    """Copy the start, draw the rest uniformly: solved with chance base^-(L-1), mean score
    ``expected_random_score``; both fall with the level. Level 1 is always solved."""
    draw = np.random.default_rng(0)
    solved_by_level, score_by_level = [], []
    for level in (1, 2, 3, 4, 6):
        game, solved, total = _game(level), 0, 0.0
        for seed in range(2000):
            game.reset(seed=seed)
            digits = [game.start] + [int(d) for d in draw.integers(5, size=level - 1)]
            reward = game.step(chain.answer_text(digits))[1]
            solved += reward == 1.0
            total += reward
        solved_by_level.append(solved / 2000)
        score_by_level.append(total / 2000)
        assert abs(solved / 2000 - 5.0 ** -(level - 1)) < 0.03
        assert abs(total / 2000 - chain.expected_random_score(level)) < 0.03
    assert solved_by_level[0] == 1.0
    assert all(a > b for a, b in zip(score_by_level, score_by_level[1:], strict=False))
    assert all(a >= b for a, b in zip(solved_by_level, solved_by_level[1:], strict=False))


def test_agent_targets_teach_format_and_copying_but_no_successor_above_level_one():
    config = ToyConfig(enabled=True, family="chain", agent_examples=3000)
    successor_hits = pairs = level_one = 0
    for (observation,), target in _agent_examples(config, 0):
        start, level = map(int, re.fullmatch(r"Start: (\d)\. Length: (\d)\.",
                                             observation).groups())
        digits = [int(d) for d in re.fullmatch(r"\\boxed\{([0-9 ]*)\}", target).group(1).split()]
        assert len(digits) == level and digits[0] == start  # format and copying
        assert all(d in range(config.chain_base) for d in digits)
        level_one += level == 1
        for prev, nxt in zip(digits, digits[1:], strict=False):
            successor_hits += nxt == (prev + 1) % config.chain_base
            pairs += 1
    assert level_one >= 1000  # a third of the examples: the level the agent is taught
    # Every later digit is uniform: it is the successor at chance rate (1/base).
    assert abs(successor_hits / pairs - 1 / config.chain_base) < 0.02


def test_designer_and_hint_targets_are_chain_programs_at_every_level():
    def prompt(skill, documents, examples):
        return [{"role": "user", "content": f"{skill} {examples}"}]

    levels = []
    for _, target in designer_pairs(CONFIG, prompt, seed=0):
        program = recipe_program(target)
        level = chain.program_level(program)
        assert program.strip() == chain.render_program(level, 5).strip()
        levels.append(level)
    assert set(levels) == set(chain.LEVELS)
    assert {hint for _, hint in hint_pairs(CONFIG, seed=0)} == {"Count up: 0 1 2 3 4 0."}


def test_pool_grid_and_metrics_of_the_chain_world():
    config = ToyConfig(enabled=True, family="chain", pool_levels=(2, 3), chain_base=3)
    assert [chain.program_level(p) for p, _, _ in fixed_pool(config)] == [2, 3]
    assert all(chain.program_base(p) == 3 for p, _, _ in fixed_pool(config))
    grid = heldout_grid(config, seed=1)
    assert grid == heldout_grid(config, seed=1)
    assert len(grid) == len(config.heldout_levels) * config.heldout_episodes
    # The run's eval renders every grid entry with family.render_program: a chain game.
    level, rule, _ = grid[0]
    assert family_render_program(level, rule) == chain.render_program(level, 3)
    for i, (level, _, episode_seed) in enumerate(grid):  # every start equally often
        game = _game(level, 3)
        game.reset(seed=episode_seed)
        assert game.start == i % config.heldout_episodes % 3
    returns = np.random.default_rng(0).choice([0.0, 0.5, 1.0], size=len(grid))
    m = heldout_metrics(grid, returns)
    levels = np.array([lv for lv, _, _ in grid])
    assert m["eval/toy/pass@1"] == pytest.approx(np.mean(returns == 1.0))
    assert m["eval/toy/return_mean"] == pytest.approx(np.mean(returns))
    for lv in config.heldout_levels:
        assert m[f"eval/toy/level_{lv}/pass@1"] == pytest.approx(
            np.mean(returns[levels == lv] == 1.0))
    assert "Start: " in tokenizer_text(config) and "Start: " not in tokenizer_text()


@pytest.mark.parametrize("field,value", [("family", "tree"), ("chain_base", 2),
                                         ("pool_levels", (0,))])
def test_bad_chain_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"toy.{field}"):
        ToyConfig(**{field: value})


def test_lookup_metrics_read_the_warm_start_policy_at_chance_and_the_table_at_one():
    from spade_jax.toy.chain_world import lookup_metrics

    draw = np.random.default_rng(0)
    levels, random_scores, known_scores = [], [], []
    for level in (2, 3, 4, 6):
        for _ in range(2000):
            start = int(draw.integers(5))
            digits = [start] + [int(d) for d in draw.integers(5, size=level - 1)]
            levels.append(level)
            random_scores.append(chain.score(digits, start, level))
            known_scores.append(chain.score(chain.target(start, level), start, level))
    levels = np.array(levels)
    chance = lookup_metrics(levels, np.array(random_scores))
    assert chance["eval/toy/copy_rate"] == 1.0
    assert abs(chance["eval/toy/lookup_rate"] - 0.2) < 0.02
    assert lookup_metrics(levels, np.array(known_scores))["eval/toy/lookup_rate"] == 1.0
    assert lookup_metrics(levels, np.zeros(len(levels)))["eval/toy/copy_rate"] == 0.0


def test_the_unspaced_answer_format_scores_alike_and_still_teaches_no_successor():
    game = _game(3)
    for seed in range(10):
        game.reset(seed=seed)
        for answer in (chain.target(game.start, 3), [game.start, 0, 0], [1, 2]):
            assert game.step(chain.answer_text(answer, ""))[1] == \
                game.step(chain.answer_text(answer))[1] == chain.score(answer, game.start, 3)
    config = ToyConfig(enabled=True, family="chain", chain_separator="", agent_examples=3000)
    hits = pairs = 0
    for (observation,), target in _agent_examples(config, 0):
        start, level = map(int, re.fullmatch(r"Start: (\d)\. Length: (\d)\.",
                                             observation).groups())
        digits = [int(d) for d in re.fullmatch(r"\\boxed\{([0-9]*)\}", target).group(1)]
        assert len(digits) == level and digits[0] == start
        hits += sum(b == (a + 1) % 5 for a, b in zip(digits, digits[1:], strict=False))
        pairs += level - 1
    assert abs(hits / pairs - 0.2) < 0.02
    with pytest.raises(ValueError, match="toy.chain_separator"):
        ToyConfig(chain_separator=",")
