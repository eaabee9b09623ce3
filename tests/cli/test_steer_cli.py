"""End to end on a tiny planted MoE: telemetry -> labels -> probe -> expert sets -> the
`python -m spade_jax.steer` table (subprocess), checked against the model's construction.

The model is `planted_moe.planted_moe` (tests/support/planted_moe.py) over a real sentencepiece vocabulary: the
planted experts fire on "behaviour" tokens (every third id) and emit the end-of-turn token,
every other token is followed by the next id. Unmodified greedy completions therefore end
within a few tokens; suppressing the planted experts means the end token never comes.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import numpy as np
import pytest
from planted_moe import PLANTED, TOP_K, planted_moe

from spade_jax.models import save_hf
from spade_jax.steer import main
from spade_jax.steering.capture import score_and_record
from spade_jax.steering.expert_sets import expert_sets_from_scores, save_expert_sets
from spade_jax.steering.experts import ExpertCounts
from spade_jax.steering.labels import BEHAVIOURS, labels_for_trace, load_labels_jsonl
from spade_jax.steering.probe import group_split, probe_router_layers
from spade_jax.steering.segment import SegmenterConfig, project_labels_to_tokens, segment_tokens
from spade_jax.steering.telemetry import TelemetryReader, TelemetryWriter
from spade_jax.tokenizers import train_sentencepiece

MAX_NEW = 12
BLOCK = 4  # tokens per segment (the segmenter's cap; the blocks contain no sentence enders)


def _build(tmp_path):
    tokenizer = train_sentencepiece(
        ["what is one plus two three four five six seven eight nine ten answer " * 4,
         "user assistant system\n"], tmp_path / "tok" / "sp", vocab_size=300)
    vocab = tokenizer.vocab_size
    stops = set(tokenizer.eos_ids)
    plain_ids = [t for t in range(vocab) if tokenizer.decode([t]).strip(" ").isalnum()]
    target = min(stops)
    ordinary = [t for t in range(vocab) if t not in stops]
    behaviour = {t for t in ordinary if t % 3 == 0}
    successor = {t: ordinary[(ordinary.index(t) + 1) % len(ordinary)] for t in ordinary}
    successor |= {t: ordinary[0] for t in stops}
    model = planted_moe(vocab, behaviour, target, successor)
    return tokenizer, model, behaviour, target, successor, plain_ids


def _greedy_length(prompt, behaviour, target, successor, suppress):
    """Generated tokens by the construction (stop at the end token, at most MAX_NEW)."""
    token, count = prompt[-1], 0
    while count < MAX_NEW:
        token = target if token in behaviour and not suppress else successor[token]
        count += 1
        if token == target:
            break
    return count


@pytest.mark.slow  # ~130 s loaded: JAX subprocess, model build
def test_end_to_end_table(tmp_path):
    tokenizer, model, behaviour, target, successor, plain_ids = _build(tmp_path)
    save_hf(model, model.config, tmp_path / "model")

    # 1. Telemetry: traces made of 4-token segments, all behaviour or all ordinary tokens.
    rng = np.random.default_rng(0)
    pools = ([t for t in plain_ids if t in behaviour], [t for t in plain_ids if t not in behaviour])
    traces, kinds = [], []
    for _ in range(16):
        kind = rng.integers(0, 2, size=6)
        traces.append(sum((rng.choice(pools[k], BLOCK).tolist() for k in kind), []))
        kinds.append(kind)
    with TelemetryWriter(tmp_path / "telemetry", chunk_tokens=128) as writer:
        score_and_record(model, traces, writer)

    # 2. Labels, imported from JSONL: behaviour segments are "conclusion", the rest cycle
    #    through the other five behaviours (so every class has tokens).
    others = [b for b in BEHAVIOURS if b != "conclusion"]
    label_lines, token_labels = [], []
    for trace_id, (trace, kind) in enumerate(zip(traces, kinds, strict=True)):
        segments = segment_tokens([tokenizer.decode([t]) for t in trace],
                                  SegmenterConfig(max_tokens=BLOCK))
        assert [s.end - s.start for s in segments] == [BLOCK] * 6
        for i, k in enumerate(kind):
            label = "conclusion" if k == 0 else others[(trace_id + i) % len(others)]
            label_lines.append(json.dumps({"trace_id": str(trace_id), "segment": i,
                                           "label": label}))
    (tmp_path / "labels.jsonl").write_text("\n".join(label_lines) + "\n")
    records = load_labels_jsonl(tmp_path / "labels.jsonl")
    for trace_id, trace in enumerate(traces):
        segments = segment_tokens([tokenizer.decode([t]) for t in trace],
                                  SegmenterConfig(max_tokens=BLOCK))
        labels = labels_for_trace(records, str(trace_id), len(segments))
        token_labels.append(project_labels_to_tokens(segments, labels, len(trace)))

    # 3. Probe and risk difference, streaming the telemetry chunk by chunk.
    reader = TelemetryReader(tmp_path / "telemetry")
    counts = ExpertCounts(len(BEHAVIOURS), reader.num_layers, reader.num_experts)
    labels_n = np.concatenate(token_labels)
    logits, seq_ids, offset = [], [], 0
    for chunk in reader.iter_chunks():
        n = len(chunk.token_ids)
        counts.update(chunk.selected, labels_n[offset : offset + n])
        logits.append(chunk.router_logits.astype(np.float32))
        seq_ids.append(chunk.sequence_ids)
        offset += n
    is_conclusion = (labels_n == BEHAVIOURS.index("conclusion")).astype(np.int64)
    train, test = group_split(np.concatenate(seq_ids), test_fraction=0.25)
    (result,) = probe_router_layers(np.concatenate(logits), is_conclusion, train, test,
                                    [(0,)], 2).values()
    assert result.macro_f1 > 0.95 > result.majority_macro_f1 + 0.3
    sets = expert_sets_from_scores(counts.risk_difference(), 2, reader.metadata["moe_layers"],
                                   TOP_K)
    assert sets.sets["conclusion"] == {0: PLANTED}
    save_expert_sets(tmp_path / "sets.json", sets)

    # 4. The steered evaluation table from the CLI.
    problems = [{"problem": "what is one plus two", "answer": "3"},
                {"problem": "what is four plus five", "answer": "9"}]
    (tmp_path / "bench.jsonl").write_text("\n".join(json.dumps(p) for p in problems) + "\n")
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "spade_jax.steer", f"--checkpoint={tmp_path / 'model'}",
         f"--tokenizer={tmp_path / 'tok' / 'sp.model'}", f"--suite=jsonl:{tmp_path / 'bench.jsonl'}",
         f"--expert_sets={tmp_path / 'sets.json'}", "--suppress=conclusion",
         f"--max_new_tokens={MAX_NEW}", "--samples=1", f"--out={out}"],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "results.png").stat().st_size > 0
    assert "| steered |" in (out / "results.md").read_text()
    with (out / "results.csv").open() as f:
        rows = {r["condition"]: r for r in csv.DictReader(f)}
    assert list(rows) == ["unmodified", "steered", "random-control", "prompt-control"]

    def expected(system: str | None, suppress: bool) -> float:
        lengths = []
        for p in problems:
            messages = [{"role": "user", "content": f"{p['problem']}\n\nSolve the problem. "
                         "Put your final answer within \\boxed{}."}]
            if system:
                messages.insert(0, {"role": "system", "content": system})
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                   enable_thinking=False)
            lengths.append(_greedy_length(prompt, behaviour, target, successor, suppress))
        return float(np.mean(lengths))

    unmodified, steered = expected(None, False), expected(None, True)
    assert steered == MAX_NEW > unmodified
    assert float(rows["unmodified"]["mean_tokens"]) == unmodified
    assert float(rows["steered"]["mean_tokens"]) == steered
    np.testing.assert_allclose(float(rows["steered"]["relative_token_change"]),
                               (steered - unmodified) / unmodified)
    for row in rows.values():
        np.testing.assert_allclose(float(row["accuracy_delta"]),
                                   float(row["accuracy"]) - float(rows["unmodified"]["accuracy"]))
        assert int(row["completions"]) == len(problems)


def test_bad_expert_set_arguments_exit_2(tmp_path, capsys):
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"problem": "1+1", "answer": "2"}) + "\n")
    bad = tmp_path / "sets.json"
    bad.write_text('{"format": "spade_jax.expert_sets/1", "num_experts": 8, "top_k": 2, '
                   '"sets": {"planning": {"0": [1, 8]}}}')
    common = [f"--checkpoint={tmp_path}", f"--suite=jsonl:{bench}", f"--expert_sets={bad}"]
    assert main([*common, "--suppress=planning"]) == 2
    assert f"{bad}: behaviour 'planning' layer 0: expert ids [8] outside [0, 8)" in \
        capsys.readouterr().err
    bad.write_text('{"format": "spade_jax.expert_sets/1", "num_experts": 8, "top_k": 2, '
                   '"sets": {"planning": {"0": [1, 2]}}}')
    assert main([*common, "--suppress=reflection"]) == 2
    assert "behaviour(s) ['reflection'] not in the expert-set file" in capsys.readouterr().err
    assert main([*common, "--suppress=planning"]) == 2  # valid sets, but no model there
    assert "has no config.json" in capsys.readouterr().err
