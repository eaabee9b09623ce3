"""Identify protocol: profile correlations, Jaccard over many datasets with its null, experts
shared by every dataset, the set-size x layer sweep, and disjoint random control sets.

Planted data: router probabilities are built by hand so that, at one layer, each behaviour
puts a known share of its routing on a set of experts common to every dataset plus one
expert of its own per dataset; the functions must find exactly the common set, and each
statistic is checked against a direct NumPy computation. Pure NumPy, no model, no JAX.
"""

import itertools

import numpy as np
import pytest

from spade_jax.steering import (
    RoutingMass,
    multi_dataset_jaccard,
    profile_correlations,
    random_expert_sets_like,
    shared_experts,
    top_n_sweep,
    validate_expert_sets,
)
from spade_jax.steering.experts import (
    ExpertCounts,
    cross_dataset_jaccard,
    segment_routing_mass,
    top_n_experts,
    transfer_auc,
)

NUM_CLASSES, NUM_LAYERS, NUM_EXPERTS, TOP_K, NUM_DATASETS = 4, 3, 32, 4, 3
PLANTED_LAYER = 1
SHARED_MASS = 0.4  # routing mass each behaviour puts on its shared set at PLANTED_LAYER
OWN_MASS = 0.1  # ... and on its one dataset-specific expert


def _shared_set(b):
    return [4 * b + i for i in range(4)]  # experts 0..15, four per behaviour


def _own_expert(b, d):
    return 16 + NUM_CLASSES * d + b  # experts 16..27, one per (behaviour, dataset)


def _planted_dataset(d, seed, num_segments=400, noise_labels=False):
    """Router logits ``log p + N(0, 0.1)`` with p as above at PLANTED_LAYER (uniform
    elsewhere, N(0, 1) logits on the other layers); selections are top-k of logits plus
    Gumbel noise, i.e. k draws without replacement from the router distribution."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, 14, num_segments)
    seg_labels = rng.integers(0, NUM_CLASSES, num_segments)
    labels = np.repeat(seg_labels, lengths)
    segments = np.repeat(np.arange(num_segments), lengths)
    logits = rng.normal(size=(labels.size, NUM_LAYERS, NUM_EXPERTS))
    probs_ce = np.empty((NUM_CLASSES, NUM_EXPERTS))
    for b in range(NUM_CLASSES):
        rest = (1 - SHARED_MASS - OWN_MASS) / (NUM_EXPERTS - 5)
        probs_ce[b] = rest
        probs_ce[b, _shared_set(b)] = SHARED_MASS / 4
        probs_ce[b, _own_expert(b, d)] = OWN_MASS
    logits[:, PLANTED_LAYER] = np.log(probs_ce[labels]) + 0.1 * rng.normal(
        size=(labels.size, NUM_EXPERTS))
    gumbel = rng.gumbel(size=logits.shape)
    selected = np.argsort(-(logits + gumbel), axis=-1)[..., :TOP_K]
    if noise_labels:  # relabel whole segments at random: no behaviour -> expert link left
        labels = np.repeat(rng.integers(0, NUM_CLASSES, num_segments), lengths)
    return dict(logits=logits, selected=selected, labels=labels, segments=segments)


@pytest.fixture(scope="module")
def planted():
    return [_planted_dataset(d, seed=10 + d) for d in range(NUM_DATASETS)]


def _counts(data):
    return ExpertCounts(NUM_CLASSES, NUM_LAYERS, NUM_EXPERTS).update(
        data["selected"], data["labels"])


def _softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


# ---------------------------------------------------------------- profile correlations


def test_profile_correlations_on_constructed_profiles_match_corrcoef():
    rng = np.random.default_rng(0)
    num_classes, num_layers, num_experts = 6, 4, 16
    signal_cle = np.zeros((num_classes, num_layers, num_experts))
    for b in range(num_classes):  # three disjoint (layer, expert) pairs per behaviour
        for i in range(3):
            flat = 3 * b + i
            signal_cle[b, flat % num_layers, flat // num_layers] = 1.0
    scores = {f"ds{d}": signal_cle + 0.1 * rng.normal(size=signal_cle.shape) for d in range(3)}
    names = ["p", "e", "r", "f", "x", "c"]
    result = profile_correlations(scores, names)

    num_profiles = 3 * num_classes
    assert len(result.rows) == num_profiles * (num_profiles - 1) // 2
    assert set(result.rows[0]) == {"behaviour_a", "dataset_a", "behaviour_b", "dataset_b", "r"}
    for row in result.rows:  # every r against np.corrcoef
        a = scores[row["dataset_a"]][names.index(row["behaviour_a"])].ravel()
        b = scores[row["dataset_b"]][names.index(row["behaviour_b"])].ravel()
        assert row["r"] == pytest.approx(np.corrcoef(a, b)[0, 1], abs=1e-12)
    same = [r["r"] for r in result.rows if r["behaviour_a"] == r["behaviour_b"]]
    cross = [r["r"] for r in result.rows
             if r["behaviour_a"] != r["behaviour_b"] and r["dataset_a"] != r["dataset_b"]]
    assert len(same) == num_classes * 3 and result.same_behaviour_mean == pytest.approx(
        np.mean(same))
    assert result.cross_behaviour_mean == pytest.approx(np.mean(cross))
    assert result.same_behaviour_mean > 0.7  # the paper's 0.729 regime
    assert abs(result.cross_behaviour_mean) < 0.1  # near zero (paper: -0.107)

    one_layer = profile_correlations(scores, names, layer=2)
    row = one_layer.rows[0]
    expected = np.corrcoef(scores["ds0"][0, 2], scores["ds0"][1, 2])[0, 1]
    assert (row["behaviour_a"], row["behaviour_b"]) == ("p", "e")
    assert row["r"] == pytest.approx(expected, abs=1e-12)


def test_profile_correlations_from_planted_counts(planted):
    result = profile_correlations({f"d{d}": _counts(data) for d, data in enumerate(planted)},
                                  layer=PLANTED_LAYER)
    assert result.same_behaviour_mean > 0.7  # ~0.80 here
    assert result.cross_behaviour_mean < result.same_behaviour_mean - 0.6  # ~-0.27 here
    # Within one dataset risk differences sum to zero (token-weighted) over behaviours.
    assert result.cross_behaviour_within_dataset_mean < 0


def test_profile_correlations_rejects_malformed_input():
    good = np.random.default_rng(0).normal(size=(3, 2, 4))
    with pytest.raises(ValueError, match="at least 2 datasets"):
        profile_correlations({"a": good})
    with pytest.raises(ValueError, match="disagree"):
        profile_correlations({"a": good, "b": good[:, :, :3]})
    with pytest.raises(ValueError, match="behaviour names"):
        profile_correlations({"a": good, "b": good}, ["x", "y"])
    with pytest.raises(ValueError, match="layer must be"):
        profile_correlations({"a": good, "b": good}, layer=2)
    flat = good.copy()
    flat[1] = 0.5
    with pytest.raises(ValueError, match="constant profile"):
        profile_correlations({"a": good, "b": flat})


# ---------------------------------------------------------------- Jaccard over D datasets


def test_multi_dataset_jaccard_finds_planted_sets(planted):
    datasets = [(d["selected"], d["labels"]) for d in planted]
    groups = [d["segments"] for d in planted]
    result = multi_dataset_jaccard(datasets, NUM_EXPERTS, NUM_CLASSES, n=5,
                                   layer=PLANTED_LAYER, num_permutations=30, seed=0,
                                   groups=groups)
    # Independent: Top-5 = shared four + the dataset's own expert, so every pair has 4/6.
    assert result.pairs == ((0, 1), (0, 2), (1, 2))
    np.testing.assert_allclose(result.per_pair_pc, 4 / 6)
    assert result.mean == pytest.approx(4 / 6)
    assert result.p_value == pytest.approx(1 / 31)
    assert result.null_mean < 0.3 and result.null_std > 0

    # The two-dataset function is the D = 2 case, to the same numbers.
    two = multi_dataset_jaccard(datasets[:2], NUM_EXPERTS, NUM_CLASSES, n=5, layer=0,
                                num_permutations=20, seed=3, groups=groups[:2])
    old = cross_dataset_jaccard(datasets[0], datasets[1], NUM_EXPERTS, NUM_CLASSES, n=5,
                                layer=0, num_permutations=20, seed=3, groups=tuple(groups[:2]))
    np.testing.assert_array_equal(old.per_class, two.per_class)
    assert (old.mean, old.null_mean, old.p_value) == (two.mean, two.null_mean, two.p_value)


def test_multi_dataset_jaccard_noise_labels_are_not_significant():
    noise = [_planted_dataset(d, seed=20 + d, noise_labels=True) for d in range(NUM_DATASETS)]
    result = multi_dataset_jaccard(
        [(d["selected"], d["labels"]) for d in noise], NUM_EXPERTS, NUM_CLASSES, n=5,
        layer=PLANTED_LAYER, num_permutations=40, seed=0, groups=[d["segments"] for d in noise])
    assert result.p_value > 0.05
    assert abs(result.mean - result.null_mean) < 3 * result.null_std + 1e-9


def test_multi_dataset_jaccard_rejects_malformed_input(planted):
    data = [(d["selected"], d["labels"]) for d in planted]
    with pytest.raises(ValueError, match="at least 2 datasets"):
        multi_dataset_jaccard(data[:1], NUM_EXPERTS, NUM_CLASSES)
    with pytest.raises(ValueError, match=r"n must be in \[1, 32\]"):
        multi_dataset_jaccard(data, NUM_EXPERTS, NUM_CLASSES, n=33, layer=0)
    with pytest.raises(ValueError, match="number of layers"):
        multi_dataset_jaccard([data[0], (data[1][0][:, :2], data[1][1])], NUM_EXPERTS,
                              NUM_CLASSES)
    with pytest.raises(ValueError, match="dataset 1: need selected"):
        multi_dataset_jaccard([data[0], (data[1][0], data[1][1][:-1])], NUM_EXPERTS,
                              NUM_CLASSES)
    with pytest.raises(ValueError, match="group arrays"):
        multi_dataset_jaccard(data, NUM_EXPERTS, NUM_CLASSES, groups=[None, None])


# ---------------------------------------------------------------- experts shared by all datasets


def test_shared_experts_recovers_planted_set_and_its_routing_share(planted):
    counts = [_counts(d) for d in planted]
    masses = [RoutingMass(NUM_CLASSES, NUM_LAYERS, NUM_EXPERTS) for _ in planted]
    for mass, data in zip(masses, planted, strict=True):
        for start in range(0, data["labels"].size, 1000):  # chunked, as from telemetry
            mass.update(data["logits"][start:start + 1000], data["labels"][start:start + 1000])

    found = shared_experts(counts, n=5, layer=PLANTED_LAYER, mass_by_dataset=masses)
    assert len(found) == NUM_CLASSES
    for b, result in enumerate(found):
        assert result.behaviour == b and result.layers == (PLANTED_LAYER,)
        assert result.experts == {(PLANTED_LAYER, e) for e in _shared_set(b)}
        assert result.chance_share == pytest.approx(4 / NUM_EXPERTS)
        np.testing.assert_allclose(result.mass_share_d, SHARED_MASS, atol=0.02)
        for d, data in enumerate(planted):
            is_b = data["labels"] == b
            probs = _softmax(data["logits"][is_b, PLANTED_LAYER])
            direct = probs[:, _shared_set(b)].sum(axis=1).mean()
            assert result.mass_share_d[d] == pytest.approx(direct, rel=1e-9)
            # The same number through segment_routing_mass with labels as the segments.
            ids, per_label = segment_routing_mass(data["logits"], data["labels"],
                                                  result.experts)
            assert result.mass_share_d[d] == pytest.approx(per_label[list(ids).index(b)])
            selected = data["selected"][is_b, PLANTED_LAYER]
            assert result.selection_share_d[d] == pytest.approx(
                np.isin(selected, _shared_set(b)).mean())

    # All layers competing: same experts, shares over L layers, no mass without RoutingMass.
    everywhere = shared_experts(counts, n=5)
    assert [r.experts for r in everywhere] == [r.experts for r in found]
    assert everywhere[0].layers == tuple(range(NUM_LAYERS))
    assert everywhere[0].mass_share_d is None
    np.testing.assert_allclose(everywhere[0].selection_share_d * NUM_LAYERS,
                               found[0].selection_share_d)


def test_shared_experts_rejects_malformed_input(planted):
    counts = [_counts(d) for d in planted]
    with pytest.raises(ValueError, match="at least 2 datasets"):
        shared_experts(counts[:1], n=5)
    with pytest.raises(ValueError, match=r"n must be in \[1, 32\]"):
        shared_experts(counts, n=40, layer=0)
    with pytest.raises(ValueError, match="disagree"):
        shared_experts([counts[0], ExpertCounts(NUM_CLASSES, NUM_LAYERS, 8)], n=2)
    with pytest.raises(ValueError, match="RoutingMass for"):
        shared_experts(counts, n=5, mass_by_dataset=[RoutingMass(NUM_CLASSES, NUM_LAYERS,
                                                                 NUM_EXPERTS)])
    with pytest.raises(ValueError, match="router logits must be"):
        RoutingMass(NUM_CLASSES, NUM_LAYERS, NUM_EXPERTS).update(np.zeros((3, 2, 32)),
                                                                 np.zeros(3, int))


# ---------------------------------------------------------------- set-size x layer sweep


def test_top_n_sweep_table(planted):
    counts = [_counts(d) for d in planted]
    transfer = [(d["logits"], d["segments"], d["labels"]) for d in planted]
    rows = top_n_sweep(counts, ns=[2, 5], layers=[None, 0, PLANTED_LAYER],
                       transfer_data=transfer, behaviours=["a", "b", "c", "d"])
    assert len(rows) == 2 * 3 * NUM_CLASSES
    assert set(rows[0]) == {"n", "layer", "behaviour", "jaccard", "auc"}
    table = {(r["n"], r["layer"], r["behaviour"]): r for r in rows}
    for name in "abcd":
        assert table[5, PLANTED_LAYER, name]["jaccard"] == pytest.approx(4 / 6)
        assert table[5, PLANTED_LAYER, name]["auc"] > 0.9
        assert table[5, 0, name]["jaccard"] < 0.5  # a noise layer is not stable...
        assert abs(table[5, 0, name]["auc"] - 0.5) < 0.15  # ...and does not transfer

    # Independent: the AUC cell from top_n_experts + transfer_auc over ordered pairs.
    sets = [top_n_experts(c.risk_difference(), 2, PLANTED_LAYER) for c in counts]
    direct = np.mean([
        transfer_auc(sets[s], *transfer[t])[1]
        for s, t in itertools.permutations(range(NUM_DATASETS), 2)
    ])
    assert table[2, PLANTED_LAYER, "b"]["auc"] == pytest.approx(direct, abs=1e-12)

    no_auc = top_n_sweep(counts, ns=[3])
    assert len(no_auc) == (1 + NUM_LAYERS) * NUM_CLASSES and no_auc[0]["layer"] is None
    assert all(np.isnan(r["auc"]) for r in no_auc)


def test_top_n_sweep_rejects_malformed_input(planted):
    counts = [_counts(d) for d in planted]
    with pytest.raises(ValueError, match="at least 2 datasets"):
        top_n_sweep(counts[:1], ns=[2])
    with pytest.raises(ValueError, match=r"n \[33\] outside \[1, 32\] for layer 0"):
        top_n_sweep(counts, ns=[2, 33], layers=[None, 0])
    with pytest.raises(ValueError, match="transfer datasets"):
        top_n_sweep(counts, ns=[2], transfer_data=[(planted[0]["logits"],
                                                    planted[0]["segments"],
                                                    planted[0]["labels"])])


# ---------------------------------------------------------------- random control sets


def _masks(num_experts, activate=(), suppress=()):
    a, s = np.zeros(num_experts, bool), np.zeros(num_experts, bool)
    a[list(activate)], s[list(suppress)] = True, True
    return a, s


def test_random_control_sets_disjoint_equal_size_deterministic():
    num_experts = 16
    chosen = {3: _masks(num_experts, [1, 2], [5, 6, 7]), 7: _masks(num_experts, [], range(8))}
    draws = [random_expert_sets_like(chosen, num_experts, seed=s, disjoint_from=chosen)
             for s in (0, 0, 1)]
    for layer, (activate, suppress) in chosen.items():
        ra, rs = draws[0][layer]
        assert (ra.sum(), rs.sum()) == (activate.sum(), suppress.sum())
        assert not ((ra | rs) & (activate | suppress)).any()  # disjoint from the chosen set
        assert ra.shape == (num_experts,)  # routed experts only: no shared-expert slot
        validate_expert_sets(ra, rs, num_experts, k=4)
        np.testing.assert_array_equal(draws[1][layer][0], ra)  # same seed, same sets
        np.testing.assert_array_equal(draws[1][layer][1], rs)
    assert any((draws[2][layer][1] != draws[0][layer][1]).any() for layer in chosen)

    # A plain mask also works, and layers absent from disjoint_from avoid nothing.
    avoid = np.zeros(num_experts, bool)
    avoid[:12] = True
    ra, rs = random_expert_sets_like({0: _masks(num_experts, [0], [1, 2])}, num_experts, 5,
                                     disjoint_from={0: avoid})[0]
    assert set(np.flatnonzero(ra | rs)) <= set(range(12, 16))


def test_random_control_sets_default_is_unchanged():
    """Without disjoint_from the draw is the original one: a permutation of all E experts
    per layer, in ascending layer order, from default_rng(seed)."""
    num_experts = 16
    chosen = {4: _masks(num_experts, [1], [2, 3]), 0: _masks(num_experts, [9, 10], [])}
    rng = np.random.default_rng(7)
    expected = {}
    for layer in sorted(chosen):
        n_a, n_s = int(chosen[layer][0].sum()), int(chosen[layer][1].sum())
        order = rng.permutation(num_experts)[: n_a + n_s]
        expected[layer] = _masks(num_experts, order[:n_a], order[n_a:])
    got = random_expert_sets_like(chosen, num_experts, seed=7)
    for layer in chosen:
        np.testing.assert_array_equal(got[layer][0], expected[layer][0])
        np.testing.assert_array_equal(got[layer][1], expected[layer][1])


def test_random_control_sets_reject_malformed_input():
    num_experts = 16
    chosen = {2: _masks(num_experts, [], range(10))}
    with pytest.raises(ValueError, match="layer 2: need 10 random experts .* only 6 of 16"):
        random_expert_sets_like(chosen, num_experts, seed=0, disjoint_from=chosen)
    with pytest.raises(ValueError, match=r"activate mask must have shape \(16,\)"):
        random_expert_sets_like({0: (np.zeros(8, bool), np.zeros(16, bool))}, num_experts, 0)
    with pytest.raises(ValueError, match="disjoint_from layer 0: masks must be bool"):
        random_expert_sets_like({0: _masks(num_experts, [1])}, num_experts, 0,
                                disjoint_from={0: np.zeros(8, bool)})
