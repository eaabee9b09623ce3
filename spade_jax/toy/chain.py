"""The toy world's second family: "chain" games, whose per-level skill is an output
mapping (a successor table) rather than an attention pattern (docs/toy_world.md).

Every program is the same short game in the published recipe's contract (a class named
``*Env``, ``\\boxed{}`` actions, the last reward is the score) with two constants at the
top; the designer chooses the level by what it writes:

    LEVEL = 4            # how many digits the answer has (1 .. ToyConfig.chain_max_level)
    BASE = 5             # the digits count up modulo BASE (fixed per run: ToyConfig.chain_base)

The agent sees ``Start: 3. Length: 4.`` and must answer ``\\boxed{3 4 0 1}``: the start,
then each next digit the successor of the previous one (``(d + 1) % BASE``); spaces in
the answer are ignored (``\\boxed{3401}`` is the same answer). One try; the
score is the share of leading digits that are right, over the longer of the answer and
the target (``right / max(LEVEL, len(answer))``: extra digits cost, a malformed answer
scores 0), so 1 only for the exact sequence. That is the ``"partial"`` length rule (the
default, ``ToyConfig.chain_length_rule``); under ``"exact_length"`` an answer whose length
is not LEVEL scores 0 and one of the right length scores ``right / LEVEL`` (so stopping
early, which partial credit pays for, earns nothing: the length is part of the skill).
So:

- level 1 is a copy (the warm start's format); each further digit is one lookup of the
  successor table, the same table at every level and for every start;
- a policy that copies the start and draws the rest uniformly from ``range(BASE)`` solves
  level L (the whole sequence) with chance ``BASE ** -(L - 1)``, and its expected score
  is ``sum_k BASE**-k / L`` for k = 0..L-1 (partial credit: ``expected_random_score``;
  the same under both length rules, since it writes L digits);
- the hint (``hint_for``) states the table as its cycle (``Cycle: 0 1 2 3 4 0.``) or as
  successor pairs (``Next: 0>1 1>2 2>3 3>4 4>0.``, ``ToyConfig.chain_hint_form``): a
  strategy that holds for every start, not an episode's answer (the start is drawn per
  episode). The warm start can teach following such a hint on *other* tables
  (``ToyConfig.chain_hint_following``), so the hint helps an agent that does not know
  this table yet, and RL on no-hint plays is what learns it.

This module imports nothing of the package but ``env_stats`` (as ``family`` does), so
``family.render_program`` can render a chain program for the held-out eval.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from spade_jax.spade.env_stats import stated_level

# The family's levels by default (``ToyConfig.chain_max_level`` = 9); a run may reach up to
# ``MAX_LEVEL`` (``levels``): the answer is then that many digits long.
LEVELS: tuple[int, ...] = tuple(range(1, 10))
MAX_LEVEL = 16
BASES: tuple[int, ...] = (3, 4, 5, 6, 7, 8, 9, 10)
DEFAULT_BASE = 5
# The held-out grid's and the fixed pool's "rule" slot for a chain game of this base: the
# run's held-out eval renders ``family.render_program(level, rule)``, which hands a rule
# with this prefix to ``render_program`` below.
GRID_RULE_PREFIX = "chain_base"
# The family's skill name (spade.skills="toy_chain": ``spade_jax.spade.skills.CHAIN``): the
# designer prompts of the warm start and the pool's games name it.
SKILL = "chain"
# How an answer's length enters its score (``ToyConfig.chain_length_rule``; module docstring).
LENGTH_RULES: tuple[str, ...] = ("partial", "exact_length")
# How the hint writes the successor table (``ToyConfig.chain_hint_form``; ``table_hint``).
HINT_FORMS: tuple[str, ...] = ("cycle", "pairs")
DEFAULT_LENGTH_RULE = "partial"
# The score line of each rule's program (``right`` leading digits of ``answer`` are right).
_SCORE_LINES = {
    "partial": "score = right / max(LEVEL, len(answer))",
    "exact_length": "score = right / LEVEL if len(answer) == LEVEL else 0.0",
}

_PROGRAM = '''\
LEVEL = {level}
BASE = {base}


class ChainEnv:
    def reset(self, seed=None):
        self.start = random.Random(seed).randrange(BASE)
        return "Start: %d. Length: %d." % (self.start, LEVEL), {{}}

    def step(self, action):
        target = [str((self.start + i) % BASE) for i in range(LEVEL)]
        found = re.fullmatch(r"\\\\boxed\\{{([0-9 ]*)\\}}", action.strip())
        answer = list(found.group(1).replace(" ", "")) if found else []
        right = 0
        for got, want in zip(answer, target):
            if got != want:
                break
            right += 1
        {score_line}
        return ("Correct." if score == 1 else "Wrong."), score, True, False, {{}}
'''

_BASE_LINE = re.compile(r"^BASE\s*=\s*(\d+)\s*$", re.M)


def levels(max_level: int = LEVELS[-1]) -> tuple[int, ...]:
    """The family's levels 1 .. ``max_level`` (``ToyConfig.chain_max_level``)."""
    if not isinstance(max_level, int) or not 1 <= max_level <= MAX_LEVEL:
        raise ValueError(f"chain max level must be an int in 1..{MAX_LEVEL}, got {max_level!r}")
    return tuple(range(1, max_level + 1))


def _check(level: int, base: int, length_rule: str = DEFAULT_LENGTH_RULE) -> None:
    if not isinstance(level, int) or not 1 <= level <= MAX_LEVEL:
        raise ValueError(f"chain level must be an int in 1..{MAX_LEVEL}, got {level!r}")
    if base not in BASES:
        raise ValueError(f"chain base must be one of {BASES}, got {base!r}")
    if length_rule not in LENGTH_RULES:
        raise ValueError(f"chain length rule must be one of {LENGTH_RULES}, got {length_rule!r}")


def render_program(level: int, base: int = DEFAULT_BASE,
                   length_rule: str = DEFAULT_LENGTH_RULE) -> str:
    """The chain game at ``level`` (the answer's length) counting modulo ``base``, scored
    by ``length_rule`` (``LENGTH_RULES``; the ``"partial"`` program is the one the family
    had before the rule existed, byte for byte)."""
    _check(level, base, length_rule)
    return _PROGRAM.format(level=level, base=base, score_line=_SCORE_LINES[length_rule])


def program_level(source: str) -> int | None:
    """The level a program states (its ``LEVEL = n`` line), None if it states none."""
    return stated_level(source)


def program_base(source: str) -> int | None:
    match = _BASE_LINE.search(source)
    return int(match.group(1)) if match else None


def program_length_rule(source: str) -> str | None:
    """The length rule a chain program scores by (its score line), None if neither."""
    found = [rule for rule, line in _SCORE_LINES.items() if line in source]
    return found[0] if len(found) == 1 else None


def grid_rule(base: int, length_rule: str = DEFAULT_LENGTH_RULE) -> str:
    """The held-out grid's rule slot for chain games of ``base`` scored by ``length_rule``:
    ``chain_base5`` (partial: the name it had before the rule existed) or
    ``chain_base5_exact_length``."""
    _check(1, base, length_rule)
    suffix = "" if length_rule == DEFAULT_LENGTH_RULE else f"_{length_rule}"
    return f"{GRID_RULE_PREFIX}{base}{suffix}"


def _parse_rule(rule: object) -> tuple[int, str] | None:
    if not isinstance(rule, str) or not rule.startswith(GRID_RULE_PREFIX):
        return None
    base, _, length_rule = rule[len(GRID_RULE_PREFIX):].partition("_")
    return int(base), length_rule or DEFAULT_LENGTH_RULE


def base_of_rule(rule: str) -> int | None:
    """The base a grid rule names (``grid_rule``), None for any other rule."""
    parsed = _parse_rule(rule)
    return parsed[0] if parsed else None


def length_rule_of_rule(rule: str) -> str | None:
    """The length rule a grid rule names (``grid_rule``), None for any other rule."""
    parsed = _parse_rule(rule)
    return parsed[1] if parsed else None


def render_grid_program(level: int, rule: str) -> str:
    """The chain program a held-out grid entry ``(level, rule)`` names (``grid_rule``)."""
    parsed = _parse_rule(rule)
    if parsed is None:
        raise ValueError(f"not a chain grid rule: {rule!r}")
    return render_program(level, *parsed)


def observation(start: int, level: int) -> str:
    """The first observation of an episode (as the program writes it)."""
    return f"Start: {start}. Length: {level}."


def target(start: int, level: int, base: int = DEFAULT_BASE) -> list[int]:
    """The right answer's digits (as the program computes them)."""
    return [(start + i) % base for i in range(level)]


def answer_text(digits: list[int] | tuple[int, ...], separator: str = " ") -> str:
    """An answer as the warm start writes it: the digits joined by ``separator`` (the
    program ignores spaces, so ``\\boxed{3 4 0}`` and ``\\boxed{340}`` score alike)."""
    return "\\boxed{" + separator.join(str(d) for d in digits) + "}"


def score(answer: list[int] | tuple[int, ...], start: int, level: int,
          base: int = DEFAULT_BASE, length_rule: str = DEFAULT_LENGTH_RULE) -> float:
    """The program's score of an answer, computed here for tests and analyses: the share
    of right leading digits over the longer of the answer and the target (``"partial"``),
    or 0 unless the answer has ``level`` digits and then the share (``"exact_length"``)."""
    _check(level, base, length_rule)
    right = 0
    for got, want in zip(answer, target(start, level, base), strict=False):
        if got != want:
            break
        right += 1
    if length_rule == "exact_length":
        return right / level if len(answer) == level else 0.0
    return right / max(level, len(answer))


def expected_random_score(level: int, base: int = DEFAULT_BASE) -> float:
    """Expected score of the warm start's policy (the start copied, the other L-1 digits
    uniform over ``range(base)``): leading run k+1 long with chance base^-k."""
    return sum(base ** -k for k in range(level)) / level


def hint_for(base: int = DEFAULT_BASE, form: str = "cycle") -> str:
    """The strategy hint of a chain program: the successor table, as its cycle from 0
    back to 0 (``Cycle: 0 1 2 3 4 0.``) or, ``form="pairs"``, as one ``d>next`` piece per
    digit (``Next: 0>1 1>2 2>3 3>4 4>0.``). It holds for every start, so it is a rule, not
    an episode's answer."""
    _check(1, base)
    return table_hint(range(base), form)


def table_hint(cycle: Sequence[int], form: str = "cycle") -> str:
    """The successor table of ``cycle`` written as a hint in ``form`` (``HINT_FORMS``)."""
    if form == "cycle":
        return cycle_hint(cycle)
    if form == "pairs":
        return pairs_hint(cycle_successors(cycle))
    raise ValueError(f"a chain hint form is one of {HINT_FORMS}, got {form!r}")


def pairs_hint_pattern(base: int) -> str:
    """The regular expression of a pairs hint in table form for ``base`` digits (every
    digit once, in order: ``Next: 0>d 1>d .. (base-1)>d.``): what a chain run's
    ``spade.hint_pattern`` lets through (what each digit is sent to is the writer's)."""
    _check(1, base)
    return "Next: " + " ".join(rf"{d}>\d" for d in range(base)) + r"\."


def cycle_hint(cycle: Sequence[int]) -> str:
    """A successor table written as a hint: its cycle from 0 back to 0. The chain games'
    table is ``0 1 .. base-1``; the warm start's hint-following examples use others."""
    return "Cycle: " + " ".join(str(d) for d in _checked_cycle(cycle) + [0]) + "."


def pairs_hint(successors: Sequence[int]) -> str:
    """A successor table (``successors[d]`` follows digit d) written as one ``d>next``
    piece per digit, in digit order (``Next: 0>1 1>2 2>3 3>4 4>0.`` for the count-up
    table). A chain run's tokenizer keeps each piece one token (``pair_symbols``), so
    following the hint is a lookup of one token by its first digit rather than finding a
    digit in a list and copying the one after it (the cycle form, which the toy's 2-layer
    policy did not learn to follow)."""
    successors = [int(e) for e in successors]
    if any(not 0 <= e < len(successors) or e == d for d, e in enumerate(successors)):
        raise ValueError(f"a pairs hint maps each digit to another digit below "
                         f"{len(successors)}, got {successors}")
    return "Next: " + " ".join(f"{d}>{e}" for d, e in enumerate(successors)) + "."


def cycle_successors(cycle: Sequence[int]) -> list[int]:
    """The successor table of a cycle hint's ``cycle``: entry d is the digit after d."""
    cycle = _checked_cycle(cycle)
    successors = [0] * len(cycle)
    for i, d in enumerate(cycle):
        successors[d] = cycle[(i + 1) % len(cycle)]
    return successors


def pair_symbols(base: int = DEFAULT_BASE) -> tuple[str, ...]:
    """Every ``d>e`` piece a pairs hint of this base can hold (d != e): one token each in
    a chain run's tokenizer."""
    return tuple(f"{d}>{e}" for d in range(base) for e in range(base) if d != e)


def _checked_cycle(cycle: Sequence[int]) -> list[int]:
    cycle = list(cycle)
    if not cycle or cycle[0] != 0 or sorted(cycle) != list(range(len(cycle))):
        raise ValueError(f"a cycle hint lists 0..{len(cycle) - 1} once each from 0, got {cycle}")
    return cycle


def follow(cycle: Sequence[int], start: int, level: int) -> list[int]:
    """``level`` digits from ``start`` on, each the next one of ``cycle`` (wrapping): the
    answer a hint naming ``cycle`` leads to (``target`` for the count-up cycle)."""
    cycle = list(cycle)
    position = cycle.index(start)
    return [cycle[(position + i) % len(cycle)] for i in range(level)]


def follow_table(successors: Sequence[int], start: int, level: int) -> list[int]:
    """``level`` digits from ``start`` on, each ``successors`` of the one before: the
    answer a pairs hint of ``successors`` leads to."""
    digits = [start]
    while len(digits) < level:
        digits.append(int(successors[digits[-1]]))
    return digits
