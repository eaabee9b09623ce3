"""Behaviour data: segmenter, label import / judge parsing, and chunked telemetry."""

import gc
import json
import weakref

import numpy as np
import pytest

from spade_jax.steering.labels import (
    BEHAVIOURS,
    CODEBOOK_PROMPT,
    build_judge_prompt,
    label_trace_with_judge,
    labels_for_trace,
    load_labels_jsonl,
    parse_judge_output,
)
from spade_jax.steering.segment import (
    Segment,
    SegmenterConfig,
    index_within_segment,
    project_labels_to_tokens,
    segment_length_stats,
    segment_tokens,
    token_segment_ids,
    token_texts_from_offsets,
)
from spade_jax.steering.telemetry import TelemetryReader, TelemetryWriter

# ---------------------------------------------------------------- segmenter


def test_segmenter_cuts_sentences_and_clauses_not_decimals():
    tokens = ["Let", " me", " plan", ".", " x", " =", " 3", ".", "5", ";", " so", " y",
              "?", "\n\n", "Done", "!"]
    segments = segment_tokens(tokens)
    texts = ["".join(tokens[s.start : s.end]) for s in segments]
    assert texts == ["Let me plan.", " x = 3.5;", " so y?\n\n", "Done!"]
    # Sentences only: the clause ender ';' no longer cuts.
    sentences = segment_tokens(tokens, SegmenterConfig(clause_enders=""))
    assert ["".join(tokens[s.start : s.end]) for s in sentences][1] == " x = 3.5; so y?\n\n"


def test_segmenter_cap_and_stats():
    tokens = [" w"] * 300 + ["."] + [" a", "."] * 10
    segments = segment_tokens(tokens, SegmenterConfig(max_tokens=125))
    assert max(s.num_tokens for s in segments) <= 125
    assert segments[0].start == 0 and segments[-1].end == len(tokens)
    assert all(a.end == b.start for a, b in zip(segments[:-1], segments[1:], strict=True))
    assert sorted(s.num_tokens for s in segments[:3]) == [100, 100, 101]  # 301 -> 3 pieces
    lengths = np.array([s.num_tokens for s in segments])
    stats = segment_length_stats(segments)
    assert stats["median"] == np.median(lengths) == 2
    assert stats["p5"] == pytest.approx(np.percentile(lengths, 5))
    assert stats["p95"] == pytest.approx(np.percentile(lengths, 95))
    assert stats["count"] == len(segments) == 13


def test_offsets_give_gaps_to_next_token():
    text = "It is 3.5. Next step"
    offsets = [(0, 2), (3, 5), (6, 7), (7, 8), (8, 9), (9, 10), (11, 15), (16, 20)]
    texts = token_texts_from_offsets(text, offsets)
    assert "".join(texts) == text
    assert [(s.start, s.end) for s in segment_tokens(texts)] == [(0, 6), (6, 8)]
    with pytest.raises(ValueError, match="out of order"):
        token_texts_from_offsets(text, [(3, 5), (0, 2)])


def test_label_projection_and_within_segment_index():
    segments = [Segment(0, 3), Segment(3, 4), Segment(5, 8)]
    labels = project_labels_to_tokens(segments, [2, 0, 5], num_tokens=9)
    np.testing.assert_array_equal(labels, [2, 2, 2, 0, -1, 5, 5, 5, -1])
    ids = token_segment_ids(segments, 9)
    np.testing.assert_array_equal(ids, [0, 0, 0, 1, -1, 2, 2, 2, -1])
    np.testing.assert_array_equal(index_within_segment(ids), [0, 1, 2, 0, 0, 0, 1, 2, 0])
    with pytest.raises(ValueError, match="overlaps"):
        token_segment_ids([Segment(0, 3), Segment(2, 4)], 9)
    with pytest.raises(ValueError, match="2 segments but 1 labels"):
        project_labels_to_tokens(segments[:2], [1], 9)


# ---------------------------------------------------------------- labels and judge


def test_jsonl_import_and_line_numbered_errors(tmp_path):
    good = tmp_path / "labels.jsonl"
    good.write_text(
        '{"trace_id": "t1", "segment": 1, "label": "Reflection"}\n'
        "\n"
        '{"trace_id": "t1", "segment": 0, "label": "planning", "text": "Let me"}\n'
    )
    records = load_labels_jsonl(good)
    assert labels_for_trace(records, "t1", 2) == [
        BEHAVIOURS.index("planning"),
        BEHAVIOURS.index("reflection"),
    ]
    with pytest.raises(ValueError, match=r"no label for segment\(s\) \[2\]"):
        labels_for_trace(records, "t1", 3)

    cases = {
        '{"trace_id": "t", "segment": 0, "label": "musing"}': "line 2: unknown label 'musing'",
        '{"trace_id": "t", "label": "fact"}': r"line 2: missing key\(s\) \['segment'\]",
        '{"trace_id": "t", "segment": -1, "label": "fact"}': "line 2: 'segment' must be an int",
        "{not json": "line 2: invalid JSON",
        '{"trace_id": "t", "segment": 0, "label": "fact"}': r"line 2: duplicate .* \(first on line 1\)",
    }
    for bad_line, message in cases.items():
        path = tmp_path / "bad.jsonl"
        path.write_text('{"trace_id": "t", "segment": 0, "label": "fact"}\n' + bad_line + "\n")
        with pytest.raises(ValueError, match=message):
            load_labels_jsonl(path)


def test_judge_prompt_and_parsing():
    segments = ["Let me try  substitution.", "x = 2.", "Wait, is that right?"]
    prompt = build_judge_prompt(segments)
    assert prompt.startswith(CODEBOOK_PROMPT)
    assert all(name in CODEBOOK_PROMPT for name in BEHAVIOURS)
    assert "[0] Let me try substitution.\n[1] x = 2.\n[2] Wait, is that right?" in prompt

    reply = "Sure, here are the labels:\n**0**: Planning\n- [1] execution\n2: reflection\n"
    assert parse_judge_output(reply, 3) == [0, 1, 4]
    with pytest.raises(ValueError, match=r"no label for segment\(s\) \[2\]"):
        parse_judge_output("0: planning\n1: fact", 3)
    with pytest.raises(ValueError, match="unknown label 'pondering'"):
        parse_judge_output("0: planning\n1: pondering\n2: fact", 3)
    with pytest.raises(ValueError, match="out of range"):
        parse_judge_output("0: planning\n1: fact\n2: fact\n3: fact", 3)

    calls = []

    def fake_judge(text: str) -> str:
        calls.append(text)
        return "0: planning\n1: execution\n2: conclusion"

    assert label_trace_with_judge(fake_judge, segments) == [0, 1, 5]
    assert calls == [prompt]


# ---------------------------------------------------------------- telemetry


def _records(num_tokens, num_layers=3, num_experts=8, k=2, seed=0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(num_tokens, num_layers, num_experts)).astype(np.float32)
    selected = np.argsort(-logits, axis=-1)[..., :k]
    return (
        rng.integers(0, 1000, num_tokens),
        np.arange(num_tokens) % 50,
        np.arange(num_tokens) // 50,
        logits,
        selected,
    )


@pytest.mark.slow  # > 5 s quiet (fast-tier budget)
def test_telemetry_round_trip_in_bounded_chunks(tmp_path):
    records = _records(1037)
    writer = TelemetryWriter(tmp_path / "tel", chunk_tokens=100, logits_dtype="float32")
    with writer:
        for start in range(0, 1037, 73):  # appends straddle chunk boundaries
            writer.append(*(a[start : start + 73] for a in records))
            assert writer.buffered_tokens < 100
    reader = TelemetryReader(tmp_path / "tel")
    assert len(reader) == 11 and reader.num_tokens == 1037 and reader.complete
    assert (reader.num_layers, reader.num_experts, reader.top_k) == (3, 8, 2)
    assert sorted(p.name for p in (tmp_path / "tel").glob("chunk_*.npz"))[-1] == "chunk_000010.npz"

    pieces, previous = [], None
    for chunk in reader.iter_chunks():
        assert len(chunk.token_ids) <= 100
        if previous is not None:
            gc.collect()
            assert previous() is None, "the reader kept an earlier chunk alive"
        previous = weakref.ref(chunk.router_logits)
        pieces.append(tuple(np.array(a) for a in chunk))  # copies, so the chunk can die
        del chunk
    for field, original in enumerate(records):
        np.testing.assert_array_equal(np.concatenate([p[field] for p in pieces]), original)


def test_telemetry_float16_batches_and_errors(tmp_path):
    rng = np.random.default_rng(1)
    batch, steps, layers, experts, k = 2, 5, 2, 8, 2
    logits_lbte = [rng.normal(size=(batch, steps, experts)) for _ in range(layers)]
    selected_lbtk = [np.argsort(-x, axis=-1)[..., :k] for x in logits_lbte]
    valid = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)
    with TelemetryWriter(tmp_path / "t16", chunk_tokens=4) as writer:
        writer.append_batch(rng.integers(0, 9, (batch, steps)), logits_lbte, selected_lbtk,
                            sequence_ids_b=np.array([10, 11]), valid_bt=valid)
    reader = TelemetryReader(tmp_path / "t16")
    chunks = list(reader.iter_chunks())
    assert [len(c.token_ids) for c in chunks] == [4, 4]
    logits = np.concatenate([c.router_logits for c in chunks])
    assert logits.dtype == np.float16
    expected = np.stack(logits_lbte, axis=2)[valid]
    np.testing.assert_allclose(logits, expected, atol=2e-3)
    np.testing.assert_array_equal(np.concatenate([c.sequence_ids for c in chunks]),
                                  [10, 10, 10, 11, 11, 11, 11, 11])
    np.testing.assert_array_equal(np.concatenate([c.positions for c in chunks]),
                                  [0, 1, 2, 0, 1, 2, 3, 4])

    with pytest.raises(ValueError, match="already holds telemetry"):
        TelemetryWriter(tmp_path / "t16")
    writer = TelemetryWriter(tmp_path / "bad", chunk_tokens=4)
    recs = _records(6)
    writer.append(*recs)
    with pytest.raises(ValueError, match=r"\(L, E, k\) changed"):
        writer.append(*_records(3, num_layers=4))
    with pytest.raises(ValueError, match="router_logits has 5 tokens"):
        writer.append(recs[0][:6], recs[1], recs[2], recs[3][:5], recs[4][:5])
    # A run that dies before close() still leaves a readable, flagged-incomplete prefix.
    partial = TelemetryReader(tmp_path / "bad")
    assert not partial.complete and partial.num_tokens == 4
    manifest = json.loads((tmp_path / "bad" / "manifest.json").read_text())
    assert manifest["chunks"] == [{"file": "chunk_000000.npz", "num_tokens": 4}]
