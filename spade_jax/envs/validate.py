"""Validation of an environment program before any agent sees it.

Checks, in order (the first failure decides the reason code):
  hint non-empty (when given) -> static gate (parse, caps, imports, contract) -> loads in
  the sandbox -> a scripted episode runs with right types, finite rewards and a return in
  [0, 1], and ends within the step cap -> the same seed replays to the same transcript
  hash in the same worker and in a fresh one (deterministic reset) -> reset(seed=None)
  works -> episodes under random and adversarial actions (empty, maximal-length,
  non-ASCII, control characters, garbage) end within the step cap without errors ->
  CPU time and peak memory within budget.

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
import collections
import dataclasses
import json
import random
import string
import threading
import time
from collections.abc import Callable, Iterable

from spade_jax.envs import supervisor
from spade_jax.envs.config import SandboxConfig
from spade_jax.envs.contract import AUTO_CONTRACT, REFERENCE_MAX_TURNS, resolve_contract
from spade_jax.envs.pool import EnvHandle, EnvPool
from spade_jax.envs.results import REASON_CODES, SandboxError
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
    # Seed of the scripted episode and of the random actions.
    seed: int = 1234
    # Budgets over the whole validation, per worker (CPU seconds, peak RSS in MiB).
    max_cpu_s: float = 20.0
    max_rss_mb: int = 512

    def __post_init__(self) -> None:
        if self.step_cap < 1 or self.random_episodes < 0:
            raise ValueError("ValidationConfig.step_cap must be >= 1, random_episodes >= 0")
        if self.max_cpu_s <= 0 or self.max_rss_mb <= 0:
            raise ValueError("ValidationConfig budgets must be > 0")


@dataclasses.dataclass(frozen=True)
class ValidationReport:
    """Outcome of validate_program. `reason` is "ok" or "<code>: <detail>"."""

    ok: bool
    reason: str
    checks_passed: tuple[str, ...]
    transcript_hash: str | None
    elapsed_s: float

    @property
    def code(self) -> str:
        """The stable reason code alone (a key of REASON_CODES)."""
        return self.reason.split(":", 1)[0]

    def to_json(self) -> str:
        return json.dumps({**dataclasses.asdict(self), "code": self.code}, indent=2)


class ValidityTally:
    """Counts reports by reason code, for a run's validity-rate-by-reason metrics."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()

    def add(self, report: ValidationReport) -> None:
        self.counts[report.code] += 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def validity_rate(self) -> float:
        return self.counts["ok"] / self.total if self.total else 0.0

    def rates(self) -> dict[str, float]:
        return {code: n / self.total for code, n in sorted(self.counts.items())}


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
    """
    if not isinstance(source, str):
        raise TypeError(f"program source must be str, got {type(source).__name__}")
    contract = resolve_contract(contract, source)
    config = config if config is not None else ValidationConfig()
    if contract == "reference":  # the wrapper ends every episode at max_turns
        config = dataclasses.replace(config, step_cap=max_turns)
    reference = contract == "reference"
    start = time.monotonic()
    passed: list[str] = []
    digest = None
    handles: list[EnvHandle] = []
    try:
        if hint is not None and (not isinstance(hint, str) or not hint.strip()):
            raise _Failed(SandboxError("bad_hint", "hint is empty"), "hint")
        pool = pool if pool is not None else default_pool()
        gate = check_source(source, pool.config, contract)
        if not gate.ok:
            raise _Failed(gate.error, "static_gate")
        passed.append("static_gate")
        handles = pool.open_many([source, source], contract=contract, max_turns=max_turns)
        for handle in handles:
            if not handle.ok:
                raise _Failed(handle.error, "load")
        passed.append("load")
        first, fresh = handles
        if reference:
            _recipe_checks(first)
            passed.append("recipe_checks")
        script = _cycle(_BOXED_SCRIPT if reference else _SCRIPT)
        digest = _episode(pool, first, config.seed, script, config, "scripted_episode")
        passed.append("scripted_episode")
        again = _episode(pool, first, config.seed, script, config, "deterministic_reset")
        other = _episode(pool, fresh, config.seed, script, config, "deterministic_reset")
        shuffled = _random_actions(
            random.Random(config.seed), pool.config.max_action_chars, boxed=reference
        )
        mixed = _episode(pool, first, config.seed + 7, shuffled, config, "deterministic_reset")
        mixed_fresh = _episode(
            pool, fresh, config.seed + 7, shuffled, config, "deterministic_reset"
        )
        if not (digest == again == other and mixed == mixed_fresh):
            raise _Failed(
                SandboxError(
                    "nondeterministic_reset", "same seed and actions, different transcript"
                ),
                "deterministic_reset",
            )
        passed.append("deterministic_reset")
        _reset_without_seed(pool, fresh)
        passed.append("reset_seed_none")
        rng = random.Random(config.seed)
        for episode in range(config.random_episodes):
            actions = _random_actions(rng, pool.config.max_action_chars, boxed=reference)
            _episode(pool, fresh, config.seed + 1 + episode, actions, config, "random_actions")
        passed.append("random_actions")
        garbage = _BOXED_GARBAGE if reference else _GARBAGE
        adversarial = _cycle(garbage + ("x" * pool.config.max_action_chars,))
        _episode(pool, first, config.seed + 100, adversarial, config, "adversarial_actions")
        passed.append("adversarial_actions")
        for handle in handles:
            _check_usage(handle, config)
        passed.append("resources")
    except _Failed as failed:
        return ValidationReport(
            False, str(failed.error), tuple(passed), digest, time.monotonic() - start
        )
    finally:
        for handle in handles:
            handle.close()
    return ValidationReport(True, "ok", tuple(passed), digest, time.monotonic() - start)


def _cycle(actions: tuple[str, ...]) -> Callable[[int], str]:
    return lambda t: actions[t % len(actions)]


def _random_actions(
    rng: random.Random, max_chars: int, boxed: bool = False
) -> Callable[[int], str]:
    chosen = [
        "".join(rng.choice(string.printable) for _ in range(rng.randint(0, 40))) for _ in range(256)
    ]
    if boxed:  # every other action boxed, as an agent under the recipe's parser sends it
        chosen = [f"\\boxed{{{a}}}" if i % 2 == 0 else a for i, a in enumerate(chosen)]
    return lambda t: chosen[t % len(chosen)][:max_chars]


def _recipe_checks(handle: EnvHandle) -> None:
    """The recipe validator's steps (types and the reward range are checked by the pool on
    every step): reset(seed=42) with a non-empty observation, its three test actions until
    the episode ends, reset(seed=123)."""
    first = handle.reset(42)
    if not first.ok:
        raise _Failed(first.error, "recipe_checks reset(seed=42)")
    if not first.observation.strip():
        raise _Failed(SandboxError("bad_type", "reset() gave an empty observation"), "recipe_checks")
    for action in _RECIPE_ACTIONS:
        result = handle.step(action)
        if not result.ok:
            raise _Failed(result.error, f"recipe_checks step {action!r}")
        if result.terminated or result.truncated:
            break
    again = handle.reset(123)
    if not again.ok:
        raise _Failed(again.error, "recipe_checks reset(seed=123)")


def _episode(
    pool: EnvPool,
    handle: EnvHandle,
    seed: int,
    actions: Callable[[int], str],
    config: ValidationConfig,
    check: str,
) -> str:
    """Runs one episode to its end; returns its transcript digest or raises _Failed."""
    first = handle.reset(seed)
    if not first.ok:
        raise _Failed(first.error, check)
    for t in range(config.step_cap):
        result = handle.step(actions(t))
        if not result.ok:
            raise _Failed(result.error, f"{check} step {t}")
        if result.terminated or result.truncated:
            return handle.transcript_digest
    raise _Failed(
        SandboxError("no_termination", f"still running after {config.step_cap} steps"), check
    )


def _reset_without_seed(pool: EnvPool, handle: EnvHandle) -> None:
    # The pool always passes a concrete seed; the contract also promises seed=None works.
    reply = supervisor.exchange(
        [(handle.worker, {"op": "reset", "seed": None}, pool.config.call_deadline_s)]
    )[0]
    result = supervisor.check_reset(reply, pool.config)
    if not result.ok:
        raise _Failed(result.error, "reset_seed_none")


def _check_usage(handle: EnvHandle, config: ValidationConfig) -> None:
    usage = handle.usage()
    if isinstance(usage, SandboxError):
        raise _Failed(usage, "resources")
    if usage["cpu_s"] > config.max_cpu_s or usage["max_rss_kb"] > config.max_rss_mb * 1024:
        raise _Failed(SandboxError("resource_limit", f"{usage}"), "resources")


def summarize(reports: Iterable[ValidationReport]) -> dict[str, int]:
    """Reason code -> count over many reports (every code listed, zeros included)."""
    counts = dict.fromkeys(REASON_CODES, 0)
    for report in reports:
        counts[report.code] += 1
    return counts
