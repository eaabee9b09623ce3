"""Steering schedules (always / after / before the first answer / window), their device
detectors, the text-marker detector's agreement with the host text tracker, and the table's
standard errors. NumPy / JAX only, driven step by step as the sampler drives them."""

from __future__ import annotations

import random
import re
import string

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spade_jax.steering import compare
from spade_jax.steering.operator import SCHEDULE_DETECTORS, SCHEDULES, make_steering_hook
from spade_jax.steering.schedule import (
    DEVICE_ANSWER_PATTERNS,
    FirstAnswerTracker,
    TextMarkerDetector,
    TokenCountDetector,
    TokenPatternDetector,
    detector_for_schedule,
    find_first_answer,
    parse_marker,
)

E, K, B, N = 8, 2, 4, 12
TRIGGER = 7


def _hook(schedule: str):
    suppress = np.zeros(E, bool)
    suppress[[2, 5]] = True
    return make_steering_hook({0: (np.zeros(E, bool), suppress)}, K, 0.01, schedule)


def _edited_steps(schedule: str, detector, tokens_bn: np.ndarray) -> np.ndarray:
    """Which generated tokens [B, N] were produced by an edited forward, driving the hook and
    the detector as the sampler does: the forward producing token j sees the detector state
    after tokens 0 .. j-1 (the prefill sees the initial state), then token j updates it."""
    hook = _hook(schedule)
    logits_b1e = jnp.asarray(np.random.default_rng(0).normal(size=(B, 1, E)), jnp.float32)
    state = None if detector is None else detector.init(B)
    update = None if detector is None else jax.jit(detector.update)
    edited = np.zeros(tokens_bn.shape, bool)
    for j in range(tokens_bn.shape[1]):
        active = None if state is None else state.fired_b
        out = hook(logits_b1e, 0, active=active)
        edited[:, j] = np.asarray(jnp.any(out != logits_b1e, axis=(1, 2)))
        if state is not None:
            state = update(state, jnp.asarray(tokens_bn[:, j], jnp.int32))
    return edited


def _tokens_with_trigger_at(fire_at: list[int | None]) -> np.ndarray:
    tokens = np.ones((B, N), np.int64)
    for b, at in enumerate(fire_at):
        if at is not None:
            tokens[b, at] = TRIGGER
            tokens[b, at + 2:at + 3] = TRIGGER  # a second trigger changes nothing (sticky)
    return tokens


FIRE_AT = [0, 3, N - 1, None]


def _before_mask() -> np.ndarray:
    """True where token j comes no later than the token that completes the marker."""
    n = np.arange(N)
    return np.stack([n <= (N if at is None else at) for at in FIRE_AT])


def test_schedules_and_detector_kinds():
    assert SCHEDULES == ("always", "after_first_answer", "before_first_answer", "window")
    assert SCHEDULE_DETECTORS == {"after_first_answer": "first_answer",
                                  "before_first_answer": "first_answer",
                                  "window": "token_count"}


def test_cut_schedule_edits_exactly_the_tokens_up_to_the_first_answer():
    detector = TokenPatternDetector(((TRIGGER,),))
    tokens = _tokens_with_trigger_at(FIRE_AT)
    before = _before_mask()
    np.testing.assert_array_equal(_edited_steps("before_first_answer", detector, tokens), before)
    # "after_first_answer" is unchanged: exactly the complement; "always" edits everything.
    np.testing.assert_array_equal(_edited_steps("after_first_answer", detector, tokens), ~before)
    assert _edited_steps("always", None, tokens).all()
    assert _edited_steps("always", detector, tokens).all()  # "always" ignores the flag


@pytest.mark.parametrize("window", [1, 3, N, N + 5])
def test_window_schedule_edits_exactly_the_first_w_generated_tokens(window):
    tokens = np.random.default_rng(window).integers(0, 50, size=(B, N))
    edited = _edited_steps("window", TokenCountDetector(window), tokens)
    np.testing.assert_array_equal(edited, np.broadcast_to(np.arange(N) < window, (B, N)))


def test_schedule_validation():
    with pytest.raises(ValueError, match="window length"):
        detector_for_schedule("window")
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="window_tokens must be an int >= 1"):
            detector_for_schedule("window", window_tokens=bad)
    with pytest.raises(ValueError, match="only for schedule='window'"):
        detector_for_schedule("always", window_tokens=4)
    for schedule in ("after_first_answer", "before_first_answer"):
        with pytest.raises(ValueError, match="needs a first-answer detector"):
            detector_for_schedule(schedule)
    with pytest.raises(ValueError, match="schedule must be one of"):
        detector_for_schedule("sometimes")
    assert detector_for_schedule("always") is None
    assert detector_for_schedule("window", window_tokens=3) == TokenCountDetector(3)
    marker = TokenPatternDetector(((1,),))
    assert detector_for_schedule("before_first_answer", first_answer=marker) is marker
    logits = jnp.zeros((B, 1, E))
    for schedule in ("after_first_answer", "before_first_answer", "window"):
        with pytest.raises(ValueError, match=f"schedule='{schedule}' needs the per-sequence"):
            _hook(schedule)(logits, 0)


# ---- the text-marker detector -----------------------------------------------------------


def _device_first_fire(detector, ids: list[int]) -> int | None:
    """The first token index at which the jitted device detector's flag is set."""
    if not ids:
        return None

    @jax.jit
    def fired(tokens_n):
        def body(state, token):
            state = detector.update(state, token[None])
            return state, state.fired_b[0]

        return jax.lax.scan(body, detector.init(1), tokens_n)[1]

    flags = np.asarray(fired(jnp.asarray(ids, jnp.int32)))
    return int(np.argmax(flags)) if flags.any() else None


def _token_at_offset(decode, ids: list[int], end: int | None) -> int | None:
    """Index of the token whose text contains character ``end - 1`` of the decoded text."""
    if end is None:
        return None
    return next(i for i in range(len(ids)) if len(decode(ids[: i + 1])) >= end)


def test_marker_automaton_matches_re_on_random_tokenisations():
    """Pure automaton check: for random texts cut into random vocabulary pieces, it fires at
    the token holding the end of the earliest ``re`` match of the device patterns."""
    vocab = sorted(set(string.ascii_letters + " \n:*{}\\é.,") | {
        "\\boxed{", " answer", " is", "Final", " final", "**", "Answer", " the", "The", "  ",
        "\n\n", "fin", "al ans", "wer i", "x"})
    detector = TextMarkerDetector.from_token_texts(vocab)
    pieces = ["The answer is", "the  answer\nis", "final answer:", "Final Answer is",
              "\\boxed{", "**Answer**", "\nanswer :", "answer:", "xfinal answer:", "**ANSWER**",
              "\\BOXED{", "hello", " ", "\n", "the", " answer", "ans", "wer", ":", "final", "x",
              "*", "**ans", "é"]
    rng = random.Random(0)
    for _ in range(600):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 6)))
        ids, i = [], 0
        while i < len(text):
            ids.append(rng.choice([j for j, v in enumerate(vocab) if text.startswith(v, i)]))
            i += len(vocab[ids[-1]])
        ends = [m.end() for p in DEVICE_ANSWER_PATTERNS if (m := re.search(p, text))]
        want = _token_at_offset(lambda t: "".join(vocab[j] for j in t), ids,
                                min(ends) if ends else None)
        assert detector.first_fire(ids) == want, (text, [vocab[j] for j in ids])


def test_parse_marker_subset():
    assert parse_marker(r"(?im)^\s*answer\s*:").start == "line"
    assert parse_marker(r"(?i)\bthe\s+answer").ignore_case
    for bad in (r"a|b", r"(?:x)", r"a.b", r"\d", "a b", r"\s*"):
        with pytest.raises(ValueError):
            parse_marker(bad)


AGREEMENT_TEXTS = [
    "Let me compute. 2+2 = 4. So the answer is 4. Wait, let me double check.",
    "We get \\boxed{7} and the answer is 7",
    "First we add: one plus two is three.\nAnswer: 3",
    "Thinking...\n  answer :  nine\nmore text",
    "The final answer is 12, so **Answer** 12",
    "So THE   ANSWER\nIS ten. The answer is ten.",
    "Final Answer: \\boxed{5}",
    "no marker here, just reasoning about answers and what is final",
    "my answer is 4 and the boxed value is \\boxed{4}",
    "We conclude.**answer**: 8",
    "Résumé: the answer is 6",
    "In short: the\tanswer is 3.",
    "Answer:\\boxed{2}",
    "answer: first line counts",
]


@pytest.fixture(scope="module")
def sp_tokenizer(tmp_path_factory):
    from spade_jax.tokenizers import train_sentencepiece

    corpus = [t * 3 for t in AGREEMENT_TEXTS] + [
        "the answer is final answer boxed what is one plus two three four five\n" * 4]
    return train_sentencepiece(corpus, tmp_path_factory.mktemp("sp") / "sp", vocab_size=400)


def test_device_detector_agrees_with_the_text_tracker(sp_tokenizer):
    """For a real sentencepiece tokenizer, the run command's device detector fires at the
    same token as the host text tracker: ``find_first_answer`` on the whole text and the
    streaming ``FirstAnswerTracker`` fed the decoded text token by token."""
    tok = sp_tokenizer
    detector = compare.answer_detector(tok)
    # The tokenizer splits some markers across pieces that also hold neighbouring text, so
    # a token-id pattern detector cannot see them all; the text detector does not care.
    pattern_detector = TokenPatternDetector(compare.answer_token_patterns(tok))
    pattern_misses = 0
    fired_somewhere = 0
    for text in AGREEMENT_TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text

        def decode(t):
            return tok.decode(t, skip_special_tokens=True)

        want = _token_at_offset(decode, ids, find_first_answer(text))
        tracker, streamed, previous = FirstAnswerTracker(1), None, ""
        for i in range(len(ids)):
            current = decode(ids[: i + 1])
            if tracker.update([current[len(previous):]])[0]:
                streamed = i
                break
            previous = current
        assert streamed == want, text
        assert _device_first_fire(detector, ids) == want, text
        assert detector.first_fire(ids) == want, text
        fired_somewhere += want is not None
        pattern_misses += _device_first_fire(pattern_detector, ids) != want
    assert fired_somewhere == len(AGREEMENT_TEXTS) - 1
    print(f"token-pattern detector disagrees on {pattern_misses}/{len(AGREEMENT_TEXTS)} texts")


def test_documented_disagreement_trailing_word_boundary(sp_tokenizer):
    """The one documented difference: the text tracker's "the answer is\\b" waits for a
    non-word character; the device detector cannot look ahead and fires at "is"."""
    text = "the answer issue is open"
    ids = sp_tokenizer.encode(text)
    assert find_first_answer(text) is None
    assert _device_first_fire(compare.answer_detector(sp_tokenizer), ids) is not None


def test_out_of_vocabulary_ids_are_empty_text():
    detector = TextMarkerDetector.from_token_texts(["the", " answer", " is", "x"])
    assert detector.first_fire([0, 1, 99, 2]) == 3
    assert _device_first_fire(detector, [0, 1, 99, 2]) == 3


# ---- the table's standard errors ---------------------------------------------------------


def test_table_standard_errors_are_paired_per_problem():
    rng = np.random.default_rng(0)
    base_t = rng.integers(50, 150, size=(6, 2)).astype(float)
    steer_t = base_t * 0.7 + rng.normal(0, 3, size=(6, 2))
    base_s = rng.integers(0, 2, size=(6, 2)).astype(float)
    steer_s = rng.integers(0, 2, size=(6, 2)).astype(float)

    def result(name, t, s, dose=None):
        return compare.ConditionResult(name, float(t.mean()), float(s.mean()), 0.1, t.size,
                                       tokens_ps=t, scores_ps=s, dose=dose)

    rows = compare.table_rows([result("unmodified", base_t, base_s),
                               result("steered n=2", steer_t, steer_s, dose=2)])
    assert list(rows[0])[:7] == ["condition", "mean_tokens", "accuracy", "accuracy_stderr",
                                 "relative_token_change", "accuracy_delta", "completions"]
    row = rows[1]
    t0, t1 = base_t.mean(1), steer_t.mean(1)
    np.testing.assert_allclose(row["tokens_stderr"], t1.std(ddof=1) / np.sqrt(6))
    np.testing.assert_allclose(row["token_delta"], t1.mean() - t0.mean())
    np.testing.assert_allclose(row["token_delta_stderr"], (t1 - t0).std(ddof=1) / np.sqrt(6))
    ratio = t1.mean() / t0.mean()
    np.testing.assert_allclose(row["relative_token_change_stderr"],
                               (t1 - ratio * t0).std(ddof=1) / np.sqrt(6) / t0.mean())
    d_acc = steer_s.mean(1) - base_s.mean(1)
    np.testing.assert_allclose(row["accuracy_delta_stderr"], d_acc.std(ddof=1) / np.sqrt(6))
    assert row["dose"] == 2 and row["problems"] == 6 and rows[0]["dose"] == ""
    assert rows[0]["token_delta_stderr"] == 0.0
    md = compare.markdown_table(rows)
    assert "| steered n=2 |" in md and "+-" in md
    # Without per-problem data the SE columns are NaN, the old columns unchanged.
    bare = compare.table_rows([compare.ConditionResult("unmodified", 10.0, 0.5, 0.1, 4),
                               compare.ConditionResult("steered", 5.0, 0.5, 0.1, 4)])
    assert bare[1]["relative_token_change"] == -0.5
    assert np.isnan(bare[1]["token_delta_stderr"]) and np.isnan(bare[1]["tokens_stderr"])
