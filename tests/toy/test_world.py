"""The toy world's warm-start data teaches formats, not answers; the held-out grid and
its metrics (checked against a plain NumPy computation)."""

import re

import numpy as np
import pytest

from spade_jax.spade.extraction import recipe_program
from spade_jax.spade.prompts import hint_writer_messages, parse_designer_output
from spade_jax.toy.family import LEVELS, key_digit, program_level, program_rule, render_program
from spade_jax.toy.world import (
    ToyConfig,
    _agent_examples,
    designer_pairs,
    fixed_pool,
    heldout_grid,
    heldout_metrics,
    hint_pairs,
)

CONFIG = ToyConfig(enabled=True)


def _prompt(skill, documents, examples):
    return [{"role": "user", "content": f"{skill} {examples}"}]


def test_designer_targets_are_the_family_at_every_level_independent_of_the_example():
    pairs = designer_pairs(CONFIG, _prompt, seed=0)
    assert len(pairs) == CONFIG.designer_examples
    levels = []
    for _, target in pairs:
        program = recipe_program(target)
        level, rule = program_level(program), program_rule(program)
        assert program.strip() == render_program(level, rule).strip()
        levels.append(level)
    assert set(levels) == set(LEVELS)
    # Easy levels more often, as designer_level_weights says.
    assert np.mean(np.array(levels) <= 2) > np.mean(np.array(levels) >= 8)
    assert designer_pairs(CONFIG, _prompt, seed=0) == pairs  # seeded
    assert designer_pairs(CONFIG, _prompt, seed=1) != pairs


def test_hint_targets_state_the_programs_rule():
    for messages, hint in hint_pairs(CONFIG, seed=0):
        assert hint == f"The key digit is the {program_rule(messages[-1]['content'])}."


def test_agent_targets_carry_no_information_about_the_key_above_level_one():
    config = ToyConfig(enabled=True, agent_examples=3000)
    hits, total = 0, 0
    for turns, target in _agent_examples(config, 0):
        digits = [int(d) for d in re.findall(r"\d", turns[0])]
        answer = int(re.fullmatch(r"\\boxed\{(\d)\}", target).group(1))
        assert answer in digits
        if len(digits) == 1:
            continue
        rule = re.search(r"the (first|last)\.$", turns[-1])
        hits += answer == key_digit(digits, rule.group(1) if rule else "last")
        total += 1
    # Uniform over the shown digits: the key is hit about as often as a random copy hits
    # it (digits repeat, so a little more than 1/L), far from a taught answer.
    assert hits / total < 0.45


def test_agent_examples_are_laid_out_as_the_agent_loop_lays_out_an_episode(tmp_path):
    from spade_jax.rollout.agent_loop import AgentLoopConfig, ChatTurns
    from spade_jax.spade.warm_start import turn_end_id
    from spade_jax.tokenizers import train_sentencepiece
    from spade_jax.toy.world import agent_sequences, tokenizer_text

    (tmp_path / "text.txt").write_text(tokenizer_text())
    tokenizer = train_sentencepiece([tmp_path / "text.txt"], str(tmp_path / "spm"),
                                    vocab_size=400)
    agent = AgentLoopConfig(max_turns=2)
    config = ToyConfig(enabled=True, agent_examples=6)
    turns = ChatTurns(tokenizer, None, False)
    end = turn_end_id(tokenizer)
    for seq, (text, answer) in zip(agent_sequences(config, 0, tokenizer, agent),
                                   _agent_examples(config, 0), strict=True):
        prompt = turns.first_prompt(text[0])
        if len(text) == 3:
            prompt += tokenizer.encode(text[1]) + [end] + turns.after_policy(text[2], True)
        target = tokenizer.encode(answer) + [end]
        assert seq.token_ids == prompt + target
        assert seq.loss_mask == [0] * len(prompt) + [1] * len(target)


def test_heldout_grid_is_fixed_and_metrics_match_numpy():
    grid = heldout_grid(CONFIG, seed=3)
    assert grid == heldout_grid(CONFIG, seed=3)
    assert len(grid) == len(CONFIG.heldout_levels) * CONFIG.heldout_episodes
    assert len({seed for _, _, seed in grid}) == len(grid)
    returns = np.random.default_rng(0).choice([0.0, 0.5, 1.0], size=len(grid))
    m = heldout_metrics(grid, returns)
    levels = np.array([lv for lv, _, _ in grid])
    assert m["eval/toy/pass@1"] == pytest.approx(np.mean(returns > 0))
    assert m["eval/toy/first_try"] == pytest.approx(np.mean(returns == 1.0))
    for level in CONFIG.heldout_levels:
        assert m[f"eval/toy/level_{level}/pass@1"] == pytest.approx(
            np.mean(returns[levels == level] > 0))


@pytest.mark.parametrize("field,value", [("designer_level_weights", (1, 2)),
                                         ("heldout_levels", (0, 3)),
                                         ("heldout_episodes", 3),
                                         ("agent_examples", 0)])
def test_bad_toy_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"toy.{field}"):
        ToyConfig(**{field: value})


def test_fixed_pools_hold_every_level_and_rule():
    from spade_jax.toy.world import CONSTANT_KEY, fixed_pool

    curriculum = fixed_pool(ToyConfig(enabled=True))
    constant = fixed_pool(ToyConfig(enabled=True, pool="constant_key"))
    assert {(program_level(p), program_rule(p)) for p, _, _ in curriculum} == {
        (level, rule) for level in LEVELS for rule in ("first", "last")}
    assert all(f"key = {CONSTANT_KEY}" in p for p, _, _ in constant)
    with pytest.raises(ValueError, match="toy.pool"):
        ToyConfig(pool="easy")


@pytest.mark.parametrize("family", ["key_digit", "chain"])
@pytest.mark.parametrize("extraction", [parse_designer_output, recipe_program])
def test_warm_start_prompts_quote_programs_as_the_loop_holds_them(family, extraction):
    # The hint writer's prompts, the memory examples and a fixed pool's programs must be
    # the text the loop gets by parsing a designer reply: taught on the rendered program
    # (one newline longer), the warm-started chain policy wrote its hint exactly for
    # rendered programs and a malformed one for every program its designer wrote.
    config = ToyConfig(enabled=True, family=family, hint_examples=40)
    shown = []

    def prompt(skill, documents, examples):
        shown.extend(example["program"] for example in examples)
        return [{"role": "user", "content": skill}]

    def read(reply):
        if extraction is recipe_program:
            return extraction(reply)
        return extraction(reply, require_hint=False).program

    held = {read(target) for _, target in designer_pairs(config, prompt, seed=0)}
    assert held and shown and set(shown) <= held
    hinted = {messages[-1]["content"] for messages, _ in hint_pairs(config, seed=0)}
    assert hinted <= {hint_writer_messages(program)[-1]["content"] for program in held}
    assert {program for program, _, _ in fixed_pool(config)} <= held
    # the form differs from the rendered text, so this test would see a regression
    assert not any(program.endswith("\n") for program in held)
