"""The chain family (spade_jax/toy/chain.py) and its toy world (toy/chain_world.py):
programs validate in the recipe's contract and pass gymnasium's checker, the score is as
documented, difficulty grows with the level under the warm start's policy, and the warm
start's agent targets carry no successor information above level 1."""

import dataclasses
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


def _game(level, base=5, length_rule="partial"):
    namespace = {"random": random, "re": re}
    exec(chain.render_program(level, base, length_rule), namespace)  # noqa: S102 - the project's own program
    return namespace["ChainEnv"]()


@pytest.mark.parametrize("base,length_rule", [(3, "partial"), (5, "partial"),
                                              (5, "exact_length")])
def test_every_levels_program_passes_the_recipe_contracts_validation(base, length_rule):
    for level in chain.LEVELS:
        source = chain.render_program(level, base, length_rule)
        report = validate_program(source, contract="reference")
        assert report.ok, (level, report)
        assert chain.program_level(source) == level and chain.program_base(source) == base
        assert chain.program_length_rule(source) == length_rule


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
    for level in (0, chain.MAX_LEVEL + 1, 2.0):
        with pytest.raises(ValueError, match="level"):
            chain.render_program(level)
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
    assert {hint for _, hint in hint_pairs(CONFIG, seed=0)} == {"Cycle: 0 1 2 3 4 0."}


def test_hint_following_examples_follow_other_tables_and_never_the_games_own():
    config = ToyConfig(enabled=True, family="chain", agent_examples=30, chain_hint_following=600)
    examples = _agent_examples(config, 0)
    assert len(examples) == 630
    assert _agent_examples(ToyConfig(enabled=True, family="chain", agent_examples=30), 0) == \
        examples[:30]  # the no-hint examples do not change
    pattern = (r"Start: (\d)\. Length: (\d)\.\n\nHINT: Cycle: ((?:\d )+)0\.")
    tables, levels = set(), set()
    for (observation,), target in examples[30:]:
        start, level, cycle = re.fullmatch(pattern, observation).groups()
        start, level = int(start), int(level)
        cycle = [int(d) for d in cycle.split()]
        digits = [int(d) for d in re.fullmatch(r"\\boxed\{([0-9 ]*)\}", target).group(1).split()]
        # the answer walks the hint's cycle from the start (by hand, not chain.follow)
        expected = [start]
        while len(expected) < level:
            expected.append(cycle[(cycle.index(expected[-1]) + 1) % len(cycle)])
        assert digits == expected
        assert sorted(cycle) == list(range(5)) and cycle[0] == 0
        tables.add(tuple(cycle))
        levels.add(level)
    assert (0, 1, 2, 3, 4) not in tables  # the games' own table is never shown answered
    assert len(tables) == 23 and levels == {2, 3, 4, 5, 6}  # every other 5-cycle; one wrap
    assert chain.follow([0, 1, 2, 3, 4], 3, 4) == chain.target(3, 4)
    with pytest.raises(ValueError, match="once each from 0"):
        chain.cycle_hint([1, 0, 2])


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


# Level 3, start 3, base 5: the target is 3 4 0. Scores worked out by hand for each rule.
HAND_SCORES = [  # answer, partial, exact_length
    ("\\boxed{3 4 0}", 1.0, 1.0),
    ("\\boxed{340}", 1.0, 1.0),
    ("\\boxed{3 4 1}", 2 / 3, 2 / 3),        # right length, 2 leading digits right
    ("\\boxed{3 0 0}", 1 / 3, 1 / 3),        # the first right only (the third does not count)
    ("\\boxed{4 4 0}", 0.0, 0.0),            # wrong first digit
    ("\\boxed{3 4}", 2 / 3, 0.0),            # stops early: partial credit only under "partial"
    ("\\boxed{3}", 1 / 3, 0.0),
    ("\\boxed{3 4 0 1}", 3 / 4, 0.0),        # one digit too many
    ("\\boxed{}", 0.0, 0.0),
    ("3 4 0", 0.0, 0.0),                     # malformed
]


@pytest.mark.parametrize("answer,partial,exact", HAND_SCORES)
def test_the_exact_length_rule_scores_zero_unless_the_answer_has_level_digits(
        answer, partial, exact):
    """Both rules' programs (as the sandbox runs them) and the host-side ``chain.score``
    agree with the hand-computed scores of a level-3 game whose start is 3."""
    seed = next(s for s in range(100) if random.Random(s).randrange(5) == 3)
    digits = [int(d) for d in re.findall(r"\d", answer)] if answer.startswith("\\boxed") \
        else None
    for rule, want in (("partial", partial), ("exact_length", exact)):
        game = _game(3, 5, rule)
        assert game.reset(seed=seed)[0] == "Start: 3. Length: 3."
        _, reward, done, _, _ = game.step(answer)
        assert reward == pytest.approx(want) and done, (rule, answer)
        if digits is not None:
            assert chain.score(digits, 3, 3, 5, rule) == pytest.approx(want), (rule, answer)
    with pytest.raises(ValueError, match="length rule"):
        chain.score([3], 3, 3, 5, "longest")


def test_the_exact_length_program_scores_alike_in_the_sandbox():
    with EnvPool(SandboxConfig(call_deadline_s=3.0, spare_workers=1)) as pool:
        env = make_env(chain.render_program(3, 5, "exact_length"), pool, contract="reference",
                       max_turns=1)
        observation, _ = env.reset(seed=7)
        start = int(re.match(r"Start: (\d)", observation).group(1))
        right = chain.target(start, 3)
        for answer, want in ((right, 1.0), (right[:2], 0.0), (right + [0], 0.0),
                             (right[:2] + [(right[2] + 1) % 5], 2 / 3)):
            env.reset(seed=7)
            reward = env.step(chain.answer_text(answer))[1]
            assert reward == pytest.approx(want) == pytest.approx(
                chain.score(answer, start, 3, 5, "exact_length"))
        env.close()


def test_the_length_rule_reaches_the_pool_the_designer_targets_and_the_grid():
    config = ToyConfig(enabled=True, family="chain", pool_levels=(2, 3),
                       chain_length_rule="exact_length")
    assert [chain.program_length_rule(p) for p, _, _ in fixed_pool(config)] == \
        ["exact_length"] * 2
    assert {chain.program_length_rule(recipe_program(target)) for _, target in
            designer_pairs(config, lambda *a: [{"role": "user", "content": ""}], seed=0)} == \
        {"exact_length"}
    grid = heldout_grid(config, seed=1)
    assert {rule for _, rule, _ in grid} == {"chain_base5_exact_length"}
    assert family_render_program(3, grid[0][1]) == chain.render_program(3, 5, "exact_length")
    # The default is unchanged: partial credit, the grid rule's old name, the old seeds.
    assert ToyConfig().chain_length_rule == "partial"
    assert heldout_grid(CONFIG, seed=1)[0][1] == "chain_base5"
    assert [s for _, _, s in heldout_grid(CONFIG, seed=1)] == [s for _, _, s in grid]
    assert family_render_program(3, "chain_base5") == chain.render_program(3, 5)
    assert chain.program_length_rule(chain.render_program(3, 5)) == "partial"
    with pytest.raises(ValueError, match="toy.chain_length_rule"):
        ToyConfig(chain_length_rule="longest")
    # The exact-length rule's held-out readings: a wrong-length answer reads as no copy.
    m = heldout_metrics([(3, "chain_base5_exact_length", 0)] * 2, [0.0, 2 / 3])
    assert m["eval/toy/copy_rate"] == 0.5 and m["eval/toy/lookup_rate"] == 0.5


def test_a_chain_runs_tokenizer_is_trained_on_the_chain_worlds_text(tmp_path):
    """``run.build_tokenizer`` hands the run's ``ToyConfig`` to the toy tokenizer text, so
    a chain run's tokenizer knows the chain observations, programs and skill text (before,
    it was trained on the key-digit world's text whatever the family)."""
    from spade_jax.experiment import TokenizerSpec, load_experiment
    from spade_jax.run import _loop_prompt_text, build_tokenizer
    from spade_jax.spade.skills import CHAIN, KEY_DIGIT, get_skill_set

    config = load_experiment("chain:check")
    assert get_skill_set(config.spade.skills) == (CHAIN,)
    assert config.toy.chain_length_rule == "exact_length"  # the chain experiments' rule
    assert f"'{CHAIN.name}': {CHAIN.description}" in _loop_prompt_text(config.toy)
    assert f"'{KEY_DIGIT.name}'" in _loop_prompt_text() == _loop_prompt_text(ToyConfig())
    tokenizer = build_tokenizer(TokenizerSpec(vocab_size=400, text="toy"), tmp_path, config.toy)
    text = (tmp_path / "tokenizer" / "toy_world.txt").read_text()
    assert "Start: 3. Length: 4." in text and "Digits: " not in text
    assert chain.render_program(4, 5, "exact_length") in text
    assert f"'{CHAIN.name}'" in text
    # One piece per digit, so every answer digit is a token the policy writes on its own.
    pieces = [tokenizer.decode([t]) for t in tokenizer.encode("\\boxed{3 4 0 1}")]
    assert [p.strip() for p in pieces if p.strip().isdigit()] == ["3", "4", "0", "1"]
    # The key-digit world's tokenizer text is unchanged (no config, or a key-digit one).
    assert tokenizer_text(ToyConfig()) == tokenizer_text() and "Digits: " in tokenizer_text()


def test_the_pairs_hint_writes_each_digits_successor_as_one_piece(tmp_path):
    """``chain_hint_form="pairs"``: the hint lists ``d>next`` for every digit in digit
    order (checked by hand against the cycle), the hint writer's targets, the
    hint-following examples and the tokenizer text use it, and the run's tokenizer keeps
    every piece one token (the default cycle form's tokenizer text is unchanged)."""
    from spade_jax.experiment import TokenizerSpec
    from spade_jax.run import build_tokenizer

    assert chain.hint_for(5, "pairs") == "Next: 0>1 1>2 2>3 3>4 4>0."
    assert chain.table_hint([0, 3, 1, 4, 2], "pairs") == "Next: 0>3 1>4 2>0 3>1 4>2."
    assert chain.pairs_hint([2, 0, 0]) == "Next: 0>2 1>0 2>0."  # any table, not only cycles
    with pytest.raises(ValueError, match="another digit"):
        chain.pairs_hint([0, 2, 1])
    assert chain.hint_for(3, "cycle") == chain.hint_for(3) == "Cycle: 0 1 2 0."
    assert len(chain.pair_symbols(5)) == 20 and "2>2" not in chain.pair_symbols(5)
    with pytest.raises(ValueError, match="hint form"):
        chain.table_hint([0, 1, 2], "table")
    with pytest.raises(ValueError, match="toy.chain_hint_form"):
        ToyConfig(chain_hint_form="table")

    config = ToyConfig(enabled=True, family="chain", agent_examples=6, chain_hint_following=300,
                       chain_hint_form="pairs")
    assert {hint for _, hint in hint_pairs(config, 0)} == {"Next: 0>1 1>2 2>3 3>4 4>0."}
    pattern = r"Start: (\d)\. Length: (\d)\.\n\nHINT: Next: ((?:\d>\d ?)+)\."

    def checked_table_and_level(observation: str, target: str) -> tuple[str, int]:
        """The example's hint table and level, after checking its answer walks the table
        from the start (by hand) and the table is never the games' own."""
        start, level, table = re.fullmatch(pattern, observation).groups()
        successor = dict(pair.split(">") for pair in table.split())
        assert sorted(successor) == list("01234") and successor != {
            "0": "1", "1": "2", "2": "3", "3": "4", "4": "0"}  # never the games' own table
        expected = [start]
        while len(expected) < int(level):
            expected.append(successor[expected[-1]])
        assert target == "\\boxed{" + " ".join(expected) + "}"
        return table, int(level)

    tables, levels = zip(*(checked_table_and_level(observation, target)
                           for (observation,), target in _agent_examples(config, 0)[6:]), strict=True)
    # far more tables than examples could teach by heart; hinted copying at level 1 too
    assert len(set(tables)) > 250 and set(levels) == {1, 2, 3, 4, 5, 6}
    # chain_hint_max_level extends the hinted answers to every level (the table wraps)
    longer = dataclasses.replace(config, chain_hint_max_level=9)
    assert {checked_table_and_level(observation, target)[1]
            for (observation,), target in _agent_examples(longer, 0)[6:]} == set(range(1, 10))
    with pytest.raises(ValueError, match="toy.chain_hint_max_level"):
        ToyConfig(chain_hint_max_level=10)
    with pytest.raises(ValueError, match="chain_hint_form='pairs'"):
        ToyConfig(chain_hint_max_level=1)  # the cycle form's examples start at level 2
    assert ToyConfig(chain_hint_max_level=1, chain_hint_form="pairs").chain_hint_max_level == 1
    assert "Next: 0>1" in tokenizer_text(config) and "Next:" not in tokenizer_text(CONFIG)

    tokenizer = build_tokenizer(TokenizerSpec(vocab_size=400, text="toy"), tmp_path, config)
    hint = chain.pairs_hint([2, 3, 4, 0, 1])
    pieces = [tokenizer.decode([t]) for t in tokenizer.encode(hint)]
    assert [p for p in pieces if ">" in p] == ["0>2", "1>3", "2>4", "3>0", "4>1"]
    assert tokenizer.decode(tokenizer.encode(hint)) == hint


@pytest.mark.parametrize("base", [3, 5, 7, 10])
def test_the_hint_pattern_follows_the_base_and_a_stale_one_is_refused(base):
    """`chain:hint`/`toy` keep only hints in the pairs table's form; the pattern is built
    from the base, and a run that changes the base under another base's pattern (every
    hint rejected, no hint arm, silently: seen 2026-12-07 with `--set toy.chain_base=7`)
    is refused before it starts, with the pattern it needs in the message."""
    from spade_jax.experiment import check_warm_start, load_experiment

    pattern = chain.pairs_hint_pattern(base)
    assert re.fullmatch(pattern, chain.hint_for(base, "pairs"))
    other = [(d + 2) % base if (d + 2) % base != d else (d + 1) % base for d in range(base)]
    assert re.fullmatch(pattern, chain.pairs_hint(other))  # any table in the form
    assert not re.fullmatch(pattern, chain.hint_for(base, "cycle"))
    assert not re.fullmatch(pattern, chain.pairs_hint(other)[:-1])  # no closing stop
    if base != 5:
        assert not re.fullmatch(pattern, chain.hint_for(5, "pairs"))

    check_warm_start(load_experiment("toy"))  # base 5 and its own pattern
    stale = load_experiment("toy", [f"toy.chain_base={base}"])
    if base == 5:
        check_warm_start(stale)
        return
    with pytest.raises(ValueError, match="rejects the hint of the run's own games") as error:
        check_warm_start(stale)
    assert chain.pairs_hint_pattern(base) in str(error.value)
    check_warm_start(load_experiment("toy", [f"toy.chain_base={base}",
                                            f"spade.hint_pattern=r'{pattern}'"]))
    # Without a hint arm there is nothing to filter.
    check_warm_start(load_experiment("toy", [f"toy.chain_base={base}",
                                            "spade.hint_mode='none'"]))


def test_a_hint_budget_that_cuts_the_bases_hint_is_refused_once_the_tokenizer_exists(tmp_path):
    """Base 7's table is 17 tokens under the toy tokenizer (base 5's 13), past the 16 that
    `chain:hint` gives the hint writer: every hint would be cut and none used. The run
    stops after training its tokenizer (`python -m spade_jax.train` prints one error line,
    exit 2) naming the budget it needs."""
    from spade_jax.experiment import ConfigProblemAtStart, check_chain_hint_fits, load_experiment
    from spade_jax.run import build_tokenizer

    pattern = chain.pairs_hint_pattern(7)
    config = load_experiment("toy", ["toy.chain_base=7", f"spade.hint_pattern=r'{pattern}'"])
    tokenizer = build_tokenizer(config.tokenizer, tmp_path, config.toy)
    needed = len(tokenizer.encode(chain.hint_for(7, "pairs"))) + 1
    assert needed > config.spade.hint_max_tokens == 16
    with pytest.raises(ConfigProblemAtStart, match=f"set spade.hint_max_tokens={needed} or more"):
        check_chain_hint_fits(config, tokenizer)
    check_chain_hint_fits(load_experiment("toy", [
        "toy.chain_base=7", f"spade.hint_pattern=r'{pattern}'",
        f"spade.hint_max_tokens={needed}"]), tokenizer)
    check_chain_hint_fits(load_experiment("toy", ["toy.chain_base=7", "spade.hint_mode='none'"]),
                          tokenizer)


def test_a_higher_top_level_reaches_the_warm_start_tokenizer_pool_and_grid():
    """`toy.chain_max_level` (default 9) moves the family's top level: the designer's
    programs, the agent's answers and the fixed pool then reach it, the tokenizer sees its
    observations, and the held-out grid may name it; the default run's data is unchanged."""
    config = ToyConfig(enabled=True, family="chain", chain_max_level=12,
                       designer_level_weights=(1,) * 12, heldout_levels=(2, 10, 12),
                       agent_examples=300, chain_hint_following=200, chain_hint_max_level=9)

    def prompt(skill, documents, examples):
        return [{"role": "user", "content": f"{skill} {examples}"}]

    designed = {chain.program_level(recipe_program(t)) for _, t in designer_pairs(config, prompt, 0)}
    assert designed == set(range(1, 13))
    answered = set()
    for (observation,), target in _agent_examples(config, 0)[:300]:
        level = int(re.fullmatch(r"Start: \d\. Length: (\d+)\.", observation).group(1))
        digits = re.fullmatch(r"\\boxed\{([0-9 ]*)\}", target).group(1).split()
        assert len(digits) == level
        answered.add(level)
    assert answered == set(range(1, 13))
    hinted = {int(re.search(r"Length: (\d+)\.", obs).group(1))
              for (obs,), _ in _agent_examples(config, 0)[300:]}
    assert max(hinted) == 9  # hint following still stops at chain_hint_max_level
    assert [chain.program_level(p) for p, _, _ in fixed_pool(config)] == list(range(1, 13))
    assert "Length: 12." in tokenizer_text(config)
    assert "Length: 10." not in tokenizer_text(CONFIG)
    level, rule, episode_seed = heldout_grid(config, seed=0)[-1]
    assert level == 12 and family_render_program(level, rule) == chain.render_program(12, 5)
    game = _game(12)
    game.reset(seed=episode_seed)
    assert game.step(chain.answer_text(chain.target(game.start, 12)))[1] == 1.0
    # the default top level is the family's nine levels, byte for byte
    assert ToyConfig(enabled=True, family="chain").chain_max_level == chain.LEVELS[-1] == 9
    assert tokenizer_text(CONFIG) == tokenizer_text(dataclasses.replace(CONFIG, chain_max_level=9))


@pytest.mark.parametrize("kwargs,match", [
    ({"chain_max_level": 12}, "designer_level_weights must be 12 weights"),
    ({"chain_max_level": 17, "designer_level_weights": (1,) * 17}, "chain_max_level must be"),
    ({"chain_max_level": 6, "designer_level_weights": (1,) * 6}, "heldout_levels must be"),
    ({"chain_max_level": 12, "designer_level_weights": (1,) * 12, "chain_hint_max_level": 13},
     "chain_hint_max_level must be"),
])
def test_settings_outside_the_top_level_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ToyConfig(enabled=True, family="chain", **kwargs)
    with pytest.raises(ValueError, match="key-digit family has levels 1..9"):
        ToyConfig(chain_max_level=12, designer_level_weights=(1,) * 12)


def test_an_agent_budget_that_cuts_the_longest_answer_is_refused(tmp_path):
    """At 12 levels the longest spaced answer (`toy.chain_separator=' '`) is 27 tokens under
    the toy tokenizer (the end token makes 28), past the 24 `chain:hint` gives the agent:
    every top-level answer would be cut short and score as wrong. The run stops after its
    tokenizer naming the budget. (`toy`'s unspaced answers fit: 17 tokens at level 12.)"""
    from spade_jax.experiment import ConfigProblemAtStart, check_chain_answer_fits, load_experiment
    from spade_jax.run import build_tokenizer

    twelve = ["toy.chain_max_level=12", "toy.designer_level_weights=" + ",".join("1" * 12),
              "toy.chain_separator=' '"]
    config = load_experiment("toy", twelve)
    tokenizer = build_tokenizer(config.tokenizer, tmp_path, config.toy)
    longest = chain.answer_text(chain.target(4, 12), " ")
    needed = len(tokenizer.encode(longest)) + 1
    assert needed > config.agent.sampler.max_new_tokens == 24
    with pytest.raises(ConfigProblemAtStart,
                       match=f"set agent.sampler.max_new_tokens={needed} or more"):
        check_chain_answer_fits(config, tokenizer)
    check_chain_answer_fits(load_experiment("toy", [*twelve, f"agent.sampler.max_new_tokens={needed}"]),
                            tokenizer)
    # toy's own answers (unspaced) fit at 12 levels, and every nine-level run fits
    unspaced = load_experiment("toy", twelve[:2])
    check_chain_answer_fits(unspaced, build_tokenizer(unspaced.tokenizer, tmp_path / "unspaced",
                                                      unspaced.toy))
    nine = load_experiment("chain:hint")
    check_chain_answer_fits(nine, build_tokenizer(nine.tokenizer, tmp_path / "nine", nine.toy))


def test_toy_twelve_is_toy_with_the_top_level_at_twelve():
    """`toy:twelve` changes only what twelve levels need: the top level, the designer's
    warm-start weights and the held-out grid (levels 10 and 12 added), and the agent's
    budget; hint following stays at 9, so levels 10-12 are beyond the hint's reach."""
    from spade_jax.experiment import load_experiment
    from spade_jax.overrides import diff

    toy, twelve = load_experiment("toy"), load_experiment("toy:twelve")
    assert set(diff(toy, twelve)) == {
        "name", "toy.chain_max_level", "toy.designer_level_weights", "toy.heldout_levels",
        "agent.sampler.max_new_tokens"}
    assert twelve.toy.chain_max_level == 12 and twelve.toy.chain_hint_max_level == 9
    assert set(twelve.toy.heldout_levels) == set(toy.toy.heldout_levels) | {10, 12}
    assert load_experiment("spade_self_generation:toy:twelve").toy == twelve.toy


def test_a_blocklisted_grid_program_is_left_out_of_the_held_out_eval_and_the_run_goes_on():
    """The held-out grid's programs are texts the designer can write too, and a play of
    such a copy past a limit blocklists every copy (seen: a call timing out on an
    overloaded host ended a `toy` run at its next evaluation). The evaluation then plays
    the rest of the grid, logs what it left out and counts it."""
    from types import SimpleNamespace

    from spade_jax.envs import SandboxError
    from spade_jax.experiment import load_experiment
    from spade_jax.run import _toy_eval
    from spade_jax.toy.family import render_program

    config = load_experiment("toy", ["toy.heldout_levels=(2, 3)", "toy.heldout_episodes=2"])
    grid = heldout_grid(config.toy, config.seed)
    played = []

    def run_episodes(specs, seed):
        played.extend(spec.env_id for spec in specs)
        return [SimpleNamespace(return_=1.0) for _ in specs]

    loop = SimpleNamespace(run_episodes=run_episodes)
    with EnvPool(SandboxConfig(call_deadline_s=3.0, spare_workers=1)) as pool:
        whole = _toy_eval(config, loop, pool, step=4)
        assert len(played) == len(grid) and "eval/toy/episodes_not_played" not in whole
        level, rule, _ = grid[0]
        pool.block(render_program(level, rule), SandboxError("timeout", "no reply within 2s"))
        played.clear()
        cut = _toy_eval(config, loop, pool, step=8)
    left_out = sum(1 for lv, rl, _ in grid if (lv, rl) == (level, rule))
    assert 0 < left_out < len(grid) and len(played) == len(grid) - left_out
    assert cut["eval/toy/episodes_not_played"] == left_out
    assert cut["eval/toy/pass@1"] == 1.0  # over the episodes played
    assert {k for k in whole if k.startswith("eval/toy/level_")} >= \
        {k for k in cut if k.startswith("eval/toy/level_")}


def test_toy_replay_is_toy_with_the_masked_replay():
    """`toy:replay` is `toy` plus the three settings its runs were made with (docs/toy_world.md,
    "Keeping the program writing"), and they pass the start-up check."""
    from spade_jax.experiment import check_supervised_replay, load_experiment
    from spade_jax.overrides import diff

    toy, replay = load_experiment("toy"), load_experiment("toy:replay")
    assert set(diff(toy, replay)) == {"name", "spade.supervised_replay",
                                      "spade.supervised_replay_masks_level",
                                      "train.supervised_coef"}
    assert load_experiment("toy", ["spade.supervised_replay=4", "train.supervised_coef=1.0",
                                   "spade.supervised_replay_masks_level=True"]).spade == replay.spade
    check_supervised_replay(replay)
    assert load_experiment("spade_self_generation:toy:replay").spade.supervised_replay == 4
