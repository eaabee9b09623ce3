"""Held-out evaluation: a scripted policy (forced outputs) gets exactly the expected scores.

Every suite kind is run end to end on fixtures written here, with right, wrong, malformed
and (for code) time-limited answers; pass@1 and its standard error are re-derived by hand.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from pathlib import Path

import numpy as np
import pytest

from spade_jax.evaluation import (
    CodeRunnerConfig,
    EvalConfig,
    ScriptedPolicy,
    SuiteConfig,
    evaluate_suites,
    pass_at_1,
    run_suites,
    write_report,
)
from spade_jax.evaluation.tool_tasks import ToolTaskEnv, load_tool_tasks

N = 4  # samples per problem


def _jsonl(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _script(rules: list[tuple[str, list]]) -> ScriptedPolicy:
    return ScriptedPolicy.from_json(
        {"rules": [{"match": m, "outputs": o} for m, o in rules], "default": "no idea"})


def _reference(per_sample: list[list[int]]) -> tuple[float, float]:
    """pass@1 and clustered SE from the definitions, with the statistics module."""
    p = [sum(row) / len(row) for row in per_sample]
    return statistics.fmean(p), statistics.stdev(p) / math.sqrt(len(p))


def _one(policy, suite, n=N, **kw):
    return evaluate_suites(policy, [suite], EvalConfig(samples_per_problem=n, **kw))[0]


def test_math_suite_scores_right_wrong_and_malformed(tmp_path):
    path = _jsonl(tmp_path / "aime.jsonl", [
        {"id": "half", "problem": "Q-HALF: what is 1/2?", "answer": "\\frac{1}{2}"},
        {"id": "big", "problem": "Q-BIG: 2 times 102?", "answer": 204},
        {"problem": "Q-NONE: unanswered", "answer": "7"},
    ])
    policy = _script([
        ("Q-HALF", ["\\boxed{0.5}", "so $\\frac{2}{4}$", "\\boxed{3}", "no answer at all"]),
        ("Q-BIG", ["\\boxed{204}", "\\boxed{204}", "\\boxed{204}", "<think>\\boxed{204}"]),
    ])
    result = _one(policy, SuiteConfig("aime", "math", path=path))
    assert result.problem_ids == ["half", "big", "aime-3"]
    expected = [[1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]]
    np.testing.assert_array_equal(result.scores, expected)
    # "no idea" (default) and an unclosed <think> carry no answer; "\boxed{3}" is wrong.
    assert result.reasons == {"correct": 5, "wrong": 1, "no_answer": 6}
    p, se = _reference(expected)
    assert result.pass_at_1 == pytest.approx(p) and result.stderr == pytest.approx(se)


def test_multiple_choice_suite(tmp_path):
    path = _jsonl(tmp_path / "gpqa.jsonl", [
        {"id": "q1", "question": "MC-ONE?", "choices": ["w", "x", "y", "z"], "answer": "B"},
        {"id": "q2", "question": "MC-TWO?", "choices": ["w", "x", "y"], "answer": 2},
    ])
    policy = _script([
        ("MC-ONE", ["<answer>B</answer>", "The answer is (C)", "I am not sure",
                    "<answer>Z</answer>"]),
        ("MC-TWO", ["Answer: c", "<think>A?</think><answer>C</answer>", "<answer>A</answer>",
                    "<answer>C</answer>"]),
    ])
    result = _one(policy, SuiteConfig("gpqa", "multiple_choice", path=path))
    expected = [[1, 0, 0, 0], [1, 1, 0, 1]]
    np.testing.assert_array_equal(result.scores, expected)
    assert result.reasons == {"correct": 4, "wrong": 3, "no_answer": 1}
    assert result.pass_at_1 == pytest.approx(_reference(expected)[0])


ADD = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
CODE_COMPLETIONS = [
    ADD,
    "```python\nimport sys\na, b = map(int, sys.stdin.read().split())\nprint(a - b)\n```",
    "```python\nwhile True:\n    pass\n```",                       # time limit
    "```python\nraise ValueError('boom')\n```",                        # runtime error
    "Just add the numbers.",                                            # no code block
]


def test_code_suite_in_sandbox_with_time_limit(tmp_path):
    path = _jsonl(tmp_path / "lcb.jsonl", [
        {"id": "add", "question": "CODE-ADD: print a+b.",
         "tests": [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5\n", "output": "10"}]},
        {"id": "twice", "question": "CODE-TWICE", "fn_name": "twice",
         "tests": [{"input": "[3]", "output": "6"}, {"input": "[0.5]", "output": "1.0"}]},
    ])
    policy = _script([
        ("CODE-ADD", CODE_COMPLETIONS),
        ("CODE-TWICE", [
            "```python\nclass Solution:\n    def twice(self, x):\n        return 2 * x\n```",
            "```python\ndef twice(x):\n    return x + x\n```",
            "```python\ndef twice(x):\n    return [x]\n```",
            "```python\ndef other(x):\n    return x\n```",               # no such function
            "```\ndef twice(x):\n    return 2 * x\n```"]),             # untagged fence is fine
    ])
    config = EvalConfig(samples_per_problem=5, code=CodeRunnerConfig(time_limit_s=1.0))
    result = evaluate_suites(policy, [SuiteConfig("lcb", "code", path=path)], config)[0]
    np.testing.assert_array_equal(result.scores, [[1, 0, 0, 0, 0], [1, 1, 0, 0, 1]])
    assert result.sample_reasons[0] == ["correct", "wrong_answer", "time_limit",
                                        "runtime_error", "no_code"]
    assert result.sample_reasons[1] == ["correct", "correct", "wrong_answer", "runtime_error",
                                        "correct"]


BANK_TASK = {
    "id": "bank",
    "user_turns": ["Move 30 from checking to savings.", "What is my savings balance now?"],
    "initial_state": {"accounts": {"checking": 100, "savings": 5}},
    "tools": [
        {"name": "get_balance", "description": "Balance of an account.",
         "parameters": {"account": "string"}, "returns": "accounts.{account}"},
        {"name": "transfer", "description": "Move money.",
         "parameters": {"source": "string", "target": "string", "amount": "number"},
         "requires": [{"path": "accounts.{source}", "op": "gte", "value": "{amount}"}],
         "effects": [{"op": "sub", "path": "accounts.{source}", "value": "{amount}"},
                     {"op": "add", "path": "accounts.{target}", "value": "{amount}"}]},
    ],
    "goal": [{"path": "accounts.savings", "op": "eq", "value": 35},
             {"path": "accounts.checking", "op": "eq", "value": 70},
             {"answer_contains": "35"}],
    "max_turns": 6,
}


def _call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_tool_suite_multi_turn(tmp_path):
    path = _jsonl(tmp_path / "tools.jsonl", [BANK_TASK])
    transfer = _call("transfer", source="checking", target="savings", amount=30)
    scripts = [
        [transfer, "Done.", _call("get_balance", account="savings"), "You have 35."],  # solves
        ["Done.", "You have 35."],                                  # claims without acting
        ["<tool_call>{not json</tool_call>", transfer, "Done.", "Savings: 35"],  # recovers
        [_call("transfer", source="checking", target="savings", amount=300),  # precondition
         _call("transfer", source="checking", target="savings", amount="30"),  # bad type
         _call("wire", to="x"), "ok", "ok", "ok"],                  # unknown tool; turn cap
    ]
    policy = _script([("Move 30 from checking", scripts)])
    result = _one(policy, SuiteConfig("tools", "tool", path=path))
    np.testing.assert_array_equal(result.scores, [[1, 0, 1, 0]])
    assert result.reasons == {"correct": 2, "goal_not_met": 2}


def test_tool_env_reports_errors_without_changing_state(tmp_path):
    env = ToolTaskEnv(load_tool_tasks(_jsonl(tmp_path / "t.jsonl", [BANK_TASK]))[0])
    observation, _ = env.reset(seed=0)
    assert "transfer" in observation and observation.endswith("Move 30 from checking to savings.")
    obs, reward, done, truncated, _ = env.step(
        _call("transfer", source="checking", target="savings", amount=300))
    assert "precondition failed" in obs and (reward, done, truncated) == (0.0, False, False)
    assert env.state == BANK_TASK["initial_state"]
    obs, *_ = env.step(_call("get_balance", account="nope"))
    assert "not found" in obs
    obs, *_ = env.step(_call("transfer", source="checking", target="savings"))
    assert "missing arguments ['amount']" in obs


def test_reasoning_gym_suite_against_package_answers():
    import reasoning_gym

    tasks = ("basic_arithmetic", "chain_sum")
    rules = []
    expected = []
    for task in tasks:
        for index in range(2):
            entry = reasoning_gym.create_dataset(task, seed=7, size=1_000_000)[index]
            right = f"<answer>{entry['answer']}</answer>"
            # sample 0 right, 1 wrong, 2 right without tags (scored on the whole text)
            rules.append((entry["question"], [right, "<answer>banana</answer>", entry["answer"]]))
            expected.append([1, 0, 1])
    suite = SuiteConfig("RG-Math", "reasoning_gym", rg_tasks=tasks, problems_per_task=2,
                        dataset_seed=7)
    result = _one(_script(rules), suite, n=3)
    assert result.problem_ids == ["basic_arithmetic/0", "basic_arithmetic/1", "chain_sum/0",
                                  "chain_sum/1"]
    np.testing.assert_array_equal(result.scores, expected)


def test_pass_at_1_stderr_reference():
    rng = np.random.default_rng(0)
    scores = (rng.random((13, 5)) < 0.4).astype(float)
    p, se = pass_at_1(scores)
    assert (p, se) == pytest.approx(_reference(scores.tolist()))
    one = np.array([[1, 0, 0, 1]])
    assert pass_at_1(one) == pytest.approx((0.5, math.sqrt(0.25 / 4)))


def test_run_suites_metrics_and_report_files(tmp_path):
    path = _jsonl(tmp_path / "m.jsonl", [
        {"id": "a", "problem": "MA", "answer": "1"}, {"id": "b", "problem": "MB", "answer": "2"}])
    policy = _script([("MA", ["\\boxed{1}"]), ("MB", ["\\boxed{2}", "\\boxed{9}"])])
    suites = [SuiteConfig("m", "math", path=path),
              SuiteConfig("m1", "math", path=path, max_problems=1)]
    config = EvalConfig(samples_per_problem=2)
    metrics = run_suites(policy, suites, config)
    assert metrics["m/pass@1"] == pytest.approx(0.75)
    assert metrics["m/pass@1_stderr"] == pytest.approx(_reference([[1, 1], [1, 0]])[1])
    assert metrics["m1/pass@1"] == 1.0 and metrics["m1/num_problems"] == 1.0
    assert metrics["mean/pass@1"] == pytest.approx(0.875)
    paths = write_report(evaluate_suites(policy, suites, config), tmp_path / "out")
    rows = list(csv.DictReader(paths["results.csv"].open()))
    assert [r["suite"] for r in rows] == ["m", "m1"]
    assert float(rows[0]["pass@1"]) == pytest.approx(0.75)
    assert "| m | math | 2 | 2 | 75.0 |" in paths["results.md"].read_text()
    assert paths["results.png"].read_bytes()[:4] == b"\x89PNG"
    assert len(paths["samples.jsonl"].read_text().splitlines()) == 6
