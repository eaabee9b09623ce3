"""Held-out evaluation: suites, answer checkers, sandboxed code tests, tool-calling tasks.

    from spade_jax.evaluation import run_suites, default_suites, EvalConfig, SamplerPolicy
    metrics = run_suites(SamplerPolicy(model, tokenizer), default_suites(cpu=True),
                         EvalConfig(samples_per_problem=2))

Standalone: `python -m spade_jax.evaluate --checkpoint=DIR --suite=RG-Math --out=DIR`.
Modules: `policy` (TextPolicy, SamplerPolicy, ScriptedPolicy), `checkers` (math-verify,
multiple choice, exact), `data` (JSONL formats, DataError), `code_runner` (sandboxed
tests), `tool_tasks` (multi-turn tool tasks), `episodes` (multi-turn driver), `suites`
(configs, evaluate_suites, run_suites), `report` (pass@1, SE, tables, PNG).
"""

from spade_jax.evaluation.checkers import CHECKERS, Verdict, get_checker, register_checker
from spade_jax.evaluation.code_runner import CodeRunner, CodeRunnerConfig
from spade_jax.evaluation.data import DataError
from spade_jax.evaluation.episodes import run_task_episodes
from spade_jax.evaluation.policy import (
    EpisodePolicy,
    SamplerPolicy,
    SamplerPolicyConfig,
    ScriptedPolicy,
    TextPolicy,
    load_policy,
)
from spade_jax.evaluation.report import SuiteResult, markdown_table, pass_at_1, write_report
from spade_jax.evaluation.suites import (
    SUITE_KINDS,
    EvalConfig,
    SuiteConfig,
    default_suites,
    evaluate_suites,
    run_suites,
)
from spade_jax.evaluation.tool_tasks import ToolTask, ToolTaskEnv, load_tool_tasks

__all__ = [
    "CHECKERS", "SUITE_KINDS", "CodeRunner", "CodeRunnerConfig", "DataError", "EpisodePolicy",
    "EvalConfig", "SamplerPolicy", "SamplerPolicyConfig", "ScriptedPolicy", "SuiteConfig",
    "SuiteResult", "TextPolicy", "ToolTask", "ToolTaskEnv", "Verdict", "default_suites",
    "evaluate_suites", "get_checker", "load_policy", "load_tool_tasks", "markdown_table",
    "pass_at_1", "register_checker", "run_suites", "run_task_episodes", "write_report",
]
