"""Runs candidate programs against tests inside the environment sandbox (`EnvPool`).

A candidate is never run in the trainer. It is embedded (as a string literal) in a small
trusted environment program whose step(test) executes the candidate with the test's stdin
(or calls `fn_name` with the test's arguments) and returns what it printed / returned as
the observation. One worker per candidate, one sandbox call per test, so the sandbox's
per-call wall-clock deadline is the time limit: a candidate that runs past it is killed and
scored "time_limit". Outputs are compared here, in the trainer, not in the worker.

The sandbox's static gate (an import allow-list meant for environment programs) is off for
this pool: solutions legitimately `import sys`. The kernel layers (seccomp, namespaces,
rlimits, uid drop) are the boundary and stay on; the pool refuses to run without them
unless `SandboxConfig.allow_weak_isolation` is set by the caller.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Sequence
from typing import Any

from spade_jax.envs import EnvPool, SandboxConfig
from spade_jax.evaluation.checkers import CORRECT, Verdict, visible_text
from spade_jax.evaluation.data import CodeProblem

# Failure reasons of code samples (besides checkers' "no_answer"):
WRONG_ANSWER, RUNTIME_ERROR, TIME_LIMIT, NO_CODE = (
    "wrong_answer", "runtime_error", "time_limit", "no_code")

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)

_HARNESS = '''
import builtins, io, json, sys

SOLUTION = %r
FN_NAME = %r
MAX_OUTPUT = %d


class Environment:
    def reset(self, seed=None):
        return "ready", {}

    def step(self, action):
        test_input = json.loads(action)
        out = io.StringIO()
        saved = sys.stdin, sys.stdout
        sys.stdin, sys.stdout = io.StringIO(test_input if FN_NAME is None else ""), out
        error, result = "", None
        try:
            namespace = {"__name__": "__main__" if FN_NAME is None else "solution",
                         "__builtins__": builtins}
            exec(compile(SOLUTION, "<solution>", "exec"), namespace)
            if FN_NAME is not None:
                args = json.loads(test_input)
                holder = namespace.get("Solution")
                fn = getattr(holder(), FN_NAME) if isinstance(holder, type) else namespace[FN_NAME]
                result = fn(*args)
        except SystemExit:
            pass
        except BaseException as err:
            error = (type(err).__name__ + ": " + str(err))[:2000]
        finally:
            sys.stdin, sys.stdout = saved
        if FN_NAME is None:
            text = out.getvalue()
        else:
            try:
                text = json.dumps(result)
            except (TypeError, ValueError):
                text = repr(result)
        return text[:MAX_OUTPUT], 0.0, False, False, {"error": error}
'''


@dataclasses.dataclass(frozen=True)
class CodeRunnerConfig:
    """Settings of sandboxed test execution.

    Attributes:
      time_limit_s: wall-clock limit of one test (a problem's own `time_limit_s` wins).
      memory_limit_mb: address-space limit of a candidate's worker.
      max_output_chars: output kept per test (longer output is compared truncated).
      max_concurrent: candidates (workers) in flight at once.
      float_tolerance: numeric tokens compare equal within this absolute/relative error.
      allow_weak_isolation: run even if a sandbox layer is missing (development only).
    """

    time_limit_s: float = 6.0
    memory_limit_mb: int = 1024
    max_output_chars: int = 65_536
    max_concurrent: int = 16
    float_tolerance: float = 1e-6
    allow_weak_isolation: bool = False

    def __post_init__(self) -> None:
        if not self.time_limit_s > 0:
            raise ValueError(f"CodeRunnerConfig.time_limit_s must be > 0, got {self.time_limit_s}")
        if self.max_output_chars < 1 or self.max_concurrent < 1:
            raise ValueError("CodeRunnerConfig needs max_output_chars >= 1 and max_concurrent >= 1")
        if not self.float_tolerance >= 0:
            raise ValueError("CodeRunnerConfig.float_tolerance must be >= 0")


def extract_code(completion: str) -> str | None:
    """The last fenced code block (a ```python block preferred), or None."""
    blocks = _FENCE.findall(visible_text(completion))
    if not blocks:
        return None
    python = [code for lang, code in blocks if lang.lower() in ("python", "py", "python3")]
    return (python or [code for _, code in blocks])[-1]


def _tokens_match(got: str, want: str, tol: float) -> bool:
    if got == want:
        return True
    try:
        a, b = float(got), float(want)
    except ValueError:
        return False
    return math.isclose(a, b, rel_tol=tol, abs_tol=tol)


def stdout_matches(got: str, want: str, tol: float = 1e-6) -> bool:
    """LiveCodeBench-style: line by line, whitespace-split tokens, numbers within tol."""
    got_lines = [line.split() for line in got.strip().splitlines()]
    want_lines = [line.split() for line in want.strip().splitlines()]
    if len(got_lines) != len(want_lines):
        return False
    return all(
        len(g) == len(w) and all(_tokens_match(x, y, tol) for x, y in zip(g, w, strict=True))
        for g, w in zip(got_lines, want_lines, strict=True)
    )


def _values_match(got: Any, want: Any, tol: float) -> bool:
    if isinstance(got, list) and isinstance(want, list):
        return len(got) == len(want) and all(
            _values_match(g, w, tol) for g, w in zip(got, want, strict=True))
    if isinstance(got, dict) and isinstance(want, dict):
        return got.keys() == want.keys() and all(_values_match(got[k], want[k], tol) for k in got)
    numbers = (int, float)
    if isinstance(got, numbers) and isinstance(want, numbers) and not isinstance(got, bool):
        return math.isclose(got, want, rel_tol=tol, abs_tol=tol)
    return got == want


def return_matches(got: str, want: str, tol: float = 1e-6) -> bool:
    """Call-based: the JSON-encoded return value equals the expected JSON value."""
    try:
        return _values_match(json.loads(got), json.loads(want), tol)
    except json.JSONDecodeError:
        return False


class CodeRunner:
    """Scores candidate programs on their problems' tests in the sandbox."""

    def __init__(self, config: CodeRunnerConfig | None = None) -> None:
        self.config = config or CodeRunnerConfig()
        self._pools: dict[float, EnvPool] = {}

    def _pool(self, time_limit_s: float) -> EnvPool:
        if time_limit_s not in self._pools:
            chars = self.config.max_output_chars + 64
            # A candidate program is not an environment: its time limit is the problem's
            # (wall clock), its memory RLIMIT_AS, and a failed test neither blocklists it
            # nor is replayed.
            self._pools[time_limit_s] = EnvPool(SandboxConfig(
                call_deadline_s=time_limit_s, memory_limit_mb=self.config.memory_limit_mb,
                max_observation_chars=chars, max_message_bytes=6 * chars + 8192,
                static_gate=False, spare_workers=0, call_cpu_budget_s=None,
                worker_memory_mb=None, replay_audit_rate=0.0, blocklist_on_limits=False,
                allow_weak_isolation=self.config.allow_weak_isolation))
        return self._pools[time_limit_s]

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()

    def __enter__(self) -> CodeRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def score(self, jobs: Sequence[tuple[CodeProblem, str]]) -> list[Verdict]:
        """One verdict per (problem, completion): correct only if every test passes."""
        verdicts: list[Verdict | None] = [None] * len(jobs)
        runnable: dict[float, list[tuple[int, CodeProblem, str]]] = {}
        for index, (problem, completion) in enumerate(jobs):
            code = extract_code(completion)
            if code is None or not code.strip():
                verdicts[index] = Verdict(0.0, NO_CODE)
                continue
            limit = problem.time_limit_s or self.config.time_limit_s
            runnable.setdefault(limit, []).append((index, problem, code))
        for limit, group in runnable.items():
            step = self.config.max_concurrent
            for start in range(0, len(group), step):
                chunk = group[start : start + step]
                for (index, _, _), verdict in zip(chunk, self._run(limit, chunk), strict=True):
                    verdicts[index] = verdict
        return verdicts  # type: ignore[return-value]

    def _run(self, limit: float, chunk: list[tuple[int, CodeProblem, str]]) -> list[Verdict]:
        pool = self._pool(limit)
        sources = [_HARNESS % (code, p.fn_name, self.config.max_output_chars)
                   for _, p, code in chunk]
        handles = pool.open_many(sources)
        try:
            verdicts: list[Verdict | None] = [None] * len(chunk)
            live = []
            resets = pool.reset_many([(h, 0) for h in handles])
            for i, reset in enumerate(resets):
                if not reset.ok:
                    verdicts[i] = Verdict(0.0, f"sandbox_error:{reset.error.code}")
                else:
                    live.append(i)
            for k in range(max(len(p.tests) for _, p, _ in chunk)):
                live = [i for i in live if verdicts[i] is None and k < len(chunk[i][1].tests)]
                calls = [(handles[i], json.dumps(chunk[i][1].tests[k].input)) for i in live]
                for i, result in zip(live, pool.step_many(calls), strict=True):
                    problem = chunk[i][1]
                    verdicts[i] = self._judge(result, problem.tests[k].output, problem.fn_name)
            return [v or Verdict(1.0, CORRECT) for v in verdicts]
        finally:
            for handle in handles:
                handle.close()

    def _judge(self, result: Any, want: str, fn_name: str | None) -> Verdict | None:
        """None if the test passed; else the failing verdict."""
        if result.error is not None:
            code = result.error.code
            if code == "timeout":
                return Verdict(0.0, TIME_LIMIT)
            return Verdict(0.0, "memory_limit" if code == "memory_limit" else f"sandbox_error:{code}")
        if result.info.get("error"):
            return Verdict(0.0, RUNTIME_ERROR)
        tol = self.config.float_tolerance
        ok = (stdout_matches(result.observation, want, tol) if fn_name is None
              else return_matches(result.observation, want, tol))
        return None if ok else Verdict(0.0, WRONG_ANSWER)
