"""Read at scale: residual-stream capture, resumable telemetry, the streaming probe, controls.

References: transformers' ``output_hidden_states`` for the residual stream (a tiny random
Qwen3-MoE), a plain-NumPy gradient-descent logistic regression for the streaming probe,
an uninterrupted capture for a resumed one, and hand-written old-format shards.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import tracemalloc

import jax
import numpy as np
import pytest
import tiny_hf
import torch
from flax import nnx

from spade_jax.models import ModelOptions, load_hf
from spade_jax.steering.capture import CaptureConfig, score_and_record
from spade_jax.steering.controls import (
    input_embedding_features,
    project_features,
    width_matched_projection,
)
from spade_jax.steering.probe import (
    FeatureMoments,
    StreamingProbeConfig,
    evaluate_streaming_probe,
    fit_streaming_probe,
    macro_f1,
    predict_probe,
    residual_window_features,
    telemetry_feature_chunks,
)
from spade_jax.steering.telemetry import TelemetryReader, TelemetryWriter

NUM_LAYERS = 3

# ---------------------------------------------------------------- residual stream vs transformers


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 3-layer random Qwen3-MoE: the HF model, our looped and scanned loads of it."""
    path = tmp_path_factory.mktemp("moe")
    hf_model = tiny_hf.make_hf_model("moe", path, num_hidden_layers=NUM_LAYERS)
    looped, _ = load_hf(path)
    scanned, _ = load_hf(path, options=ModelOptions(scan_layers=True))
    return hf_model, looped, scanned


@functools.partial(jax.jit, static_argnames=("graphdef", "layers"))
def _forward(graphdef, state, ids_bt, mask_bt, layers):
    out = nnx.merge(graphdef, state)(ids_bt, attention_mask_bt=mask_bt, return_logits=False,
                                     return_residuals=layers)
    return out.residuals, out.hidden


def _residuals(model, ids_bt, mask_bt, layers):
    graphdef, state = nnx.split(model)
    residuals, hidden = _forward(graphdef, state, ids_bt, mask_bt, layers)
    return np.asarray(residuals), np.asarray(hidden)


def _hf_hidden_states(hf_model, ids_bt, mask_bt):
    with torch.no_grad():
        out = hf_model(torch.tensor(ids_bt), attention_mask=torch.tensor(mask_bt),
                       output_hidden_states=True)
    return [h.numpy() for h in out.hidden_states]  # L + 1: embeddings, ..., final norm


def _rel_err(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_residuals_match_transformers_hidden_states_looped_and_scanned(tiny):
    hf_model, looped, scanned = tiny
    ids = np.random.RandomState(0).randint(0, tiny_hf.VOCAB, (2, 8))
    mask = np.ones_like(ids)
    mask[1, 5:] = 0  # right padding, as capture feeds it
    reference = _hf_hidden_states(hf_model, ids, mask)
    assert len(reference) == NUM_LAYERS + 1
    real = mask.astype(bool)

    residuals, hidden = _residuals(looped, ids, mask, True)
    assert residuals.shape == (2, 8, NUM_LAYERS, 32)
    for layer in range(NUM_LAYERS):  # residual l = HF hidden_states[l], entering layer l
        assert _rel_err(residuals[:, :, layer][real], reference[layer][real]) <= 1e-5, layer
    assert _rel_err(hidden[real], reference[NUM_LAYERS][real]) <= 1e-5  # after the final norm
    np.testing.assert_array_equal(residuals[:, :, 0], np.asarray(looped.embed_vd[...])[ids])
    np.testing.assert_array_equal(input_embedding_features(looped, ids[0]), residuals[0, :, 0])

    # Scanned: a subset, out of order (the scan's buffer keeps exactly the rows asked for;
    # all layers take the same path). One compile, not two.
    scanned_some, _ = _residuals(scanned, ids, mask, (2, 0))
    assert scanned_some.shape == (2, 8, 2, 32)
    np.testing.assert_allclose(scanned_some, residuals[:, :, [2, 0]], rtol=1e-5, atol=1e-5)
    graphdef, state = nnx.split(looped)  # off by default (traced only, not compiled)
    assert jax.eval_shape(lambda s: nnx.merge(graphdef, s)(ids).residuals, state) is None
    with pytest.raises(ValueError, match="distinct layer indices"):
        looped(ids, return_residuals=(0, 0))


# ---------------------------------------------------------------- capture: residuals and resume

SEQUENCE_LENGTHS = (5, 11, 7, 10, 4, 9, 6)  # all in one 16-token bucket
CAPTURE = CaptureConfig(batch_size=2, residual_layers=(2, 0))


def _sequences():
    rng = np.random.default_rng(3)
    return [rng.integers(0, tiny_hf.VOCAB, n).tolist() for n in SEQUENCE_LENGTHS]


def _writer(path, **kwargs):
    return TelemetryWriter(path, chunk_tokens=8, logits_dtype="float32",
                           residual_dtype="float32", **kwargs)


def _by_sequence(directory):
    """{sequence id: (token ids, positions, router logits, residuals)}; asserts each
    sequence is stored once, contiguous, in position order."""
    chunks = list(TelemetryReader(directory).iter_chunks())
    seq = np.concatenate([c.sequence_ids for c in chunks])
    fields = [np.concatenate([getattr(c, f) for c in chunks])
              for f in ("token_ids", "positions", "router_logits", "residuals")]
    out = {}
    for sid in np.unique(seq):
        rows = np.flatnonzero(seq == sid)
        assert (np.diff(rows) == 1).all(), f"sequence {sid} is split"
        assert fields[1][rows].tolist() == list(range(len(rows))), f"sequence {sid} positions"
        out[int(sid)] = tuple(f[rows] for f in fields)
    return out


def test_capture_records_residuals_and_resumes_without_duplicates(tiny, tmp_path):
    hf_model, looped, _ = tiny
    sequences = _sequences()
    with _writer(tmp_path / "whole") as writer:
        written = score_and_record(looped, sequences, writer, config=CAPTURE)
    reader = TelemetryReader(tmp_path / "whole")
    assert written == reader.num_tokens == sum(SEQUENCE_LENGTHS)
    assert reader.residual_shape == (2, 32) and reader.residual_layers == (2, 0)
    whole = _by_sequence(tmp_path / "whole")
    for sid, ids in enumerate(sequences):  # each sequence alone through transformers
        reference = _hf_hidden_states(hf_model, np.array([ids]), np.ones((1, len(ids)), int))
        tokens, _, _, residuals = whole[sid]
        assert tokens.tolist() == ids
        assert _rel_err(residuals[:, 0], reference[2][0]) <= 1e-5
        assert _rel_err(residuals[:, 1], reference[0][0]) <= 1e-5
    router_only = next(reader.iter_chunks(residuals=False))
    assert router_only.residuals is None

    # A crash: 33 tokens in 8-token chunks, so 4 chunks are on disk, the last ending in the
    # head of sequence 3, and one token dies in the buffer (no close()).
    crashed = _writer(tmp_path / "resumed")
    score_and_record(looped, sequences[:4], crashed, config=CAPTURE)
    assert crashed.num_tokens_written == 32 and crashed.buffered_tokens == 1
    del crashed
    with pytest.raises(ValueError, match="already holds telemetry"):
        _writer(tmp_path / "resumed")
    with _writer(tmp_path / "resumed", resume=True) as writer:
        assert writer.resumed_sequence_ids == {0, 1, 2}  # 3's head was cut off
        assert writer.num_tokens_written == 5 + 11 + 7
        written = score_and_record(looped, sequences, writer, config=CAPTURE)
    assert written == sum(SEQUENCE_LENGTHS[3:])
    resumed = _by_sequence(tmp_path / "resumed")
    assert sorted(resumed) == sorted(whole)
    for sid in whole:
        for got, want in zip(resumed[sid], whole[sid], strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert TelemetryReader(tmp_path / "resumed").complete
    with _writer(tmp_path / "resumed", resume=True) as writer:  # complete: nothing left to do
        assert score_and_record(looped, sequences, writer, config=CAPTURE) == 0
    assert TelemetryReader(tmp_path / "resumed").num_tokens == sum(SEQUENCE_LENGTHS)
    with pytest.raises(ValueError, match="records residual layers"), \
            _writer(tmp_path / "resumed", resume=True) as writer:
        score_and_record(looped, sequences, writer, config=CaptureConfig(residual_layers=(1,)))


def test_old_format_shards_read_and_resume(tmp_path):
    """Shards written before residuals and resume existed: the five router arrays, and a
    manifest without residual_shape / open_sequence. A crashed one resumes conservatively
    (its last sequence may be cut, so it is dropped and recorded again)."""
    rng = np.random.default_rng(0)
    directory = tmp_path / "old"
    directory.mkdir()
    sequence_ids = np.array([4, 4, 4, 7, 7, 9, 9, 9])  # chunks of 4: [4 4 4 7] [7 9 9 9]
    entries = []
    for index, start in enumerate((0, 4)):
        np.savez(directory / f"chunk_{index:06d}.npz",
                 token_ids=rng.integers(0, 50, 4).astype(np.int32),
                 positions=np.arange(start, start + 4, dtype=np.int32),
                 sequence_ids=sequence_ids[start : start + 4],
                 router_logits=rng.normal(size=(4, 2, 6)).astype(np.float16),
                 selected=rng.integers(0, 6, (4, 2, 2)).astype(np.int16))
        entries.append({"file": f"chunk_{index:06d}.npz", "num_tokens": 4})
    manifest = {"version": 1, "num_layers": 2, "num_experts": 6, "top_k": 2,
                "logits_dtype": "float16", "chunk_tokens": 4, "num_tokens": 8,
                "complete": False, "chunks": entries, "metadata": {"moe_layers": [0, 1]}}
    (directory / "manifest.json").write_text(json.dumps(manifest))

    reader = TelemetryReader(directory)
    assert reader.residual_shape is None and reader.residual_layers == ()
    chunks = list(reader.iter_chunks())
    assert [c.residuals for c in chunks] == [None, None]
    assert np.concatenate([c.sequence_ids for c in chunks]).tolist() == sequence_ids.tolist()

    with TelemetryWriter(directory, chunk_tokens=4, resume=True) as writer:
        assert writer.resumed_sequence_ids == {4, 7}
        assert writer.metadata["moe_layers"] == [0, 1]
        writer.append(np.arange(3), np.arange(3), np.full(3, 9),
                      rng.normal(size=(3, 2, 6)), rng.integers(0, 6, (3, 2, 2)))
        with pytest.raises(ValueError, match="with every append or with none"):
            writer.append(np.arange(1), np.arange(1), np.full(1, 10),
                          rng.normal(size=(1, 2, 6)), rng.integers(0, 6, (1, 2, 2)),
                          residuals_trd=np.zeros((1, 1, 4)))
    after = TelemetryReader(directory)
    ids = np.concatenate([c.sequence_ids for c in after.iter_chunks()])
    assert ids.tolist() == [4, 4, 4, 7, 7, 9, 9, 9] and after.complete
    assert sorted(p.name for p in directory.glob("chunk_*.npz")) == [
        e["file"] for e in after.manifest["chunks"]]  # the cut-off chunk files are gone


# ---------------------------------------------------------------- streaming probe vs NumPy

NUM_CLASSES, NUM_FEATURES = 3, 6


def _synthetic(seed, num):
    """Class-dependent means on unevenly scaled features, overlapping: separable-ish."""
    rng = np.random.default_rng(seed)
    centres = np.random.default_rng(100).normal(size=(NUM_CLASSES, NUM_FEATURES)) * 0.6
    scales = np.array([1.0, 5.0, 0.2, 2.0, 1.0, 10.0])
    y = rng.choice(NUM_CLASSES, num, p=[0.5, 0.3, 0.2])
    x = (centres[y] + rng.normal(size=(num, NUM_FEATURES))) * scales + 3.0
    return x.astype(np.float32), y


def _numpy_logistic_regression(x, y, l2, balanced=False, steps=3000, lr=0.3):
    """Full-batch gradient descent on the weighted mean cross-entropy + 0.5 * l2 * ||W||^2
    over features standardised with the training mean and (population) std; "balanced"
    weights class c's tokens by N / (C * N_c)."""
    mean, std = x.mean(0), x.std(0)
    z = (x - mean) / std
    onehot = np.eye(NUM_CLASSES)[y]
    counts = np.bincount(y, minlength=NUM_CLASSES)
    token_weight = (len(y) / (NUM_CLASSES * counts))[y] if balanced else np.ones(len(y))
    w, b = np.zeros((x.shape[1], NUM_CLASSES)), np.zeros(NUM_CLASSES)
    for _ in range(steps):
        logits = z @ w + b
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        residual = (p - onehot) * (token_weight / token_weight.sum())[:, None]
        w -= lr * (z.T @ residual + l2 * w)
        b -= lr * residual.sum(0)
    return mean, std, w, b


def _chunks_of(x, y, size, weight=None):
    return [(x[i : i + size], y[i : i + size], None if weight is None else weight[i : i + size])
            for i in range(0, len(y), size)]


def test_streaming_probe_agrees_with_numpy_logistic_regression():
    x_train, y_train = _synthetic(0, 320)
    x_test, y_test = _synthetic(1, 240)
    l2 = 1e-2
    mean, std, w_ref, b_ref = _numpy_logistic_regression(x_train, y_train, l2)

    # Unlabelled (-1) and weight-0 rows are left out: only the 320 real rows count.
    x_pad = np.concatenate([x_train, x_train[:40] * 100.0])
    y_pad = np.concatenate([y_train, np.full(40, -1)])
    y_pad[-20:] = 0
    weight = np.concatenate([np.ones(320), np.zeros(40)])
    weight[-20:] = 0.0
    config = StreamingProbeConfig(l2=l2, num_epochs=30, batch_size=32, learning_rate=0.1)
    fit = fit_streaming_probe(_chunks_of(x_pad, y_pad, 48, weight), NUM_FEATURES,
                              NUM_CLASSES, config)
    params = fit.params
    assert fit.num_train == 320 and fit.num_steps == 30 * 10
    assert fit.class_counts_c.tolist() == np.bincount(y_train).tolist()
    np.testing.assert_allclose(params.mean_d, mean, rtol=1e-5)
    np.testing.assert_allclose(params.scale_d, std, rtol=1e-5)
    assert np.abs(params.w_dc - w_ref).max() < 0.05 * np.abs(w_ref).max()

    z_test = (x_test - mean) / std
    reference = np.argmax(z_test @ w_ref + b_ref, axis=1)
    predicted = predict_probe(params, x_test)
    assert (predicted == reference).mean() >= 0.95
    ours_f1, reference_f1 = macro_f1(y_test, predicted), macro_f1(y_test, reference)
    assert abs(ours_f1 - reference_f1) <= 0.02
    assert reference_f1 > 0.6  # the data are learnable, so agreement means something

    # Class-balanced weights (from the statistics pass) reach the balanced optimum too.
    _, _, w_balanced, b_balanced = _numpy_logistic_regression(x_train, y_train, l2, True)
    balanced = fit_streaming_probe(_chunks_of(x_train, y_train, 48), NUM_FEATURES, NUM_CLASSES,
                                   dataclasses.replace(config, class_weighting="balanced"))
    assert np.abs(balanced.params.w_dc - w_balanced).max() < 0.05 * np.abs(w_balanced).max()
    reference = np.argmax(z_test @ w_balanced + b_balanced, axis=1)
    assert (predict_probe(balanced.params, x_test) == reference).mean() >= 0.95

    # The streamed confusion-matrix evaluation equals macro_f1 on the gathered tokens.
    evaluation = evaluate_streaming_probe(params, iter(_chunks_of(x_test, y_test, 50)),
                                          NUM_CLASSES, majority_class=0)
    assert evaluation.num_tokens == 240 and evaluation.macro_f1 == pytest.approx(ours_f1)
    assert evaluation.majority_macro_f1 == pytest.approx(macro_f1(y_test, np.zeros(240, int)))
    with pytest.raises(TypeError, match="fresh iterator"):
        fit_streaming_probe(iter(_chunks_of(x_train, y_train, 50)), NUM_FEATURES, NUM_CLASSES)


def test_feature_moments_merge_equals_one_pass():
    x = np.random.default_rng(4).normal(3.0, 2.0, size=(500, 5)) * [1, 10, 100, 1e3, 1e-3]
    left, right = FeatureMoments(5), FeatureMoments(5)
    for start in range(0, 300, 37):
        left.update(x[start : min(start + 37, 300)])
    right.update(x[300:])
    moments = left.merge(right)
    assert moments.count == 500
    np.testing.assert_allclose(moments.mean_d, x.mean(0), rtol=1e-12)
    np.testing.assert_allclose(moments.var_d, x.var(0), rtol=1e-10)


def _lazy_chunks(num_chunks, rows=512, dims=64, classes=4):
    """A source that makes each chunk only when asked (the same chunks on every pass)."""

    def source():
        for index in range(num_chunks):
            rng = np.random.default_rng(index)
            y = rng.integers(0, classes, rows)
            x = rng.normal(size=(rows, dims)).astype(np.float32)
            x[:, :classes] += 2.0 * np.eye(classes, dtype=np.float32)[y]
            yield x, y, None

    return source


def test_streaming_probe_memory_does_not_grow_with_tokens():
    config = StreamingProbeConfig(num_epochs=1, batch_size=256)
    fit_streaming_probe(_lazy_chunks(2), 64, 4, config)  # compile outside the measurement
    peaks = []
    for num_chunks in (8, 80):  # N = 4,096 and 10 N = 40,960 tokens
        tracemalloc.start()
        fit = fit_streaming_probe(_lazy_chunks(num_chunks), 64, 4, config)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        assert fit.num_train == 512 * num_chunks
    # The 10 N data alone would be 10 MB; one chunk is 128 kB.
    assert peaks[1] < 2 * peaks[0], peaks


def test_telemetry_feature_chunks_stream_a_directory(tmp_path):
    rng = np.random.default_rng(5)
    with TelemetryWriter(tmp_path / "t", chunk_tokens=16, residual_dtype="float32") as writer:
        for sid in range(5):
            n = 9
            writer.append(np.arange(n), np.arange(n), np.full(n, sid), rng.normal(size=(n, 2, 4)),
                          rng.integers(0, 4, (n, 2, 2)), residuals_trd=rng.normal(size=(n, 2, 3)))
    source = telemetry_feature_chunks(
        tmp_path / "t", lambda c: residual_window_features(c.residuals, [1, 0]),
        lambda c: c.token_ids % 2, weights=lambda c: c.sequence_ids < 3, residuals=True)
    x, y, w = (np.concatenate(parts) for parts in zip(*source(), strict=True))
    residuals = np.concatenate([c.residuals for c in TelemetryReader(tmp_path / "t").iter_chunks()])
    np.testing.assert_array_equal(x, residuals[:, [1, 0]].reshape(-1, 6))
    assert y.tolist() == (np.arange(45) % 9 % 2).tolist() and w.sum() == 27
    assert len(list(source())) == 3  # re-opened on every call


# ---------------------------------------------------------------- controls


def test_width_matched_projection_width_determinism_and_seeds():
    d_model, window, experts = 48, 3, 8
    projection = width_matched_projection(window * d_model, experts, window, seed=7)
    assert projection.shape == (window * d_model, experts * window) and projection.dtype == np.float32
    np.testing.assert_allclose(projection.T @ projection, np.eye(experts * window), atol=1e-5)
    np.testing.assert_array_equal(projection, width_matched_projection(144, 8, 3, seed=7))
    assert not np.allclose(projection, width_matched_projection(144, 8, 3, seed=8))
    gaussian = width_matched_projection(144, 8, 3, seed=7, kind="gaussian")
    np.testing.assert_array_equal(gaussian, width_matched_projection(144, 8, 3, 7, "gaussian"))
    assert not np.allclose(gaussian, width_matched_projection(144, 8, 3, 8, "gaussian"))
    residuals = np.random.default_rng(0).normal(size=(10, window, d_model))
    features = project_features(residual_window_features(residuals, range(window)), projection)
    assert features.shape == (10, experts * window)
    with pytest.raises(ValueError, match="cannot widen"):
        width_matched_projection(16, 8, 3)


def test_residual_probe_on_captured_residuals_agrees_with_numpy(tiny, tmp_path):
    """The residual probe as `read` fits it: residual features streamed from real captured
    telemetry (`telemetry_feature_chunks` + `residual_window_features`), labels a function of
    the token, against the NumPy logistic regression on the same gathered features."""
    _, looped, _ = tiny
    rng = np.random.default_rng(11)
    sequences = [rng.integers(0, tiny_hf.VOCAB, 16).tolist() for _ in range(24)]
    with _writer(tmp_path / "t") as writer:
        score_and_record(looped, sequences, writer, config=CAPTURE)

    def labels(chunk):
        return chunk.token_ids % NUM_CLASSES

    def features(chunk):
        return residual_window_features(chunk.residuals, [0, 1])

    def split(is_train):
        return lambda chunk: (chunk.sequence_ids < 16) == is_train  # by sequence, not token

    train = telemetry_feature_chunks(tmp_path / "t", features, labels, weights=split(True),
                                     residuals=True)
    test = telemetry_feature_chunks(tmp_path / "t", features, labels, weights=split(False),
                                    residuals=True)
    x, y, w = (np.concatenate(parts) for parts in zip(*train(), strict=True))
    x_train, y_train = x[w > 0].astype(np.float64), y[w > 0]
    x_test, y_test = x[w == 0].astype(np.float64), y[w == 0]
    l2 = 1e-2
    mean, std, w_ref, b_ref = _numpy_logistic_regression(x_train, y_train, l2, steps=2000)
    config = StreamingProbeConfig(l2=l2, num_epochs=40, batch_size=32, learning_rate=0.1)
    fit = fit_streaming_probe(train, x.shape[1], NUM_CLASSES, config)
    assert fit.num_train == len(y_train) == 16 * 16
    reference = np.argmax((x_test - mean) / std @ w_ref + b_ref, axis=1)
    predicted = predict_probe(fit.params, x_test)
    assert (predicted == reference).mean() >= 0.95
    assert abs(macro_f1(y_test, predicted) - macro_f1(y_test, reference)) <= 0.05
    evaluation = evaluate_streaming_probe(
        fit.params, [(xc, np.where(wc > 0, yc, -1), None) for xc, yc, wc in test()],
        NUM_CLASSES, majority_class=int(np.bincount(y_train).argmax()))
    assert evaluation.num_tokens == len(y_test)
    assert evaluation.macro_f1 == pytest.approx(macro_f1(y_test, predicted))
