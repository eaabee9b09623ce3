"""The toy task family: "key digit" games whose difficulty is a number the designer writes.

Every program of the family is the same short game in the published recipe's contract (a
class named ``*Env``, ``\\boxed{}`` actions, the last reward is the score) with two
constants at the top, which the designer chooses by what it writes:

    LEVEL = 4            # how many distinct digits are shown (1 .. 9)
    RULE = "last"        # which of them is the key: the "first" or the "last" shown

The agent sees the digits and is told the key is the first or the last one, not which. A
right first answer scores 1; a wrong one is answered with the rule ("Wrong." and "HINT:
The key digit is the last.") and a second chance worth 0.5. So:

- level 1 is trivial (one digit), which is what the warm-started agent can do;
- at level L a policy that copies a shown digit at random wins 1/L of first tries, so the
  high levels give RL almost no signal at the start while the low ones give plenty: the
  skill (find the digit at an end of the list, and read which end from the feedback) is
  learned low and carries upwards, level by level, as the designer raises the level;
- the hint ("The key digit is the last.") carries a strategy, not an answer (the digits
  differ every episode): it is the rule, shown as the second turn's feedback shows it, so
  an agent that has learned to act on the feedback can act on the hint at its first turn.
  It cannot help an agent that cannot yet find an end of the list at that level: regret
  is high where the agent can find it but does not know which end (the frontier), zero
  at level 1 (mastered), low where it cannot find it (intractable).

``render_program`` writes a program, ``program_level`` reads a program's level back (the
``designer/difficulty_mean`` metric), ``hint_for`` is the hint a program's rule implies,
``key_digit`` the key of an instance.
"""

from __future__ import annotations

import re

from spade_jax.spade.env_stats import stated_level
from spade_jax.spade.prompts import DesignerOutput, parse_designer_output

LEVELS: tuple[int, ...] = tuple(range(1, 10))
RULES: tuple[str, ...] = ("first", "last")
# Score of a right answer at the first turn / at the second (after the rule is told).
FIRST_TRY_REWARD = 1.0
SECOND_TRY_REWARD = 0.5
TURNS = 2
SKILL = "key_digit"  # spade.skills="toy" (spade_jax.spade.skills.KEY_DIGIT)

_PROGRAM = '''\
LEVEL = {level}
RULE = "{rule}"


class KeyDigitEnv:
    def reset(self, seed=None):
        self.digits = random.Random(seed).sample(range(10), LEVEL)
        self.turn = 0
        shown = " ".join(map(str, self.digits))
        return "Digits: " + shown + ". The key digit is the first or the last.", {{}}

    def step(self, action):
        self.turn += 1
        key = {key}
        if action.strip() == "\\\\boxed{{%d}}" % key:
            return "Correct.", 1.5 - 0.5 * self.turn, True, False, {{}}
        hint = "HINT: The key digit is the " + RULE + "."
        return "Wrong.\\n\\n" + hint, 0.0, self.turn >= 2, False, {{}}
'''

_RULE_LINE = re.compile(r"^RULE\s*=\s*[\"'](\w+)[\"']\s*$", re.M)


_KEY = 'self.digits[0] if RULE == "first" else self.digits[-1]'


def render_program(level: int, rule: str, constant_key: int | None = None) -> str:
    """The family's program at ``level`` (1..9) with ``rule`` ("first"/"last").

    ``constant_key``: the agent-path check's variant, whose key is this digit whatever is
    shown (a preference RL finds in a dozen updates; ``key_digit:check``)."""
    if isinstance(rule, str) and rule.startswith("chain_base") and constant_key is None:
        # A chain game's held-out grid entry (``toy.family="chain"``): the run's held-out
        # eval renders every grid entry through this function (``spade_jax/toy/chain.py``,
        # which checks the level against its own range).
        from spade_jax.toy import chain

        return chain.render_grid_program(level, rule)
    if level not in LEVELS:
        raise ValueError(f"toy level must be one of {LEVELS}, got {level!r}")
    if rule not in RULES:
        raise ValueError(f"toy rule must be one of {RULES}, got {rule!r}")
    if constant_key is not None and constant_key not in range(10):
        raise ValueError(f"constant_key must be a digit, got {constant_key!r}")
    key = _KEY if constant_key is None else str(constant_key)
    return _PROGRAM.format(level=level, rule=rule, key=key)


def program_level(source: str) -> int | None:
    """The level a program states (its ``LEVEL = n`` line), None if it states none."""
    return stated_level(source)


def program_rule(source: str) -> str | None:
    match = _RULE_LINE.search(source)
    return match.group(1) if match else None


def hint_for(rule: str) -> str:
    """The strategy hint of a program with ``rule``: the rule, in the feedback's words."""
    if rule not in RULES:
        raise ValueError(f"toy rule must be one of {RULES}, got {rule!r}")
    return f"The key digit is the {rule}."


def observation(digits: list[int] | tuple[int, ...]) -> str:
    """The first observation of an episode with these digits (as the program writes it)."""
    return (f"Digits: {' '.join(str(d) for d in digits)}. "
            "The key digit is the first or the last.")


def key_digit(digits: list[int] | tuple[int, ...], rule: str) -> int:
    """The key of an instance showing ``digits`` under ``rule`` (as the program computes it)."""
    if rule not in RULES:
        raise ValueError(f"toy rule must be one of {RULES}, got {rule!r}")
    return digits[0] if rule == "first" else digits[-1]


def designer_reply(program: str) -> str:
    """The designer's warm-start reply for ``program``: the program alone, in a python block."""
    return f"```python\n{program}```"


def as_loop_program(program: str) -> str:
    """``program`` as the loop holds it once the designer's reply is parsed: the text its
    hint writer reads and its memory examples show (the block without the newline before
    the closing fence). The warm start's prompts quote programs in this form: taught on the
    rendered text, one token longer, the warm-started chain policy wrote the successor
    table exactly for rendered programs and a malformed one for every program its own
    designer wrote (docs/toy_world.md, "A hint the agent can follow")."""
    parsed = parse_designer_output(designer_reply(program), require_hint=False)
    if not isinstance(parsed, DesignerOutput):
        raise ValueError(f"a toy program must parse as a designer reply: {parsed}")
    return parsed.program
