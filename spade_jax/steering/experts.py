"""Identify: which experts go with which behaviour, and does the association transfer?

Risk difference (paper eq. 4) per behaviour b, layer l, expert e, over labelled tokens:

    RD[b, l, e] = P(e selected at l | behaviour b) - P(e selected at l)

subtracting the dataset's own baseline expert usage. SteerMoE's two-set contrast instead
uses ``P(selected | b) - P(selected | not b)``. Both come from one table of selection counts
that can be accumulated chunk by chunk from telemetry (:class:`ExpertCounts`).

Transfer checks: Jaccard of Top-n sets across datasets against a label-permutation null, and
transfer AUC -- rank the target dataset's segments by the routing mass the *source* Top-n
set receives, and ask how well that separates behaviour-b segments (Mann-Whitney AUC).

The paper's full Identify protocol on top: profile correlations of one behaviour across
datasets vs across behaviours (:func:`profile_correlations`), Jaccard over any number of
datasets with its permutation null (:func:`multi_dataset_jaccard`), the experts every
dataset shares and the routing they carry (:func:`shared_experts`, :class:`RoutingMass`),
and the set-size x layer table of Jaccard and transfer AUC (:func:`top_n_sweep`).

Legend: ``N`` tokens, ``L`` layers, ``E`` experts, ``k`` selected per token, ``C`` classes,
``S`` segments.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import numpy as np

ExpertSet = frozenset[tuple[int, int]]  # (layer, expert) pairs


@dataclasses.dataclass
class ExpertCounts:
    """Selection counts by behaviour: ``selected_cle[c, l, e]`` and ``tokens_c[c]``.

    Tokens with label < 0 (unlabelled) are skipped. ``update`` can be called once per
    telemetry chunk, so a whole corpus never has to sit in memory.
    """

    num_classes: int
    num_layers: int
    num_experts: int
    selected_cle: np.ndarray = dataclasses.field(init=False)
    tokens_c: np.ndarray = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        if min(self.num_classes, self.num_layers, self.num_experts) < 1:
            raise ValueError(f"all sizes must be >= 1, got {self}")
        shape = (self.num_classes, self.num_layers, self.num_experts)
        self.selected_cle = np.zeros(shape, np.int64)
        self.tokens_c = np.zeros(self.num_classes, np.int64)

    def update(self, selected_nlk: np.ndarray, labels_n: np.ndarray) -> ExpertCounts:
        selected = np.asarray(selected_nlk)
        labels = np.asarray(labels_n)
        if selected.ndim != 3 or selected.shape[:2] != (labels.shape[0], self.num_layers):
            raise ValueError(
                f"selected must be [N, L={self.num_layers}, k] with N={labels.shape[0]} "
                f"(labels), got {selected.shape}"
            )
        if selected.size and (selected.min() < 0 or selected.max() >= self.num_experts):
            raise ValueError(f"expert indices must be in [0, {self.num_experts})")
        if labels.size and labels.max() >= self.num_classes:
            raise ValueError(f"labels must be < num_classes={self.num_classes}")
        keep = labels >= 0
        selected, labels = selected[keep], labels[keep]
        layer_1l1 = np.arange(self.num_layers)[None, :, None]
        flat = (labels[:, None, None] * self.num_layers + layer_1l1) * self.num_experts + selected
        self.selected_cle += np.bincount(flat.ravel(), minlength=self.selected_cle.size).reshape(
            self.selected_cle.shape
        )
        self.tokens_c += np.bincount(labels, minlength=self.num_classes)
        return self

    def _check_nonempty(self) -> None:
        empty = np.flatnonzero(self.tokens_c == 0)
        if empty.size:
            raise ValueError(f"behaviour class(es) {empty.tolist()} have no labelled tokens")

    def risk_difference(self) -> np.ndarray:
        """``[C, L, E]``: P(selected | b) - P(selected) over all labelled tokens."""
        self._check_nonempty()
        p_given_b = self.selected_cle / self.tokens_c[:, None, None]
        p_overall = self.selected_cle.sum(axis=0) / self.tokens_c.sum()
        return p_given_b - p_overall[None]

    def contrast_difference(self) -> np.ndarray:
        """``[C, L, E]``: P(selected | b) - P(selected | not b) (SteerMoE's two-set form)."""
        self._check_nonempty()
        rest_tokens_c = self.tokens_c.sum() - self.tokens_c
        if (rest_tokens_c == 0).any():
            raise ValueError("contrast needs tokens outside every behaviour; only one class seen")
        rest_cle = self.selected_cle.sum(axis=0)[None] - self.selected_cle
        return (
            self.selected_cle / self.tokens_c[:, None, None]
            - rest_cle / rest_tokens_c[:, None, None]
        )


def risk_difference(
    selected_nlk: np.ndarray, labels_n: np.ndarray, num_experts: int, num_classes: int
) -> np.ndarray:
    """``[C, L, E]`` risk difference from one in-memory array of selections."""
    counts = ExpertCounts(num_classes, np.asarray(selected_nlk).shape[1], num_experts)
    return counts.update(selected_nlk, labels_n).risk_difference()


def top_n_experts(scores_cle: np.ndarray, n: int, layer: int | None = None) -> list[ExpertSet]:
    """Per behaviour, the ``n`` (layer, expert) pairs with the highest score.

    With ``layer`` given, only that layer's experts compete (the paper's Top-10 at L12/L36).
    """
    scores = np.asarray(scores_cle, np.float64)
    if scores.ndim != 3:
        raise ValueError(f"scores must be [C, L, E], got {scores.shape}")
    if np.isnan(scores).any():
        raise ValueError("scores contain NaN")
    num_layers, num_experts = scores.shape[1:]
    if layer is not None and not 0 <= layer < num_layers:
        raise ValueError(f"layer must be in [0, {num_layers}), got {layer}")
    candidates = num_experts if layer is not None else num_layers * num_experts
    if not 1 <= n <= candidates:
        raise ValueError(f"n must be in [1, {candidates}], got {n}")
    sets = []
    for scores_le in scores:
        if layer is not None:
            order = np.argsort(-scores_le[layer], kind="stable")[:n]
            sets.append(frozenset((layer, int(e)) for e in order))
        else:
            order = np.argsort(-scores_le.ravel(), kind="stable")[:n]
            sets.append(frozenset((int(i // num_experts), int(i % num_experts)) for i in order))
    return sets


def jaccard(a: Iterable, b: Iterable) -> float:
    a, b = set(a), set(b)
    if not a and not b:
        raise ValueError("Jaccard of two empty sets is undefined")
    return len(a & b) / len(a | b)


def permute_labels(labels_n: np.ndarray, groups_n: np.ndarray | None, rng: np.random.Generator) -> np.ndarray:
    """Shuffles labels across tokens, or across whole groups (segments) when given."""
    labels = np.asarray(labels_n)
    if groups_n is None:
        return rng.permutation(labels)
    unique, first, inverse = np.unique(np.asarray(groups_n), return_index=True, return_inverse=True)
    group_labels = labels[first]
    if (group_labels[inverse.reshape(-1)] != labels).any():
        raise ValueError("every token of a group must carry the same label")
    return rng.permutation(group_labels)[inverse.reshape(-1)]


class JaccardResult(NamedTuple):
    per_class: np.ndarray  # [C] observed Jaccard of the two datasets' Top-n sets
    mean: float
    null_mean: float  # mean over permutations of the mean Jaccard
    p_value: float  # (1 + #null >= observed) / (1 + permutations)


def cross_dataset_jaccard(
    dataset_a: tuple[np.ndarray, np.ndarray],
    dataset_b: tuple[np.ndarray, np.ndarray],
    num_experts: int,
    num_classes: int,
    n: int = 10,
    layer: int | None = None,
    num_permutations: int = 200,
    seed: int = 0,
    groups: tuple[np.ndarray | None, np.ndarray | None] = (None, None),
) -> JaccardResult:
    """Jaccard of risk-difference Top-n sets between two datasets ``(selected_nlk, labels_n)``
    with a null from shuffling labels (per segment when ``groups`` are given) in both.

    The two-dataset case of :func:`multi_dataset_jaccard` (same numbers for the same seed).
    """
    result = multi_dataset_jaccard(
        [dataset_a, dataset_b], num_experts, num_classes, n=n, layer=layer,
        num_permutations=num_permutations, seed=seed, groups=list(groups),
    )
    return JaccardResult(result.per_class, result.mean, result.null_mean, result.p_value)


def rank_auc(scores: np.ndarray, is_positive: np.ndarray) -> float:
    """ROC AUC via the Mann-Whitney U statistic, ties counted as one half."""
    scores = np.asarray(scores, np.float64)
    positive = np.asarray(is_positive, bool)
    if scores.shape != positive.shape or scores.ndim != 1:
        raise ValueError(f"need equal 1-D arrays, got {scores.shape}, {positive.shape}")
    num_pos, num_neg = int(positive.sum()), int((~positive).sum())
    if num_pos == 0 or num_neg == 0:
        raise ValueError(f"AUC needs both classes, got {num_pos} positive, {num_neg} negative")
    order = np.argsort(scores, kind="stable")
    sorted_scores = scores[order]
    # Average 1-based rank within each run of tied scores.
    _, run_start, run_length = np.unique(sorted_scores, return_index=True, return_counts=True)
    run_rank = run_start + (run_length + 1) / 2.0
    ranks = np.empty_like(scores)
    ranks[order] = np.repeat(run_rank, run_length)
    u_statistic = ranks[positive].sum() - num_pos * (num_pos + 1) / 2.0
    return float(u_statistic / (num_pos * num_neg))


def segment_routing_mass(
    router_logits_nlE: np.ndarray, token_segment_ids_n: np.ndarray, expert_set: ExpertSet
) -> tuple[np.ndarray, np.ndarray]:
    """Per segment, the mean over its tokens of the router probability mass on ``expert_set``.

    Returns ``(segment_ids [S], mass [S])`` with segments in ascending id order.
    """
    logits = np.asarray(router_logits_nlE, np.float64)
    if not expert_set:
        raise ValueError("expert_set is empty")
    layers = sorted({layer for layer, _ in expert_set})
    mass_n = np.zeros(logits.shape[0])
    for layer in layers:
        z = logits[:, layer, :]
        probs = np.exp(z - z.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
        experts = [e for l_, e in expert_set if l_ == layer]
        mass_n += probs[:, experts].sum(axis=1)
    segment_ids, inverse = np.unique(np.asarray(token_segment_ids_n), return_inverse=True)
    inverse = inverse.reshape(-1)
    totals = np.bincount(inverse, weights=mass_n)
    return segment_ids, totals / np.bincount(inverse)


def transfer_auc(
    source_sets: Sequence[ExpertSet],
    target_router_logits_nlE: np.ndarray,
    target_segment_ids_n: np.ndarray,
    target_labels_n: np.ndarray,
) -> np.ndarray:
    """``[C]`` AUC per behaviour: do the source Top-n experts rank target segments of that
    behaviour above the rest? (paper, L36: mean 0.768, reflection 0.863, execution 0.631)."""
    labels = np.asarray(target_labels_n)
    labelled = labels >= 0  # unlabelled segments are neither positives nor negatives
    logits = np.asarray(target_router_logits_nlE)[labelled]
    segment_ids = np.asarray(target_segment_ids_n)[labelled]
    _, first = np.unique(segment_ids, return_index=True)
    segment_labels = labels[labelled][first]
    aucs = np.empty(len(source_sets))
    for c, expert_set in enumerate(source_sets):
        _, mass = segment_routing_mass(logits, segment_ids, expert_set)
        aucs[c] = rank_auc(mass, segment_labels == c)
    return aucs


# ---------------------------------------------------------------- the paper's Identify protocol
#
# Paper numbers these reproduce (Qwen3-30B-A3B, six datasets): same-behaviour profile
# correlation 0.729 vs -0.107 across behaviours (L12); Top-10 Jaccard across datasets 0.511
# vs 0.202 under the label-permutation null; six of the Top-10 experts of planning,
# reflection and conclusion shared by all six datasets, carrying 15-23% of the routing mass;
# source -> target transfer AUC 0.768 at L36.


def _as_scores(scores_or_counts: np.ndarray | ExpertCounts) -> np.ndarray:
    if isinstance(scores_or_counts, ExpertCounts):
        return scores_or_counts.risk_difference()
    scores = np.asarray(scores_or_counts, np.float64)
    if scores.ndim != 3:
        raise ValueError(f"scores must be [C, L, E], got {scores.shape}")
    return scores


def _check_same_shapes(shapes: Sequence[tuple[int, ...]], names: Sequence[object]) -> None:
    if len(set(shapes)) != 1:
        listed = ", ".join(f"{name}: {shape}" for name, shape in zip(names, shapes, strict=True))
        raise ValueError(f"datasets disagree on [C, L, E]: {listed}")


def _shape_of(table: ExpertCounts | RoutingMass) -> tuple[int, int, int]:
    return table.num_classes, table.num_layers, table.num_experts


def _check_layer(layer: int | None, num_layers: int) -> None:
    if layer is not None and not 0 <= layer < num_layers:
        raise ValueError(f"layer must be in [0, {num_layers}), got {layer}")


@dataclasses.dataclass(frozen=True)
class ProfileCorrelations:
    """Pearson correlations between behaviour expert profiles.

    Attributes:
      rows: one dict per unordered pair of distinct (behaviour, dataset) profiles, with keys
        ``behaviour_a, dataset_a, behaviour_b, dataset_b, r``; profiles are ordered
        dataset-major (every behaviour of the first dataset, then the second, ...).
      same_behaviour_mean: mean r over pairs of one behaviour on two different datasets
        (paper, L12: 0.729).
      cross_behaviour_mean: mean r over pairs of two different behaviours on two different
        datasets (paper: -0.107).
      cross_behaviour_within_dataset_mean: mean r over two different behaviours on the same
        dataset. Kept apart because risk differences of one dataset are tied together --
        their token-weighted sum over behaviours is zero at every (layer, expert) -- which
        pushes these correlations negative by construction (about -1/(C-1) without signal).
    """

    rows: tuple[dict[str, object], ...]
    same_behaviour_mean: float
    cross_behaviour_mean: float
    cross_behaviour_within_dataset_mean: float


def profile_correlations(
    scores_by_dataset: Mapping[str, np.ndarray | ExpertCounts],
    behaviours: Sequence[str] | None = None,
    layer: int | None = None,
) -> ProfileCorrelations:
    """Correlates expert profiles of behaviours across datasets.

    A behaviour's profile on one dataset is its risk-difference vector over all ``L x E``
    (layer, expert) pairs (``layer`` given: that layer's ``E`` experts only). High r between
    one behaviour's profiles on different datasets, and r near zero between different
    behaviours, says the behaviour -> expert association is a property of the model rather
    than of one dataset.

    Args:
      scores_by_dataset: dataset name -> ``[C, L, E]`` scores (e.g. risk difference) or an
        :class:`ExpertCounts`, whose risk difference is used. At least two datasets, all of
        one shape.
      behaviours: ``C`` names for the rows (default: class indices).
      layer: restrict profiles to one layer (the paper's profiles are at L12).
    """
    if len(scores_by_dataset) < 2:
        raise ValueError(f"need at least 2 datasets, got {len(scores_by_dataset)}")
    names = list(scores_by_dataset)
    scores = [_as_scores(scores_by_dataset[name]) for name in names]
    _check_same_shapes([s.shape for s in scores], names)
    num_classes, num_layers, _ = scores[0].shape
    if num_classes < 2:
        raise ValueError(f"need at least 2 behaviours to compare across, got {num_classes}")
    labels = list(range(num_classes)) if behaviours is None else list(behaviours)
    if len(labels) != num_classes:
        raise ValueError(f"{len(labels)} behaviour names for {num_classes} score classes")
    _check_layer(layer, num_layers)
    if any(np.isnan(s).any() for s in scores):
        raise ValueError("scores contain NaN")
    profiles_pf = np.stack(
        [(s[:, layer, :] if layer is not None else s.reshape(num_classes, -1)) for s in scores]
    ).reshape(len(names) * num_classes, -1)
    keys = [(labels[c], name) for name in names for c in range(num_classes)]
    centred_pf = profiles_pf - profiles_pf.mean(axis=1, keepdims=True)
    norm_p = np.sqrt((centred_pf**2).sum(axis=1))
    flat = np.flatnonzero(norm_p <= 1e-12 * (1 + np.abs(profiles_pf).max(axis=1)))
    if flat.size:
        raise ValueError(
            f"constant profile(s) {[keys[i] for i in flat]}: Pearson r is undefined"
        )
    unit_pf = centred_pf / norm_p[:, None]
    r_pp = np.clip(unit_pf @ unit_pf.T, -1.0, 1.0)
    rows, same, cross, within = [], [], [], []
    for i, j in itertools.combinations(range(len(keys)), 2):
        (b_a, d_a), (b_b, d_b) = keys[i], keys[j]
        r = float(r_pp[i, j])
        rows.append(dict(behaviour_a=b_a, dataset_a=d_a, behaviour_b=b_b, dataset_b=d_b, r=r))
        if b_a == b_b:
            same.append(r)  # same behaviour, so necessarily different datasets
        elif d_a != d_b:
            cross.append(r)
        else:
            within.append(r)
    return ProfileCorrelations(
        tuple(rows), float(np.mean(same)), float(np.mean(cross)), float(np.mean(within))
    )


@dataclasses.dataclass(frozen=True)
class MultiJaccardResult:
    """Top-n Jaccard across D datasets against a label-permutation null.

    Attributes:
      pairs: the ``P = D (D-1) / 2`` dataset index pairs ``(i, j)``, ``i < j``.
      per_pair_pc: ``[P, C]`` observed Jaccard of the two datasets' Top-n sets per behaviour.
      per_class: ``[C]`` mean over pairs.
      mean: the statistic: mean over pairs and behaviours (paper: 0.511).
      null_mean, null_std: mean and (population) std of that statistic over permutations
        (paper null mean: 0.202).
      p_value: ``(1 + #{null >= observed}) / (1 + num_permutations)``.
      num_permutations: how many label permutations the null holds.
    """

    pairs: tuple[tuple[int, int], ...]
    per_pair_pc: np.ndarray
    per_class: np.ndarray
    mean: float
    null_mean: float
    null_std: float
    p_value: float
    num_permutations: int


def _pairwise_top_n_jaccard(
    scores: Sequence[np.ndarray], n: int, layer: int | None
) -> np.ndarray:
    """``[P, C]`` Jaccard of Top-n sets for every dataset pair ``i < j``."""
    sets = [top_n_experts(s, n, layer) for s in scores]
    return np.array([
        [jaccard(a, b) for a, b in zip(sets[i], sets[j], strict=True)]
        for i, j in itertools.combinations(range(len(sets)), 2)
    ])


def multi_dataset_jaccard(
    datasets: Sequence[tuple[np.ndarray, np.ndarray]],
    num_experts: int,
    num_classes: int,
    n: int = 10,
    layer: int | None = None,
    num_permutations: int = 200,
    seed: int = 0,
    groups: Sequence[np.ndarray | None] | None = None,
) -> MultiJaccardResult:
    """Mean pairwise Jaccard of risk-difference Top-n sets over ``D >= 2`` datasets, with a
    permutation p-value.

    Why a null: with ``n`` of ``L x E`` experts chosen, two sets overlap somewhat by chance
    and more so when a few experts are busy everywhere; shuffling labels keeps that
    structure and destroys only the behaviour -> expert link.

    Args:
      datasets: per dataset ``(selected_nlk, labels_n)``; labels < 0 are unlabelled.
      n, layer: Top-n size; ``layer`` restricts the competition to one layer.
      num_permutations, seed: the null -- each permutation shuffles every dataset's labels
        (in dataset order, from one ``np.random.default_rng(seed)``), within the dataset and
        by whole group when ``groups[d]`` (segment ids ``[N_d]``) is given, as
        :func:`permute_labels` does.
      groups: per dataset segment ids or None (token-level shuffling); default all None.
    """
    if len(datasets) < 2:
        raise ValueError(f"need at least 2 datasets, got {len(datasets)}")
    if num_permutations < 1:
        raise ValueError(f"num_permutations must be >= 1, got {num_permutations}")
    groups = [None] * len(datasets) if groups is None else list(groups)
    if len(groups) != len(datasets):
        raise ValueError(f"{len(groups)} group arrays for {len(datasets)} datasets")
    selected = [np.asarray(s) for s, _ in datasets]
    labels = [np.asarray(lab) for _, lab in datasets]
    for d, (sel, lab, grp) in enumerate(zip(selected, labels, groups, strict=True)):
        if sel.ndim != 3 or lab.shape != (sel.shape[0],):
            raise ValueError(
                f"dataset {d}: need selected [N, L, k] and labels [N], got {sel.shape}, "
                f"{lab.shape}")
        if grp is not None and np.shape(grp) != lab.shape:
            raise ValueError(f"dataset {d}: groups {np.shape(grp)} do not match labels "
                             f"{lab.shape}")
    num_layers = {sel.shape[1] for sel in selected}
    if len(num_layers) != 1:
        raise ValueError(f"datasets disagree on the number of layers: {sorted(num_layers)}")
    num_layers = num_layers.pop()
    _check_layer(layer, num_layers)
    candidates = num_experts if layer is not None else num_layers * num_experts
    if not 1 <= n <= candidates:
        raise ValueError(f"n must be in [1, {candidates}], got {n}")

    def rd(sel: np.ndarray, lab: np.ndarray) -> np.ndarray:
        return ExpertCounts(num_classes, num_layers, num_experts).update(sel, lab).risk_difference()

    per_pair = _pairwise_top_n_jaccard([rd(s, lab) for s, lab in zip(selected, labels, strict=True)], n, layer)
    observed = float(per_pair.mean())
    rng = np.random.default_rng(seed)
    null = np.empty(num_permutations)
    for i in range(num_permutations):
        shuffled = [permute_labels(lab, grp, rng) for lab, grp in zip(labels, groups, strict=True)]
        null[i] = _pairwise_top_n_jaccard(
            [rd(s, lab) for s, lab in zip(selected, shuffled, strict=True)], n, layer).mean()
    p_value = (1 + np.sum(null >= observed)) / (1 + num_permutations)
    return MultiJaccardResult(
        pairs=tuple(itertools.combinations(range(len(datasets)), 2)),
        per_pair_pc=per_pair,
        per_class=per_pair.mean(axis=0),
        mean=observed,
        null_mean=float(null.mean()),
        null_std=float(null.std()),
        p_value=float(p_value),
        num_permutations=num_permutations,
    )


def _softmax_last(logits: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, np.float64)
    probs = np.exp(z - z.max(axis=-1, keepdims=True))
    return probs / probs.sum(axis=-1, keepdims=True)


@dataclasses.dataclass
class RoutingMass:
    """Router probability mass by behaviour: ``mass_cle[c, l, e]`` is the sum over tokens of
    class ``c`` of ``softmax(router_logits[t, l])[e]``; ``tokens_c[c]`` counts those tokens.

    The probability-weighted companion of :class:`ExpertCounts` (which counts top-k
    selections), accumulated chunk by chunk the same way; labels < 0 are skipped.
    """

    num_classes: int
    num_layers: int
    num_experts: int
    mass_cle: np.ndarray = dataclasses.field(init=False)
    tokens_c: np.ndarray = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        if min(self.num_classes, self.num_layers, self.num_experts) < 1:
            raise ValueError(f"all sizes must be >= 1, got {self}")
        self.mass_cle = np.zeros((self.num_classes, self.num_layers, self.num_experts))
        self.tokens_c = np.zeros(self.num_classes, np.int64)

    def update(self, router_logits_nlE: np.ndarray, labels_n: np.ndarray) -> RoutingMass:
        logits = np.asarray(router_logits_nlE)
        labels = np.asarray(labels_n)
        expected = (labels.shape[0], self.num_layers, self.num_experts)
        if labels.ndim != 1 or logits.shape != expected:
            raise ValueError(f"router logits must be [N, L, E] = {expected}, got {logits.shape}")
        if labels.size and labels.max() >= self.num_classes:
            raise ValueError(f"labels must be < num_classes={self.num_classes}")
        keep = labels >= 0
        probs_nle = _softmax_last(logits[keep])
        one_hot_nc = np.eye(self.num_classes)[labels[keep]]
        self.mass_cle += np.einsum("nc,nle->cle", one_hot_nc, probs_nle)
        self.tokens_c += np.bincount(labels[keep], minlength=self.num_classes)
        return self


@dataclasses.dataclass(frozen=True)
class SharedExperts:
    """A behaviour's experts found in the Top-n set of every dataset.

    Attributes:
      behaviour: the class index.
      experts: the (layer, expert) pairs in every dataset's Top-n set.
      layers: the layers the shares are taken over (the ``layer`` of the Top-n competition,
        else all layers).
      selection_share_d: ``[D]`` per dataset, of all top-k selections that the behaviour's
        tokens make on ``layers``, the fraction that land on ``experts``.
      mass_share_d: ``[D]`` per dataset, of all router probability mass of the behaviour's
        tokens on ``layers`` (one per token and layer), the fraction on ``experts``: the
        token-weighted mean over the behaviour's tokens of ``sum_{(l,e) in experts} p_le``
        divided by ``len(layers)`` (paper: 15-23% for six shared Top-10 experts at one
        layer). None when no :class:`RoutingMass` was given.
      chance_share: either share under uniform routing, ``|experts| / (len(layers) * E)``.
    """

    behaviour: int
    experts: ExpertSet
    layers: tuple[int, ...]
    selection_share_d: np.ndarray
    mass_share_d: np.ndarray | None
    chance_share: float


def shared_experts(
    counts_by_dataset: Sequence[ExpertCounts],
    n: int,
    layer: int | None = None,
    mass_by_dataset: Sequence[RoutingMass] | None = None,
) -> list[SharedExperts]:
    """Per behaviour, the experts every dataset puts in its risk-difference Top-n set, and
    how much of the behaviour's routing they carry on each dataset.

    A set that recurs on every dataset and carries well above ``chance_share`` of the
    behaviour's routing is a candidate for steering that does not hinge on one domain.

    Args:
      counts_by_dataset: one :class:`ExpertCounts` per dataset (``D >= 2``, one shape).
      n, layer: Top-n size and optional single competing layer, as in :func:`top_n_experts`.
      mass_by_dataset: optional :class:`RoutingMass` per dataset (same shapes) for the
        probability-mass share; without it only the selection share is reported.
    """
    if len(counts_by_dataset) < 2:
        raise ValueError(f"need at least 2 datasets, got {len(counts_by_dataset)}")
    _check_same_shapes([_shape_of(c) for c in counts_by_dataset], range(len(counts_by_dataset)))
    num_classes, num_layers, num_experts = _shape_of(counts_by_dataset[0])
    if mass_by_dataset is not None:
        if len(mass_by_dataset) != len(counts_by_dataset):
            raise ValueError(f"{len(mass_by_dataset)} RoutingMass for "
                             f"{len(counts_by_dataset)} datasets")
        for d, mass in enumerate(mass_by_dataset):
            if _shape_of(mass) != _shape_of(counts_by_dataset[0]):
                raise ValueError(f"dataset {d}: RoutingMass is {_shape_of(mass)}, counts are "
                                 f"{_shape_of(counts_by_dataset[0])}")
            if (mass.tokens_c == 0).any():
                raise ValueError(f"dataset {d}: RoutingMass has behaviour(s) with no tokens "
                                 f"{np.flatnonzero(mass.tokens_c == 0).tolist()}")
    _check_layer(layer, num_layers)
    sets_dc = [top_n_experts(c.risk_difference(), n, layer) for c in counts_by_dataset]
    layers = (layer,) if layer is not None else tuple(range(num_layers))
    results = []
    for b in range(num_classes):
        common: ExpertSet = frozenset.intersection(*(sets[b] for sets in sets_dc))
        idx_l = np.array([l_ for l_, _ in sorted(common)], int)
        idx_e = np.array([e for _, e in sorted(common)], int)

        def share(table_cle: np.ndarray, b: int = b, idx_l=idx_l, idx_e=idx_e) -> float:
            total = table_cle[b, list(layers)].sum()
            return float(table_cle[b, idx_l, idx_e].sum() / total) if total > 0 else 0.0

        selection = np.array([share(c.selected_cle) for c in counts_by_dataset])
        mass = (None if mass_by_dataset is None
                else np.array([share(m.mass_cle) for m in mass_by_dataset]))
        results.append(SharedExperts(
            behaviour=b, experts=common, layers=layers, selection_share_d=selection,
            mass_share_d=mass, chance_share=len(common) / (len(layers) * num_experts),
        ))
    return results


class _TransferTarget:
    """A target dataset prepared once for many transfer AUCs: router probabilities of its
    labelled tokens, their segment index, and each segment's label."""

    def __init__(self, router_logits_nlE, segment_ids_n, labels_n) -> None:
        labels = np.asarray(labels_n)
        logits = np.asarray(router_logits_nlE)
        segment_ids = np.asarray(segment_ids_n)
        if logits.ndim != 3 or labels.shape != (logits.shape[0],) or segment_ids.shape != labels.shape:
            raise ValueError(f"need logits [N, L, E], segment ids [N], labels [N]; got "
                             f"{logits.shape}, {segment_ids.shape}, {labels.shape}")
        labelled = labels >= 0
        self.probs_nle = _softmax_last(logits[labelled])
        _, first, inverse = np.unique(segment_ids[labelled], return_index=True,
                                      return_inverse=True)
        self.inverse_n = inverse.reshape(-1)
        self.tokens_s = np.bincount(self.inverse_n)
        self.labels_s = labels[labelled][first]

    def auc(self, expert_set: ExpertSet, behaviour: int) -> float:
        layers = [l_ for l_, _ in expert_set]
        experts = [e for _, e in expert_set]
        mass_n = self.probs_nle[:, layers, experts].sum(axis=1)
        mass_s = np.bincount(self.inverse_n, weights=mass_n) / self.tokens_s
        return rank_auc(mass_s, self.labels_s == behaviour)


def top_n_sweep(
    counts_by_dataset: Sequence[ExpertCounts],
    ns: Sequence[int],
    layers: Sequence[int | None] | None = None,
    transfer_data: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None,
    behaviours: Sequence[str] | None = None,
) -> list[dict[str, object]]:
    """The paper's set-size / layer sweep as a tidy table: how stable and how transferable
    a behaviour's Top-n set is as ``n`` and the competing layer change.

    One row per ``(n, layer, behaviour)`` with keys ``n, layer, behaviour, jaccard, auc``:

    - ``jaccard``: mean over dataset pairs ``i < j`` of the Jaccard of their risk-difference
      Top-n sets (:func:`top_n_experts`).
    - ``auc``: mean over ordered pairs ``source != target`` of :func:`transfer_auc` of the
      source's Top-n set on the target; NaN when ``transfer_data`` is None.

    Args:
      counts_by_dataset: one :class:`ExpertCounts` per dataset (``D >= 2``, one shape).
      ns: set sizes; each must fit every swept layer (``n <= E`` per layer, ``<= L E``).
      layers: competing layers; None in the list means all layers compete (default: None
        then every layer).
      transfer_data: per dataset ``(router_logits_nlE, segment_ids_n, labels_n)``, aligned
        with ``counts_by_dataset``; every target needs segments of every behaviour and
        some of other behaviours.
      behaviours: ``C`` names for the ``behaviour`` column (default: class indices).
    """
    if len(counts_by_dataset) < 2:
        raise ValueError(f"need at least 2 datasets, got {len(counts_by_dataset)}")
    shapes = [(c.num_classes, c.num_layers, c.num_experts) for c in counts_by_dataset]
    _check_same_shapes(shapes, range(len(shapes)))
    num_classes, num_layers, num_experts = shapes[0]
    labels = list(range(num_classes)) if behaviours is None else list(behaviours)
    if len(labels) != num_classes:
        raise ValueError(f"{len(labels)} behaviour names for {num_classes} classes")
    layers = [None, *range(num_layers)] if layers is None else list(layers)
    if not ns or not layers:
        raise ValueError("ns and layers must be non-empty")
    for layer in layers:
        _check_layer(layer, num_layers)
        candidates = num_experts if layer is not None else num_layers * num_experts
        bad = [n for n in ns if not 1 <= n <= candidates]
        if bad:
            where = f"layer {layer}" if layer is not None else "all layers"
            raise ValueError(f"n {bad} outside [1, {candidates}] for {where}")
    targets = None
    if transfer_data is not None:
        if len(transfer_data) != len(counts_by_dataset):
            raise ValueError(f"{len(transfer_data)} transfer datasets for "
                             f"{len(counts_by_dataset)} count tables")
        targets = [_TransferTarget(*data) for data in transfer_data]
        for d, target in enumerate(targets):
            if target.probs_nle.shape[1:] != (num_layers, num_experts):
                raise ValueError(f"transfer dataset {d}: logits [N, L, E] with L, E = "
                                 f"{target.probs_nle.shape[1:]}, counts have "
                                 f"{(num_layers, num_experts)}")
    scores = [c.risk_difference() for c in counts_by_dataset]
    pairs = list(itertools.combinations(range(len(scores)), 2))
    rows = []
    for n in ns:
        for layer in layers:
            sets_dc = [top_n_experts(s, n, layer) for s in scores]
            for b in range(num_classes):
                jac = float(np.mean([jaccard(sets_dc[i][b], sets_dc[j][b]) for i, j in pairs]))
                auc = float("nan")
                if targets is not None:
                    auc = float(np.mean([
                        targets[t].auc(sets_dc[s][b], b)
                        for s, t in itertools.permutations(range(len(targets)), 2)
                    ]))
                rows.append(dict(n=n, layer=layer, behaviour=labels[b], jaccard=jac, auc=auc))
    return rows
