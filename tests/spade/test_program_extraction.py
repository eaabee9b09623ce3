"""Issue 30 item 10: how a designer reply becomes a program. The recipe reads the first
```python block, else the whole reply, and repairs f-string braces; this project's
"last_block" reads the last block and refuses a reply without one. Re-derived here from
the recipe's rule on replies where the two differ."""

from __future__ import annotations

import ast
import dataclasses

import pytest

from spade_jax.envs import EnvPool, SandboxConfig
from spade_jax.spade.extraction import PROGRAM_EXTRACTIONS, recipe_program, repair_fstring_braces
from spade_jax.spade.window import Outcome

FIRST = "class FirstEnv:\n    pass"
SECOND = "class SecondEnv:\n    pass"
TWO_BLOCKS = f"Draft:\n```python\n{FIRST}\n```\nFinal:\n```python\n{SECOND}\n```\n"
# Literal braces inside f-strings: a syntax error until they are doubled.
BROKEN_FSTRING = (
    "class BoxEnv:\n"
    "    def reset(self, seed=None):\n"
    "        self.goal = 3\n"
    "        text = f\"Reach {self.goal}; answer \\\\boxed{your move} or {}.\"\n"
    "        return text, {}\n"
)


def test_two_blocks_recipe_takes_the_first_last_block_the_last():
    assert recipe_program(TWO_BLOCKS) == FIRST
    assert PROGRAM_EXTRACTIONS["recipe"](TWO_BLOCKS) == FIRST
    assert PROGRAM_EXTRACTIONS["last_block"](TWO_BLOCKS) == SECOND


def test_no_block_recipe_takes_the_whole_reply():
    reply = "class BareEnv:\n    def reset(self, seed=None):\n        return 'hi', {}\n"
    assert recipe_program(reply) == reply
    assert PROGRAM_EXTRACTIONS["last_block"](reply) is None  # a parse error here


def test_fstring_braces_are_repaired_until_the_program_parses():
    with pytest.raises(SyntaxError):
        ast.parse(BROKEN_FSTRING)
    fixed = recipe_program(f"```python\n{BROKEN_FSTRING}```")
    ast.parse(fixed)  # parses now
    # The expression field stays; the literal ones are doubled.
    assert "{self.goal}" in fixed and "\\\\boxed{{your move}}" in fixed and "{{}}" in fixed
    namespace: dict = {}
    exec(compile(fixed, "<test>", "exec"), namespace)  # noqa: S102 - our own test program
    assert namespace["BoxEnv"]().reset()[0] == "Reach 3; answer \\boxed{your move} or {}."


def test_a_valid_program_is_returned_unchanged_and_hopeless_ones_stop():
    valid = "x = {'a': 1}\ny = f'{x}'\n"
    assert repair_fstring_braces(valid) == valid
    hopeless = "def f(:\n    pass\n"  # not a brace problem: nothing to change
    assert repair_fstring_braces(hopeless) == hopeless


class _CharTokenizer:
    eos_ids = frozenset({0})

    def apply_chat_template(self, messages, add_generation_prompt=False, enable_thinking=True):
        return [ord(c) + 1 for c in "".join(m["content"] for m in messages)]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i - 1) for i in ids if i > 0)


GAME = r'''
class WalkEnv:
    def __init__(self, max_turns=12):
        self.max_turns = max_turns
    def reset(self, seed=None):
        self.turn = self.pos = 0
        return f"Walk to 3 with \\boxed{{step}}.", {}
    def step(self, action):
        self.turn += 1
        if "step" in action:
            self.pos += 1
        if self.pos >= 3:
            return "Arrived.", 1.0, True, False, {}
        return f"At {self.pos}.", self.pos / 3, False, self.turn >= self.max_turns, {}
'''


@pytest.mark.parametrize("mode", ["recipe", "last_block"])
def test_the_designer_reads_replies_by_the_configured_extraction(mode):
    """The loop's designer: a reply whose game comes first (then a draft of a helper) and
    a reply with no fence at all. The recipe validates both games; last_block reads the
    helper of the first and refuses the second."""
    from spade_jax.spade.config import SpadeConfig
    from spade_jax.spade.design import Attempt, Designer
    from spade_jax.spade.memory import EnvironmentMemory, MemoryConfig

    tok = _CharTokenizer()
    replies = [f"```python\n{GAME}\n```\nA helper:\n```python\nx = 1\n```",
               GAME]
    config = dataclasses.replace(SpadeConfig(envs_per_round=2, program_extraction=mode,
                                             probe_episodes=0))
    with EnvPool(SandboxConfig(call_deadline_s=2.0)) as pool:
        designer = Designer(config, tokenizer=tok, pool=pool, generate=None,
                            corpus_sampler=None, memory=EnvironmentMemory(MemoryConfig()),
                            seed=0, max_turns=25)
        batch = [Attempt(i, 0, "Logical Deduction", [1], [ord(c) + 1 for c in r], [])
                 for i, r in enumerate(replies)]
        designer.validate(batch, ["a", "b"], [1, 2])
    outcomes = [a.verdict.outcome for a in batch]
    if mode == "recipe":
        assert outcomes == [Outcome.VALID, Outcome.VALID], [a.verdict for a in batch]
    else:
        assert outcomes == [Outcome.INVALID, Outcome.PARSE_ERROR], [a.verdict for a in batch]
