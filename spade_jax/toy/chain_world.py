"""The toy world over the chain family (``ToyConfig.family="chain"``; ``toy/chain.py``):
warm-start data, tokenizer text, fixed pool and held-out grid, called by ``toy/world.py``'s
functions of the same names when the config selects this family.

What the warm start teaches, and what it leaves to RL:

- the designer role: the chain program at levels drawn from ``designer_level_weights``,
  for the loop's own designer prompts on the chain skill (``chain.SKILL``; with and
  without a memory example, whose level the target does not follow), at the run's base
  and length rule;
- the hint writer: a program -> its hint (the successor table, in ``chain_hint_form``);
- the agent role: the answer format and level-1 copying, and (``chain_hint_following``)
  following a hint on tables other than the games' own. A third of the examples are
  level 1 (the target is the start); the rest are at random levels, and their target is
  the start followed by LEVEL-1 digits drawn uniformly from ``range(base)``: the length
  and the alphabet of an answer, no successor information
  (``tests/toy/test_chain.py`` checks the targets' second digits hit the successor at
  chance rate). The game has one try, so there are no second turns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from spade_jax.seeding import Phase, derive_seed, rng
from spade_jax.spade.prompts import hint_writer_messages
from spade_jax.toy import chain
from spade_jax.toy.family import as_loop_program, designer_reply

Messages = list[dict[str, str]]


def designer_pairs(config: Any, designer_messages: Any, seed: int) -> list[tuple[Messages, str]]:
    """(designer chat -> chain program) pairs, as ``world.designer_pairs`` builds them for
    the key-digit family (same draws of level and example)."""
    draw = rng(seed, 0, Phase.WARM_START, 0)
    weights = np.asarray(config.designer_level_weights, np.float64)
    weights /= weights.sum()
    base, rule = config.chain_base, config.chain_length_rule
    levels = chain.levels(config.chain_max_level)
    pairs = []
    for i in range(config.designer_examples):
        level = int(draw.choice(levels, p=weights))
        examples = []
        if i % 2:
            example_level = int(draw.choice(levels))
            build_on = bool(draw.integers(2))
            examples = [{"program": as_loop_program(chain.render_program(example_level,
                                                                         base, rule)),
                         "hint": "", "regime": "frontier" if build_on else "mastered",
                         "win_rate": float(draw.uniform()), "regret": float(draw.uniform(-.2, .6)),
                         "build_on": build_on}]
        pairs.append((designer_messages(chain.SKILL, [], examples),
                      designer_reply(chain.render_program(level, base, rule))))
    return pairs


def hint_pairs(config: Any, seed: int) -> list[tuple[Messages, str]]:
    """(hint-writer chat on a chain program -> its hint) pairs over every level."""
    draw = rng(seed, 0, Phase.WARM_START, 1)
    levels = chain.levels(config.chain_max_level)
    return [(hint_writer_messages(as_loop_program(chain.render_program(
                int(draw.choice(levels)), config.chain_base, config.chain_length_rule))),
             chain.hint_for(config.chain_base, config.chain_hint_form))
            for _ in range(config.hint_examples)]


def agent_examples(config: Any, seed: int) -> list[tuple[tuple[str, ...], str]]:
    """(observation,) -> answer text (module docstring: format and copying only), then
    ``chain_hint_following`` hinted examples (``hint_following_examples``)."""
    draw = rng(seed, 0, Phase.WARM_START, 2)
    base, levels = config.chain_base, chain.levels(config.chain_max_level)
    examples = []
    for i in range(config.agent_examples):
        level = 1 if i % 3 == 0 else int(draw.choice(levels))
        start = int(draw.integers(base))
        digits = [start] + [int(d) for d in draw.integers(base, size=level - 1)]
        examples.append(((chain.observation(start, level),),
                         chain.answer_text(digits, config.chain_separator)))
    return examples + hint_following_examples(config, seed)


def hint_following_examples(config: Any, seed: int) -> list[tuple[tuple[str, ...], str]]:
    """(hinted observation,) -> the answer the hint's table leads to, on random tables
    other than the games' count-up one: the first observation as the loop shows a hint
    arm's (``agent_first_observation``). What it teaches is reading a table off the hint;
    the games' table is never shown with an answer, and the no-hint examples stay uniform.

    - ``chain_hint_form="cycle"``: the other cycles through every digit, levels 2 ..
      ``chain_hint_max_level`` (default base + 1: one wrap at most);
    - ``"pairs"``: any table sending each digit to another one (base 5: 1,023 besides the
      games'), levels 1 .. ``chain_hint_max_level``, too many tables to learn the answers
      by heart, so what fits the examples is looking the next digit up in the hint."""
    from spade_jax.rollout.hints import agent_first_observation

    draw = rng(seed, 0, Phase.WARM_START, 3)
    base, form = config.chain_base, config.chain_hint_form
    count_up = [(d + 1) % base for d in range(base)]
    first_level = 1 if form == "pairs" else 2
    last_level = config.chain_hint_max_level or min(base + 1, config.chain_max_level)
    levels = range(first_level, last_level + 1)  # ToyConfig rejects cycle with max 1
    examples = []
    while len(examples) < config.chain_hint_following:
        if form == "pairs":
            # each digit's successor: one of the other base - 1 digits
            successors = [(d + 1 + int(draw.integers(base - 1))) % base for d in range(base)]
            hint = chain.pairs_hint(successors)
        else:
            cycle = [0] + [int(d) + 1 for d in draw.permutation(base - 1)]
            successors = chain.cycle_successors(cycle)
            hint = chain.cycle_hint(cycle)
        if successors == count_up:
            continue
        level, start = int(draw.choice(levels)), int(draw.integers(base))
        observation = agent_first_observation(chain.observation(start, level), hint)
        examples.append(((observation,), chain.answer_text(
            chain.follow_table(successors, start, level), config.chain_separator)))
    return examples


def agent_sequences(config: Any, seed: int, tokenizer: Any, agent: Any) -> list[Any]:
    """``agent_examples`` as token sequences laid out as the agent loop lays out a first
    turn (its ``ChatTurns``), the reply closed by the turn-end token."""
    from spade_jax.rollout.agent_loop import ChatTurns
    from spade_jax.spade.warm_start import supervised_sequence, turn_end_id

    turns = ChatTurns(tokenizer, agent.system_prompt, agent.enable_thinking,
                      agent.first_turn_template, agent.observation_role)
    end = turn_end_id(tokenizer)
    return [supervised_sequence(turns.first_prompt(prompt[0]), tokenizer.encode(answer) + [end])
            for prompt, answer in agent_examples(config, seed)]


def tokenizer_text(base: int = chain.DEFAULT_BASE, hint_form: str = "cycle",
                   max_level: int = chain.LEVELS[-1]) -> str:
    """Every chain program (under both length rules), hint (in ``hint_form``), observation
    and answer shape (both separators), at levels 1 .. ``max_level``."""
    levels = chain.levels(max_level)
    parts = [chain.render_program(level, base, rule) for rule in chain.LENGTH_RULES
             for level in levels]
    parts += [chain.hint_for(base, hint_form), "Correct.", "Wrong."]
    parts += [chain.observation(s, level) for s in range(base) for level in levels]
    parts += [chain.answer_text(chain.target(s, level, base), separator)
              for s in range(base) for level in levels for separator in (" ", "")]
    return "\n".join(parts)


def fixed_pool(config: Any) -> list[tuple[str, str | None, str]]:
    """A fixed-pool run's programs: the chain game at every level of ``pool_levels``
    (every level when empty); hints are written by the policy (hint_mode "self")."""
    levels = config.pool_levels or chain.levels(config.chain_max_level)
    return [(as_loop_program(chain.render_program(level, config.chain_base,
                                                  config.chain_length_rule)), None,
             chain.SKILL) for level in levels]


def heldout_grid(config: Any, seed: int) -> list[tuple[int, str, int]]:
    """(level, rule, episode seed) of the held-out evaluation, seeded from Phase.EVAL as
    the key-digit grid is, every start equally often (``_seed_with_start``); the rule
    slot names the base and the length rule (``chain.grid_rule``), so the run's eval
    renders the run's chain program (``family.render_program``)."""
    rule = chain.grid_rule(config.chain_base, config.chain_length_rule)
    return [(level, rule, _seed_with_start(seed, level, i, i % config.chain_base,
                                           config.chain_base))
            for level in config.heldout_levels for i in range(config.heldout_episodes)]


def _seed_with_start(seed: int, level: int, i: int, start: int, base: int) -> int:
    """The first Phase.EVAL-derived episode seed (in a fixed order) whose start, as the
    program draws it (``random.Random(seed).randrange(base)``), is ``start``: the grid
    shows every start equally often (episode i has start i % base), so a per-level score
    is not skewed by which starts 16 random seeds happened to draw."""
    import random

    for j in range(10_000):
        candidate = derive_seed(seed, 0, Phase.EVAL, level, i, j)
        if random.Random(candidate).randrange(base) == start:
            return candidate
    raise RuntimeError("no seed with that start")  # chance base^-10000


def heldout_metrics(grid: Sequence[tuple[int, str, int]], returns: Sequence[float]
                    ) -> dict[str, float]:
    """``eval/toy/pass@1`` (share of held-out episodes solved exactly: score 1; the game
    has one try, so ``first_try`` is the same), ``eval/toy/return_mean`` (the mean score:
    partial credit), and per level pass@1 and the mean score."""
    returns_arr = np.asarray(returns, np.float64)
    solved = returns_arr >= 1.0 - 1e-9
    levels = np.asarray([lv for lv, _, _ in grid])
    out = {"eval/toy/pass@1": float(np.mean(solved)),
           "eval/toy/first_try": float(np.mean(solved)),
           "eval/toy/return_mean": float(np.mean(returns_arr))}
    for level in sorted(set(levels.tolist())):
        out[f"eval/toy/level_{level}/pass@1"] = float(np.mean(solved[levels == level]))
        out[f"eval/toy/level_{level}/return_mean"] = float(np.mean(returns_arr[levels == level]))
    out.update(lookup_metrics(levels, returns_arr))
    return out


def lookup_metrics(levels: np.ndarray, returns: np.ndarray) -> dict[str, float]:
    """What the scores say about the two skills, reading an episode's score at level L as
    a leading run of ``round(score * L)`` right digits (exact when the answer has L
    digits; a longer answer reads as a shorter run; under the ``"exact_length"`` rule an
    answer of any other length scores 0 and reads as a run of 0, so there ``copy_rate``
    is the share with the right length and first digit, and ``lookup_rate`` counts the
    answers of the right length only):

    ``eval/toy/copy_rate``    share of episodes whose first digit is right (the start
                              copied: the warm start's skill);
    ``eval/toy/lookup_rate``  share of successor lookups right, given the digits before
                              them were (pooled over levels >= 2): 1/base for a policy
                              that does not know the table, 1 for one that does."""
    runs = np.rint(returns * levels).astype(int)
    tried = right = 0
    for level, run in zip(levels.tolist(), runs.tolist(), strict=True):
        if level >= 2 and run >= 1:  # lookups 1 .. run-1 right, lookup `run` (if any) wrong
            tried += min(run, level - 1)
            right += run - 1
    return {"eval/toy/copy_rate": float(np.mean(runs >= 1)),
            "eval/toy/lookup_rate": float(right / tried) if tried else float("nan")}
