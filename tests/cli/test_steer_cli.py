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
from planted_moe import NUM_EXPERTS, PLANTED, TOP_K, planted_moe

from spade_jax.models import save_hf
from spade_jax.steer import main
from spade_jax.steering.capture import score_and_record
from spade_jax.steering.expert_sets import expert_sets_from_scores, save_expert_sets
from spade_jax.steering.experts import ExpertCounts
from spade_jax.steering.labels import BEHAVIOURS, labels_for_trace, load_labels_jsonl
from spade_jax.steering.operator import CONCISE_SYSTEM_PROMPT
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
    """Generated tokens by the construction (stop at the end token, at most MAX_NEW).
    ``suppress``: a bool, or ``f(j)`` for the forward producing generated token ``j``."""
    token, count = prompt[-1], 0
    while count < MAX_NEW:
        off = suppress(count) if callable(suppress) else suppress
        token = target if token in behaviour and not off else successor[token]
        count += 1
        if token == target:
            break
    return count


@pytest.mark.slow  # ~130 s loaded: JAX subprocess, model build; + the in-process sweep
def test_end_to_end_table(tmp_path, capsys):
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

    def expected(system: str | None, suppress) -> float:
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
    # Every problem gives the same completion here, so the paired SEs are exactly 0.
    assert float(rows["steered"]["token_delta_stderr"]) == 0.0
    assert float(rows["steered"]["relative_token_change_stderr"]) == 0.0

    # 5. In process: the window schedule and a dose sweep in one run. The window clamps the
    #    first WINDOW generated tokens only; the planted experts are redundant (either one
    #    alone, selected on a behaviour token, moves the LM head to the end token), so the
    #    top-1 dose changes nothing and the top-2 dose is the whole effect; the random
    #    control, disjoint from the planted experts, never changes a length.
    window = 3
    out = tmp_path / "out_window"
    assert main(["run", f"--checkpoint={tmp_path / 'model'}",
                 f"--tokenizer={tmp_path / 'tok' / 'sp.model'}",
                 f"--suite=jsonl:{tmp_path / 'bench.jsonl'}",
                 f"--expert_sets={tmp_path / 'sets.json'}", "--suppress=conclusion",
                 "--schedule=window", f"--window_tokens={window}", "--dose=1,2",
                 f"--max_new_tokens={MAX_NEW}", f"--out={out}"]) == 0
    assert (out / "dose.png").stat().st_size > 0
    with (out / "results.csv").open() as f:
        rows = {r["condition"]: r for r in csv.DictReader(f)}
    assert list(rows) == ["unmodified", "steered n=1", "random-control n=1", "steered n=2",
                          "random-control n=2", "prompt-control"]
    assert [rows[c]["dose"] for c in rows] == ["", "1", "1", "2", "2", ""]
    windowed = expected(None, lambda j: j < window)
    assert unmodified < windowed < steered  # released after the window, not before
    lengths = {c: float(r["mean_tokens"]) for c, r in rows.items()}
    assert lengths == {"unmodified": unmodified, "steered n=1": unmodified,
                       "random-control n=1": unmodified, "steered n=2": windowed,
                       "random-control n=2": unmodified,
                       "prompt-control": expected(CONCISE_SYSTEM_PROMPT, False)}
    # Resumable: a re-run into the same --out reuses every finished condition (one is
    # deleted: only it is evaluated again) and writes the same table; other arguments are
    # refused, naming the first that differs.
    window_run = ["run", f"--checkpoint={tmp_path / 'model'}",
                  f"--tokenizer={tmp_path / 'tok' / 'sp.model'}",
                  f"--suite=jsonl:{tmp_path / 'bench.jsonl'}",
                  f"--expert_sets={tmp_path / 'sets.json'}", "--suppress=conclusion",
                  "--schedule=window", f"--window_tokens={window}", "--dose=1,2",
                  f"--max_new_tokens={MAX_NEW}", f"--out={out}"]
    table = (out / "results.csv").read_text()
    (out / "conditions" / "steered_n_2.json").unlink()
    capsys.readouterr()
    assert main(window_run) == 0
    err = capsys.readouterr().err
    assert err.count("reused from") == 5 and "steered n=2: reused" not in err
    assert (out / "results.csv").read_text() == table
    assert main([*window_run, "--eps=0.5"]) == 2
    assert "holds a run with other arguments (eps" in capsys.readouterr().err

    # 6. The cut schedule through the sampler with the text-marker detector: a marker that
    #    completes at generated token f steers the forwards producing tokens 0 .. f, then
    #    releases, so the end token follows the first behaviour token at index >= f.
    _check_cut_schedule(model, tokenizer, behaviour, target, successor)


def _check_cut_schedule(model, tokenizer, behaviour, target, successor):
    from spade_jax.rollout import generate
    from spade_jax.steering.operator import make_steering_hook
    from spade_jax.steering.schedule import TextMarkerDetector

    texts = [tokenizer.decode([v], skip_special_tokens=True) for v in range(tokenizer.vocab_size)]

    def chain(start, n):  # the suppressed greedy chain after prompt token ``start``
        out = [successor[start]]
        while len(out) < n:
            out.append(successor[out[-1]])
        return out

    # A prompt token whose chain spells letters-only text over 4 tokens, with a behaviour
    # token among the first 3 (so the marker completes after the unmodified model stops).
    start = next(t for t in successor if t not in behaviour and t != target
                 and all(texts[g].isalpha() for g in chain(t, 4))
                 and any(g in behaviour for g in chain(t, 3)))
    marker = "".join(texts[g] for g in chain(start, 4))
    detector = TextMarkerDetector.from_token_texts(texts, patterns=(marker,))
    fire = detector.first_fire(chain(start, MAX_NEW))
    assert fire is not None and fire <= 3
    suppress = np.zeros(NUM_EXPERTS, bool)
    suppress[list(PLANTED)] = True
    hook = make_steering_hook({0: (np.zeros(NUM_EXPERTS, bool), suppress)}, TOP_K, 0.01,
                              "before_first_answer")
    result = generate(model, [[start]], MAX_NEW, stop_tokens=[target], router_hook=hook,
                      answer_detector=detector)
    unmodified = _greedy_length([start], behaviour, target, successor, False)
    cut = _greedy_length([start], behaviour, target, successor, lambda j: j <= fire)
    assert unmodified < cut < MAX_NEW  # released at the marker, not before, not never
    assert len(result.tokens[0]) == cut


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


def test_schedule_and_dose_arguments_exit_2(tmp_path, capsys):
    """Checked before any model is loaded."""
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"problem": "1+1", "answer": "2"}) + "\n")
    sets = tmp_path / "sets.json"
    sets.write_text('{"format": "spade_jax.expert_sets/1", "num_experts": 8, "top_k": 2, '
                    '"sets": {"planning": {"0": [1, 2]}}}')
    common = [f"--checkpoint={tmp_path}", f"--suite=jsonl:{bench}", f"--expert_sets={sets}",
              "--suppress=planning"]
    for extra, message in (
            (["--schedule=window"], "schedule='window' needs a window length"),
            (["--schedule=window", "--window_tokens=0"], "window_tokens must be an int >= 1"),
            (["--window_tokens=4"], "--window_tokens is only for --schedule=window"),
            (["--dose=0,2"], "--dose needs integers >= 1"),
            (["--dose=a"], "--dose must be a comma list of integers")):
        assert main(["run", *common, *extra]) == 2
        assert message in capsys.readouterr().err


def test_dose_masks_take_the_top_n_by_score_or_file_order(tmp_path):
    from spade_jax.steer import dose_masks, ranked_expert_lists
    from spade_jax.steering.expert_sets import load_expert_sets

    path = tmp_path / "sets.json"
    path.write_text(json.dumps({
        "format": "spade_jax.expert_sets/1", "num_experts": 8, "top_k": 2,
        "sets": {"planning": {"0": [6, 1, 3], "1": [4, 0]}, "reflection": {"0": [5, 2]}},
        "scores": {"planning": {"0": [0.1, 0.3, 0.2]}}}))
    sets = load_expert_sets(path)
    ranked = ranked_expert_lists(path, sets, ["planning", "reflection"])
    assert ranked == {"planning": {0: [1, 3, 6], 1: [4, 0]}, "reflection": {0: [5, 2]}}
    masks = dose_masks(path, sets, ["planning", "reflection"], [], 1)
    assert {layer: np.flatnonzero(s).tolist() for layer, (_, s) in masks.items()} == \
        {0: [1, 5], 1: [4]}
    masks = dose_masks(path, sets, ["planning"], [], 5)  # more than a set has: all of it
    assert {layer: np.flatnonzero(s).tolist() for layer, (_, s) in masks.items()} == \
        {0: [1, 3, 6], 1: [0, 4]}


def test_identify_sets_carry_their_scores_so_a_dose_takes_the_highest(tmp_path):
    """`expert_sets_from_scores` (what `steer identify` writes) keeps each chosen expert's
    score; saved and loaded, the dose sweep's top 1 is the highest-scoring expert, not the
    lowest id."""
    from spade_jax.steer import dose_masks
    from spade_jax.steering.expert_sets import (
        expert_sets_from_scores,
        load_expert_sets,
        save_expert_sets,
    )

    scores_cle = np.zeros((2, 1, 8))
    scores_cle[0, 0, [1, 4, 6]] = [0.2, 0.9, 0.5]  # behaviour 0: expert 4 first, then 6, 1
    scores_cle[1, 0, [2, 3, 7]] = [0.7, 0.1, 0.3]
    sets = expert_sets_from_scores(scores_cle, 3, moe_layers=(0,), top_k=2,
                                   behaviours=("planning", "reflection"), layer=0)
    assert sets.sets["planning"][0] == (1, 4, 6)
    assert sets.scores["planning"][0] == (0.2, 0.9, 0.5)
    path = tmp_path / "sets.json"
    save_expert_sets(path, sets)
    assert load_expert_sets(path).scores == sets.scores
    for n, want in ((1, [4]), (2, [4, 6]), (3, [1, 4, 6])):
        (_, suppress), = dose_masks(path, load_expert_sets(path), ["planning"], [], n).values()
        assert np.flatnonzero(suppress).tolist() == want
