"""Held-out evaluation suites: build prompts, sample through a `TextPolicy`, score, aggregate.

    results = evaluate_suites(policy, default_suites(), EvalConfig(samples_per_problem=4))
    metrics = run_suites(policy, suites, config)   # {"RG-Math/pass@1": ..., ...} for logging

The same code serves the in-training eval (the SPADE loop calls `run_suites` every N
rounds) and `python -m spade_jax.evaluate`. Suite kinds:
  reasoning_gym    RG-Math / RG-Algo / RG-Cog / RG-Logic, generated offline from fixed
                   (dataset_seed, problems_per_task): item i of each task, i < k; scored by
                   the package's verifier; a sample counts as correct at score 1.
  math             JSONL problem/answer, checked by math-verify.
  multiple_choice  JSONL question/choices/answer, the letter extracted and compared.
  code             JSONL question/tests, run in the sandbox with a time limit.
  tool             JSONL multi-turn tool-calling tasks (`tool_tasks`), run as episodes.
pass@1 per problem is the share of its n samples that are correct; a suite's pass@1 is the
mean over problems; see `report.pass_at_1` for the standard error.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from spade_jax.evaluation import data, report, tool_tasks
from spade_jax.evaluation.checkers import CORRECT, WRONG, Verdict, get_checker
from spade_jax.evaluation.code_runner import CodeRunner, CodeRunnerConfig
from spade_jax.evaluation.episodes import run_task_episodes
from spade_jax.evaluation.policy import TextPolicy
from spade_jax.seeding import Phase, derive_seed

SUITE_KINDS = ("reasoning_gym", "math", "multiple_choice", "code", "tool")
RG_SUITE_NAMES = ("RG-Math", "RG-Algo", "RG-Cog", "RG-Logic")

MATH_INSTRUCTION = "Solve the problem. Put your final answer within \\boxed{}."
CHOICE_INSTRUCTION = ("Answer with the letter of the correct option inside "
                      "<answer></answer>, e.g. <answer>B</answer>.")
RG_INSTRUCTION = "Give your final answer inside <answer></answer>."
CODE_STDIN_INSTRUCTION = ("Write a complete Python 3 program that reads the input from "
                          "standard input and prints the output. Put it in one ```python block.")
CODE_CALL_INSTRUCTION = ("Complete the function `{fn}` (a method of class Solution if the "
                         "starter code has one). Put the code in one ```python block.")


@dataclasses.dataclass(frozen=True)
class SuiteConfig:
    """One evaluation suite.

    Attributes:
      name: label in tables and metric keys ("AIME25", "RG-Math", ...).
      kind: one of SUITE_KINDS.
      path: the JSONL file (every kind but reasoning_gym).
      rg_suite: RG suite for kind reasoning_gym (default: `name`).
      rg_tasks: only these reasoning-gym tasks (default: all of the suite's).
      max_tasks: only the first k tasks of the suite in sorted order (None: all).
      problems_per_task: items per reasoning-gym task (item indices 0..k-1).
      dataset_seed: reasoning-gym generator seed; fixed so numbers compare across runs.
      max_problems: only the first k problems of a file (None: all).
      max_new_tokens: overrides EvalConfig.max_new_tokens for this suite.
    """

    name: str
    kind: str
    path: str | None = None
    rg_suite: str | None = None
    rg_tasks: tuple[str, ...] = ()
    max_tasks: int | None = None
    problems_per_task: int = 10
    dataset_seed: int = 0
    max_problems: int | None = None
    max_new_tokens: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "rg_tasks", tuple(self.rg_tasks))
        if not self.name:
            raise ValueError("SuiteConfig.name must be non-empty")
        if self.kind not in SUITE_KINDS:
            raise ValueError(f"SuiteConfig.kind must be one of {SUITE_KINDS}, got {self.kind!r}")
        if self.kind == "reasoning_gym":
            suite = self.rg_suite or self.name
            if suite not in RG_SUITE_NAMES:
                raise ValueError(f"suite {self.name!r}: rg_suite must be one of {RG_SUITE_NAMES}")
        elif not self.path:
            raise ValueError(f"suite {self.name!r} of kind {self.kind!r} needs a path")
        for name in ("max_tasks", "max_problems", "max_new_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"SuiteConfig.{name} must be >= 1 or None, got {value}")
        if self.problems_per_task < 1:
            raise ValueError(f"SuiteConfig.problems_per_task must be >= 1, got {self.problems_per_task}")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Settings shared by all suites of one evaluation.

    Attributes:
      samples_per_problem: n completions per problem (pass@1 = mean correct share).
      seed: sampling seed (each suite offsets it by its index).
      max_new_tokens: generation budget per completion / per tool-task turn.
      max_turns: agent turns per tool-task episode at most (a task's own limit is lower).
      problems_per_call: problems per policy call (bounds a batch to n x this rows).
      code: sandbox settings of code suites (time limit per test, memory).
    """

    samples_per_problem: int = 4
    seed: int = 0
    max_new_tokens: int = 1024
    max_turns: int = 8
    problems_per_call: int = 64
    code: CodeRunnerConfig = dataclasses.field(default_factory=CodeRunnerConfig)

    def __post_init__(self) -> None:
        for name in ("samples_per_problem", "max_new_tokens", "max_turns", "problems_per_call"):
            if getattr(self, name) < 1:
                raise ValueError(f"EvalConfig.{name} must be >= 1, got {getattr(self, name)}")


def default_suites(cpu: bool = False) -> tuple[SuiteConfig, ...]:
    """The four reasoning-gym suites (offline, fixed seed). `cpu`: 2 tasks x 2 items each."""
    if cpu:
        return tuple(SuiteConfig(n, "reasoning_gym", max_tasks=2, problems_per_task=2,
                                 max_new_tokens=64) for n in RG_SUITE_NAMES)
    return tuple(SuiteConfig(n, "reasoning_gym", problems_per_task=10) for n in RG_SUITE_NAMES)


# ----------------------------------------------------------------------------- problems


@dataclasses.dataclass
class Problem:
    """A single-turn problem: its prompt and how to score one completion."""

    id: str
    prompt: str
    score: Callable[[str], Verdict] | None = None  # None: scored in batch (code)
    payload: Any = None


def _rg_problems(suite: SuiteConfig) -> list[Problem]:
    from spade_jax.envs import RG_SUITES, make_reasoning_gym_env

    available = RG_SUITES[suite.rg_suite or suite.name]
    tasks = suite.rg_tasks or available
    unknown = sorted(set(tasks) - set(available))
    if unknown:
        raise ValueError(f"suite {suite.name!r}: tasks {unknown} are not in {suite.rg_suite or suite.name}")
    tasks = sorted(tasks)[: suite.max_tasks]
    problems = []
    for task in tasks:
        env = make_reasoning_gym_env(task, dataset_seed=suite.dataset_seed)
        for index in range(suite.problems_per_task):
            question, _ = env.reset(seed=index)
            problems.append(Problem(f"{task}/{index}", f"{question}\n\n{RG_INSTRUCTION}",
                                    _rg_scorer(env, env.entry)))
    return problems


def _rg_scorer(env: Any, entry: dict[str, Any]) -> Callable[[str], Verdict]:
    def score(completion: str) -> Verdict:
        env.entry = entry
        value = env.score(completion)
        return Verdict(1.0, CORRECT) if value >= 1.0 else Verdict(0.0, WRONG if value == 0
                                                                   else "partial")
    return score


def _file_problems(suite: SuiteConfig) -> list[Problem]:
    if suite.kind == "math":
        check = get_checker("math")
        return [Problem(p.id, f"{p.problem}\n\n{MATH_INSTRUCTION}",
                        lambda text, a=p.answer: check(text, a))
                for p in data.load_math(suite.path)[: suite.max_problems]]
    if suite.kind == "multiple_choice":
        check = get_checker("multiple_choice")
        problems = []
        for p in data.load_multiple_choice(suite.path)[: suite.max_problems]:
            options = "\n".join(f"{chr(65 + i)}) {c}" for i, c in enumerate(p.choices))
            problems.append(Problem(p.id, f"{p.question}\n\n{options}\n\n{CHOICE_INSTRUCTION}",
                                    lambda text, a=p.answer: check(text, a)))
        return problems
    problems = []
    for p in data.load_code(suite.path)[: suite.max_problems]:
        instruction = (CODE_STDIN_INSTRUCTION if p.fn_name is None
                       else CODE_CALL_INSTRUCTION.format(fn=p.fn_name))
        starter = f"\n\nStarter code:\n```python\n{p.starter_code}\n```" if p.starter_code else ""
        problems.append(Problem(p.id, f"{p.question}{starter}\n\n{instruction}", payload=p))
    return problems


# ----------------------------------------------------------------------------- running


def _sample_problems(policy: TextPolicy, problems: list[Problem], n: int, seed: int,
                     max_new_tokens: int, per_call: int) -> list[list[str]]:
    completions: list[list[str]] = []
    for start in range(0, len(problems), per_call):
        chunk = problems[start : start + per_call]
        out = policy.complete([[{"role": "user", "content": p.prompt}] for p in chunk],
                              n=n, seed=derive_seed(seed, start),
                              max_new_tokens=max_new_tokens)
        if len(out) != len(chunk) or any(len(texts) != n for texts in out):
            raise RuntimeError(f"policy returned {[len(t) for t in out]} completions for "
                               f"{len(chunk)} conversations x n={n}")
        completions.extend(out)
    return completions


def _run_single_turn(policy: TextPolicy, suite: SuiteConfig, config: EvalConfig, seed: int,
                     runner: Callable[[], CodeRunner]) -> tuple[list[str], list[list[Verdict]],
                                                               list[list[str]]]:
    problems = _rg_problems(suite) if suite.kind == "reasoning_gym" else _file_problems(suite)
    n = config.samples_per_problem
    completions = _sample_problems(policy, problems, n, seed,
                                   suite.max_new_tokens or config.max_new_tokens,
                                   config.problems_per_call)
    if suite.kind == "code":
        jobs = [(p.payload, text) for p, texts in zip(problems, completions, strict=True)
                for text in texts]
        flat = runner().score(jobs)
        verdicts = [flat[i * n : (i + 1) * n] for i in range(len(problems))]
    else:
        verdicts = [[p.score(text) for text in texts]
                    for p, texts in zip(problems, completions, strict=True)]
    return [p.id for p in problems], verdicts, completions


def _run_tool(policy: TextPolicy, suite: SuiteConfig, config: EvalConfig,
              seed: int) -> tuple[list[str], list[list[Verdict]], list[list[str]]]:
    tasks = tool_tasks.load_tool_tasks(suite.path)[: suite.max_problems]
    n = config.samples_per_problem
    returns = run_task_episodes(
        policy, [lambda t=t: tool_tasks.ToolTaskEnv(t) for t in tasks], n=n,
        seeds=[0] * len(tasks), seed=seed,
        max_turns=min(config.max_turns, max((t.max_turns for t in tasks), default=1)),
        max_new_tokens=suite.max_new_tokens or config.max_new_tokens)
    verdicts = [[Verdict(1.0, CORRECT) if r >= 1.0 else Verdict(0.0, "goal_not_met")
                 for r in row] for row in returns]
    return [t.id for t in tasks], verdicts, [[""] * n for _ in tasks]


def evaluate_suites(
    policy: TextPolicy,
    suites: Sequence[SuiteConfig],
    config: EvalConfig | None = None,
) -> list[report.SuiteResult]:
    """Runs every suite; returns per-suite results (scores, reasons, pass@1, stderr)."""
    config = config or EvalConfig()
    names = [s.name for s in suites]
    if len(set(names)) != len(names):
        raise ValueError(f"suite names must be unique, got {names}")
    runners: list[CodeRunner] = []

    def runner() -> CodeRunner:
        if not runners:
            runners.append(CodeRunner(config.code))
        return runners[0]

    results = []
    try:
        for index, suite in enumerate(suites):
            start = time.perf_counter()
            seed = derive_seed(config.seed, Phase.EVAL, index)
            if suite.kind == "tool":
                ids, verdicts, completions = _run_tool(policy, suite, config, seed)
            else:
                ids, verdicts, completions = _run_single_turn(policy, suite, config, seed, runner)
            scores = np.array([[v.score for v in row] for row in verdicts], dtype=np.float64)
            scores = scores.reshape(len(ids), config.samples_per_problem)
            reasons = collections.Counter(v.reason for row in verdicts for v in row)
            results.append(report.SuiteResult(
                name=suite.name, kind=suite.kind, problem_ids=ids, scores=scores,
                reasons=dict(sorted(reasons.items())),
                sample_reasons=[[v.reason for v in row] for row in verdicts],
                completions=completions, seconds=time.perf_counter() - start))
    finally:
        for r in runners:
            r.close()
    return results


def run_suites(
    policy: TextPolicy,
    suites: Sequence[SuiteConfig],
    config: EvalConfig | None = None,
) -> dict[str, float]:
    """Flat metrics for the training log: `<suite>/pass@1`, `<suite>/pass@1_stderr`,
    `<suite>/num_problems` per suite and `mean/pass@1` (unweighted mean over suites)."""
    return report.metrics(evaluate_suites(policy, suites, config))
