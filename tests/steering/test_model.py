"""Steering wired to a real Qwen3 MoE: a planted behaviour, telemetry capture, the judge.

The planted model (``planted_moe``, in ``tests/support/planted_moe.py``) is built by hand so every claim has a known answer:

* attention output projections are zero, so each position sees only its own token;
* token ``t``'s embedding is ``a * e_0 * (+1 if t in B else -1) + e_2 + e_{3+t}`` (one-hot);
* layer 0's router puts ``+c * e_0`` on the planted experts P, so they are selected exactly
  on behaviour tokens B; the other experts get small random weights on the one-hot dims;
* only the planted experts have non-zero outputs: a large vector along ``e_1`` (their SwiGLU
  input is the constant ``e_2`` feature), and the LM head maps ``e_1`` to the target token X;
* otherwise the LM head maps token t's one-hot dim to ``successor[t]``.

So greedy decoding emits X right after a B token and ``successor[t]`` after any other token;
suppressing P removes X from the output, activating P makes every token X. Layer 1 is inert
(zero router, zero experts).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from planted_moe import NUM_EXPERTS, PLANTED, TOP_K, planted_moe

from spade_jax.rollout import generate
from spade_jax.steering import make_steering_hook
from spade_jax.steering.capture import (
    CaptureConfig,
    generate_and_record,
    moe_layer_indices,
    score_and_record,
)
from spade_jax.steering.expert_sets import (
    ExpertSetError,
    expert_sets_from_scores,
    load_expert_sets,
    save_expert_sets,
    steering_masks,
)
from spade_jax.steering.experts import ExpertCounts
from spade_jax.steering.labels import BEHAVIOURS, PolicyJudge, label_trace_with_judge
from spade_jax.steering.probe import group_split, probe_router_layers
from spade_jax.steering.schedule import TokenPatternDetector
from spade_jax.steering.telemetry import TelemetryReader, TelemetryWriter

V, X, B = 24, 20, {3, 9, 15}
# t -> t + 1 skipping X; after X the chain restarts at 4, so X recurs every 7 tokens.
SUCCESSOR = {t: (t + 1 if t + 1 != X else X + 1) % V for t in range(V) if t != X} | {X: 4}


@pytest.fixture(scope="module")
def model():
    return planted_moe(V, B, X, SUCCESSOR)


def _masks(activate=(), suppress=()):
    a, s = np.zeros(NUM_EXPERTS, bool), np.zeros(NUM_EXPERTS, bool)
    a[list(activate)], s[list(suppress)] = True, True
    return {0: (a, s)}


def _rms_norm(x):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def test_capture_matches_numpy_router_and_generation(model, tmp_path):
    """Teacher-forced capture = NumPy re-derivation; generation capture = teacher forcing."""
    rng = np.random.default_rng(1)
    sequences = [rng.integers(0, V, size=n).tolist() for n in (5, 17, 9)]
    with TelemetryWriter(tmp_path / "tf", chunk_tokens=8, logits_dtype="float32") as writer:
        written = score_and_record(model, sequences, writer, sequence_ids=[10, 11, 12],
                                   config=CaptureConfig(batch_size=2))
    reader = TelemetryReader(tmp_path / "tf")
    assert written == reader.num_tokens == 31 and len(reader) == 4
    assert reader.metadata["moe_layers"] == [0, 1]
    chunks = list(reader.iter_chunks())
    token_ids = np.concatenate([c.token_ids for c in chunks])
    logits = np.concatenate([c.router_logits for c in chunks])
    assert token_ids.tolist() == sum(sequences, [])
    assert np.concatenate([c.sequence_ids for c in chunks]).tolist() == \
        [10] * 5 + [11] * 17 + [12] * 9
    assert np.concatenate([c.positions for c in chunks]).tolist() == \
        list(range(5)) + list(range(17)) + list(range(9))
    embed = np.asarray(model.embed_vd[...])
    router = np.asarray(model.layers[0].moe.router_de[...])
    expected = _rms_norm(embed[token_ids]) @ router  # attention is zero: h = x
    np.testing.assert_allclose(logits[:, 0], expected, rtol=1e-4, atol=1e-4)
    selected = np.concatenate([c.selected for c in chunks])[:, 0]
    np.testing.assert_array_equal(np.sort(selected, axis=1),
                                  np.sort(np.argsort(-expected, axis=1)[:, :TOP_K], axis=1))

    prompts = [[0, 1], [7]]
    with TelemetryWriter(tmp_path / "gen", logits_dtype="float32") as writer:
        (result,) = generate_and_record(model, prompts, writer, 24, sequence_ids=[0, 1])
    gen = TelemetryReader(tmp_path / "gen").read_chunk(0)
    fed = [p + t for p, t in zip(prompts, result.tokens, strict=True)]
    assert gen.token_ids.tolist() == sum((f[:-1] for f in fed), [])
    with TelemetryWriter(tmp_path / "ref", logits_dtype="float32") as writer:
        score_and_record(model, [f[:-1] for f in fed], writer)
    ref = TelemetryReader(tmp_path / "ref").read_chunk(0)
    np.testing.assert_allclose(gen.router_logits, ref.router_logits, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.sort(gen.selected, -1), np.sort(ref.selected, -1))


@pytest.mark.slow  # ~32 s loaded
def test_planted_signal_probe_risk_difference_and_steering(model, tmp_path):
    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, V, size=24).tolist() for _ in range(24)]
    with TelemetryWriter(tmp_path / "t", chunk_tokens=200) as writer:
        score_and_record(model, sequences, writer)
    reader = TelemetryReader(tmp_path / "t")
    counts = ExpertCounts(2, reader.num_layers, reader.num_experts)
    parts = []
    for chunk in reader.iter_chunks():  # streamed: counts grow chunk by chunk
        labels = np.isin(chunk.token_ids, list(B)).astype(np.int64)
        counts.update(chunk.selected, labels)
        parts.append((chunk.router_logits.astype(np.float32), labels, chunk.sequence_ids))
    logits_nle, labels_n, trace_n = (np.concatenate(p) for p in zip(*parts, strict=True))

    # Read: the behaviour is linearly readable from layer 0's router logits, not layer 1's.
    train, test = group_split(trace_n, test_fraction=0.25)
    results = probe_router_layers(logits_nle, labels_n, train, test, [(0,), (1,)], 2)
    assert results[(0,)].macro_f1 > 0.95
    assert results[(0,)].majority_macro_f1 < 0.5
    assert results[(1,)].macro_f1 <= results[(1,)].majority_macro_f1 + 0.05

    # Identify: risk difference ranks the planted experts first.
    rd = counts.risk_difference()
    sets = expert_sets_from_scores(rd, 2, reader.metadata["moe_layers"], TOP_K,
                                   behaviours=("other", "behaviour"))
    assert sets.sets["behaviour"] == {0: PLANTED}
    save_expert_sets(tmp_path / "sets.json", sets)
    assert load_expert_sets(tmp_path / "sets.json") == sets

    # Steer: X follows exactly the B tokens; suppressing P removes X, activating P forces it.
    prompt = [[0], [5]]  # batch of 2 as in the capture test: the unhooked compile is shared
    plain = generate(model, prompt, 24).tokens[0]
    fed = [0] + plain[:-1]
    assert all((tok == X) == (prev in B) for prev, tok in zip(fed, plain, strict=True))
    assert plain.count(X) >= 3
    suppress = make_steering_hook(steering_masks(sets, suppress=["behaviour"]), TOP_K)
    suppressed = generate(model, prompt, 24, router_hook=suppress).tokens[0]
    assert X not in suppressed
    assert suppressed == [SUCCESSOR[t] for t in [0] + suppressed[:-1]]
    activate = make_steering_hook(steering_masks(sets, activate=["behaviour"]), TOP_K)
    assert generate(model, prompt, 24, router_hook=activate).tokens[0] == [X] * 24

    # after_first_answer: identical up to and including the first X, then no X.
    late = make_steering_hook(steering_masks(sets, suppress=["behaviour"]), TOP_K,
                              schedule="after_first_answer")
    gated = generate(model, prompt, 24, router_hook=late,
                     answer_detector=TokenPatternDetector(((X,),))).tokens[0]
    first = plain.index(X)
    assert gated[: first + 1] == plain[: first + 1]
    assert X not in gated[first + 1 :]


def test_expert_set_files_fail_clearly(tmp_path):
    path = tmp_path / "bad.json"
    cases = [
        ("{", "invalid JSON"),
        (json.dumps({"format": "x"}), "'format' must be"),
        (json.dumps({"format": "spade_jax.expert_sets/1", "num_experts": 8, "top_k": 2}),
         "missing key(s) ['sets']"),
        (json.dumps({"format": "spade_jax.expert_sets/1", "num_experts": 8, "top_k": 2,
                     "sets": {"planning": {"zero": [1]}}}), "layer keys must be integers"),
        (json.dumps({"format": "spade_jax.expert_sets/1", "num_experts": 8, "top_k": 2,
                     "sets": {"planning": {"0": [1, 9]}}}), "expert ids [9] outside [0, 8)"),
    ]
    for text, message in cases:
        path.write_text(text)
        with pytest.raises(ExpertSetError, match=None) as err:
            load_expert_sets(path)
        assert str(path) in str(err.value) and message in str(err.value), str(err.value)
    with pytest.raises(ExpertSetError, match="no such"):
        load_expert_sets(tmp_path / "missing.json")
    sets = expert_sets_from_scores(np.arange(6 * 2 * 8, dtype=float).reshape(6, 2, 8), 7,
                                   [1, 3], TOP_K)
    assert sets.sets["planning"] == {3: (1, 2, 3, 4, 5, 6, 7)}
    with pytest.raises(ExpertSetError, match="leaves 1 < k=2"):
        steering_masks(sets, suppress=["planning"])
    with pytest.raises(ExpertSetError, match="not in the expert-set file"):
        steering_masks(sets, suppress=["wandering"])
    with pytest.raises(ExpertSetError, match="7 experts activated"):
        steering_masks(sets, activate=["planning"])


def test_policy_judge_prompts_the_policy_with_the_codebook():
    class EchoJudgePolicy:
        """Labels segment i by a keyword in its text, as a model following the prompt would."""

        def __init__(self):
            self.requests = []

        def complete(self, conversations, *, n, seed, max_new_tokens):
            self.requests.append((conversations, n, seed, max_new_tokens))
            lines = [ln for ln in conversations[0][0]["content"].splitlines()
                     if ln.startswith("[")]
            out = [f"{ln[1:ln.index(']')]}: {'planning' if 'Let me' in ln else 'execution'}"
                   for ln in lines]
            return [["Sure.\n" + "\n".join(out)]]

    policy = EchoJudgePolicy()
    labels = label_trace_with_judge(PolicyJudge(policy), ["Let me try x.", "x = 2 + 3 = 5."])
    assert labels == [BEHAVIOURS.index("planning"), BEHAVIOURS.index("execution")]
    (conversations, n, _, _), = policy.requests
    assert n == 1 and "functional role" in conversations[0][0]["content"]
    assert moe_layer_indices(planted_moe(V, B, X, SUCCESSOR)) == (0, 1)
