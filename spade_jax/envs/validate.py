"""Validation of an environment program before any agent sees it.

Checks, in order (the first failure decides the reason code):
  hint non-empty (when given) -> static gate (parse, caps, imports, contract) -> loads in
  the sandbox -> a scripted episode runs with right types, finite rewards and a return in
  [0, 1], and ends within the step cap -> the same seed replays to the same transcript
  hash in the same worker and in a fresh one (deterministic reset) -> episodes of
  agent-like actions (words of the game's own observations, in the policy's format) end
  cleanly and agree in two workers -> reset(seed=None)
  works -> episodes under random and adversarial actions (empty, maximal-length,
  non-ASCII, control characters, garbage) end within the step cap without errors ->
  CPU time and peak memory within budget. Every call is held to the pool's per-call CPU
  budget (the contract's second: "slow_call") and deadline.

Under the reference (recipe) contract the same checks run with boxed actions mixed in
(`\\boxed{...}`, as the agent sends them), after the recipe's own validator steps:
reset(seed=42) with a non-empty observation, the three test actions `\\boxed{1}`,
`\\boxed{test}`, `\\boxed{42}` with the right types and rewards in [-10, 10], then
reset(seed=123). Episodes end within `max_turns` by construction (the wrapper truncates
there), so "no_termination" does not apply; a step reward outside [-10, 10] anywhere is
"reward_out_of_range".
"""

from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import json
import math
import os
import random
import re
import string
import threading
import time
from collections.abc import Callable, Sequence

from spade_jax import seeding
from spade_jax.envs import supervisor
from spade_jax.envs.config import SandboxConfig
from spade_jax.envs.contract import (
    AUTO_CONTRACT,
    REFERENCE_MAX_TURNS,
    TOOL_CONTRACTS,
    resolve_contract,
)
from spade_jax.envs.pool import EnvHandle, EnvPool
from spade_jax.envs.results import SandboxError
from spade_jax.envs.static_gate import check_source

_SCRIPT = ("", "0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "yes", "no", "a", "b", "c")
_SCRIPT += ("up", "down", "left", "right", "42", "A1", "hello world", "3 4", "done")
_GARBAGE = (
    "",
    "ünïcødé ✓ 🤖 \u202e ‮ 漢字",
    "\x00\x01\x02\x1b[2J\x7f",
    "-1",
    "1e309",
    "NaN",
    "None",
    "{}",
    "' OR 1=1 --",
    "\ud800",  # lone surrogate
    "9" * 5000,
)
# The recipe validator's test actions, then boxed variants of the script and of garbage.
_RECIPE_ACTIONS = ("\\boxed{1}", "\\boxed{test}", "\\boxed{42}")
_BOXED_SCRIPT = _RECIPE_ACTIONS + tuple(f"\\boxed{{{a}}}" for a in _SCRIPT) + _SCRIPT[:6]
_BOXED_GARBAGE = _GARBAGE + (
    "\\boxed{}", "\\boxed{", "\\boxed{{}}", "\\boxed{\\boxed{1}}", "}\\boxed}{",
    "\\boxed{ünïcødé ✓ 🤖}", "\\boxed{" + "9" * 5000 + "}", "\\boxed{\x00\x1b[2J}",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ValidationConfig:
    """How hard validation pushes a program."""

    # Every episode must terminate or truncate within this many steps, whatever the actions.
    step_cap: int = 64
    # Episodes of uniformly random printable actions.
    random_episodes: int = 2
    # Episodes played the way an agent plays: words and numbers of the game's own
    # observations, in the policy's action format (`\\boxed{...}` under the reference
    # contract), with seeded choices; each is played in two workers, which must agree.
    # A program that behaves only on the validator's own inputs meets these.
    agent_episodes: int = 2
    # Base seed of every episode seed and random action of a validation (drawn through
    # `spade_jax.seeding` with Phase.VALIDATION). None: fresh OS entropy per call, so a
    # program cannot learn the validator's seeds and behave only on those. A run passes
    # `validate_program(..., seed=derive_seed(experiment_seed, step, Phase.VALIDATION, i))`
    # (reproducible, and the same on every host).
    seed: int | None = None
    # Budgets over the whole validation, per worker (CPU seconds, peak RSS in MiB).
    max_cpu_s: float = 20.0
    max_rss_mb: int = 512
    # Wall-clock budget of one whole validation (loads excluded, each bounded by the
    # pool's load deadline): every call's deadline is cut to what is left, and a program
    # still running when it is spent fails with "validation_timeout" (a program sleeping
    # just under the per-call deadline cannot hold a validation for minutes).
    max_total_s: float = 60.0

    def __post_init__(self) -> None:
        if self.step_cap < 1 or self.random_episodes < 0:
            raise ValueError("ValidationConfig.step_cap must be >= 1, random_episodes >= 0")
        if self.max_cpu_s <= 0 or self.max_rss_mb <= 0 or not self.max_total_s > 0:
            raise ValueError("ValidationConfig budgets (max_cpu_s, max_rss_mb, max_total_s) "
                             "must be > 0")
        if self.random_episodes > 64 or not 0 <= self.agent_episodes <= 64:
            raise ValueError("ValidationConfig.random_episodes and agent_episodes must lie "
                             "in [0, 64]")
        if self.seed is not None and (type(self.seed) is not int or self.seed < 0):
            raise ValueError(f"ValidationConfig.seed must be an int >= 0 or None, got {self.seed!r}")


@dataclasses.dataclass(frozen=True)
class ValidationReport:
    """Outcome of validate_program. `reason` is "ok" or "<code>: <detail>"."""

    ok: bool
    reason: str
    checks_passed: tuple[str, ...]
    transcript_hash: str | None
    elapsed_s: float
    # The base seed the validation drew its episode seeds and actions from.
    seed: int | None = None

    @property
    def code(self) -> str:
        """The stable reason code alone (a key of REASON_CODES)."""
        return self.reason.split(":", 1)[0]

    def to_json(self) -> str:
        return json.dumps({**dataclasses.asdict(self), "code": self.code}, indent=2)


class _Failed(Exception):
    def __init__(self, error: SandboxError, check: str) -> None:
        super().__init__(str(error))
        self.error = SandboxError(error.code, f"[{check}] {error.detail}")


_default_pool: EnvPool | None = None
_default_lock = threading.Lock()


def default_pool() -> EnvPool:
    """A process-wide pool with default settings, started on first use."""
    global _default_pool
    with _default_lock:
        if _default_pool is None:
            _default_pool = EnvPool(SandboxConfig())
            atexit.register(_default_pool.close)
        return _default_pool


def validate_program(
    source: str,
    hint: str | None = None,
    *,
    pool: EnvPool | None = None,
    config: ValidationConfig | None = None,
    contract: str = AUTO_CONTRACT,
    max_turns: int = REFERENCE_MAX_TURNS,
    seed: int | None = None,
) -> ValidationReport:
    """Validates an environment program (and its hint, if given). Never raises on a bad
    program; raises TypeError only for a non-str source, ValueError for an unknown
    contract.

    Args:
      source: the program text.
      hint: the hint shown to the agent, or None (no hint to check).
      pool: the sandbox pool (default: the process-wide one).
      config: how hard to push the program.
      contract: "paper", "reference" or "auto" ("paper" if the source defines a top-level
        `class Environment`, else "reference"); see `spade_jax.envs.contract`.
      max_turns: the reference contract's turn budget (the game is built with it).
      seed: base seed of the validation's episode seeds and random actions (overrides
        `config.seed`); None with `config.seed` None draws a fresh one.
    """
    if not isinstance(source, str):
        raise TypeError(f"program source must be str, got {type(source).__name__}")
    contract = resolve_contract(contract, source)
    config = config if config is not None else ValidationConfig()
    if contract in ("reference", *TOOL_CONTRACTS):  # the pool ends every episode at max_turns
        config = dataclasses.replace(config, step_cap=max_turns)
    seed = seed if seed is not None else config.seed
    seed = seed if seed is not None else int.from_bytes(os.urandom(4), "little") >> 1
    start = time.monotonic()
    passed: list[str] = []
    run = _Run(config, contract, max_turns, seed, start)
    try:
        if hint is not None and (not isinstance(hint, str) or not hint.strip()):
            raise _Failed(SandboxError("bad_hint", "hint is empty"), "hint")
        run.pool = pool if pool is not None else default_pool()
        if run.pool.config.static_gate:  # off only in tests of the runtime layers
            gate = check_source(source, run.pool.config, contract)
            if not gate.ok:
                raise _Failed(gate.error, "static_gate")
            passed.append("static_gate")
        if contract in TOOL_CONTRACTS:
            _run_tool_checks(run, source, passed)
        else:
            _run_checks(run, source, passed)
    except _Failed as failed:
        return ValidationReport(
            False, str(failed.error), tuple(passed), run.digest, time.monotonic() - start, seed
        )
    finally:
        for handle in run.handles:
            handle.close()
    return ValidationReport(
        True, "ok", tuple(passed), run.digest, time.monotonic() - start, seed
    )


def validate_programs(
    sources: Sequence[str],
    hints: Sequence[str | None] | None = None,
    *,
    pool: EnvPool | None = None,
    config: ValidationConfig | None = None,
    contract: str = AUTO_CONTRACT,
    max_turns: int = REFERENCE_MAX_TURNS,
    seeds: Sequence[int | None] | None = None,
    max_parallel: int = 8,
) -> list[ValidationReport]:
    """Validates several candidates concurrently (threads; each validation mostly waits on
    its own sandbox workers); one report per source, in input order. Each validation is
    bounded by `config.max_total_s`, so the call takes about that long at most per
    `max_parallel` candidates.

    Args:
      sources, hints: the programs and their hints (None: no hint to check).
      seeds: per candidate, its validation seed (e.g. `derive_seed(experiment_seed, step,
        Phase.VALIDATION, index)`); None = fresh seeds.
      max_parallel: validations running at once (each holds two workers).
      pool, config, contract, max_turns: as for `validate_program`.
    """
    count = len(sources)
    hints = list(hints) if hints is not None else [None] * count
    seeds = list(seeds) if seeds is not None else [None] * count
    if len(hints) != count or len(seeds) != count:
        raise ValueError(f"validate_programs: {count} sources but {len(hints)} hints and "
                         f"{len(seeds)} seeds")
    if type(max_parallel) is not int or max_parallel < 1:
        raise ValueError(f"max_parallel must be an int >= 1, got {max_parallel!r}")
    pool = pool if pool is not None else default_pool()

    def one(index: int) -> ValidationReport:
        return validate_program(sources[index], hints[index], pool=pool, config=config,
                                contract=contract, max_turns=max_turns, seed=seeds[index])

    if count <= 1 or max_parallel == 1:
        return [one(i) for i in range(count)]
    with concurrent.futures.ThreadPoolExecutor(min(max_parallel, count)) as executor:
        return list(executor.map(one, range(count)))


@dataclasses.dataclass
class _Run:
    """One validation in progress: settings, seeds, deadline, open handles, result."""

    config: ValidationConfig
    contract: str
    max_turns: int
    seed: int
    start: float
    pool: EnvPool | None = None
    handles: list[EnvHandle] = dataclasses.field(default_factory=list)
    digest: str | None = None

    def __post_init__(self) -> None:
        draws = seeding.rng(self.seed, seeding.Phase.VALIDATION)
        # scripted, mixed, adversarial, then one per random episode; the action RNG seed
        self.episode_seeds = [int(x) for x in draws.integers(0, 2**31, 3 + 64)]
        self.actions_seed = int(draws.integers(0, 2**63))

    @property
    def reference(self) -> bool:
        return self.contract == "reference"

    def remaining(self, check: str) -> float:
        """Seconds left of the overall budget; raises validation_timeout when none."""
        left = self.start + self.config.max_total_s - time.monotonic()
        if left <= 0:
            raise self.timeout(check)
        return left

    def timeout(self, check: str) -> _Failed:
        return _Failed(SandboxError(
            "validation_timeout", f"validation ran past its {self.config.max_total_s:g} s budget"
        ), check)  # fmt: skip

    def call_failed(self, error: SandboxError, check: str) -> _Failed:
        """The failure of one call, or validation_timeout if the overall budget (which cut
        the call's deadline short) is what ran out."""
        if error.code == "timeout" and time.monotonic() >= self.start + self.config.max_total_s:
            return self.timeout(check)
        return _Failed(error, check)


def _load_pair(run: _Run, source: str, passed: list[str]) -> tuple[EnvHandle, EnvHandle]:
    """The program loaded in two workers: the checks replay the first one's episodes in
    the second ("fresh"), so a transcript that depends on a worker's history shows."""
    run.handles = run.pool.open_many([source, source], contract=run.contract,
                                     max_turns=run.max_turns, trial=True)
    for handle in run.handles:
        if not handle.ok:
            raise _Failed(handle.error, "load")
    passed.append("load")
    return tuple(run.handles)


def _require_same_transcripts(same: bool) -> None:
    if not same:
        raise _Failed(
            SandboxError("nondeterministic_reset", "same seed and actions, different transcript"),
            "deterministic_reset",
        )


def _run_checks(run: _Run, source: str, passed: list[str]) -> None:
    """Every check after the static gate, in order; raises _Failed at the first failure."""
    pool, config, reference = run.pool, run.config, run.reference
    first, fresh = _load_pair(run, source, passed)
    if reference:
        _recipe_checks(run, first)
        passed.append("recipe_checks")
    scripted_seed, mixed_seed, adversarial_seed, *random_seeds = run.episode_seeds
    rng = random.Random(run.actions_seed)
    script = _cycle(_BOXED_SCRIPT if reference else _SCRIPT)
    run.digest = _episode(run, first, scripted_seed, script, "scripted_episode")
    passed.append("scripted_episode")
    again = _episode(run, first, scripted_seed, script, "deterministic_reset")
    other = _episode(run, fresh, scripted_seed, script, "deterministic_reset")
    shuffled = _random_actions(rng, pool.config.max_action_chars, boxed=reference)
    mixed = _episode(run, first, mixed_seed, shuffled, "deterministic_reset")
    mixed_fresh = _episode(run, fresh, mixed_seed, shuffled, "deterministic_reset")
    _require_same_transcripts(run.digest == again == other and mixed == mixed_fresh)
    passed.append("deterministic_reset")
    _agent_like_episodes(run, first, fresh)
    passed.append("agent_like_actions")
    _reset_without_seed(run, fresh)
    passed.append("reset_seed_none")
    for episode in range(config.random_episodes):
        actions = _random_actions(rng, pool.config.max_action_chars, boxed=reference)
        _episode(run, fresh, random_seeds[episode % len(random_seeds)], actions,
                 "random_actions")
    passed.append("random_actions")
    garbage = _BOXED_GARBAGE if reference else _GARBAGE
    adversarial = _cycle(garbage + ("x" * pool.config.max_action_chars,))
    _episode(run, first, adversarial_seed, adversarial, "adversarial_actions")
    passed.append("adversarial_actions")
    for handle in run.handles:
        _check_usage(handle, config)
    passed.append("resources")


def _run_tool_checks(run: _Run, source: str, passed: list[str]) -> None:
    """The checks of a tool environment (contracts "tool", "reference_tool_use"), in the
    order of `_run_checks`, with turns an agent could send: the agent loop's JSON actions
    calling the program's own tools with arguments drawn from their schemas (right ones,
    and wrong names, missing ones, wrong types, unknown tools, malformed calls), final
    answers, and plain and garbage text. The tool list was checked at load (by the worker
    and again here, in the trainer: "bad_tools" names the tool and the problem)."""
    pool, config = run.pool, run.config
    first, fresh = _load_pair(run, source, passed)
    schemas = first.tools or ()
    scripted_seed, mixed_seed, adversarial_seed, *random_seeds = run.episode_seeds

    def turns(seed: int, mode: str) -> _ToolTurns:
        return _ToolTurns(seed, schemas, mode, run.max_turns, pool.config.max_action_chars)

    run.digest = _episode(run, first, scripted_seed, turns(run.actions_seed, "scripted"),
                          "scripted_episode")
    passed.append("scripted_episode")
    again = _episode(run, first, scripted_seed, turns(run.actions_seed, "scripted"),
                     "deterministic_reset")
    other = _episode(run, fresh, scripted_seed, turns(run.actions_seed, "scripted"),
                     "deterministic_reset")
    mixed = _episode(run, first, mixed_seed, turns(run.actions_seed + 1, "mixed"),
                     "deterministic_reset")
    mixed_fresh = _episode(run, fresh, mixed_seed, turns(run.actions_seed + 1, "mixed"),
                           "deterministic_reset")
    _require_same_transcripts(run.digest == again == other and mixed == mixed_fresh)
    passed.append("deterministic_reset")
    draws = seeding.rng(run.seed, seeding.Phase.VALIDATION, 1)
    for _ in range(config.agent_episodes):
        seed, choices = (int(x) for x in draws.integers(0, 2**31, 2))
        one = _episode(run, first, seed, turns(choices, "agent"), "agent_like_actions")
        two = _episode(run, fresh, seed, turns(choices, "agent"), "agent_like_actions")
        if one != two:
            raise _Failed(SandboxError(
                "nondeterministic_reset", "agent-like tool calls: same seed and choices, "
                "different transcripts in two workers"), "agent_like_actions")
    passed.append("agent_like_actions")
    _reset_without_seed(run, fresh)
    passed.append("reset_seed_none")
    for episode in range(config.random_episodes):
        _episode(run, fresh, random_seeds[episode % len(random_seeds)],
                 turns(run.actions_seed + 2 + episode, "random"), "random_actions")
    passed.append("random_actions")
    _episode(run, first, adversarial_seed, turns(run.actions_seed, "adversarial"),
             "adversarial_actions")
    passed.append("adversarial_actions")
    for handle in run.handles:
        _check_usage(handle, config)
    passed.append("resources")


class _ToolTurns:
    """Turns of a tool-calling agent (seeded; one instance per episode). "scripted": every
    tool once with arguments that fit its schema, then a final answer; "mixed", "agent"
    and "random": calls with fitting or broken arguments (broken: an unknown or missing
    argument, a wrong type, an unknown tool), malformed calls, plain text and final
    answers, mostly calls, with strings from the observations ("agent") or random;
    "adversarial": garbage text, garbage arguments and oversized replies."""

    def __init__(self, seed: int, tools: Sequence[dict], mode: str, max_turns: int,
                 max_chars: int) -> None:
        self.rng = random.Random(seed)
        self.tools = [t["function"] for t in tools]
        self.mode = mode
        self.max_turns = max_turns
        self.max_chars = max_chars
        self.words: dict[str, None] = {}

    def __call__(self, t: int, observation: str) -> str:
        self.words.update(dict.fromkeys(_OBSERVED_TOKEN.findall(observation[:4000])))
        rng = self.rng
        if self.mode == "scripted":
            if t < len(self.tools) and t < self.max_turns - 1:
                return _tool_action([self._call(self.tools[t], broken=False)])
            return _tool_action([], content=f"<answer>{self._string()}</answer>")
        if self.mode == "adversarial":
            return self._adversarial(t)[: self.max_chars]
        draw = rng.random()
        if draw < 0.08:  # a final answer, plain or tagged
            answer = self._string()
            return answer if rng.random() < 0.5 else _tool_action([], f"<answer>{answer}</answer>")
        if draw < 0.16:  # malformed calls, as the agent loop reports them or as raw text
            if rng.random() < 0.5:
                return _tool_action([], errors=["tool call 0: not JSON (Expecting value at "
                                                "char 0)"])
            return '<tool_call>{"name": ' + self._string() + "</tool_call>"
        calls = [self._call(rng.choice(self.tools), broken=rng.random() < 0.3)
                 for _ in range(rng.choice((1, 1, 1, 2, 3)))]
        if rng.random() < 0.1:
            return "".join(f"<tool_call>{json.dumps(c)}</tool_call>" for c in calls)
        return _tool_action(calls)

    def _string(self) -> str:
        rng = self.rng
        if self.mode == "agent" and self.words and rng.random() < 0.8:
            return rng.choice(list(self.words))
        return "".join(rng.choice(string.ascii_letters + string.digits + " _-")
                       for _ in range(rng.randint(0, 12)))

    def _value(self, schema: dict, depth: int = 0):
        rng = self.rng
        if "enum" in schema:
            return rng.choice(schema["enum"])
        kind = schema.get("type", "string")
        kind = rng.choice(kind) if isinstance(kind, list) else kind
        low, high = schema.get("minimum", -5), schema.get("maximum", 100)
        if kind == "integer":
            words = [int(w) for w in self.words if re.fullmatch(r"-?\d{1,9}", w)]
            if words and rng.random() < 0.5:
                return rng.choice(words)
            return rng.randint(int(math.ceil(low)), max(int(math.ceil(low)), int(high)))
        if kind == "number":
            return round(rng.uniform(low, high), 2)
        if kind == "boolean":
            return rng.random() < 0.5
        if kind == "null":
            return None
        if kind == "array":
            items = schema.get("items", {"type": "string"})
            return [self._value(items, depth + 1) for _ in range(rng.randint(0, 3 if depth < 3 else 0))]
        if kind == "object":
            properties = schema.get("properties", {})
            return {name: self._value(sub, depth + 1) for name, sub in properties.items()
                    if depth < 4 and (name in schema.get("required", []) or rng.random() < 0.5)}
        return self._string()

    def _call(self, function: dict, broken: bool) -> dict:
        rng = self.rng
        parameters = function["parameters"]
        properties = parameters.get("properties", {})
        required = parameters.get("required", [])
        arguments = {name: self._value(schema) for name, schema in properties.items()
                     if name in required or rng.random() < 0.6}
        if not broken:
            return {"name": function["name"], "arguments": arguments}
        how = rng.choice(("unknown_tool", "extra", "missing", "type"))
        if how == "unknown_tool":
            return {"name": function["name"] + "_x", "arguments": arguments}
        if how == "extra" or not properties:
            return {"name": function["name"], "arguments": dict(arguments, zz_extra=1)}
        name = rng.choice(sorted(properties))
        if how == "missing":
            arguments.pop(name, None)
        else:
            wrong = {"string": 7, "integer": "seven", "number": "7.5", "boolean": "yes"}
            arguments[name] = wrong.get(properties[name].get("type"), [1.5, "x"])
        return {"name": function["name"], "arguments": arguments}

    def _adversarial(self, t: int) -> str:
        rng = self.rng
        kind = t % 4
        if kind == 0:
            return _GARBAGE[(t // 4) % len(_GARBAGE)] or "<tool_call></tool_call>"
        if kind == 1 and self.tools:
            function = rng.choice(self.tools)
            nasty = rng.choice(["", "ünïcødé ✓ 🤖 \u202e", "\x00\x1b[2J", "9" * 4000,
                                 -(2**70), 1e308, [[[[]]]], {"a": {"b": None}}, True])
            arguments = {name: nasty for name in function["parameters"].get("properties", {})}
            return _tool_action([{"name": function["name"], "arguments": arguments}])
        if kind == 2:
            return _tool_action([{"name": "__class__", "arguments": {}},
                                 {"name": "reset", "arguments": {"seed": 1}},
                                 {"name": "check", "arguments": {"answer": "x"}}])
        return "<tool_call>" * 50 + '{"name": "x"' + "}" * 200


def _tool_action(calls: list, content: str = "", errors: Sequence[str] = ()) -> str:
    """An action as the agent loop sends it under ``action_format="tool_call"``."""
    return json.dumps({"content": content, "tool_calls": calls, "errors": list(errors)},
                      ensure_ascii=False)


def _cycle(actions: tuple[str, ...]) -> Callable[[int, str], str]:
    return lambda t, observation: actions[t % len(actions)]


# What an agent answers with: numbers (fractions, decimals) and words of the observations.
_OBSERVED_TOKEN = re.compile(r"-?\d+(?:[./]\d+)?|[A-Za-z][A-Za-z_'-]{0,23}")


class _AgentLike:
    """Actions drawn the way an agent answers (seeded): one to three words or numbers from
    the episode's own observations so far, mostly in the policy's action format (boxed
    under the reference contract), sometimes as a short sentence around them."""

    def __init__(self, seed: int, boxed: bool) -> None:
        self.rng = random.Random(seed)
        self.boxed = boxed
        self.tokens: dict[str, None] = {}  # in order of appearance

    def __call__(self, t: int, observation: str) -> str:
        self.tokens.update(dict.fromkeys(_OBSERVED_TOKEN.findall(observation[:4000])))
        tokens = list(self.tokens) or ["yes"]
        picked = " ".join(self.rng.choice(tokens) for _ in range(self.rng.choice((1, 1, 2, 3))))
        if self.rng.random() < 0.2:
            return f"I think the answer is {picked}."
        return f"\\boxed{{{picked}}}" if self.boxed else picked


def _agent_like_episodes(run: _Run, first: EnvHandle, fresh: EnvHandle) -> None:
    """Episodes of agent-like actions, each played in both workers (same seed, same
    choices): they must end cleanly and give the same transcript."""
    check = "agent_like_actions"
    draws = seeding.rng(run.seed, seeding.Phase.VALIDATION, 1)
    for _ in range(run.config.agent_episodes):
        seed, choices = (int(x) for x in draws.integers(0, 2**31, 2))
        one = _episode(run, first, seed, _AgentLike(choices, run.reference), check)
        two = _episode(run, fresh, seed, _AgentLike(choices, run.reference), check)
        if one != two:
            raise _Failed(SandboxError(
                "nondeterministic_reset", "agent-like actions: same seed and choices, "
                "different transcripts in two workers"), check)


def _random_actions(
    rng: random.Random, max_chars: int, boxed: bool = False
) -> Callable[[int, str], str]:
    chosen = [
        "".join(rng.choice(string.printable) for _ in range(rng.randint(0, 40))) for _ in range(256)
    ]
    if boxed:  # every other action boxed, as an agent under the recipe's parser sends it
        chosen = [f"\\boxed{{{a}}}" if i % 2 == 0 else a for i, a in enumerate(chosen)]
    return lambda t, observation: chosen[t % len(chosen)][:max_chars]


def _recipe_checks(run: _Run, handle: EnvHandle) -> None:
    """The recipe validator's steps (types and the reward range are checked by the pool on
    every step): reset(seed=42) with a non-empty observation, its three test actions until
    the episode ends, reset(seed=123)."""
    check = "recipe_checks"
    first = handle.reset(42, deadline_s=run.remaining(check))
    if not first.ok:
        raise run.call_failed(first.error, "recipe_checks reset(seed=42)")
    if not first.observation.strip():
        raise _Failed(SandboxError("bad_type", "reset() gave an empty observation"), check)
    for action in _RECIPE_ACTIONS:
        result = handle.step(action, deadline_s=run.remaining(check))
        if not result.ok:
            raise run.call_failed(result.error, f"recipe_checks step {action!r}")
        if result.terminated or result.truncated:
            break
    again = handle.reset(123, deadline_s=run.remaining(check))
    if not again.ok:
        raise run.call_failed(again.error, "recipe_checks reset(seed=123)")


def _episode(
    run: _Run, handle: EnvHandle, seed: int, actions: Callable[[int, str], str], check: str
) -> str:
    """Runs one episode to its end (`actions(t, last observation)` gives each action);
    returns its transcript digest or raises _Failed."""
    first = handle.reset(seed, deadline_s=run.remaining(check))
    if not first.ok:
        raise run.call_failed(first.error, check)
    observation = first.observation
    for t in range(run.config.step_cap):
        result = handle.step(actions(t, observation), deadline_s=run.remaining(check))
        if not result.ok:
            raise run.call_failed(result.error, f"{check} step {t}")
        observation = result.observation
        if result.terminated or result.truncated:
            return handle.transcript_digest
    raise _Failed(
        SandboxError("no_termination", f"still running after {run.config.step_cap} steps"), check
    )


def _reset_without_seed(run: _Run, handle: EnvHandle) -> None:
    # The pool always passes a concrete seed; the contract also promises seed=None works.
    deadline = min(run.pool.config.call_deadline_s, run.remaining("reset_seed_none"))
    reply = supervisor.exchange([(handle.worker, {"op": "reset", "seed": None}, deadline)],
                                run.pool.config.call_cpu_budget_s)[0]
    result = supervisor.check_reset(reply, run.pool.config)
    if not result.ok:
        raise run.call_failed(result.error, "reset_seed_none")


def _check_usage(handle: EnvHandle, config: ValidationConfig) -> None:
    usage = handle.usage()
    if isinstance(usage, SandboxError):
        raise _Failed(usage, "resources")
    if usage["cpu_s"] > config.max_cpu_s or usage["max_rss_kb"] > config.max_rss_mb * 1024:
        raise _Failed(SandboxError("resource_limit", f"{usage}"), "resources")
