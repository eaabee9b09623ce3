"""Role prompts for SPADE's one policy, and the parser for the designer's output.

One policy plays two roles, each with its own system prompt:

- the **Environment Designer** (`DESIGNER_SYSTEM_PROMPT`, `designer_user_prompt`) writes a
  Python environment program and a privileged hint, in the format that
  `parse_designer_output` reads and `format_designer_output` writes;
- the **Reasoning Agent** (`AGENT_SYSTEM_PROMPT`) plays environments. In the hint arm,
  `agent_first_observation` shows it the hint. The program never sees the hint.

For the reference (recipe) contract, games named `*Env` with boxed actions:
`reference_designer_system_prompt` / `reference_designer_user_prompt` ask for one game
(a ```python block, no hint), and the agent gets no system prompt: its first user turn is
`REFERENCE_AGENT_FIRST_TURN_TEMPLATE` (set it as `AgentLoopConfig.first_turn_template`,
with `AgentLoopConfig.action_format="boxed"`), later turns the bare observation.

Designer output format: the hint in `<hint>...</hint>` and the program in a fenced
```python block. The parser is lenient: it accepts a fence with no language tag, the hint
before or after the block, and a fence longer than three backticks. When there are
several program blocks, it takes the last one.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from spade_jax.envs.contract import (
    PROGRAM_CONTRACT,
    REFERENCE_MAX_TURNS,
    render_reference_contract,
    render_tool_contract,
)

# The hint presentation lives in the rollout layer (evaluation uses it too); re-exported
# here, next to the other role prompts.
from spade_jax.rollout.hints import agent_first_observation  # noqa: F401
from spade_jax.spade.skills import SKILL_SETS, Skill

# --------------------------------------------------------------------------- system prompts

DESIGNER_SYSTEM_PROMPT: str = f"""\
You are the Environment Designer. You write training environments for a reasoning agent:
a Python program that the agent interacts with through text, plus a hint for the agent.

{PROGRAM_CONTRACT}
What makes a good environment:
- Its difficulty sits at the agent's frontier. The agent should solve it with the hint but
  usually not without it. Environments the agent always solves teach nothing. So do
  environments nobody can solve, or broken ones.
- A new instance for every seed, drawn with `random.Random(seed)`, so the agent cannot
  memorise answers.
- Multi-turn environments with state and partial rewards are welcome: feedback after each
  step, and partial credit for sub-goals that sums to at most 1.
- The opening observation states the task, not its solution. Do not print the governing
  formula or law. Let the agent infer it, for example from measurements it asks for.
- The program is short and readable, and it parses actions leniently (numbers with
  regular expressions, case-insensitive words).

What makes a good hint: information that substantively helps. Examples are a structural
observation about the problem, the key step of a partial solution, or the quantity to
compute first. The hint is fixed text, while every seed draws a new instance, so it must
not be one instance's answer. A hint that only states an answer string is useless.

Output format: first the hint inside <hint>...</hint>, then the whole program in one
fenced python block. Write nothing after the block.

<hint>your hint for the agent</hint>
```python
import random

class Environment:
    ...
```
"""


# A short designer prompt for CPU-sized policies: a tiny model cannot use 1k tokens of
# instructions, and every designer sequence carries its system prompt through training.
COMPACT_DESIGNER_SYSTEM_PROMPT: str = """\
You are the Environment Designer. Write a Python class Environment with
reset(self, seed=None) -> (observation, info) and
step(self, action) -> (observation, reward, terminated, truncated, info);
text observations and actions, episode return in [0, 1]. Then a hint for the agent.
Output: <hint>...</hint> then one ```python block.
"""

DESIGNER_SYSTEM_PROMPTS: dict[str, str] = {
    "full": DESIGNER_SYSTEM_PROMPT,
    "compact": COMPACT_DESIGNER_SYSTEM_PROMPT,
}


def agent_system_prompt(answer_tag: str | None = None) -> str:
    """The Reasoning Agent's system prompt, matched to the rollout's action parser.

    Pass `answer_tag=None` for the default `ActionParser()`: the visible reply (a leading
    `<think>...</think>` removed) is the action. Pass a tag name to match
    `ActionParser(answer_tag=...)`: the content of the last `<tag>...</tag>` is the action.
    """
    if answer_tag is not None and not re.fullmatch(r"[A-Za-z][\w-]*", answer_tag):
        raise ValueError(f"answer_tag must be a tag name like 'answer', got {answer_tag!r}")
    if answer_tag is None:
        action_rule = (
            "Your whole visible reply is sent to the environment as your action. Reply "
            "with the action only, in the form the environment asks for: no explanation "
            "and no formatting. If you need to think first, put your reasoning inside "
            "<think>...</think>. That part is removed before your reply reaches the "
            "environment."
        )
    else:
        action_rule = (
            f"Put the action inside <{answer_tag}>...</{answer_tag}>, in the form the "
            f"environment asks for. Only the content of the last <{answer_tag}> block is "
            "sent to the environment. Keep any reasoning before it short."
        )
    return (
        "You are the Reasoning Agent. You interact with an environment over one or more "
        "turns. Each user message is the environment's observation, and each of your "
        "replies is one action. The environment gives rewards for correct actions, and "
        "sometimes partial rewards for progress. Read the feedback after each action and "
        f"use it. {action_rule} Be concise."
    )


# Matches the default `spade_jax.rollout.agent_loop.ActionParser()` (no answer tag).
AGENT_SYSTEM_PROMPT: str = agent_system_prompt(None)

# The agent's system prompt under the tool contract (AgentLoopConfig(action_format=
# "tool_call", observation_role="tool")); a Qwen3 chat template appends the tool list.
TOOL_AGENT_SYSTEM_PROMPT: str = (
    "You are the Tool Agent. A user asks for something that you can only do or find out "
    "through the tools listed below. Call tools as <tool_call>{\"name\": ..., "
    "\"arguments\": {...}}</tool_call>, one or several per reply; their results come back "
    "in the next message. Look values up instead of guessing them, and leave tools the "
    "request does not need alone. When the job is done, reply without a tool call: that "
    "reply is your final answer, and it should state what was asked for."
)


# --------------------------------------------------------------------------- reference contract

# The agent's first user turn under the reference contract (no system prompt). Placeholder
# "{observation}" is replaced literally (see AgentLoopConfig.first_turn_template).
REFERENCE_AGENT_FIRST_TURN_TEMPLATE: str = (
    "This is a language game. Choose your moves so that you win.\n"
    "Observation: {observation}\n"
    "Think it through step by step, then write your final answer inside \\boxed{}."
)


def reference_designer_system_prompt(max_turns: int = REFERENCE_MAX_TURNS,
                                     min_steps: int = 3) -> str:
    """The designer's system prompt for the reference contract and a turn budget: the
    published recipe's requests (its ideas, in this project's words): an interactive game
    whose state is partly hidden until the agent acts, reward for the share of the goal
    reached, an episode that ends only at the goal, medium difficulty (``min_steps`` or
    more commands), the standard library only, a ``solution()`` the game can be checked
    with, doubled braces in f-strings, and a self-check before replying."""
    return f"""\
You design text games in Python that train a reasoning agent. The agent plays one game
over several turns; each of its replies is one command.

{render_reference_contract(max_turns, stdlib_only=True)}
What to build:
- An interactive game driven by commands. Part of its state is hidden when the game
  starts and is revealed only by acting: the agent has to probe, move, ask or test, read
  what comes back, and plan its next command from it.
- Medium difficulty: winning takes at least {min_steps} commands, and no single lucky
  command wins.
- Reward progress: each step's reward is the share of the goal reached so far, between
  0 and 1 (1.0 when the goal is reached), so progress shows before the end.
- The episode ends (terminated=True) only when the goal is reached. Until then it goes
  on, and the turn limit cuts it off (truncated=True).
- The first observation explains the rules, the goal and the command syntax, written as
  \\boxed{{...}}. Later observations give the result of the last command and what is
  now known.
- Add a method solution(self) that returns the list of commands (each a \\boxed{{...}}
  string) that reaches the goal from the state reset() just created, so that the game
  can be checked by playing that list.
- In f-strings, write a literal brace doubled: {{{{ and }}}} (a box in an f-string is
  \\boxed{{{{...}}}}). In a Python string a backslash starts an escape ("\\b" is a
  backspace): write "\\\\boxed" or use a raw string, r"\\boxed{{...}}".
- Before you reply, check the code yourself: every method returns the types above,
  step() survives any text, and playing solution() after reset() reaches the goal.

Reply with the whole game in one fenced python block and nothing after it.
"""


REFERENCE_DESIGNER_SYSTEM_PROMPT: str = reference_designer_system_prompt()

# The reference contract's prompt for CPU-sized policies (prompt_style "compact"), as
# COMPACT_DESIGNER_SYSTEM_PROMPT is the paper contract's.
COMPACT_REFERENCE_DESIGNER_SYSTEM_PROMPT: str = """\
You design a text game in Python: a class named ...Env with reset(self, seed=None) ->
(observation, info) and step(self, action) -> (observation, reward, terminated,
truncated, info). Actions are \\boxed{...}; the last reward is the score.
Reply with the whole game in one ```python block.
"""


def reference_designer_user_prompt(
    skill: str | Skill,
    documents: Sequence[str],
    good_examples: Sequence[Mapping[str, Any]] = (),
    bad_examples: Sequence[Mapping[str, Any]] = (),
    *,
    max_doc_chars: int,
    max_program_chars: int = 4000,
    max_doc_words: int = 0,
) -> str:
    """The per-slot request for one reference-contract game.

    Args:
      skill: a skill name from `spade_jax.spade.skills` or a `Skill` (its description is
        shown).
      documents: corpus documents (str or objects with `.text`), each cut to its first
        `max_doc_words` words (0 = no word cut; the recipe: 6000) and to `max_doc_chars`;
        empty for the corpus-free style.
      good_examples / bad_examples: earlier games to build on / to avoid, as mappings with
        the program (`program_source`, `program` or `source`), `win_rate` (or
        `win_rate_no_hint`) and `regret`; each program cut to `max_program_chars`.
    """
    _check_limits(max_doc_chars, max_program_chars)
    resolved = _resolve_skill(skill)
    parts = [f"Design one new game that trains the skill '{resolved.name}': "
             f"{resolved.description}."]
    parts += _document_parts(
        documents, max_doc_chars, max_doc_words,
        "Source material, drawn fresh for this request. Build the game around an idea, "
        "quantity or procedure from it; do not copy it.")
    # The recipe names a game to avoid in one line, without its code.
    parts += _example_parts(good_examples, bad_examples, max_program_chars, (
        "Games that sat at the agent's frontier. Take ideas from them, but make something "
        "different:"), "Games to avoid:", _class_name)
    parts.append("Reply with the complete game in one ```python block.")
    return "\n\n".join(parts)


def _example_parts(good: Sequence[Any], bad: Sequence[Any], max_program_chars: int,
                   good_heading: str, bad_heading: str, name_of: Callable[[str], str]
                   ) -> list[str]:
    """Memory examples in a designer request: each program to build on with its scores,
    then one line per program to avoid (`_avoid_note`, naming it with ``name_of``)."""
    parts = [good_heading] if good else []
    for index, example in enumerate(good):
        program, win_rate, regret = _scored_program(example, index)
        program = _truncate(program, max_program_chars)
        fence = _fence_for(program)
        parts.append(f"Agent win rate {win_rate:.2f}, regret {regret:+.2f}\n"
                     f"{fence}python\n{program}\n{fence}")
    if bad:
        parts.append(bad_heading + "\n" + "\n".join(
            _avoid_note(example, index, name_of) for index, example in enumerate(bad)))
    return parts


def _avoid_note(example: Any, index: int, name_of: Callable[[str], str]) -> str:
    """A program to avoid as one line: too easy or too hard (its regime, else its win rate
    against one half), the agent's win rate, and what ``name_of`` calls the program."""
    pick = _picker(example, f"example {index}")
    program, win_rate, _ = _program_scores(pick)
    regime = str(pick("regime", default=""))
    too = {"mastered": "too easy", "intractable": "too hard"}.get(
        regime, "too easy" if win_rate >= 0.5 else "too hard")
    return f"- {too} (agent win rate {win_rate:.2f}): {name_of(program)}"


def _class_name(program: str) -> str:
    found = re.search(r"^class\s+(\w+)", program, flags=re.M)
    return f"class {found.group(1)}" if found else "a game without a class"


def _tool_names(program: str) -> str:
    tools = re.findall(r"^\s+def\s+tool_(\w+)", program, flags=re.M)
    return f"tools {', '.join(tools[:6])}" if tools else "no tool methods"


def _scored_program(example: Any, index: int) -> tuple[str, float, float]:
    return _program_scores(_picker(example, f"example {index}"))


_REQUIRED = object()  # pick()'s default: the key must be there


def _picker(example: Any, label: str) -> Callable[..., Any]:
    """``pick(*keys, default=...)``: the value of the first of ``keys`` that ``example`` (a
    mapping, or a record with ``to_json()``) has, else ``default``; without a default,
    errors name the example by ``label``."""
    if hasattr(example, "to_json"):
        example = example.to_json()
    if not isinstance(example, Mapping):
        raise TypeError(f"{label} must be a mapping, got {type(example).__name__}")

    def pick(*keys: str, default: Any = _REQUIRED) -> Any:
        for key in keys:
            if key in example:
                return example[key]
        if default is not _REQUIRED:
            return default
        raise ValueError(f"{label} lacks {' / '.join(keys)}")

    return pick


def _program_scores(pick: Callable[..., Any]) -> tuple[str, float, float]:
    """An example's program, win rate without a hint, and regret (long or short keys)."""
    program = str(pick("program_source", "program", "source")).rstrip("\n")
    return program, float(pick("win_rate_no_hint", "win_rate")), float(pick("regret"))


# --------------------------------------------------------------------------- tool contract

# The tool track (contract "tool", `spade_jax.envs.contract.render_tool_contract`): the
# designer writes a `class ToolEnvironment` whose tools act on hidden state; the agent
# plays it with native tool calls (AgentLoopConfig(action_format="tool_call",
# observation_role="tool"), EpisodeSpec.tools = env.tools). The loop selects these with
# spade.contract="tool": `tool_prompts(prompt_style, max_turns)` for the system prompts,
# `tool_designer_user_prompt` per slot, `tool_hint_writer_messages` for self-written hints
# (docs/environments.md, "Tool environments").


def tool_designer_system_prompt(max_turns: int = REFERENCE_MAX_TURNS) -> str:
    """The designer's system prompt for the tool contract: a small stateful service the
    agent reaches only through tools, a request that takes several calls in order, traps
    an agent must notice (distractor tools, a missing detail, a request out of scope),
    and a state check that says how much of the goal was reached."""
    return f"""\
You are the Environment Designer. You write tool-use environments in Python that train
an agent to work through tools: it sees a user's request and a list of tools, calls them,
reads what they return, and answers when the job is done.

{render_tool_contract(max_turns)}
What to build:
- A small service with state the agent cannot see: accounts, files, orders, bookings,
  devices, tickets. Tools read it or change it, and a change shows in later reads, so
  the order of calls matters.
- A request that takes several calls in a fixed order, where a later call needs a value
  an earlier one returned (look something up, then act on it, then confirm).
- Requests may come one after another: next_instruction() gives the next once the
  current one is done in the state.
- Traps a careful agent avoids: one or two distractor tools that look useful but are
  not needed, some of which do harm (the check then gives 0); a request that leaves a
  value out, so the agent must look it up with a tool instead of guessing; now and then
  a request no tool can serve, which the agent should decline in its final answer
  rather than call tools for.
- A goal you can check: check() compares the hidden state (and the final answer, when
  the request asks for one) with the goal, and gives partial credit per finished part,
  e.g. 0.5 for the right change in the state and 0.5 for the right reported value.
- Tools answer a bad request (an unknown id, not enough money, a closed item) with an
  error message, never an exception. Use enums for arguments with few valid values.
- A new instance for every seed (names, amounts, ids drawn with random.Random(seed)),
  so the agent cannot memorise answers.

Before you reply, play your environment in your head: reset(), the calls in the right
order, the final answer; check() must give 1.0. Wrong order, a guessed value, or the
distractor must give less.

Reply with the whole program in one fenced python block and nothing after it.
"""


TOOL_DESIGNER_SYSTEM_PROMPT: str = tool_designer_system_prompt()

# The tool contract's prompt for CPU-sized policies (prompt_style "compact").
COMPACT_TOOL_DESIGNER_SYSTEM_PROMPT: str = """\
You write a tool environment in Python: class ToolEnvironment with TOOLS (function
schemas), reset(self, seed=None) -> the user's request, one method tool_<name> per tool
over hidden state, and check(self, answer) -> the share of the goal reached in [0, 1].
Reply with the whole program in one ```python block.
"""

# hint_mode "self" for tool environments: the policy reads the program and writes a
# strategy hint for the agent (never trained), as HINT_WRITER_SYSTEM_PROMPT does for games.
TOOL_HINT_WRITER_SYSTEM_PROMPT: str = """\
You read the source code of a tool-use environment and write a short hint for an agent
that will work in it. The agent never sees the code: only the user's request, the tool
list and what the tools return.

Work out which tools the request needs, in which order, which value each call needs from
an earlier one, and which tools are traps. Then write 1 to 3 sentences (under 100 words)
on the strategy: what to look up first, which order the changes must happen in, what to
check before answering, and which tools to leave alone.

Give no concrete values: no ids, names, amounts or answers drawn from the code, since
every episode draws new ones. Do not name variables of the code. Reply with the hint
text only."""


def tool_hint_writer_messages(program: str) -> list[dict[str, str]]:
    """Chat messages asking the policy for a strategy hint on a tool ``program``."""
    fence = _fence_for(program)
    return [{"role": "system", "content": TOOL_HINT_WRITER_SYSTEM_PROMPT},
            {"role": "user", "content": f"Environment code:\n{fence}python\n{program}\n{fence}"}]


def tool_designer_user_prompt(
    skill: str | Skill,
    documents: Sequence[str],
    good_examples: Sequence[Mapping[str, Any]] = (),
    bad_examples: Sequence[Mapping[str, Any]] = (),
    *,
    max_doc_chars: int,
    max_program_chars: int = 4000,
    max_doc_words: int = 0,
) -> str:
    """The per-slot request for one tool environment: the skill, corpus documents to
    ground the service in, earlier environments to build on (their programs) and to avoid
    (one line each, naming their tools). Arguments as `reference_designer_user_prompt`."""
    _check_limits(max_doc_chars, max_program_chars)
    resolved = _resolve_skill(skill)
    parts = [f"Design one new tool environment that trains the skill '{resolved.name}': "
             f"{resolved.description}."]
    parts += _document_parts(
        documents, max_doc_chars, max_doc_words,
        "Source material, drawn fresh for this request. Model the service, its records "
        "or its procedure on it; do not copy it.")
    # Every such program is a `class ToolEnvironment`: its tool methods tell them apart.
    parts += _example_parts(good_examples, bad_examples, max_program_chars, (
        "Environments that sat at the agent's frontier. Take ideas from them, but build a "
        "different service or request:"), "Environments to avoid:", _tool_names)
    parts.append("Reply with the complete program in one ```python block.")
    return "\n\n".join(parts)


@dataclasses.dataclass(frozen=True)
class ToolPrompts:
    """The prompts of the tool track: the designer's system prompt (its reply is one
    ```python block, read like a reference-contract reply; the per-slot user prompt is
    the loop's to choose) and the hint writer's (`tool_hint_writer_messages`)."""

    designer_system: str
    hint_writer_system: str


def tool_prompts(prompt_style: str = "full", max_turns: int = REFERENCE_MAX_TURNS) -> ToolPrompts:
    """The tool track's prompts for a prompt style ("full" or "compact", as
    `spade.prompt_style`) and turn budget."""
    styles = {"full": lambda: tool_designer_system_prompt(max_turns),
              "compact": lambda: COMPACT_TOOL_DESIGNER_SYSTEM_PROMPT}
    style = str(prompt_style)
    if style not in styles:
        raise ValueError(f"prompt_style must be one of {sorted(styles)}, got {prompt_style!r}")
    return ToolPrompts(styles[style](), TOOL_HINT_WRITER_SYSTEM_PROMPT)


# --------------------------------------------------------------------------- user prompts

_REGIME_HEADINGS = {
    "frontier": (
        "Frontier environments: the agent solved these with the hint but not without it. "
        "Build on them with new variations, harder instances or other mechanics."
    ),
    "mastered": (
        "Mastered environments: the agent already solves these without the hint. They "
        "are too easy, so do not repeat them."
    ),
    "intractable": (
        "Intractable environments: the agent failed these even with the hint. They are too "
        "hard, or broken, or their hint did not help. Avoid them."
    ),
}


def designer_user_prompt(
    skill: str | Skill,
    documents: Sequence[str],
    memory_examples: Sequence[Mapping[str, Any]],
    *,
    max_doc_chars: int,
    max_program_chars: int = 4000,
    max_doc_words: int = 0,
) -> str:
    """The per-slot request to the designer: the skill, grounding documents, memory.

    Args:
      skill: a skill name from `spade_jax.spade.skills` or a `Skill`. Its description is
        shown to the designer.
      documents: corpus documents freshly sampled for this round (str, or objects with a
        `.text` such as `corpus.Document`). Each is cut to `max_doc_chars`. Pass an empty
        list for the no-corpus ablation: the section is left out.
      memory_examples: environments from memory as dicts. `EnvironmentRecord.to_json()`
        fits, and so do the short keys `program`, `hint`, `regime`, `win_rate`, `regret`.
        They are grouped by regime: frontier = build on, mastered = too easy,
        intractable = too hard or broken. Pass an empty list for the no-memory ablation.
      max_doc_chars: most characters kept from each document (>= 1).
      max_program_chars: most characters kept from each memory program (>= 1).
      max_doc_words: most words kept from each document before the character cut
        (0 = no word cut; the recipe: 6000).
    """
    _check_limits(max_doc_chars, max_program_chars)
    resolved = _resolve_skill(skill)
    parts = [f"Design one new environment for the skill '{resolved.name}': {resolved.description}."]
    parts += _document_parts(
        documents, max_doc_chars, max_doc_words,
        "Reference documents, sampled fresh for this request. Ground the environment in "
        "a concept, quantity or procedure from them; do not copy them.")
    examples = [_memory_example(example, index) for index, example in enumerate(memory_examples)]
    for regime, heading in _REGIME_HEADINGS.items():
        chosen = [example for example in examples if example["regime"] == regime]
        if not chosen:
            continue
        parts.append(heading)
        for example in chosen:
            program = _truncate(example["program"], max_program_chars)
            fence = _fence_for(program)
            parts.append(
                f"Agent win rate without hint {example['win_rate']:.2f}, "
                f"regret {example['regret']:+.2f}\n"
                f"<hint>{example['hint']}</hint>\n{fence}python\n{program}\n{fence}"
            )
    parts.append(
        "Write a new environment that differs from every example above. Reply with the "
        "<hint>...</hint> and one ```python block."
    )
    return "\n\n".join(parts)


# --------------------------------------------------------------------------- hint writer

# hint_mode "self": after a game validates, the same policy reads the program and writes a
# short strategy hint in a separate call that is never trained (the recipe's self-hint).
HINT_WRITER_SYSTEM_PROMPT: str = """\
You read the source code of a text game and write a short hint for a player who will
play it. The player never sees the code: only the game's text messages. Its answers go
in \\boxed{...}. Your hint is added to the player's first message.

Work out what puzzle the game poses as the player sees it, how a correct answer is
found, and what form the answer takes. Then write 1 to 3 sentences (under 100 words)
with the key idea or method for this particular game and the expected answer format
(for example: one integer, a word, a comma-separated list).

Do not give the answer itself, do not name variables or functions of the code, and do
not give generic advice such as "think carefully". Reply with the hint text only."""


def hint_writer_messages(program: str) -> list[dict[str, str]]:
    """Chat messages asking the policy for a strategy hint on ``program``."""
    fence = _fence_for(program)
    return [{"role": "system", "content": HINT_WRITER_SYSTEM_PROMPT},
            {"role": "user", "content": f"Game code:\n{fence}python\n{program}\n{fence}"}]


def parse_hint(text: str, max_chars: int = 1000) -> str | None:
    """The hint in a hint-writer reply (reasoning removed, whitespace trimmed, cut to
    ``max_chars``), or None when nothing usable is left."""
    visible = _strip_thinking(text) if isinstance(text, str) else None
    if visible is None:
        return None
    hint = visible.strip()
    return hint[:max_chars].strip() or None


def _resolve_skill(skill: str | Skill) -> Skill:
    if isinstance(skill, Skill):
        return skill
    known = {s.name: s for skill_set in SKILL_SETS.values() for s in skill_set}
    if skill not in known:
        raise ValueError(
            f"unknown skill {skill!r}; known skills: {sorted(known)} (or pass a Skill)"
        )
    return known[skill]


def _document_text(document: Any, index: int) -> str:
    text = document if isinstance(document, str) else getattr(document, "text", None)
    if not isinstance(text, str):
        raise TypeError(
            f"document {index} must be a str or have a str .text, got {type(document).__name__}"
        )
    return text


def _check_limits(max_doc_chars: int, max_program_chars: int) -> None:
    if max_doc_chars < 1:
        raise ValueError(f"max_doc_chars must be >= 1, got {max_doc_chars}")
    if max_program_chars < 1:
        raise ValueError(f"max_program_chars must be >= 1, got {max_program_chars}")


def _document_parts(documents: Sequence[Any], max_doc_chars: int, max_doc_words: int,
                    intro: str) -> list[str]:
    """The documents section of a designer request: ``intro``, then each document cut to
    its first ``max_doc_words`` words (0: no word cut) and to ``max_doc_chars``; nothing
    without documents (the corpus-free style)."""
    if not documents:
        return []
    if max_doc_words < 0:
        raise ValueError(f"max_doc_words must be >= 0, got {max_doc_words}")
    texts = [_document_text(d, index).strip() for index, d in enumerate(documents, start=1)]
    if max_doc_words:
        texts = [_first_words(text, max_doc_words) for text in texts]
    return [intro] + [f"[Document {index}]\n{_truncate(text, max_doc_chars)}"
                      for index, text in enumerate(texts, start=1)]


def _first_words(text: str, limit: int) -> str:
    """``text`` up to the end of its ``limit``-th whitespace-separated word (line breaks
    kept), marked as truncated when words were dropped."""
    words = re.finditer(r"\S+", text)
    end = None
    for count, word in enumerate(words, start=1):
        if count == limit:
            end = word.end()
            break
    if end is None or not text[end:].strip():
        return text
    return text[:end] + "\n[... truncated]"


def _truncate(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "\n[... truncated]"


def _memory_example(example: Any, index: int) -> dict[str, Any]:
    pick = _picker(example, f"memory example {index}")
    regime = str(pick("regime"))  # Regime is a StrEnum: str() gives its value
    if regime not in _REGIME_HEADINGS:
        raise ValueError(
            f"memory example {index} has regime {regime!r}; expected one of "
            f"{sorted(_REGIME_HEADINGS)}"
        )
    hint = str(pick("hint"))
    program, win_rate, regret = _program_scores(pick)
    return {"program": program, "hint": hint, "regime": regime, "win_rate": win_rate,
            "regret": regret}


# --------------------------------------------------------------------------- designer output

PARSE_FAILURE_CODES: tuple[str, ...] = (
    "not_text",  # the input is not a str
    "unterminated_think",  # a <think> block that never closes: no visible output
    "no_program_block",  # no ```python (or untagged) fenced block
    "unterminated_program_block",  # the program block never closes (output cut off)
    "empty_program",  # the block holds only whitespace
    "no_hint",  # no <hint>...</hint> outside the program block
    "empty_hint",  # the hint tag holds only whitespace
)


@dataclasses.dataclass(frozen=True)
class DesignerOutput:
    """A parsed designer reply: program source, hint, and the raw text."""

    program: str
    hint: str
    raw: str

    @property
    def ok(self) -> bool:
        return True


@dataclasses.dataclass(frozen=True)
class ParseFailure:
    """Why a designer reply could not be parsed. `code` is in `PARSE_FAILURE_CODES`."""

    code: str
    detail: str
    raw: str

    def __post_init__(self) -> None:
        if self.code not in PARSE_FAILURE_CODES:
            raise ValueError(f"unknown parse failure code {self.code!r}")

    @property
    def ok(self) -> bool:
        return False


_PYTHON_LANGS = frozenset({"python", "python3", "py", "py3"})
# A fence line: up to three spaces, three or more backticks, an optional info string.
_OPEN_FENCE = re.compile(r"[ \t]{0,3}(`{3,})([^`]*)")
_HINT_OPEN = re.compile(r"<hint\s*>", re.I)
_HINT_CLOSE = re.compile(r"</hint\s*>", re.I)


@dataclasses.dataclass(frozen=True)
class _Block:
    lang: str  # lower-cased first word of the info string; "" when untagged
    start: int  # offset of the opening fence line
    end: int  # offset just past the closing fence line (len(text) if unterminated)
    content: str
    closed: bool


def _fenced_blocks(text: str) -> list[_Block]:
    """Fenced blocks in order, scanning line by line (no backtracking regex over text)."""
    blocks: list[_Block] = []
    lines = text.split("\n")
    offset, i = 0, 0
    while i < len(lines):
        line = lines[i]
        opening = _OPEN_FENCE.fullmatch(line.rstrip("\r"))
        if opening is None:
            offset += len(line) + 1
            i += 1
            continue
        info = opening.group(2).split()
        ticks, lang = len(opening.group(1)), (info[0].lower() if info else "")
        start, body_start = offset, offset + len(line) + 1
        close = re.compile(rf"[ \t]{{0,3}}`{{{ticks},}}[ \t\r]*")
        offset, i = body_start, i + 1
        while i < len(lines) and close.fullmatch(lines[i]) is None:
            offset += len(lines[i]) + 1
            i += 1
        if i == len(lines):
            blocks.append(_Block(lang, start, len(text), text[body_start:], False))
            break
        # The newline that ends the last content line belongs to the fence, not the program.
        content = text[body_start : max(body_start, offset - 1)]
        offset += len(lines[i]) + 1
        i += 1
        blocks.append(_Block(lang, start, min(offset, len(text)), content, True))
    return blocks


def _strip_thinking(text: str) -> str | None:
    """Text without the reasoning: a leading <think>...</think> block, or everything up to
    a </think> whose opening tag was in the prompt. None if a <think> never closes."""
    stripped = text.lstrip()
    if stripped.startswith("<think>"):
        end = stripped.find("</think>")
        return None if end < 0 else stripped[end + len("</think>") :]
    end, opening = text.find("</think>"), text.find("<think>")
    if end >= 0 and (opening < 0 or opening > end):
        return text[end + len("</think>") :]
    return text


def parse_designer_output(text: str, *, require_hint: bool = True) -> DesignerOutput | ParseFailure:
    """Reads a designer reply into (program, hint); never raises.

    With ``require_hint=False`` (hints written separately, ``hint_mode`` "self" / "none") a
    reply without a usable hint parses with ``hint=""``.

    The program is the last fenced block tagged python/py (or, when none is tagged, the
    last untagged block), verbatim. The hint is the content of the last
    `<hint>...</hint>` outside that block, verbatim. An unclosed `<hint>` runs to the
    next fence or the end of the text. A leading `<think>...</think>` is ignored.
    """
    if not isinstance(text, str):
        return ParseFailure("not_text", f"expected str, got {type(text).__name__}", repr(text))
    raw = text
    visible = _strip_thinking(text)
    if visible is None:
        return ParseFailure("unterminated_think", "<think> is never closed", raw)
    blocks = _fenced_blocks(visible)
    tagged = [b for b in blocks if b.lang in _PYTHON_LANGS]
    candidates = tagged or [b for b in blocks if b.lang == ""]
    if not candidates:
        langs = sorted({b.lang for b in blocks})
        detail = f"fenced blocks in other languages: {langs}" if blocks else "no fenced block"
        return ParseFailure("no_program_block", detail, raw)
    block = candidates[-1]
    if not block.closed:
        return ParseFailure("unterminated_program_block", "the ``` fence never closes", raw)
    if not block.content.strip():
        return ParseFailure("empty_program", "the program block is empty", raw)
    hint = _find_hint(visible[: block.start], visible[block.end :])
    if not require_hint:
        return DesignerOutput(program=block.content, hint=(hint or "").strip(), raw=raw)
    if hint is None:
        return ParseFailure("no_hint", "no <hint>...</hint> outside the program block", raw)
    if not hint.strip():
        return ParseFailure("empty_hint", "the <hint> tag is empty", raw)
    return DesignerOutput(program=block.content, hint=hint, raw=raw)


def _find_hint(before: str, after: str) -> str | None:
    """The last complete <hint>...</hint> (after the block first), else the last unclosed
    <hint>, which runs to the next fence. Linear scans: no backtracking over the text."""
    for part in (after, before):
        opens = [m.end() for m in _HINT_OPEN.finditer(part)]
        for close in reversed(list(_HINT_CLOSE.finditer(part))):
            inside = [o for o in opens if o <= close.start()]
            if inside:
                return part[inside[-1] : close.start()]
    for part in (after, before):
        opens = list(_HINT_OPEN.finditer(part))
        if opens:
            rest = part[opens[-1].end() :]
            fence = rest.find("```")
            return rest if fence < 0 else rest[:fence]
    return None


def _fence_for(program: str) -> str:
    """A backtick fence longer than any backtick run in `program`, so it cannot close early."""
    longest = max((len(run) for run in re.findall(r"`+", program)), default=0)
    return "`" * max(3, longest + 1)


def format_designer_output(program: str, hint: str) -> str:
    """A designer reply in the canonical format, e.g. a supervised warm-start target.

    `parse_designer_output(format_designer_output(p, h))` gives back exactly `(p, h)`. An
    input that cannot round-trip raises ValueError: a program or hint that is empty or
    only whitespace, a hint containing a hint tag, or a program or hint containing a
    think tag.
    """
    if not isinstance(program, str) or not program.strip():
        raise ValueError("program must be a non-empty str")
    if not isinstance(hint, str) or not hint.strip():
        raise ValueError("hint must be a non-empty str")
    if _HINT_OPEN.search(hint) or _HINT_CLOSE.search(hint):
        raise ValueError("hint must not contain <hint> or </hint> tags")
    fence = _fence_for(program)
    text = f"<hint>{hint}</hint>\n{fence}python\n{program}\n{fence}\n"
    parsed = parse_designer_output(text)
    if not isinstance(parsed, DesignerOutput) or (parsed.program, parsed.hint) != (program, hint):
        reason = parsed.code if isinstance(parsed, ParseFailure) else "content changed"
        raise ValueError(f"program/hint cannot be written in the designer format ({reason})")
    return text


def format_program_reply(program: str, hint: str | None = None) -> str:
    """A designer reply holding the program alone, as the reference and tool contracts'
    prompts ask (``hint`` is ignored: those designers write none), e.g. a warm-start
    target. `parse_designer_output(reply, require_hint=False)` gives back the program."""
    if not isinstance(program, str) or not program.strip():
        raise ValueError("program must be a non-empty str")
    fence = _fence_for(program)
    text = f"{fence}python\n{program}\n{fence}\n"
    parsed = parse_designer_output(text, require_hint=False)
    if not isinstance(parsed, DesignerOutput) or parsed.program != program:
        reason = parsed.code if isinstance(parsed, ParseFailure) else "content changed"
        raise ValueError(f"program cannot be written as a designer reply ({reason})")
    return text
