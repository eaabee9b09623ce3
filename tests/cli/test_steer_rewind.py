"""`python -m spade_jax.steer rewind` in process on the planted MoE (tests/support/planted_moe.py).

The planted experts fire on "behaviour" tokens (every third id) and emit the end-of-turn
token; every other token is followed by the next id. So an unmodified greedy continuation
ends within a few tokens, a continuation with the planted experts suppressed never emits
the end token, and a random expert set disjoint from them changes nothing.
"""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from planted_moe import PLANTED, TOP_K, planted_moe

from spade_jax.models import save_hf
from spade_jax.steer import main
from spade_jax.steering.commands.rewind import parse_plan_label
from spade_jax.tokenizers import train_sentencepiece

# The commands end to end (model build, capture, sampling): the slow tier, with the other
# command-line tests.
pytestmark = pytest.mark.slow

MAX_NEW = 12
TRACES = [
    {"trace_id": "t1", "prompt": "what is one plus two",
     "text": "one plus two is three. wait, is that right? three plus four is seven. "
             "let me check it again. the answer is seven."},
    {"trace_id": "t2", "prompt": [{"role": "user", "content": "what is five plus five"}],
     "text": "let me verify first. five plus five is ten. double check: ten. answer ten."},
]
# Points: t1 "wait" (segment 1), t1 "let me check" (segment 3), t2 "double check" (segment
# 2); t2's first segment opens with a check but has nothing before it to back up to.
SCRIPT = {"rules": [{"match": "is that right", "outputs": ["new_round"]},
                    {"match": "verify first", "outputs": ["**Wrap_up**."]}],
          "default": "maybe a new round?"}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("rewind")
    tokenizer = train_sentencepiece(
        ["one plus two is three four five six seven ten wait is that right let me check it "
         "again verify first double answer the what " * 4, "user assistant system\n"],
        root / "tok" / "sp", vocab_size=300)
    stops = set(tokenizer.eos_ids)
    target = min(stops)
    ordinary = [t for t in range(tokenizer.vocab_size) if t not in stops]
    behaviour = {t for t in ordinary if t % 3 == 0}
    successor = {t: ordinary[(ordinary.index(t) + 1) % len(ordinary)] for t in ordinary}
    successor |= {t: ordinary[0] for t in stops}
    model = planted_moe(tokenizer.vocab_size, behaviour, target, successor)
    save_hf(model, model.config, root / "model")
    (root / "sets.json").write_text(json.dumps({
        "format": "spade_jax.expert_sets/1", "num_experts": 8, "top_k": TOP_K,
        "sets": {"conclusion": {"0": list(PLANTED)}}}))
    (root / "traces.jsonl").write_text("".join(json.dumps(t) + "\n" for t in TRACES))
    (root / "judge.json").write_text(json.dumps(SCRIPT))
    think_end = tokenizer.encode("</think>")
    return {"root": root, "tokenizer": tokenizer, "behaviour": behaviour, "target": target,
            "successor": successor, "stops": stops | set(think_end)}


def _args(world, out, *extra):
    root = world["root"]
    return ["rewind", f"--checkpoint={root / 'model'}", f"--tokenizer={root / 'tok' / 'sp.model'}",
            f"--traces={root / 'traces.jsonl'}", f"--expert_sets={root / 'sets.json'}",
            f"--max_new_tokens={MAX_NEW}", f"--out={out}", *extra]


def _rows(out):
    return [json.loads(line) for line in (out / "rewind.jsonl").read_text().splitlines()]


def _table(out):
    with (out / "rewind.csv").open() as f:
        return {r["condition"]: r for r in csv.DictReader(f)}


def _greedy(world, prefix, suppress):
    """The continuation by construction (stops at an end-of-turn id or </think>)."""
    token, out = prefix[-1], []
    while len(out) < MAX_NEW:
        on_behaviour = token in world["behaviour"] and not suppress
        token = world["target"] if on_behaviour else world["successor"][token]
        out.append(token)
        if token in world["stops"]:
            break
    return out


def test_unsteered_rewind_regenerates_the_same_text(world, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(_args(world, out, "--conditions=none,none", "--temperature=3.0",
                      "--seed=3")) == 0
    rows = _rows(out)
    assert len(rows) == 6
    by = {(r["trace_id"], r["point"], r["condition"]): r for r in rows}
    assert sorted({k[:2] for k in by}) == [("t1", 0), ("t1", 1), ("t2", 0)]
    for trace_id, point in {k[:2] for k in by}:
        first, again = by[trace_id, point, "none"], by[trace_id, point, "none#2"]
        assert first["token_ids"] == again["token_ids"] and first["text"] == again["text"]
    assert float(_table(out)["none#2"]["changed"]) == 0.0
    points = [json.loads(line) for line in (out / "points.jsonl").read_text().splitlines()]
    assert [p["check_segment"] for p in points] == [1, 3, 2]
    # Sampling was on (T = 3; the planted logits are ~7 apart): the continuations are not all the greedy chain.
    tokenizer = world["tokenizer"]
    greedy = []
    for p in points:
        trace = next(t for t in TRACES if t["trace_id"] == p["trace_id"])
        prompt = trace["prompt"] if isinstance(trace["prompt"], list) else \
            [{"role": "user", "content": trace["prompt"]}]
        prefix = tokenizer.apply_chat_template(prompt, add_generation_prompt=True,
                                               enable_thinking=True) \
            + tokenizer.encode(trace["text"])[:p["backup_token"]]
        greedy.append(_greedy(world, prefix, suppress=False))
    assert [by[p["trace_id"], p["point"], "none"]["token_ids"] for p in points] != greedy
    assert "in a first segment skipped" in capsys.readouterr().out


def test_suppressing_the_planted_experts_keeps_the_model_thinking(world, tmp_path):
    out = tmp_path / "out"
    assert main(_args(world, out, "--conditions=none,steered,random", "--temperature=0",
                      "--suppress=conclusion",
                      f"--judge=scripted:{world['root'] / 'judge.json'}")) == 0
    rows = _rows(out)
    assert len(rows) == 9
    tokenizer = world["tokenizer"]
    prefixes = {}
    for t in TRACES:
        prompt = t["prompt"] if isinstance(t["prompt"], list) else \
            [{"role": "user", "content": t["prompt"]}]
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True,
                                            enable_thinking=True)
        prefixes[t["trace_id"]] = (ids, tokenizer.encode(t["text"]))
    points = [json.loads(line) for line in (out / "points.jsonl").read_text().splitlines()]
    for p in points:
        prompt, trace = prefixes[p["trace_id"]]
        prefix = prompt + trace[:p["backup_token"]]
        assert p["prefix_tokens"] == len(prefix)
        for r in rows:
            if (r["trace_id"], r["point"]) != (p["trace_id"], p["point"]):
                continue
            want = _greedy(world, prefix, suppress=r["condition"] == "steered")
            assert r["token_ids"] == want, r
            assert r["ended_thinking"] == (want[-1] in world["stops"])
    table = _table(out)
    none, steered, random = (table[c] for c in ("none", "steered", "random"))
    assert float(none["end_of_thinking_rate"]) == 1.0
    assert float(steered["end_of_thinking_rate"]) < 1.0
    assert float(steered["mean_tokens"]) > float(none["mean_tokens"])
    assert float(steered["changed"]) == 1.0 and float(random["changed"]) == 0.0
    assert (float(random["mean_tokens"]), random["end_of_thinking_rate"]) == \
        (float(none["mean_tokens"]), none["end_of_thinking_rate"])
    labels = {(r["trace_id"], r["point"]): r["label"] for r in rows if r["condition"] == "none"}
    assert labels == {("t1", 0): "unparsed", ("t1", 1): "new_round", ("t2", 0): "wrap_up"}
    for row in table.values():
        assert (row["new_round"], row["wrap_up"], row["unparsed"]) == ("1", "1", "1")
    assert (out / "rewind.png").stat().st_size > 0
    assert "| steered | 3 |" in (out / "rewind.md").read_text()


def test_resume_skips_done_points_and_refuses_other_arguments(world, tmp_path, capsys):
    out = tmp_path / "out"
    args = _args(world, out, "--conditions=none", "--temperature=3.0")
    assert main(args) == 0  # one batch of all three points
    full = (out / "rewind.jsonl").read_text().splitlines()
    (out / "rewind.jsonl").write_text("\n".join(full[:2]) + "\n")  # the last point undone
    capsys.readouterr()
    # --batch_size is not part of the run: batches of one point now, two of them done.
    assert main([*args, "--batch_size=1"]) == 0
    printed = capsys.readouterr().out
    assert "2 of 3 batches done before" in printed
    assert "batch 3/3" in printed and "batch 1/3" not in printed
    # Point 2 drew from its own random stream (seed, 2) again, alone in its batch now.
    assert (out / "rewind.jsonl").read_text().splitlines() == full
    assert main(args) == 0
    assert "1 of 1 batches done before" in capsys.readouterr().out
    assert (out / "rewind.jsonl").read_text().splitlines() == full
    assert main([*args, "--seed=1"]) == 2
    assert "holds a different rewind run: --seed was 0, now 1" in capsys.readouterr().err


def test_bad_input_exits_2(world, tmp_path, capsys):
    root = world["root"]
    bad = tmp_path / "bad.jsonl"

    def run(traces_text, *extra):
        bad.write_text(traces_text)
        code = main([*_args(world, tmp_path / "out", "--suppress=conclusion"),
                     f"--traces={bad}", *extra])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("error: ") and "Traceback" not in err
        return err

    good = (root / "traces.jsonl").read_text()
    assert f"{bad}, line 2: invalid JSON" in run(good.splitlines()[0] + "\n{oops\n")
    assert "needs a non-empty 'text' or 'token_ids'" in run('{"trace_id": "a", "text": ""}\n')
    assert "'prompt' must be a non-empty string" in run(
        '{"trace_id": "a", "prompt": [{"x": 1}], "text": "wait"}\n')
    assert "duplicate trace_id 't1'" in run(good.splitlines()[0] + "\n" + good.splitlines()[0])
    assert "no check starts found" in run('{"trace_id": "a", "text": "one plus two."}\n')
    assert "token ids outside the tokenizer's vocabulary" in run(
        '{"trace_id": "a", "token_ids": [1, 99999]}\n')
    assert "behaviour(s) ['planning'] not in the expert-set file" in run(
        good, "--suppress=planning")
    assert "--conditions: unknown 'sometimes'" in run(good, "--conditions=none,sometimes")
    assert "invalid regex" in run(good, "--check_marker=wait(")
    bad.write_text(good)
    assert main(["rewind", f"--checkpoint={root / 'model'}", f"--traces={bad}",
                 "--conditions=none,steered", f"--out={tmp_path / 'o'}"]) == 2
    assert "need --suppress or --activate" in capsys.readouterr().err


def test_plan_labels_are_parsed_strictly():
    assert parse_plan_label("new_round") == "new_round"
    assert parse_plan_label("  **Wrap-up**.\n") == "wrap_up"
    assert parse_plan_label("<think>hmm</think>\nwrap up") == "wrap_up"
    assert parse_plan_label("new_round, because it re-checks") == "unparsed"
    assert parse_plan_label("") == "unparsed"
    assert np.isnan(float("nan"))
