"""Bad benchmark files name their line and field; the CLI end to end; the sampler adapter."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from spade_jax.evaluation import DataError, SamplerPolicy, SamplerPolicyConfig
from spade_jax.evaluation.data import load_code, load_math, load_multiple_choice
from spade_jax.evaluation.tool_tasks import load_tool_tasks


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(("loader", "lines", "message"), [
    (load_math, ['{"problem": "x", "answer": "1"}', '{"problem": "y", "answer": "2"'],
     ":2: malformed JSON"),
    (load_math, ['{"problem": "x"}'], ":1: missing field 'answer'"),
    (load_math, ['[1, 2]'], ":1: expected a JSON object"),
    (load_math, ['{"problem": 3, "answer": "1"}'], ":1: field 'problem' must be str"),
    (load_math, ['{"id": 1, "problem": "a", "answer": "1"}', '{"id": 1, "problem": "b", '
                 '"answer": "2"}'], "duplicate id '1'"),
    (load_multiple_choice, ['{"question": "q", "choices": ["a", "b"], "answer": "C"}'],
     ":1: field 'answer' must be one of ['A', 'B']"),
    (load_multiple_choice, ['', '{"question": "q", "choices": ["a"], "answer": 0}'],
     ":2: field 'choices' must be a list of 2 to 26 strings"),
    (load_code, ['{"question": "q", "tests": [{"input": "1"}]}'],
     ":1: field 'tests[0].output' must be a string"),
    (load_code, ['{"question": "q", "fn_name": "f", "tests": [{"input": "3", "output": "1"}]}'],
     ":1: field 'tests[0].input' must be a JSON list of args"),
    (load_tool_tasks, ['{"user_turns": ["hi"], "initial_state": {}, "tools": [{"name": "t", '
                       '"parameters": {"a": "str"}}], "goal": [{"answer_contains": "x"}]}'],
     ":1: field 'tools[0].parameters.a' must be one of"),
    (load_tool_tasks, ['{"user_turns": ["hi"], "initial_state": {}, "tools": [{"name": "t", '
                       '"returns": "a.{b}"}], "goal": [{"answer_contains": "x"}]}'],
     ":1: field 'tools[0].returns' refers to unknown parameter '{b}'"),
    (load_tool_tasks, ['{"user_turns": ["hi"], "initial_state": {}, "tools": [], '
                       '"goal": [{"path": "a", "op": "approx", "value": 1}]}'],
     ":1: field 'goal[0].op' must be one of"),
])
def test_bad_files_name_line_and_field(tmp_path, loader, lines, message):
    path = _write(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DataError) as err:
        loader(path)
    assert str(path) in str(err.value) and message in str(err.value)


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spade_jax.evaluate", *args],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # CLI subprocesses (~12 s in the fast-tier run)
def test_cli_with_scripted_policy(tmp_path):
    math_file = _write(tmp_path / "aime.jsonl", [
        json.dumps({"id": "p1", "problem": "CLI-ONE", "answer": "12"}),
        json.dumps({"id": "p2", "problem": "CLI-TWO", "answer": "3/4"})])
    mc_file = _write(tmp_path / "gpqa.jsonl", [
        json.dumps({"question": "CLI-MC", "choices": ["a", "b"], "answer": "A"})])
    script = tmp_path / "policy.json"
    script.write_text(json.dumps({"rules": [
        {"match": "CLI-ONE", "outputs": ["\\boxed{12}", "\\boxed{13}"]},
        {"match": "CLI-TWO", "outputs": ["\\boxed{0.75}"]},
        {"match": "CLI-MC", "outputs": ["<answer>A</answer>"]}]}))
    out = tmp_path / "out"
    done = _run(f"--policy=scripted:{script}", f"--suite=math:{math_file}",
                f"--suite=multiple_choice:{mc_file}=GPQA", "--samples=2", f"--out={out}")
    assert done.returncode == 0, done.stderr
    rows = {r["suite"]: r for r in csv.DictReader((out / "results.csv").open())}
    assert float(rows["aime"]["pass@1"]) == pytest.approx(0.75)
    assert float(rows["GPQA"]["pass@1"]) == 1.0
    assert "| aime | math | 2 | 2 | 75.0 |" in done.stdout
    assert (out / "results.png").stat().st_size > 0

    bad = _write(tmp_path / "bad.jsonl", ['{"problem": "x", "answer": "1"}', '{"problem": "y"}'])
    failed = _run(f"--policy=scripted:{script}", f"--suite=math:{bad}", f"--out={out}")
    assert failed.returncode == 2
    assert f"{bad}:2: missing field 'answer'" in failed.stderr


@pytest.mark.slow  # ~37 s loaded: trains a tokenizer, compiles the sampler
def test_sampler_policy_is_the_training_sampler(tmp_path):
    """Greedy completions equal decoding rollout.generate's tokens on the rendered chat."""
    from flax import nnx

    from spade_jax.models import ModelConfig, Qwen3
    from spade_jax.rollout import generate
    from spade_jax.tokenizers import train_sentencepiece

    tokenizer = train_sentencepiece(["what is one plus two answer boxed 0 1 2 3 " * 4,
                                     "user assistant\n"], tmp_path / "tok", vocab_size=300)
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48)
    model = Qwen3(cfg, rngs=nnx.Rngs(0))
    policy = SamplerPolicy(model, tokenizer, SamplerPolicyConfig(temperature=0.0))
    conversations = [[{"role": "user", "content": "what is one plus two"}],
                     [{"role": "user", "content": "answer 3"}]]
    texts = policy.complete(conversations, n=2, seed=0, max_new_tokens=5)
    prompts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, enable_thinking=False)
               for c in conversations]
    rows = [prompts[0], prompts[0], prompts[1], prompts[1]]  # conversation-major, n = 2
    reference = generate(model, rows, 5, temperature=0.0, stop_tokens=sorted(tokenizer.eos_ids))
    decoded = [tokenizer.decode(t, skip_special_tokens=True) for t in reference.tokens]
    assert texts == [decoded[:2], decoded[2:]]
    assert texts[0][0] == texts[0][1]  # greedy: the n samples agree
    assert policy.generated_tokens == [len(t) for t in reference.tokens]  # the token counter
