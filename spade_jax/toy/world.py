"""The toy world of an experiment: warm-start data, tokenizer text, the fixed-curriculum
pool and the held-out grid, all over the key-digit family (``toy/family.py``).

``ExperimentConfig.toy`` (a :class:`ToyConfig`) switches a run to it. What the warm start
teaches, and what it leaves to RL:

- the designer role: the family's program at levels drawn from ``designer_level_weights``
  (every level appears; easy ones more often), for the loop's own designer prompts, with
  and without memory examples; the level it writes is independent of any example shown,
  so following the agent is left to the designer's RL and the memory;
- the hint writer: a program -> the hint its RULE implies (the rule, in the feedback's
  words);
- the agent role: the answer format, and a correct answer at level 1 only (one digit:
  copy it); above level 1 its targets are shown digits drawn at random, so it starts as
  the random-copy policy (1/L at level L).
  It never sees a second turn, a hint, or an instance with more than one digit, so finding
  an extreme, reading the rule from feedback or hint, and not repeating a wrong answer are
  left to RL.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from spade_jax.seeding import Phase, derive_seed, rng
from spade_jax.spade.prompts import hint_writer_messages
from spade_jax.toy.family import (
    LEVELS,
    RULES,
    SKILL,
    as_loop_program,
    designer_reply,
    hint_for,
    observation,
    render_program,
)


@dataclasses.dataclass(frozen=True)
class ToyConfig:
    """The toy world (``enabled=False``: a normal run).

    Attributes:
      enabled: build the warm start, tokenizer, fixed pool and held-out evaluation from
        the key-digit family.
      designer_level_weights: relative frequency of each level in the designer's
        warm-start programs, one weight per level 1..9 (chain family: 1..``chain_max_level``;
        every level must appear: > 0).
      designer_examples: designer warm-start pairs (prompt -> program).
      hint_examples: hint-writer warm-start pairs (program -> hint).
      agent_examples: agent warm-start examples (``agent_sequences``).
      heldout_levels: the held-out grid's levels (``eval/toy/...``); its episodes are
        seeded from Phase.EVAL and never trained on.
      heldout_episodes: held-out episodes per level (half per rule).
      pool: the fixed pool of a ``designer_mode="fixed_pool"`` run: "curriculum" (every
        level and rule: the fixed-curriculum baseline) or "constant_key" (the agent-path
        check's games, whose key is always 7: ``key_digit:check``).
      family: "key_digit" (``toy/family.py``) or "chain" (``toy/chain.py``: count up
        from a start modulo ``chain_base``; every function below then builds from it,
        ``toy/chain_world.py``).
      chain_base: the chain family's base (its digits count up modulo it). A run whose
        ``spade.hint_pattern`` or ``spade.hint_max_tokens`` was set for another base
        (``chain:hint`` and ``toy`` set them for 5) is refused, naming the values the
        base needs (``experiment.check_chain_hint_pattern`` / ``check_chain_hint_fits``).
      pool_levels: the levels of the chain family's fixed pool (empty: every level).
      chain_separator: what separates the digits of the chain warm start's answers: " "
        (``\\boxed{3 4 0}``) or "" (``\\boxed{340}``: each digit is then a token right
        after the digit it succeeds; the tokenizer splits digits).
      chain_length_rule: how a chain answer's length enters its score (``toy/chain.py``):
        "partial" (the share of right leading digits over the longer of answer and target:
        a short answer keeps partial credit) or "exact_length" (0 unless the answer has
        LEVEL digits, else the share of right leading digits). The programs (pool,
        designer warm start, held-out grid) are rendered with it.
      chain_hint_following: extra agent warm-start examples (chain family) that teach
        following a hint in ``chain_hint_form`` on random tables other than the games' own
        (which no example shows; ``chain_world.hint_following_examples``); 0 = none. With
        them the games' hint can help an agent that does not know their table yet
        (regret); without them the hint is text the agent was never shown.
      chain_hint_form: how the chain hint (the policy's hint writer's warm-start target,
        the hint-following examples, the probe's) writes the successor table: "cycle"
        (``Cycle: 0 1 2 3 4 0.``) or "pairs" (``Next: 0>1 1>2 2>3 3>4 4>0.``, each ``d>e``
        one token of the run's tokenizer: ``tokenizer_symbols``).
      chain_hint_max_level: the longest answer the hint-following examples show (levels
        1 .. this; 2 .. this for "cycle"); 0 = ``chain_base + 1`` (one wrap of the table at
        most). Above it the warm-started agent cannot follow the games' hint, so the hint
        arm fails there and the regret term pays nothing for such games.
      chain_max_level: the chain family's top level (the longest answer; 1 ..
        ``chain.MAX_LEVEL``): the warm start's programs, answers and hint-following
        examples, the tokenizer's text and the fixed pool range over 1 .. this. The
        key-digit family has levels 1..9 only. The designer may still write any level;
        this is the range the warm start shows and the config's level lists must be in.
    """

    enabled: bool = False
    designer_level_weights: tuple[float, ...] = (4, 4, 3, 3, 2, 2, 1, 1, 1)
    designer_examples: int = 96
    hint_examples: int = 24
    agent_examples: int = 96
    heldout_levels: tuple[int, ...] = (2, 3, 4, 6, 8)
    heldout_episodes: int = 16
    pool: str = "curriculum"
    family: str = "key_digit"
    chain_base: int = 5
    pool_levels: tuple[int, ...] = ()
    chain_separator: str = " "
    chain_length_rule: str = "partial"
    chain_hint_following: int = 0
    chain_hint_form: str = "cycle"
    chain_hint_max_level: int = 0
    chain_max_level: int = 9

    def __post_init__(self) -> None:
        if self.family not in ("key_digit", "chain"):
            raise ValueError(f"toy.family must be 'key_digit' or 'chain', got {self.family!r}")
        if self.chain_base not in range(3, 11):
            raise ValueError(f"toy.chain_base must be in 3..10, got {self.chain_base!r}")
        if self.family == "chain" and self.pool != "curriculum":
            raise ValueError("toy.pool must be 'curriculum' for the chain family (it has no "
                             "constant-key variant)")
        if self.chain_separator not in (" ", ""):
            raise ValueError(f"toy.chain_separator must be ' ' or '', got "
                             f"{self.chain_separator!r}")
        if self.chain_length_rule not in ("partial", "exact_length"):
            raise ValueError(f"toy.chain_length_rule must be 'partial' or 'exact_length', got "
                             f"{self.chain_length_rule!r}")
        from spade_jax.toy.chain import HINT_FORMS, MAX_LEVEL
        from spade_jax.toy.chain import levels as chain_levels

        try:
            levels = chain_levels(self.chain_max_level)
        except ValueError:
            raise ValueError(f"toy.chain_max_level must be an int in 1..{MAX_LEVEL}, got "
                             f"{self.chain_max_level!r}") from None
        if self.family == "key_digit" and levels != LEVELS:
            raise ValueError(f"toy.chain_max_level is the chain family's; the key-digit family "
                             f"has levels {LEVELS[0]}..{LEVELS[-1]} (got chain_max_level="
                             f"{self.chain_max_level} with family='key_digit')")
        bad = [lv for lv in self.pool_levels if lv not in levels]
        if bad:
            raise ValueError(f"toy.pool_levels must be levels from {levels}, got "
                             f"{self.pool_levels}")
        if self.pool not in ("curriculum", "constant_key"):
            raise ValueError(f"toy.pool must be 'curriculum' or 'constant_key', got {self.pool!r}")
        if len(self.designer_level_weights) != len(levels) or \
                min(self.designer_level_weights) <= 0:
            raise ValueError(f"toy.designer_level_weights must be {len(levels)} weights > 0 "
                             f"(one per level {levels[0]}..{levels[-1]}), got "
                             f"{self.designer_level_weights}")
        for name in ("heldout_levels",):
            bad = [lv for lv in getattr(self, name) if lv not in levels]
            if bad or not getattr(self, name):
                raise ValueError(f"toy.{name} must be non-empty levels from {levels}, got "
                                 f"{getattr(self, name)}")

        if self.chain_hint_form not in HINT_FORMS:
            raise ValueError(f"toy.chain_hint_form must be one of {HINT_FORMS}, got "
                             f"{self.chain_hint_form!r}")
        if self.chain_hint_following < 0:
            raise ValueError(f"toy.chain_hint_following must be >= 0, got "
                             f"{self.chain_hint_following}")
        if self.chain_hint_max_level != 0 and self.chain_hint_max_level not in levels:
            raise ValueError(f"toy.chain_hint_max_level must be 0 (chain_base + 1) or a level "
                             f"from {levels}, got {self.chain_hint_max_level!r}")
        if self.chain_hint_form == "cycle" and self.chain_hint_max_level == 1:
            raise ValueError("toy.chain_hint_max_level=1 needs chain_hint_form='pairs': a "
                             "cycle hint's examples start at level 2 (level 1 is a copy)")
        for name in ("designer_examples", "hint_examples", "agent_examples"):
            if getattr(self, name) < 1:
                raise ValueError(f"toy.{name} must be >= 1, got {getattr(self, name)}")
        if self.heldout_episodes < 2 or self.heldout_episodes % 2:
            raise ValueError(f"toy.heldout_episodes must be even and >= 2 (half per rule), "
                             f"got {self.heldout_episodes}")


Messages = list[dict[str, str]]


def designer_pairs(config: ToyConfig, designer_messages: Any, seed: int) -> list[tuple[Messages, str]]:
    """(designer chat -> program reply) pairs. ``designer_messages(skill, documents,
    examples)`` is the loop's own prompt builder (``Designer._messages``); half the
    prompts carry one memory example (a random level, regime and win rate, as the loop
    shows them), whose level the target does not follow."""
    if config.family == "chain":
        from spade_jax.toy import chain_world

        return chain_world.designer_pairs(config, designer_messages, seed)
    draw = rng(seed, 0, Phase.WARM_START, 0)
    weights = np.asarray(config.designer_level_weights, np.float64)
    weights /= weights.sum()
    pairs = []
    for i in range(config.designer_examples):
        level = int(draw.choice(LEVELS, p=weights))
        rule = RULES[int(draw.integers(len(RULES)))]
        examples = []
        if i % 2:
            example_level = int(draw.choice(LEVELS))
            build_on = bool(draw.integers(2))
            examples = [{"program": as_loop_program(render_program(
                             example_level, RULES[int(draw.integers(2))])),
                         "hint": "", "regime": "frontier" if build_on else "mastered",
                         "win_rate": float(draw.uniform()), "regret": float(draw.uniform(-.2, .6)),
                         "build_on": build_on}]
        pairs.append((designer_messages(SKILL, [], examples),
                      designer_reply(render_program(level, rule))))
    return pairs


def hint_pairs(config: ToyConfig, seed: int) -> list[tuple[Messages, str]]:
    """(hint-writer chat on a program -> its hint) pairs over every level and rule."""
    if config.family == "chain":
        from spade_jax.toy import chain_world

        return chain_world.hint_pairs(config, seed)
    draw = rng(seed, 0, Phase.WARM_START, 1)
    pairs = []
    for _ in range(config.hint_examples):
        level, rule = int(draw.choice(LEVELS)), RULES[int(draw.integers(len(RULES)))]
        pairs.append((hint_writer_messages(as_loop_program(render_program(level, rule))),
                      hint_for(rule)))
    return pairs


def agent_sequences(config: ToyConfig, seed: int, tokenizer: Any, agent: Any) -> list[Any]:
    """The agent's answer format, with no information about the key above level 1, as
    token sequences laid out exactly as the agent loop lays out an episode (its
    ``ChatTurns``: the first prompt, a reply closed by the turn-end token, the feedback
    turn), so a second turn is in the distribution the warm start taught.

    A third of the examples are level-1 first turns whose target is the one digit (the
    level the agent is competent at). The rest are at random levels, first turns and
    second turns (after the family's "Wrong." and the rule), whose target is a shown digit
    drawn uniformly: the format of an answer and the random-copy policy (1/L at level L),
    not which digit is the key. ``agent``: the run's ``AgentLoopConfig``."""
    if config.family == "chain":
        from spade_jax.toy import chain_world

        return chain_world.agent_sequences(config, seed, tokenizer, agent)
    from spade_jax.rollout.agent_loop import ChatTurns
    from spade_jax.spade.warm_start import supervised_sequence, turn_end_id

    turns = ChatTurns(tokenizer, agent.system_prompt, agent.enable_thinking,
                      agent.first_turn_template, agent.observation_role)
    end = turn_end_id(tokenizer)
    out = []
    for prompt, answer in _agent_examples(config, seed):
        ids = turns.first_prompt(prompt[0])
        if len(prompt) == 3:  # a second turn: the first reply, then the feedback
            ids = ids + tokenizer.encode(prompt[1]) + [end] + turns.after_policy(prompt[2], True)
        out.append(supervised_sequence(ids, tokenizer.encode(answer) + [end]))
    return out


def _agent_examples(config: ToyConfig, seed: int) -> list[tuple[tuple[str, ...], str]]:
    """(observation[, first reply, feedback]) -> answer, as text (``agent_sequences``)."""
    if config.family == "chain":
        from spade_jax.toy import chain_world

        return chain_world.agent_examples(config, seed)
    draw = rng(seed, 0, Phase.WARM_START, 2)
    examples = []
    for i in range(config.agent_examples):
        level = 1 if i % 3 == 0 else int(draw.choice(LEVELS))
        digits = [int(d) for d in draw.integers(10, size=level)]
        turns: tuple[str, ...] = (observation(digits),)
        if i % 3 == 2:
            rule = RULES[int(draw.integers(len(RULES)))]
            turns += (f"\\boxed{{{draw.choice(digits)}}}", f"Wrong.\n\nHINT: {hint_for(rule)}")
        examples.append((turns, f"\\boxed{{{draw.choice(digits)}}}"))
    return examples


def tokenizer_text(config: ToyConfig | None = None) -> str:
    """Text the toy tokenizer is trained on: every program, hint and observation shape
    (of the chain family, when ``config`` selects it)."""
    if config is not None and config.family == "chain":
        from spade_jax.toy import chain_world

        return chain_world.tokenizer_text(config.chain_base, config.chain_hint_form,
                                          config.chain_max_level)
    parts = [render_program(level, rule) for level in LEVELS for rule in RULES]
    parts += [hint_for(rule) for rule in RULES]
    parts += [observation(list(range(n))) for n in LEVELS]
    parts += [f"Wrong.\n\nHINT: {hint_for(rule)}" for rule in RULES] + ["Correct."]
    parts += [f"\\boxed{{{d}}}" for d in range(10)]
    return "\n".join(parts)


def tokenizer_symbols(config: ToyConfig | None = None) -> tuple[str, ...]:
    """Strings the toy tokenizer keeps as one token each, beyond the chat markers: a chain
    run's ``d>e`` hint pieces under ``chain_hint_form="pairs"``, else none."""
    if config is not None and config.family == "chain" and config.chain_hint_form == "pairs":
        from spade_jax.toy import chain

        return chain.pair_symbols(config.chain_base)
    return ()


CONSTANT_KEY = 7


def fixed_pool(config: ToyConfig) -> list[tuple[str, str | None, str]]:
    """A fixed-pool run's programs: every level and rule once (drawn uniformly, without
    replacement per pass), of the family or (``pool="constant_key"``) of its
    constant-key variant; hints are written by the policy (hint_mode "self")."""
    if config.family == "chain":
        from spade_jax.toy import chain_world

        return chain_world.fixed_pool(config)
    key = CONSTANT_KEY if config.pool == "constant_key" else None
    return [(as_loop_program(render_program(level, rule, key)), None, SKILL) for level in LEVELS
            for rule in RULES]


def heldout_grid(config: ToyConfig, seed: int) -> list[tuple[int, str, int]]:
    """(level, rule, episode seed) of the held-out evaluation: a fixed grid, the same at
    every evaluation of a run, seeded from Phase.EVAL (training plays are seeded from
    other phases)."""
    if config.family == "chain":
        from spade_jax.toy import chain_world

        return chain_world.heldout_grid(config, seed)
    grid = []
    for level in config.heldout_levels:
        for i in range(config.heldout_episodes):
            rule = RULES[i % len(RULES)]
            grid.append((level, rule, derive_seed(seed, 0, Phase.EVAL, level, i)))
    return grid


def heldout_metrics(grid: Sequence[tuple[int, str, int]], returns: Sequence[float]
                    ) -> dict[str, float]:
    """``eval/toy/pass@1`` (share of held-out episodes solved: a positive score), the
    first-try share, the mean score, and pass@1 per level."""
    if grid and str(grid[0][1]).startswith("chain_base"):  # the chain family's grid
        from spade_jax.toy import chain_world

        return chain_world.heldout_metrics(grid, returns)
    returns_arr = np.asarray(returns, np.float64)
    levels = np.asarray([lv for lv, _, _ in grid])
    out = {"eval/toy/pass@1": float(np.mean(returns_arr > 0)),
           "eval/toy/first_try": float(np.mean(returns_arr >= 1.0)),
           "eval/toy/return_mean": float(np.mean(returns_arr))}
    for level in sorted(set(levels.tolist())):
        out[f"eval/toy/level_{level}/pass@1"] = float(np.mean(returns_arr[levels == level] > 0))
    return out
