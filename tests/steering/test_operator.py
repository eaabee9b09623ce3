"""The steering operator, its router hook and the first-answer detectors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spade_jax.steering import (
    make_steering_hook,
    random_expert_sets_like,
    steer_router_logits,
    validate_expert_sets,
)
from spade_jax.steering.schedule import (
    FirstAnswerConfig,
    FirstAnswerTracker,
    TokenPatternDetector,
    find_first_answer,
)

E, K = 16, 4


def _masks(activate=(), suppress=(), num_experts=E):
    a = np.zeros(num_experts, bool)
    s = np.zeros(num_experts, bool)
    a[list(activate)] = True
    s[list(suppress)] = True
    return a, s


def _numpy_reference(z, activate, suppress, eps):
    """Eqs. 5-6 written out independently in float64 NumPy."""
    z = np.asarray(z, np.float64)
    s = z - z.max(-1, keepdims=True)
    s = s - np.log(np.exp(s).sum(-1, keepdims=True))
    out = s.copy()
    out[..., activate] = s.max(-1, keepdims=True) + eps
    out[..., suppress] = s.min(-1, keepdims=True) - eps
    return out


def _softmax(x):
    x = np.asarray(x, np.float64)
    p = np.exp(x - x.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


def _top_k(x, k):
    return np.argsort(-np.asarray(x, np.float64), axis=-1, kind="stable")[..., :k]


@pytest.fixture
def logits_bte():
    rng = np.random.default_rng(0)
    # Wide spread so activated experts usually start far from the top and suppressed ones
    # usually start inside the top-k: the edit has to do real work.
    return jnp.asarray(rng.normal(scale=3.0, size=(3, 7, E)), jnp.float32)


def test_matches_numpy_reference(logits_bte):
    activate, suppress = _masks([1, 5], [0, 2, 3, 9])
    out = steer_router_logits(logits_bte, activate, suppress, eps=0.01, k=K)
    ref = _numpy_reference(logits_bte, activate, suppress, 0.01)
    np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5)
    as_lists = steer_router_logits(logits_bte, activate.tolist(), suppress.tolist(), k=K)
    np.testing.assert_allclose(np.asarray(as_lists), ref, atol=1e-5)


def test_selection_invariants_after_softmax_top_k(logits_bte):
    rng = np.random.default_rng(1)
    for _ in range(20):
        chosen = rng.permutation(E)
        n_act = int(rng.integers(0, K + 1))
        n_sup = int(rng.integers(0, E - K + 1))
        activate, suppress = _masks(chosen[:n_act], chosen[n_act : n_act + n_sup])
        out = np.asarray(steer_router_logits(logits_bte, activate, suppress, k=K))
        probs = _softmax(out)
        selected = _top_k(probs, K)
        chosen_mask = np.zeros(probs.shape, bool)
        np.put_along_axis(chosen_mask, selected, True, axis=-1)
        assert not chosen_mask[..., suppress].any(), "a suppressed expert was selected"
        assert chosen_mask[..., activate].all(), "an activated expert was not selected"
        # Untouched experts keep their relative weights: p_i / p_j = exp(z_i - z_j).
        untouched = np.flatnonzero(~activate & ~suppress)
        z = np.asarray(logits_bte, np.float64)
        i, j = untouched[0], untouched[-1]
        np.testing.assert_allclose(
            probs[..., i] / probs[..., j], np.exp(z[..., i] - z[..., j]), rtol=1e-4
        )
        # ...and also after the model's renormalisation over the selected experts.
        weights = np.take_along_axis(probs, selected, -1)
        weights /= weights.sum(-1, keepdims=True)
        base = _softmax(z)
        for b, t in np.ndindex(*selected.shape[:2]):
            kept = [e for e in selected[b, t] if e in set(untouched)]
            if len(kept) >= 2:
                w = dict(zip(selected[b, t], weights[b, t], strict=True))
                np.testing.assert_allclose(
                    w[kept[0]] / w[kept[1]], base[b, t, kept[0]] / base[b, t, kept[1]], rtol=1e-4
                )


def test_empty_sets_are_the_identity(logits_bte):
    activate, suppress = _masks()
    assert steer_router_logits(logits_bte, activate, suppress, k=K) is logits_bte
    # Traced empty masks cannot be detected at trace time: the output is log-softmax, whose
    # softmax (what the router consumes) equals the input's.
    out = jax.jit(steer_router_logits)(logits_bte, jnp.asarray(activate), jnp.asarray(suppress))
    np.testing.assert_allclose(_softmax(out), _softmax(logits_bte), atol=1e-6)


def test_low_precision_input_keeps_strict_order():
    rng = np.random.default_rng(2)
    z = jnp.asarray(rng.normal(scale=8.0, size=(64, E)), jnp.bfloat16)
    activate, suppress = _masks([3], [4, 5])
    out = steer_router_logits(z, activate, suppress, eps=0.01, k=K)
    assert out.dtype == jnp.float32
    out = np.asarray(out)
    others = np.delete(out, [3, 4, 5], axis=-1)
    assert (out[:, 3] > others.max(-1)).all()
    assert (out[:, [4, 5]].max(-1) < others.min(-1)).all()


def test_jit_and_any_leading_shape():
    rng = np.random.default_rng(3)
    activate, suppress = _masks([0], [1])
    for shape in [(E,), (5, E), (2, 3, 4, E)]:
        z = jnp.asarray(rng.normal(size=shape), jnp.float32)
        jitted = jax.jit(lambda x: steer_router_logits(x, activate, suppress))
        np.testing.assert_allclose(
            np.asarray(jitted(z)), _numpy_reference(z, activate, suppress, 0.01), atol=1e-5
        )


@pytest.mark.parametrize(
    "activate, suppress, k, message",
    [
        (range(5), (), K, "at most k"),
        ((), range(13), K, "at least k"),
        ((1, 2), (2, 3), K, "both the activate and suppress"),
    ],
)
def test_constraints_raise_clear_errors(activate, suppress, k, message):
    a, s = _masks(activate, suppress)
    with pytest.raises(ValueError, match=message):
        steer_router_logits(jnp.zeros((2, E)), a, s, k=k)


def test_shape_dtype_and_eps_errors():
    a, s = _masks()
    with pytest.raises(ValueError, match=r"shape \(16,\)"):
        steer_router_logits(jnp.zeros((2, E)), np.zeros(8, bool), s)
    with pytest.raises(ValueError, match="bool mask"):
        validate_expert_sets(np.zeros(E, np.int32), s, E)
    with pytest.raises(ValueError, match="eps must be > 0"):
        steer_router_logits(jnp.zeros((2, E)), a, s, eps=0.0)
    # Boundary cases are allowed: exactly k activated, exactly k left.
    validate_expert_sets(*_masks(range(K), range(K, E)), E, K)


def test_hook_python_layers_and_traced_layers_agree(logits_bte):
    sets = {1: _masks([2], [0, 3]), 3: _masks([], [5, 6, 7])}
    hook = make_steering_hook(sets, k=K)
    assert hook(logits_bte, 0) is logits_bte  # layer without sets: untouched
    np.testing.assert_allclose(
        np.asarray(hook(logits_bte, 1)), _numpy_reference(logits_bte, *sets[1], 0.01), atol=1e-5
    )

    def scan_layers(z):
        def body(carry, layer):
            return carry, hook(z, layer)

        return jax.lax.scan(body, None, jnp.arange(5))[1]

    stacked = np.asarray(jax.jit(scan_layers)(logits_bte))
    for layer in range(5):
        expected = hook(logits_bte, layer)
        np.testing.assert_allclose(stacked[layer], np.asarray(expected), atol=1e-5)


def test_hook_after_first_answer_schedule(logits_bte):
    sets = {0: _masks([1], [0])}
    hook = make_steering_hook(sets, k=K, schedule="after_first_answer")
    active = jnp.asarray([True, False, True])
    out = np.asarray(jax.jit(lambda z, a: hook(z, 0, active=a))(logits_bte, active))
    steered = _numpy_reference(logits_bte, *sets[0], 0.01)
    np.testing.assert_allclose(out[[0, 2]], steered[[0, 2]], atol=1e-5)
    np.testing.assert_array_equal(out[1], np.asarray(logits_bte)[1])
    with pytest.raises(ValueError, match="active"):
        hook(logits_bte, 0)
    # "always" ignores the flag.
    always = make_steering_hook(sets, k=K)
    np.testing.assert_allclose(np.asarray(always(logits_bte, 0, active=active)), steered, atol=1e-5)


def test_hook_construction_validates_every_layer():
    with pytest.raises(ValueError, match="layer 2: .*at most k"):
        make_steering_hook({0: _masks([1]), 2: _masks(range(6))}, k=K)
    with pytest.raises(ValueError, match="schedule"):
        make_steering_hook({0: _masks([1])}, k=K, schedule="sometimes")
    hook = make_steering_hook({0: _masks([1])}, k=K)
    with pytest.raises(ValueError, match="16 experts"):
        hook(jnp.zeros((1, 1, 8)), 0)


def test_random_control_sets_match_sizes():
    sets = {0: _masks([1, 2], [3, 4, 5]), 4: _masks([], range(10))}
    random_sets = random_expert_sets_like(sets, E, seed=0)
    for layer, (a, s) in sets.items():
        ra, rs = random_sets[layer]
        assert (ra.sum(), rs.sum()) == (a.sum(), s.sum())
        validate_expert_sets(ra, rs, E, K)


def test_find_first_answer_and_streaming_tracker():
    text = "Let me compute. 2+2 = 4. So the answer is 4. Wait, let me double check."
    end = find_first_answer(text)
    assert text[:end].endswith("the answer is")
    assert find_first_answer("no answer here yet") is None
    assert find_first_answer("We get \\boxed{7} and the answer is 7") == len("We get \\boxed{")

    tracker = FirstAnswerTracker(batch_size=2)
    assert not tracker.update(["First we ", "Thinking about "]).any()
    assert tracker.update(["note \\bo", "it more"]).tolist() == [False, False]
    assert tracker.update(["xed{3}", " still"]).tolist() == [True, False]  # split marker found
    assert tracker.update(["more text", " Final answer: 5"]).tolist() == [True, True]
    with pytest.raises(ValueError, match="invalid answer pattern"):
        FirstAnswerConfig(patterns=("(",))


def test_token_pattern_detector_matches_python_reference():
    detector = TokenPatternDetector(patterns=((7, 8, 9), (4,)))
    rng = np.random.default_rng(4)
    tokens_tb = rng.integers(0, 10, size=(40, 5))
    tokens_tb[:, 0] = np.where(tokens_tb[:, 0] == 4, 5, tokens_tb[:, 0])  # row 0: only 7,8,9
    tokens_tb[10:13, 0] = [7, 8, 9]

    @jax.jit
    def run(tokens):
        def body(state, token_b):
            state = detector.update(state, token_b)
            return state, state.fired_b

        return jax.lax.scan(body, detector.init(tokens.shape[1]), tokens)[1]

    fired_tb = np.asarray(run(jnp.asarray(tokens_tb)))
    for b in range(5):
        seq = tokens_tb[:, b].tolist()
        first = next(
            (t for t in range(40) if seq[t] == 4 or seq[max(0, t - 2) : t + 1] == [7, 8, 9]),
            None,
        )
        expected = np.zeros(40, bool) if first is None else np.arange(40) >= first
        np.testing.assert_array_equal(fired_tb[:, b], expected)
    assert fired_tb[12, 0] and not fired_tb[11, 0]
