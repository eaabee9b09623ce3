"""Hint-regret filter: regimes and statistics as constructed, resume after a crash, bad input."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from spade_jax.evaluation import DataError, ScriptedPolicy
from spade_jax.hint_filter import FilterConfig, load_filter_tasks, run_filter, write_outputs
from spade_jax.spade import DesignerRewardConfig, designer_reward

# (task id, P(success | hint), P(success | no hint), regime it must land in)
CONSTRUCTED = [
    ("frontier-a", 0.9, 0.1, "frontier"),
    ("frontier-b", 0.8, 0.3, "frontier"),
    ("mastered-a", 0.95, 0.95, "mastered"),
    ("mastered-misleading-hint", 0.6, 0.9, "mastered"),  # negative regret, solved without
    ("intractable-a", 0.05, 0.05, "intractable"),
    ("intractable-b", 0.1, 0.1, "intractable"),
]


def _tasks_file(path: Path, extra: int = 0) -> Path:
    rows = [{"id": tid, "prompt": f"TASK {tid}", "hint": f"HINT {tid}", "answer": "yes",
             "checker": "exact", "source": "unit-test"} for tid, *_ in CONSTRUCTED]
    rows += [{"id": f"x{i}", "prompt": f"TASK x{i}", "hint": f"HINT x{i}", "answer": "yes",
              "checker": "exact"} for i in range(extra)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _script(delay_s: float = 0.0) -> dict:
    rules = []
    for tid, p_hint, p_no_hint, _ in CONSTRUCTED:  # hint rule first: its prompt has both texts
        rules.append({"match": f"HINT {tid}", "p": p_hint, "correct": "<answer>yes</answer>",
                      "wrong": "<answer>no</answer>"})
        rules.append({"match": f"TASK {tid}", "p": p_no_hint, "correct": "<answer>yes</answer>",
                      "wrong": "<answer>no</answer>"})
    rules.append({"match": "HINT x", "p": 0.7, "correct": "<answer>yes</answer>", "wrong": "x"})
    rules.append({"match": "TASK x", "p": 0.3, "correct": "<answer>yes</answer>", "wrong": "x"})
    return {"rules": rules, "delay_s": delay_s}


def test_regimes_and_statistics_as_constructed(tmp_path):
    """n = 400 per arm: SE(regret) <= 0.035, so every regime has >= 4 SE of margin and each
    estimate must lie within 4 SE of its constructed value (a 4-sigma miss has p < 1e-4)."""
    n = 400
    tasks = load_filter_tasks(_tasks_file(tmp_path / "tasks.jsonl"))
    config = FilterConfig(samples_hint=n, samples_no_hint=n, chunk_size=4)
    stats = run_filter(ScriptedPolicy.from_json(_script()), tasks, tmp_path / "out", config,
                       progress=False)
    for (tid, p_hint, p_no_hint, regime), s in zip(CONSTRUCTED, stats, strict=True):
        assert s["id"] == tid and s["regime"] == regime, s
        hint, no_hint = np.array(s["returns_hint"]), np.array(s["returns_no_hint"])
        assert hint.size == n and no_hint.size == n
        # statistics re-derived from the raw returns with NumPy
        assert s["mean_hint"] == pytest.approx(hint.mean())
        assert s["mean_no_hint_stderr"] == pytest.approx(no_hint.std(ddof=1) / math.sqrt(n))
        assert s["regret"] == pytest.approx(hint.mean() - no_hint.mean())
        assert s["win_rate"] == pytest.approx((no_hint >= 1.0).mean())
        # ... within sampling error of the constructed probabilities
        assert abs(s["regret"] - (p_hint - p_no_hint)) < 4 * max(s["regret_stderr"], 0.01)
        assert abs(s["win_rate"] - p_no_hint) < 4 * max(s["win_rate_stderr"], 0.01)
        # the designer reward is SPADE's own function, not a re-implementation
        assert s["designer_reward"] == pytest.approx(designer_reward(hint, no_hint).total)
    summary = write_outputs(tasks, stats, tmp_path / "out", config)
    assert summary["counts"] == {"frontier": 2, "mastered": 2, "intractable": 2}
    frontier = [json.loads(x) for x in (tmp_path / "out/frontier.jsonl").read_text().splitlines()]
    assert [r["id"] for r in frontier] == ["frontier-a", "frontier-b"]
    assert frontier[0]["source"] == "unit-test" and "regret" in frontier[0]["filter_stats"]
    assert (tmp_path / "out/regret_vs_win_rate.png").read_bytes()[:4] == b"\x89PNG"


def test_regime_thresholds_are_configurable(tmp_path):
    tasks = load_filter_tasks(_tasks_file(tmp_path / "tasks.jsonl"))
    # n = 400: frontier-b's regret (0.5) sits ~3 SE below the 0.6 threshold, whatever the
    # prompt text the scripted policy's draws are keyed on.
    config = FilterConfig(samples_hint=400, samples_no_hint=400,
                          reward=DesignerRewardConfig(frontier_regret=0.6, mastered_return=0.99))
    stats = run_filter(ScriptedPolicy.from_json(_script()), tasks, tmp_path / "o", config,
                       progress=False)
    regimes = {s["id"]: s["regime"] for s in stats}
    assert regimes["frontier-b"] == "intractable"  # regret ~0.5 <= 0.6, best arm 0.8 < 0.99
    assert regimes["frontier-a"] == "frontier"


class _Crash(Exception):
    pass


class _CountingPolicy:
    def __init__(self, inner: ScriptedPolicy, crash_after: int | None = None):
        self.inner, self.crash_after, self.prompts = inner, crash_after, []

    def complete(self, conversations, *, n, seed, max_new_tokens):
        if self.crash_after is not None and len(self.prompts) >= self.crash_after:
            raise _Crash
        self.prompts.append([c[0]["content"] for c in conversations])
        return self.inner.complete(conversations, n=n, seed=seed, max_new_tokens=max_new_tokens)


def test_resume_skips_finished_chunks_and_torn_lines(tmp_path):
    tasks = load_filter_tasks(_tasks_file(tmp_path / "tasks.jsonl", extra=6))  # 12 tasks
    config = FilterConfig(samples_hint=8, samples_no_hint=8, chunk_size=3)
    script = ScriptedPolicy.from_json(_script())
    reference = run_filter(script, tasks, tmp_path / "ref", config, progress=False)

    crashing = _CountingPolicy(script, crash_after=5)  # 2 calls (arms) per chunk: dies in chunk 2
    with pytest.raises(_Crash):
        run_filter(crashing, tasks, tmp_path / "run", config, progress=False)
    progress = tmp_path / "run/progress.jsonl"
    assert len(progress.read_text().splitlines()) == 6
    with progress.open("a") as handle:  # a torn write of chunk 2's first line
        handle.write('{"id": "intractable-a", "regime": "fr')
    resumed = _CountingPolicy(script)
    stats = run_filter(resumed, tasks, tmp_path / "run", config, progress=False)
    assert stats == reference
    sampled = {p.removeprefix("TASK ").split("\n")[0] for call in resumed.prompts for p in call}
    assert sampled == {t.id for t in tasks[6:]}  # chunks 0 and 1 were not sampled again

    other = FilterConfig(samples_hint=9, samples_no_hint=8, chunk_size=3)
    with pytest.raises(ValueError, match="other tasks or settings"):
        run_filter(script, tasks, tmp_path / "run", other, progress=False)


def test_progress_and_outputs_in_a_bucket_resume_like_a_local_run(tmp_path, gcs, monkeypatch):
    """--out=gs://...: the progress file is uploaded after every chunk, so a run that dies
    resumes from the bucket without re-sampling finished chunks and equals an uninterrupted
    local run; the outputs land in the bucket, equal to the local ones, and nothing is
    written to a local ``gs:`` directory."""
    from etils import epath

    gcs.create_bucket("outs")
    monkeypatch.chdir(tmp_path)  # a wrong local write would land here, as ./gs:/...
    tasks = load_filter_tasks(_tasks_file(tmp_path / "tasks.jsonl", extra=6))  # 12 tasks
    config = FilterConfig(samples_hint=8, samples_no_hint=8, chunk_size=3)
    scripted = ScriptedPolicy.from_json(_script())
    reference = run_filter(scripted, tasks, tmp_path / "filter", config, progress=False)
    with pytest.raises(_Crash):  # dies in chunk 2, after chunks 0 and 1 were uploaded
        run_filter(_CountingPolicy(scripted, crash_after=5), tasks, "gs://outs/filter", config,
                   progress=False)
    assert len(epath.Path("gs://outs/filter/progress.jsonl").read_text().splitlines()) == 6
    resumed = _CountingPolicy(scripted)
    assert run_filter(resumed, tasks, "gs://outs/filter", config, progress=False) == reference
    assert len(resumed.prompts) == 4  # two chunks left, two arms each
    summary = write_outputs(tasks, reference, "gs://outs/filter", config)
    assert summary == write_outputs(tasks, reference, tmp_path / "filter", config)
    assert epath.Path("gs://outs/filter/frontier.jsonl").read_text() == (
        tmp_path / "filter" / "frontier.jsonl").read_text()
    assert not (tmp_path / "gs:").exists()


def _cli(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "spade_jax.filter", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


@pytest.mark.slow  # three CLI subprocesses (~21 s in the fast-tier run)
def test_cli_killed_mid_run_then_resumed_equals_uninterrupted(tmp_path):
    tasks = _tasks_file(tmp_path / "tasks.jsonl", extra=6)
    script = tmp_path / "policy.json"
    script.write_text(json.dumps(_script(delay_s=0.4)))
    common = [f"--tasks={tasks}", f"--policy=scripted:{script}", "--samples_hint=8",
              "--samples_no_hint=8", "--chunk_size=2"]
    fast = tmp_path / "fast.json"
    fast.write_text(json.dumps(_script()))
    ref = subprocess.run([sys.executable, "-m", "spade_jax.filter", *common[:1],
                          f"--policy=scripted:{fast}", *common[2:], f"--out={tmp_path / 'ref'}"],
                         capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr

    out = tmp_path / "run"
    proc = _cli(*common, f"--out={out}")
    progress = out / "progress.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline:
        if progress.exists() and len(progress.read_text().splitlines()) >= 4:
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    lines = len(progress.read_text().splitlines())
    assert 4 <= lines < 12, "the run must be killed mid-file"
    done = subprocess.run([sys.executable, "-m", "spade_jax.filter", *common, f"--out={out}"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "hint filter" in done.stderr and "task" in done.stderr  # tqdm bar (with ETA)
    for name in ("frontier.jsonl", "mastered.jsonl", "intractable.jsonl", "summary.json"):
        assert (out / name).read_text() == (tmp_path / "ref" / name).read_text(), name


PROGRAM = '''
class Environment:
    def reset(self, seed=None):
        return "Say the secret word.", {}

    def step(self, action):
        won = action.strip() == "tangerine"
        return ("right" if won else "wrong"), (1.0 if won else 0.0), True, False, {}
'''


def test_program_tasks_run_in_the_sandbox(tmp_path):
    rows = [{"id": "secret", "program": PROGRAM, "hint": "The word is tangerine."},
            {"id": "broken", "program": "class Environment(:\n", "hint": "nothing"}]
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    policy = ScriptedPolicy.from_json({"rules": [
        {"match": "tangerine", "outputs": ["tangerine", "tangerine", "tangerine", "apple"]},
        {"match": "Say the secret word", "outputs": ["apple", "pear", "tangerine", "plum"]}]})
    stats = run_filter(policy, load_filter_tasks(path), tmp_path / "out",
                       FilterConfig(samples_hint=4, samples_no_hint=4), progress=False)
    assert stats[0]["returns_hint"] == [1.0, 1.0, 1.0, 0.0]
    assert stats[0]["returns_no_hint"] == [0.0, 0.0, 1.0, 0.0]
    assert stats[0]["regime"] == "frontier" and stats[0]["regret"] == pytest.approx(0.5)
    assert stats[1]["regime"] == "intractable" and stats[1]["broken"].startswith("syntax_error")


@pytest.mark.parametrize(("line", "message"), [
    ('{"prompt": "p", "hint": "h", "answer": "1", "checker": "math"', ":2: malformed JSON"),
    ('{"prompt": "p", "answer": "1", "checker": "math"}', ":2: missing field 'hint'"),
    ('{"prompt": "p", "hint": "h", "checker": "math"}', ":2: missing field 'answer'"),
    ('{"prompt": "p", "hint": "h", "answer": "1"}', ":2: missing field 'checker'"),
    ('{"prompt": "p", "hint": "h", "answer": "1", "checker": "regex"}',
     ":2: field 'checker': unknown checker 'regex'"),
    ('{"hint": "h", "program": 5}', ":2: field 'program' must be str"),
])
def test_bad_input_names_line_and_field(tmp_path, line, message):
    path = tmp_path / "tasks.jsonl"
    path.write_text('{"prompt": "ok", "hint": "h", "answer": "1", "checker": "exact"}\n'
                    + line + "\n")
    with pytest.raises(DataError, match=None) as err:
        load_filter_tasks(path)
    assert f"{path}{message}" in str(err.value)


@pytest.mark.slow
def test_cli_bad_input_exit_status(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text('{"prompt": "p", "hint": "h", "answer": "1", "checker": "nope"}\n')
    done = subprocess.run([sys.executable, "-m", "spade_jax.filter", f"--tasks={path}",
                           f"--out={tmp_path / 'o'}", "--policy=scripted:/nonexistent.json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and f"{path}:1: field 'checker'" in done.stderr
