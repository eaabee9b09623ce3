"""How a designer reply becomes a program (``SpadeConfig.program_extraction``).

    "last_block"  this project's parser (``prompts.parse_designer_output``): the last
                  python-tagged fenced block (or the last untagged one), verbatim; a reply
                  without one is a parse error ("no_program_block").
    "recipe"      the published recipe's reading: the FIRST block opened by a line
                  "```python" and closed by a line starting "```", else the whole reply;
                  then f-string braces are repaired (:func:`repair_fstring_braces`). Every
                  reply yields a program, and validation decides.

Which one runs changes how many programs are valid, so the recipe experiments use
"recipe" (docs/reference_parity.md).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable

from spade_jax.envs.contract import parse_program

# A "```python" line, the block, and a newline before the closing fence (non-greedy: the
# first such block).
_FIRST_PYTHON_BLOCK = re.compile(r"```python\n(.*?)\n```", re.DOTALL)
# A replacement field without nested braces: "{...}".
_FIELD = re.compile(r"\{([^{}]*)\}")
# Repair rounds at most: each fixes the line of one syntax error.
MAX_REPAIR_ROUNDS = 20


def recipe_program(reply: str) -> str:
    """The program the recipe reads from ``reply``: its first python block (else the whole
    reply), with f-string braces repaired."""
    found = _FIRST_PYTHON_BLOCK.search(reply)
    return repair_fstring_braces(found.group(1) if found else reply)


def _is_expression(text: str) -> bool:
    try:
        ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return True


def repair_fstring_braces(source: str, max_rounds: int = MAX_REPAIR_ROUNDS) -> str:
    """Doubles the braces of literal "{...}" that broke an f-string: while the source does
    not parse, on the line of the syntax error every "{inner}" whose inner text is not a
    Python expression becomes "{{inner}}" (a designer writing ``f"\\boxed{answer here}"``
    or ``f"use {}"``). Stops when the source parses, when a round changes nothing, or after
    ``max_rounds``; returns the source as far as it got (validation judges the rest)."""
    for _ in range(max_rounds):
        try:
            parse_program(source)
            return source
        except (SyntaxError, ValueError, RecursionError, MemoryError) as err:
            line_number = getattr(err, "lineno", None)
        lines = source.split("\n")
        if not line_number or not 1 <= line_number <= len(lines):
            return source
        line = lines[line_number - 1]
        fixed = _FIELD.sub(
            lambda m: m.group(0) if _is_expression(m.group(1)) else "{{" + m.group(1) + "}}",
            line)
        if fixed == line:
            return source
        lines[line_number - 1] = fixed
        source = "\n".join(lines)
    return source


def _last_block(reply: str) -> str | None:
    """This project's reading (no hint required): the program, or None for a parse error."""
    from spade_jax.spade.prompts import DesignerOutput, parse_designer_output

    parsed = parse_designer_output(reply, require_hint=False)
    return parsed.program if isinstance(parsed, DesignerOutput) else None


# name -> reply -> program (None: the reply holds no program).
PROGRAM_EXTRACTIONS: dict[str, Callable[[str], str | None]] = {
    "last_block": _last_block,
    "recipe": recipe_program,
}
