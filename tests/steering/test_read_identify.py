"""Read (probes, controls) and Identify (risk difference, Jaccard, transfer AUC).

Each statistic is checked against an independent NumPy re-derivation, then the whole
pipeline against synthetic router data with a planted behaviour -> expert structure.
"""

import itertools

import numpy as np
import pytest

from spade_jax.steering.controls import (
    TfidfConfig,
    fit_tfidf,
    position_features,
    prefix_mask,
    segment_features_to_tokens,
)
from spade_jax.steering.experts import (
    ExpertCounts,
    cross_dataset_jaccard,
    rank_auc,
    risk_difference,
    top_n_experts,
    transfer_auc,
)
from spade_jax.steering.probe import (
    ProbeConfig,
    centered_router_features,
    compare_feature_sets,
    evaluate_probe,
    fit_logistic_probe,
    group_split,
    layer_windows,
    macro_f1,
    probe_router_layers,
)

# ---------------------------------------------------------------- statistics vs references


def test_macro_f1_against_hand_computation():
    y_true = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2])
    y_pred = np.array([0, 1, 0, 1, 2, 2, 2, 0, 3])
    # class 0: tp 2, fp 1, fn 1 -> 2*2/(2*2+1+1) = 4/6; class 1: tp 1, fp 1, fn 1 -> 2/4;
    # class 2: tp 2, fp 1, fn 2 -> 4/7; class 3: tp 0, fp 1 -> 0 (present only in y_pred).
    expected = np.mean([4 / 6, 2 / 4, 4 / 7, 0.0])
    assert macro_f1(y_true, y_pred) == pytest.approx(expected)
    assert macro_f1(y_true, y_true) == 1.0
    with pytest.raises(ValueError, match="equal non-empty"):
        macro_f1(y_true, y_pred[:3])


def test_rank_auc_against_brute_force_pairs():
    rng = np.random.default_rng(0)
    for _ in range(10):
        scores = rng.integers(0, 6, size=40).astype(float)  # many ties
        positive = rng.random(40) < 0.4
        pairs = [
            1.0 if p > n else 0.5 if p == n else 0.0
            for p, n in itertools.product(scores[positive], scores[~positive])
        ]
        assert rank_auc(scores, positive) == pytest.approx(np.mean(pairs))
    with pytest.raises(ValueError, match="both classes"):
        rank_auc(np.ones(3), np.ones(3, bool))


def test_risk_difference_and_contrast_against_loops():
    rng = np.random.default_rng(1)
    num_tokens, num_layers, num_experts, k, num_classes = 300, 3, 7, 2, 4
    selected = np.stack(
        [[rng.choice(num_experts, k, replace=False) for _ in range(num_layers)]
         for _ in range(num_tokens)]
    )
    labels = rng.integers(-1, num_classes, num_tokens)  # -1 = unlabelled, ignored
    counts = ExpertCounts(num_classes, num_layers, num_experts)
    for start in range(0, num_tokens, 64):  # chunked accumulation, as from telemetry
        counts.update(selected[start : start + 64], labels[start : start + 64])
    rd, contrast = counts.risk_difference(), counts.contrast_difference()
    labelled = labels >= 0
    for c, layer, e in itertools.product(range(num_classes), range(num_layers), range(num_experts)):
        chose = (selected[:, layer, :] == e).any(axis=1)
        in_c = labels == c
        p_c = chose[in_c].mean()
        assert rd[c, layer, e] == pytest.approx(p_c - chose[labelled].mean())
        assert contrast[c, layer, e] == pytest.approx(p_c - chose[labelled & ~in_c].mean())
    np.testing.assert_allclose(risk_difference(selected, labels, num_experts, num_classes), rd)
    with pytest.raises(ValueError, match=r"class\(es\) \[3\]"):
        ExpertCounts(4, 3, 7).update(selected, np.minimum(labels, 2)).risk_difference()


def test_top_n_orders_by_score():
    scores = np.zeros((2, 2, 4))
    scores[0, 1, 3], scores[0, 0, 2], scores[0, 1, 0] = 0.9, 0.5, 0.4
    scores[1, 0, 1] = 1.0
    sets = top_n_experts(scores, n=2)
    assert sets[0] == {(1, 3), (0, 2)}
    assert top_n_experts(scores, n=1, layer=1)[0] == {(1, 3)}
    assert (0, 1) in sets[1]
    with pytest.raises(ValueError, match="n must be"):
        top_n_experts(scores, n=9)


def test_group_split_never_splits_a_group():
    groups = np.repeat(np.arange(20), 7)
    train, test = group_split(groups, test_fraction=0.25, seed=3)
    assert not (train & test).any() and (train | test).all()
    assert set(groups[train]).isdisjoint(groups[test])
    assert len(set(groups[test])) == 5


def test_probe_reaches_the_regularised_optimum():
    """KKT check in NumPy: the objective's gradient at the fitted parameters is ~0."""
    rng = np.random.default_rng(2)
    num, dims, classes, l2 = 400, 5, 3, 1e-2
    y = rng.integers(0, classes, num)
    x = rng.normal(size=(num, dims)) + rng.normal(size=(classes, dims))[y]
    params = fit_logistic_probe(x, y, classes, ProbeConfig(l2=l2, num_steps=60))
    x_std = (x - params.mean_d) / params.scale_d
    logits = x_std @ params.w_dc + params.b_c
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    residual = probs - np.eye(classes)[y]
    grad_w = x_std.T @ residual / num + l2 * params.w_dc
    grad_b = residual.mean(0)
    assert np.abs(grad_w).max() < 1e-4 and np.abs(grad_b).max() < 1e-4
    assert np.abs(params.w_dc).max() > 0.1  # it actually learned something


def test_tfidf_against_hand_computation():
    model = fit_tfidf(["the cat sat", "the dog", "a cat, a cat"], TfidfConfig(max_features=10))
    assert set(model.vocabulary) == {"the", "cat", "sat", "dog", "a", ","}
    idf = {t: np.log(4 / (1 + df)) + 1 for t, df in
           {"the": 2, "cat": 2, "sat": 1, "dog": 1, "a": 1, ",": 1}.items()}
    row = model.transform(["cat cat dog unseen"])[0]
    expected = np.zeros(len(model.vocabulary))
    expected[model.vocabulary["cat"]] = 2 * idf["cat"]
    expected[model.vocabulary["dog"]] = idf["dog"]
    np.testing.assert_allclose(row, expected / np.linalg.norm(expected), rtol=1e-6)
    capped = fit_tfidf(["the cat sat", "the dog", "a cat, a cat"], TfidfConfig(max_features=2))
    assert set(capped.vocabulary) == {"cat", "the"}  # the two most frequent by document


# ---------------------------------------------------------------- planted signal

NUM_CLASSES, NUM_LAYERS, NUM_EXPERTS, TOP_K = 6, 4, 16, 4
PLANTED_LAYERS = (1, 2)


def _planted_experts(layer):
    # Two experts per behaviour, a different assignment on each planted layer.
    shift = 5 * layer
    return {b: [(2 * b + shift) % NUM_EXPERTS, (2 * b + 1 + shift) % NUM_EXPERTS]
            for b in range(NUM_CLASSES)}


def _planted_dataset(seed, num_traces=40, segments_per_trace=8, boost=1.6):
    """Router logits with noise plus a boost on the planted experts of the token's behaviour
    at the planted layers; selections are the top-k of those logits. Behaviour frequencies
    are skewed so the majority baseline is meaningful."""
    rng = np.random.default_rng(seed)
    frequencies = np.array([0.3, 0.25, 0.15, 0.1, 0.12, 0.08])
    logits, labels, segment_ids, traces, positions, texts = [], [], [], [], [], []
    segment = 0
    for trace in range(num_traces):
        position = 0
        for _ in range(segments_per_trace):
            behaviour = rng.choice(NUM_CLASSES, p=frequencies)
            length = int(rng.integers(3, 20))
            z = rng.normal(size=(length, NUM_LAYERS, NUM_EXPERTS))
            for layer in PLANTED_LAYERS:
                z[:, layer, _planted_experts(layer)[behaviour]] += boost
            logits.append(z)
            labels += [behaviour] * length
            segment_ids += [segment] * length
            traces += [trace] * length
            positions += list(range(position, position + length))
            texts.append(f"word{rng.integers(50)} word{rng.integers(50)}")  # label-free text
            position += length
            segment += 1
    logits = np.concatenate(logits).astype(np.float32)
    selected = np.argsort(-logits, axis=-1)[..., :TOP_K]
    return dict(logits=logits, selected=selected, labels=np.array(labels),
                segments=np.array(segment_ids), traces=np.array(traces),
                positions=np.array(positions), texts=texts)


@pytest.fixture(scope="module")
def planted():
    return _planted_dataset(seed=0), _planted_dataset(seed=1)


@pytest.mark.slow  # ~11 s loaded: probe training
def test_planted_probe_recovers_behaviours_above_controls(planted):
    data, _ = planted
    train, test = group_split(data["traces"], test_fraction=0.25, seed=0)
    config = ProbeConfig(l2=1e-3, num_steps=60)
    per_layer = probe_router_layers(
        data["logits"], data["labels"], train, test,
        [(layer,) for layer in range(NUM_LAYERS)] + layer_windows(NUM_LAYERS, 2),
        NUM_CLASSES, config,
    )
    majority = per_layer[(0,)].majority_macro_f1
    assert majority < 0.1
    for layer in PLANTED_LAYERS:
        assert per_layer[(layer,)].macro_f1 > majority + 0.4, per_layer
    assert per_layer[(0,)].macro_f1 < majority + 0.15  # noise layer carries nothing
    # A window spanning both planted layers reads more than either layer alone.
    assert per_layer[(1, 2)].macro_f1 > max(per_layer[(1,)].macro_f1, per_layer[(2,)].macro_f1) + 0.05

    tfidf = fit_tfidf([data["texts"][s] for s in np.unique(data["segments"][train])])
    controls = compare_feature_sets(
        {
            "router_l1": centered_router_features(data["logits"], [1]),
            "position": position_features(data["positions"]),
            "tfidf": segment_features_to_tokens(tfidf.transform(data["texts"]), data["segments"]),
        },
        data["labels"], train, test, NUM_CLASSES, config,
    )
    assert controls["router_l1"].macro_f1 > controls["position"].macro_f1 + 0.3
    assert controls["router_l1"].macro_f1 > controls["tfidf"].macro_f1 + 0.3

    # The planted signal is on every token, so dropping each segment's first five keeps it.
    later = ~prefix_mask(data["segments"], 5)
    dropped = evaluate_probe(centered_router_features(data["logits"], [1]), data["labels"],
                             train & later, test & later, NUM_CLASSES, config)
    assert dropped.macro_f1 > dropped.majority_macro_f1 + 0.4


def test_planted_risk_difference_ranks_planted_experts_first(planted):
    data, _ = planted
    rd = risk_difference(data["selected"], data["labels"], NUM_EXPERTS, NUM_CLASSES)
    contrast = ExpertCounts(NUM_CLASSES, NUM_LAYERS, NUM_EXPERTS).update(
        data["selected"], data["labels"]).contrast_difference()
    for layer in PLANTED_LAYERS:
        planted_sets = _planted_experts(layer)
        for scores in (rd, contrast):
            found = top_n_experts(scores, n=2, layer=layer)
            assert found == [{(layer, e) for e in planted_sets[b]} for b in range(NUM_CLASSES)]
    # Across all layers, each behaviour's top-4 are its planted (layer, expert) pairs.
    top4 = top_n_experts(rd, n=4)
    for b in range(NUM_CLASSES):
        assert top4[b] == {(layer, e) for layer in PLANTED_LAYERS
                           for e in _planted_experts(layer)[b]}


def test_planted_sets_transfer_across_datasets(planted):
    source, target = planted
    result = cross_dataset_jaccard(
        (source["selected"], source["labels"]), (target["selected"], target["labels"]),
        NUM_EXPERTS, NUM_CLASSES, n=2, layer=1, num_permutations=30, seed=0,
        groups=(source["segments"], target["segments"]),
    )
    assert result.mean == 1.0 and result.null_mean < 0.3
    assert result.p_value == pytest.approx(1 / 31)

    source_sets = top_n_experts(
        risk_difference(source["selected"], source["labels"], NUM_EXPERTS, NUM_CLASSES), n=2,
        layer=1,
    )
    aucs = transfer_auc(source_sets, target["logits"], target["segments"], target["labels"])
    assert (aucs > 0.9).all(), aucs
    # A set from a noise layer transfers at chance.
    noise_sets = top_n_experts(
        risk_difference(source["selected"], source["labels"], NUM_EXPERTS, NUM_CLASSES), n=2,
        layer=3,
    )
    noise_aucs = transfer_auc(noise_sets, target["logits"], target["segments"], target["labels"])
    assert np.abs(noise_aucs - 0.5).max() < 0.25 and noise_aucs.mean() < 0.65
