"""Structured outcomes of sandboxed calls: stable reason codes, never exceptions.

A training run must survive any environment program, so every failure of an untrusted call
(timeout, crash, bad type, non-finite reward, ...) comes back as a `SandboxError` inside the
result object. Reason codes are stable strings; logs and validity-rate counters key on them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# Reason code -> one-line meaning. The keys are a stable public vocabulary.
REASON_CODES: dict[str, str] = {
    "ok": "program passed every check",
    "bad_hint": "a hint was given but it is empty or not a string",
    "source_too_large": "source exceeds the byte or AST-node cap",
    "syntax_error": "source does not parse",
    "forbidden_import": "imports a module outside the allow-list",
    "forbidden_name": "uses a forbidden builtin (eval, exec, open, __import__, ...)",
    "forbidden_attribute": "touches a forbidden dunder attribute (__subclasses__, __globals__, ...)",
    "missing_contract": "no game class with reset() and step() (`class Environment`, or a "
    "`*Env` class under the reference contract)",
    "weak_isolation": "a sandbox layer is missing and weak isolation was not allowed",
    "load_failed": "module-level code or Environment() raised",
    "bad_tools": "a tool environment's tool list breaks the schema rules, names a tool "
    "without its method, or changed between load and reset (the detail names the tool)",
    "timeout": "a call ran past its wall-clock deadline; the worker was killed",
    "slow_call": "a call used more CPU time than the per-call budget (the contract's one "
    "second); the worker was killed",
    "crash": "the worker process died during a call",
    "memory_limit": "the program hit the address-space limit, or its worker held more "
    "memory (anonymous and shared) than its budget and was killed",
    "pool_memory_limit": "the pool's workers together went over the pool memory budget and "
    "this worker, the largest, was killed",
    "program_error": "reset() or step() raised an exception",
    "bad_type": "a returned value has the wrong type or shape",
    "nonfinite_reward": "a reward is NaN, infinite or out of float range",
    "observation_too_large": "an observation exceeds the character cap",
    "message_too_large": "a worker message exceeds the byte cap",
    "protocol_violation": "a worker message is malformed or carries the wrong nonce",
    "return_out_of_range": "an episode's return (sum of rewards) lies outside [0, 1], or its "
    "running sum outside [-1, 1] (paper contract)",
    "reward_out_of_range": "a step reward lies outside the contract's bounds ([-1, 1] paper, "
    "[-10, 10] reference)",
    "no_termination": "an episode did not end within the step cap",
    "nondeterministic_reset": "the same seed and actions gave different transcripts",
    "nondeterministic_replay": "replaying a snapshot's actions did not reproduce its transcript",
    "resource_limit": "CPU time or memory use exceeded the validation budget",
    "validation_timeout": "validation ran past its overall wall-clock budget",
    "episode_over": "step() called after the episode ended (or before reset)",
    "closed": "the handle was closed",
    "blocklisted": "the program broke a run-time limit earlier (or the loop refused it) and "
    "is refused for further episodes",
}

# Run-time limits: a program that breaks one while it is played (a call over the CPU budget
# or the deadline, a worker over its memory budget, a transcript that a replay does not
# reproduce) is stopped, its episode ends with end reason "env_limit", and the pool
# blocklists it (`EnvPool.blocked`).
RUNTIME_LIMIT_CODES: frozenset[str] = frozenset(
    {"timeout", "slow_call", "memory_limit", "nondeterministic_replay"}
)


@dataclasses.dataclass(frozen=True)
class SandboxError:
    """Why an untrusted call failed: `code` is a key of REASON_CODES, `detail` is free text."""

    code: str
    detail: str = ""

    def __post_init__(self) -> None:
        if self.code not in REASON_CODES:
            raise ValueError(f"unknown reason code {self.code!r}")

    def __str__(self) -> str:
        return f"{self.code}: {self.detail}" if self.detail else self.code

    @property
    def end_reason(self) -> str:
        """How an episode that ended on this error is recorded (`EpisodeRecord.end_reason`):
        "env_limit" for a run-time limit or a blocklisted program, else "env_error"."""
        if self.code in RUNTIME_LIMIT_CODES or self.code == "blocklisted":
            return "env_limit"
        return "env_error"


@dataclasses.dataclass(frozen=True)
class ResetResult:
    """Outcome of reset(); on error the observation is "" and `error` says why."""

    observation: str
    info: dict[str, Any]
    error: SandboxError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclasses.dataclass(frozen=True)
class StepResult:
    """Outcome of step(); on error reward is 0.0, terminated is True and `error` says why.

    `reward` is a plain Python float that the trainer process checked itself (finite).
    """

    observation: str
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any]
    error: SandboxError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def failed_reset(error: SandboxError) -> ResetResult:
    return ResetResult(observation="", info={}, error=error)


def failed_step(error: SandboxError) -> StepResult:
    return StepResult(
        observation="", reward=0.0, terminated=True, truncated=False, info={}, error=error
    )
