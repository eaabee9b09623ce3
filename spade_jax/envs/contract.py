"""The environment program contract: the text the designer sees, and the import allow-list.

`PROGRAM_CONTRACT` is shown verbatim in the designer's system prompt and in the docs, so the
rules a program is validated against and the rules the model is told are the same text.
"""

from __future__ import annotations

import textwrap
import threading

# Modules a program may import. The sandbox zygote imports exactly these before it forks
# workers, so a worker (running as an unprivileged uid that cannot read the interpreter's
# files) finds them in sys.modules and nothing else. The static gate checks the same list.
DEFAULT_ALLOWED_IMPORTS: frozenset[str] = frozenset(
    {
        "__future__",
        "abc",
        "bisect",
        "cmath",
        "collections",
        "copy",
        "dataclasses",
        "decimal",
        "enum",
        "fractions",
        "functools",
        "heapq",
        "itertools",
        "json",
        "math",
        "numbers",
        "operator",
        "random",
        "re",
        "statistics",
        "string",
        "textwrap",
        "typing",
        "unicodedata",
    }
)

# What one reset()/step() call may use, as the contract texts state it and the sandbox
# enforces it (`SandboxConfig.call_cpu_budget_s`, `SandboxConfig.worker_memory_mb`).
CALL_CPU_BUDGET_S = 1.0
WORKER_MEMORY_MB = 512

_CONTRACT_TEMPLATE = """\
An environment program is Python source that defines `class Environment`:

    class Environment:
        def __init__(self):            # no required arguments
            ...
        def reset(self, seed: int | None = None) -> tuple[str, dict]:
            # start a new episode; return (observation, info)
            ...
        def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
            # return (observation, reward, terminated, truncated, info)
            ...

Rules (a program that breaks one is rejected before any agent sees it):
- Observations and actions are text (`str`). Rewards are plain `float` (or `int`);
  terminated/truncated are `bool`; info is a `dict` of plain values.
- The return of an episode (the sum of its rewards) lies in [0, 1]; every step reward,
  and the running sum, lies in [-1, 1]. Partial rewards are allowed and encouraged: e.g.
  0.25 for each of four sub-goals.
- reset(seed) is deterministic: the same seed and the same actions give the same
  observations and rewards. Use `random.Random(seed)`, never the global `random` state,
  the clock or object ids.
- Every episode ends (terminated or truncated) within {step_cap} steps, whatever the actions.
- step() must not raise on any action text, including "", very long or non-ASCII text:
  treat unparseable actions as wrong answers and say so in the observation.
- Only these imports are available:
{allowed}.
  No files, network, processes, threads, clock or environment variables; no eval/exec/open/__import__; no dunder tricks.
- Each call may use at most {cpu} of CPU time and the program at most {memory} MiB
  of memory; observations are at most {max_observation_chars} characters. A program
  that breaks a limit while it is played, or replays differently, is stopped and dropped.
- The hint is given to the agent, never to the program: the program must not try to tell
  whether the agent had a hint.
"""


def _allowed_block(allowed_imports: frozenset[str]) -> str:
    """The allow-list as an indented, wrapped paragraph of the contract texts."""
    return textwrap.fill(
        ", ".join(sorted(m for m in allowed_imports if m != "__future__")),
        width=88,
        initial_indent="    ",
        subsequent_indent="    ",
    )


def _seconds(value: float) -> str:
    return f"{value:g} second" + ("" if value == 1 else "s")


def render_contract(
    allowed_imports: frozenset[str] = DEFAULT_ALLOWED_IMPORTS,
    max_observation_chars: int = 16384,
    step_cap: int = 64,
    call_cpu_budget_s: float = CALL_CPU_BUDGET_S,
    memory_mb: int = WORKER_MEMORY_MB,
) -> str:
    """The contract text with a concrete allow-list, caps and limits filled in."""
    allowed = _allowed_block(allowed_imports)
    return _CONTRACT_TEMPLATE.format(
        allowed=allowed, max_observation_chars=max_observation_chars, step_cap=step_cap,
        cpu=_seconds(call_cpu_budget_s), memory=memory_mb,
    )


# The contract with the default sandbox and validation settings (designer prompt, README).
PROGRAM_CONTRACT: str = render_contract()


# ----------------------------------------------------------------------------- reference

# The two program contracts. "paper": `class Environment`, episode return = sum of rewards
# in [0, 1] (this project's text of the paper). "reference": the published recipe's games
# (a class named `*Env`, boxed actions, episode score = last reward if terminated, clipped
# to [-1, 1], else 0). "auto" picks one from the source (see `detect_contract`).
CONTRACTS: tuple[str, ...] = ("paper", "reference")
# The tool-environment contracts (docs/environments.md, "Tool environments"). "tool": a
# `class ToolEnvironment` whose tools are declared as function schemas and written as
# methods; "reference_tool_use": the published recipe's tool games (`*Env` subclasses of
# its `ToolUseBaseEnv`, `spade_jax.envs.tool_base`). Chosen by name only ("auto" never
# picks one).
TOOL_CONTRACTS: tuple[str, ...] = ("tool", "reference_tool_use")
ALL_CONTRACTS: tuple[str, ...] = CONTRACTS + TOOL_CONTRACTS
# The contracts the SPADE loop's designer can be asked to write (`spade.contract`): each
# has a designer prompt family (`spade.design.Designer.messages`). "reference_tool_use"
# programs load and play (validate_program, make_env, EnvPool, envs.check) but have no
# designer prompt of their own.
LOOP_CONTRACTS: tuple[str, ...] = CONTRACTS + ("tool",)
AUTO_CONTRACT = "auto"
# Contracts scored as the recipe scores: the last reward if terminated, clipped to [-1, 1].
RECIPE_SCORED: frozenset[str] = frozenset({"reference", "reference_tool_use"})
# The class a "tool" program defines.
TOOL_CLASS = "ToolEnvironment"
# The recipe's turn budget N: the game is built with its own defaults (cls(); on TypeError
# cls(max_turns=N)), its max_turns set to min(its own, N), and truncated after N steps.
REFERENCE_MAX_TURNS = 25
# The recipe's validator rejects step rewards outside this range; scores are clipped to
# [-1, 1] afterwards.
REFERENCE_REWARD_BOUND = 10.0

# Modules a reference program may import on top of `SandboxConfig.allowed_imports`. The
# zygote imports them (and exercises math_verify once) before it forks workers.
REFERENCE_IMPORTS: frozenset[str] = frozenset({"numpy", "math_verify"})

# Names the recipe makes available to a game without an import: name -> "module" or
# "module:attribute". Bound inside the sandbox worker only, from modules the zygote
# already imported; the static gate sees them as plain names.
REFERENCE_IMPLICIT_NAMES: dict[str, str] = {
    **{m: m for m in ("random", "re", "math", "json", "collections", "itertools",
                      "functools", "string", "copy", "heapq", "operator", "statistics")},
    "np": "numpy",
    "numpy": "numpy",
    **{n: f"collections:{n}" for n in ("deque", "defaultdict", "Counter", "OrderedDict",
                                        "namedtuple")},
    **{n: f"itertools:{n}" for n in ("combinations", "permutations", "product", "chain",
                                      "accumulate")},
    "reduce": "functools:reduce",
    "lru_cache": "functools:lru_cache",
    "deepcopy": "copy:deepcopy",
    "heappush": "heapq:heappush",
    "heappop": "heapq:heappop",
    **{n: f"typing:{n}" for n in ("Tuple", "Dict", "List", "Optional", "Union", "Any", "Set",
                                   "FrozenSet", "Callable", "Iterable", "Sequence", "Mapping")},
}  # fmt: skip

# What a reference program may take from math_verify (it wraps sympy, whose parsers
# evaluate strings: the rest of the package is refused by the static gate).
MATH_VERIFY_NAMES: frozenset[str] = frozenset(
    {"parse", "verify", "LatexExtractionConfig", "ExprExtractionConfig", "StringExtractionConfig"}
)


def check_contract_name(contract: str) -> str:
    """`contract` if it names a contract or "auto"; ValueError naming the choices otherwise."""
    if contract not in (*ALL_CONTRACTS, AUTO_CONTRACT):
        raise ValueError(
            f"unknown program contract {contract!r}; expected one of "
            f"{[*ALL_CONTRACTS, AUTO_CONTRACT]}"
        )
    return contract


# CPython 3.11's AST construction is not safe from several threads at once ("SystemError:
# AST constructor recursion depth mismatch", seen with validate_programs' threads), so every
# in-process parse of a program goes through this lock (parsing is fast; the waits are
# on the sandbox workers).
_PARSE_LOCK = threading.Lock()


def parse_program(source: str, filename: str = "<unknown>"):
    """``ast.parse(source)`` under the module's parse lock (raises what ast.parse raises)."""
    import ast

    with _PARSE_LOCK:
        return ast.parse(source, filename=filename)


def detect_contract(source: str) -> str:
    """"paper" if the source defines a top-level `class Environment`, else "reference".

    Reads the syntax tree only (nothing runs). Unparsable source counts as "reference";
    the static gate then reports the syntax error. Never a tool contract: those are
    chosen by name.
    """
    import ast

    try:
        tree = parse_program(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return "reference"
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "Environment":
            return "paper"
    return "reference"


def resolve_contract(contract: str, source: str) -> str:
    """The concrete contract for `source`: `contract`, or the detected one for "auto"."""
    check_contract_name(contract)
    return detect_contract(source) if contract == AUTO_CONTRACT else contract


_REFERENCE_TEMPLATE = """\
A game is Python source that defines one class whose name ends in `Env`:

    class DescriptiveNameEnv:
        def __init__(self, max_turns=12, **kwargs):
            ...                        # set every attribute here, then self.reset()
        def reset(self, seed=None) -> tuple[str, dict]:
            # start a new episode; return (observation, {{}})
            ...
        def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
            # return (observation, reward, terminated, truncated, {{}})
            ...

How it is run:
- The class is found by name: the first top-level class ending in `Env` that has
  reset() and step(). Name helper classes differently. It is built with its own
  defaults, `DescriptiveNameEnv()`, and its `max_turns` is then capped at {max_turns}; the
  episode is cut off after that many turns.
- Every action arrives as text of the form \\boxed{{...}}, e.g. "\\boxed{{go north}}" or
  "\\boxed{{42}}". step() takes the content of the box and interprets it.
- The score of an episode is the reward of the step that returns terminated=True,
  clipped to [-1, 1]: 1.0 for reaching the goal. Running out of turns (truncated=True)
  scores 0. Rewards of earlier steps do not count toward the score (they may report
  progress).
{names}
Rules (a game that breaks one is rejected before any agent plays it):
- reset(seed) is deterministic: the same seed and the same actions give the same
  observations and rewards. Seed `random` (or a `random.Random(seed)`) from it; never
  use the clock or object ids. The first observation is not empty.
- step() never raises, whatever the text: an action without a box, an empty box, an
  unknown command or non-ASCII text gets an observation that says what went wrong and
  what is allowed. Such a turn still counts: check the turn budget on every path and
  return truncated=True when it is spent.
- Every path returns (str, float, bool, bool, dict); step rewards lie in [-10, 10];
  info is a dict of plain values.
- No files, network, processes, threads, clock or environment variables; no
  eval/exec/open/__import__; no dunder tricks; no module internals (names starting with
  `_`){numpy_io}. Each call may use at most {cpu} of CPU
  time and the game at most {memory} MiB of memory; observations are at most
  {max_observation_chars} characters. A game that breaks a limit while it is played,
  or replays differently, is stopped and dropped.
"""

# What a game may use without an import, as the contract states it: every name the
# sandbox binds (the recipe's games use them), or, for the designer's prompt, the
# standard library only (the recipe asks for the standard library plus math and random).
_REFERENCE_NAMES = """\
- Available without an import: random, re, math, json, collections, itertools, functools,
  string, copy, heapq, operator, statistics, np (numpy), deque, defaultdict, Counter,
  OrderedDict, namedtuple, combinations, permutations, product, chain, accumulate, reduce,
  lru_cache, deepcopy, heappush, heappop, and the typing names (Tuple, Dict, List,
  Optional, Union, Any, Set, FrozenSet, Callable, Iterable, Sequence, Mapping).
  `from math_verify import parse, verify` checks a mathematical answer:
  verify(parse(expected), parse(given)) is True when they are equal as mathematics.
  Other importable modules:
{allowed}.
"""
_STDLIB_ONLY = """\
- Use the Python standard library only: math and random cover most games (random, re,
  math, json, collections, itertools, functools, string, copy, heapq, operator and
  statistics need no import). No numpy, no math_verify, no other packages.
"""


def render_reference_contract(
    max_turns: int = REFERENCE_MAX_TURNS,
    allowed_imports: frozenset[str] = DEFAULT_ALLOWED_IMPORTS,
    max_observation_chars: int = 16384,
    call_cpu_budget_s: float = CALL_CPU_BUDGET_S,
    memory_mb: int = WORKER_MEMORY_MB,
    stdlib_only: bool = False,
) -> str:
    """The reference (recipe) contract's text for a given turn budget, in this project's
    words: what the designer is told and what `validate_program(contract="reference")`
    checks. ``stdlib_only``: state the recipe's request (standard library only) instead
    of every name the sandbox makes available (and leave out the numpy file rule, which
    would contradict it)."""
    if type(max_turns) is not int or max_turns < 1:
        raise ValueError(f"max_turns must be an int >= 1, got {max_turns!r}")
    names = (_STDLIB_ONLY if stdlib_only
             else _REFERENCE_NAMES.format(allowed=_allowed_block(allowed_imports)))
    return _REFERENCE_TEMPLATE.format(
        max_turns=max_turns, names=names, max_observation_chars=max_observation_chars,
        numpy_io="" if stdlib_only else "; from numpy no file input/output",
        cpu=_seconds(call_cpu_budget_s), memory=memory_mb,
    )


# The reference contract with the recipe's 25 turns (designer prompt, docs).
REFERENCE_CONTRACT: str = render_reference_contract()


# ----------------------------------------------------------------------------- tools

_TOOL_TEMPLATE = """\
A tool environment is Python source that defines `class ToolEnvironment`. The agent acts
only by calling its tools; the tools read and change state the agent cannot see.

    class ToolEnvironment:
        TOOLS = [                      # function schemas (OpenAI / Hugging Face format)
            {{"type": "function", "function": {{
                "name": "get_balance",
                "description": "The balance of one account.",
                "parameters": {{"type": "object",
                               "properties": {{"account": {{"type": "string"}}}},
                               "required": ["account"]}}}}}},
            ...
        ]
        def __init__(self): ...        # no required arguments
        def reset(self, seed=None) -> str:
            # new hidden state from random.Random(seed); return the user's first request
        def tool_get_balance(self, account): ...   # one method tool_<name> per tool;
            # returns the tool's result as text (or a plain JSON value)
        def next_instruction(self) -> str | None:  # optional
            # called after every turn that does not end the episode: the user's next
            # request once the current one is done, else None
        def check(self, answer: str | None) -> float:
            # the share of the goal the hidden state (and, at the end, the final answer)
            # reaches, in [0, 1]; answer is None until the agent's final reply

How it is run:
- The tools are rendered into the agent's prompt. A reply calls them as
  <tool_call>{{"name": ..., "arguments": {{...}}}}</tool_call> (several per reply, run in
  order). The sandbox checks every call before your method runs: an unknown tool, an
  unknown or missing argument, a wrong type or a value outside an enum gets an error
  result, and your method is not called. Argument names must be Python identifiers.
- The observation after a turn is the result (or error) of each call, then the text of
  next_instruction() when it returns one.
- The episode ends when the agent replies without a tool call (that reply is its final
  answer), or with <answer>...</answer> (then the calls of that reply do not run), or
  after {max_turns} turns.
- Rewards come from check() alone: after every turn the agent is paid the change of
  check(None) (partial credit), and the return of the episode is check(answer) at the
  end, or the last check(None) when the turn limit cuts it off.

Rules (a program that breaks one is rejected before any agent sees it):
- TOOLS: 1 to {max_tools} tools, unique names; every parameter has a "type" (string,
  integer, number, boolean, array, object, null) or an "enum"; "required" names only
  declared properties; add distractor tools the task does not need.
- reset(seed) is deterministic, and so is every tool: the same seed and the same calls
  give the same results and rewards. Use random.Random(seed), never the clock.
- A tool never raises for arguments that match its schema: it returns an error message
  (e.g. "error: no account named 'savngs'"). check() never raises and returns a number
  in [0, 1].
- Only these imports are available:
{allowed}.
  No files, network, processes, threads, clock or environment variables; no
  eval/exec/open/__import__; no dunder tricks.
- Each call may use at most {cpu} of CPU time and the program at most {memory} MiB
  of memory; observations are at most {max_observation_chars} characters.
"""


def render_tool_contract(
    max_turns: int = REFERENCE_MAX_TURNS,
    allowed_imports: frozenset[str] = DEFAULT_ALLOWED_IMPORTS,
    max_observation_chars: int = 16384,
    call_cpu_budget_s: float = CALL_CPU_BUDGET_S,
    memory_mb: int = WORKER_MEMORY_MB,
) -> str:
    """The "tool" contract's text for a turn budget: what the tool designer is told and
    what `validate_program(contract="tool")` checks."""
    from spade_jax.envs.tools import MAX_TOOLS

    if type(max_turns) is not int or max_turns < 1:
        raise ValueError(f"max_turns must be an int >= 1, got {max_turns!r}")
    return _TOOL_TEMPLATE.format(
        max_turns=max_turns, max_tools=MAX_TOOLS, allowed=_allowed_block(allowed_imports),
        max_observation_chars=max_observation_chars, cpu=_seconds(call_cpu_budget_s),
        memory=memory_mb,
    )


TOOL_CONTRACT: str = render_tool_contract()
