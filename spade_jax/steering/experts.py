"""Identify: which experts go with which behaviour, and does the association transfer?

Risk difference (paper eq. 4) per behaviour b, layer l, expert e, over labelled tokens:

    RD[b, l, e] = P(e selected at l | behaviour b) - P(e selected at l)

subtracting the dataset's own baseline expert usage. SteerMoE's two-set contrast instead
uses ``P(selected | b) - P(selected | not b)``. Both come from one table of selection counts
that can be accumulated chunk by chunk from telemetry (:class:`ExpertCounts`).

Transfer checks: Jaccard of Top-n sets across datasets against a label-permutation null, and
transfer AUC -- rank the target dataset's segments by the routing mass the *source* Top-n
set receives, and ask how well that separates behaviour-b segments (Mann-Whitney AUC).

Legend: ``N`` tokens, ``L`` layers, ``E`` experts, ``k`` selected per token, ``C`` classes,
``S`` segments.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
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


def _mean_top_n_jaccard(counts_a, counts_b, n, layer) -> tuple[np.ndarray, float]:
    sets_a = top_n_experts(counts_a.risk_difference(), n, layer)
    sets_b = top_n_experts(counts_b.risk_difference(), n, layer)
    per_class = np.array([jaccard(a, b) for a, b in zip(sets_a, sets_b, strict=True)])
    return per_class, float(per_class.mean())


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
    with a null from shuffling labels (per segment when ``groups`` are given) in both."""
    if num_permutations < 1:
        raise ValueError(f"num_permutations must be >= 1, got {num_permutations}")
    num_layers = np.asarray(dataset_a[0]).shape[1]

    def counts(selected, labels):
        return ExpertCounts(num_classes, num_layers, num_experts).update(selected, labels)

    per_class, observed = _mean_top_n_jaccard(counts(*dataset_a), counts(*dataset_b), n, layer)
    rng = np.random.default_rng(seed)
    null = np.empty(num_permutations)
    for i in range(num_permutations):
        shuffled_a = permute_labels(dataset_a[1], groups[0], rng)
        shuffled_b = permute_labels(dataset_b[1], groups[1], rng)
        null[i] = _mean_top_n_jaccard(
            counts(dataset_a[0], shuffled_a), counts(dataset_b[0], shuffled_b), n, layer
        )[1]
    p_value = (1 + np.sum(null >= observed)) / (1 + num_permutations)
    return JaccardResult(per_class, observed, float(null.mean()), float(p_value))


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
