"""Read: L2-regularised multinomial logistic probes on router logits, scored by macro-F1.

Features per token are the router logits before top-k of one layer, minus their per-token
mean (the softmax is shift-invariant, so the mean carries no routing information), or the
concatenation over a window of consecutive layers (Qwen3-30B-A3B: L12 alone 0.608 macro-F1,
L8-L16 0.659). The probe is fitted full-batch with L-BFGS on standardised features.

Train/test splits are by *group* (trace or segment), never by token: tokens of one segment
share a label and near-identical context, so a token split would leak.

Legend: ``N`` tokens, ``L`` layers, ``E`` experts, ``D`` feature dims, ``C`` classes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

CLASS_WEIGHTINGS = ("none", "balanced")


@dataclasses.dataclass(frozen=True)
class ProbeConfig:
    """Logistic probe hyper-parameters.

    Attributes:
      l2: weight of ``0.5 * ||W||^2`` added to the mean cross-entropy (bias unpenalised).
      num_steps: fixed L-BFGS iteration budget (full batch).
      class_weighting: "none", or "balanced" (each class's tokens weighted by
        N / (C * N_c), which favours macro-F1 on skewed label mixes).
    """

    l2: float = 1e-3
    num_steps: int = 100
    class_weighting: str = "none"

    def __post_init__(self) -> None:
        if self.l2 < 0:
            raise ValueError(f"l2 must be >= 0, got {self.l2}")
        if self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps}")
        if self.class_weighting not in CLASS_WEIGHTINGS:
            raise ValueError(
                f"class_weighting must be one of {CLASS_WEIGHTINGS}, got {self.class_weighting!r}"
            )


class ProbeParams(NamedTuple):
    mean_d: np.ndarray  # standardisation, fitted on the training tokens
    scale_d: np.ndarray
    w_dc: np.ndarray
    b_c: np.ndarray


class ProbeResult(NamedTuple):
    macro_f1: float
    majority_macro_f1: float  # predicting the most frequent training class everywhere
    num_train: int
    num_test: int


def centered_router_features(router_logits_nlE: np.ndarray, layers: Sequence[int]) -> np.ndarray:
    """``[N, len(layers) * E]``: each chosen layer's logits minus their per-token mean."""
    logits = np.asarray(router_logits_nlE, np.float32)
    if logits.ndim != 3:
        raise ValueError(f"router logits must be [N, L, E], got shape {logits.shape}")
    if not layers or any(not 0 <= layer < logits.shape[1] for layer in layers):
        raise ValueError(f"layers {list(layers)} must be non-empty and in [0, {logits.shape[1]})")
    chosen_nle = logits[:, list(layers), :]
    centered_nle = chosen_nle - chosen_nle.mean(axis=-1, keepdims=True)
    return centered_nle.reshape(logits.shape[0], -1)


def layer_windows(num_layers: int, width: int, stride: int = 1) -> list[tuple[int, ...]]:
    """Windows of ``width`` consecutive layers (e.g. width 9 gives L8-L16 among them)."""
    if not 1 <= width <= num_layers or stride < 1:
        raise ValueError(f"need 1 <= width <= {num_layers} and stride >= 1, got {width}, {stride}")
    return [tuple(range(s, s + width)) for s in range(0, num_layers - width + 1, stride)]


def group_split(
    groups_n: Sequence, test_fraction: float = 0.25, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Bool train/test masks ``[N]`` that never split a group (trace or segment) in two."""
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    unique, inverse = np.unique(np.asarray(groups_n), return_inverse=True)
    if unique.size < 2:
        raise ValueError(f"need at least 2 groups to split, got {unique.size}")
    num_test = min(max(1, round(test_fraction * unique.size)), unique.size - 1)
    test_groups = np.random.default_rng(seed).permutation(unique.size)[:num_test]
    test_mask = np.isin(inverse.reshape(-1), test_groups)
    return ~test_mask, test_mask


def macro_f1(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    """Unweighted mean F1 over every class present in ``y_true`` or ``y_pred``."""
    y_true, y_pred = np.asarray(y_true), np.asarray(y_pred)
    if y_true.shape != y_pred.shape or y_true.ndim != 1 or y_true.size == 0:
        raise ValueError(f"need equal non-empty 1-D label arrays, got {y_true.shape}, {y_pred.shape}")
    scores = []
    for c in np.union1d(y_true, y_pred):
        true_pos = np.sum((y_pred == c) & (y_true == c))
        predicted, actual = np.sum(y_pred == c), np.sum(y_true == c)
        scores.append(2.0 * true_pos / (predicted + actual))
    return float(np.mean(scores))


def _objective(params, x_nd, y_n, weight_n, l2):
    logits_nc = x_nd @ params["w_dc"] + params["b_c"]
    nll_n = -jnp.take_along_axis(jax.nn.log_softmax(logits_nc), y_n[:, None], axis=1)[:, 0]
    data_loss = jnp.sum(weight_n * nll_n) / jnp.sum(weight_n)
    l2_penalty = 0.5 * l2 * jnp.sum(params["w_dc"] ** 2)
    return data_loss + l2_penalty


@functools.partial(jax.jit, static_argnames=("num_steps",))
def _lbfgs_fit(params, x_nd, y_n, weight_n, l2, num_steps):
    def loss_fn(p):
        return _objective(p, x_nd, y_n, weight_n, l2)

    # Backtracking (not the default zoom) line search: same optimum on this smooth convex
    # objective, and roughly half the compile time, which dominates small probes.
    solver = optax.lbfgs(
        linesearch=optax.scale_by_backtracking_linesearch(max_backtracking_steps=20, store_grad=True)
    )
    value_and_grad = optax.value_and_grad_from_state(loss_fn)

    def step(carry, _):
        params, opt_state = carry
        value, grad = value_and_grad(params, state=opt_state)
        updates, opt_state = solver.update(
            grad, opt_state, params, value=value, grad=grad, value_fn=loss_fn
        )
        return (optax.apply_updates(params, updates), opt_state), value

    (params, _), values = jax.lax.scan(step, (params, solver.init(params)), None, num_steps)
    return params, values


def fit_logistic_probe(
    x_nd: np.ndarray, y_n: np.ndarray, num_classes: int, config: ProbeConfig = ProbeConfig()
) -> ProbeParams:
    """Fits ``softmax(standardise(x) @ W + b)`` to integer labels in ``[0, num_classes)``."""
    x_nd = np.asarray(x_nd, np.float32)
    y_n = np.asarray(y_n)
    if x_nd.ndim != 2 or y_n.shape != (x_nd.shape[0],) or x_nd.shape[0] == 0:
        raise ValueError(f"need x [N, D] and y [N] with N > 0, got {x_nd.shape}, {y_n.shape}")
    if y_n.min() < 0 or y_n.max() >= num_classes:
        raise ValueError(f"labels must be in [0, {num_classes}), got range [{y_n.min()}, {y_n.max()}]")
    if not np.isfinite(x_nd).all():
        raise ValueError("features contain NaN or inf")
    mean_d = x_nd.mean(axis=0)
    scale_d = x_nd.std(axis=0)
    scale_d = np.where(scale_d > 1e-8, scale_d, 1.0)  # constant features stay at 0
    x_std = (x_nd - mean_d) / scale_d
    counts_c = np.bincount(y_n, minlength=num_classes)
    if config.class_weighting == "balanced":
        weight_n = (y_n.size / (num_classes * counts_c))[y_n]
    else:
        weight_n = np.ones(y_n.size)
    # Pad rows (weight 0) and feature columns (all zero, so their weights stay 0) up to
    # bucketed sizes: every probe of a sweep then reuses one compiled solver.
    num_rows, num_dims = _bucket(x_std.shape[0], 1024), _bucket(x_std.shape[1], 32)
    x_pad = np.zeros((num_rows, num_dims), np.float32)
    x_pad[: x_std.shape[0], : x_std.shape[1]] = x_std
    y_pad = np.zeros(num_rows, np.int32)
    y_pad[: y_n.size] = y_n
    weight_pad = np.zeros(num_rows, np.float32)
    weight_pad[: y_n.size] = weight_n
    init = {
        "w_dc": jnp.zeros((num_dims, num_classes), jnp.float32),
        "b_c": jnp.zeros((num_classes,), jnp.float32),
    }
    params, _ = _lbfgs_fit(
        init,
        jnp.asarray(x_pad),
        jnp.asarray(y_pad),
        jnp.asarray(weight_pad),
        jnp.float32(config.l2),
        num_steps=config.num_steps,
    )
    w_dc = np.asarray(params["w_dc"])[: x_std.shape[1]]
    return ProbeParams(mean_d, scale_d, w_dc, np.asarray(params["b_c"]))


def _bucket(size: int, minimum: int) -> int:
    """Rounds up to a multiple of an eighth of the enclosing power of two (<= 12.5% padding
    on large inputs, few distinct shapes overall), and to at least ``minimum``."""
    step = max(1, 1 << max(0, (size - 1).bit_length() - 3))
    return max(minimum, -(-size // step) * step)


def predict_probe(params: ProbeParams, x_nd: np.ndarray) -> np.ndarray:
    """Most likely class per row."""
    x_std = (np.asarray(x_nd, np.float32) - params.mean_d) / params.scale_d
    return np.argmax(x_std @ params.w_dc + params.b_c, axis=1)


def evaluate_probe(
    x_nd: np.ndarray,
    y_n: np.ndarray,
    train_mask: np.ndarray,
    test_mask: np.ndarray,
    num_classes: int,
    config: ProbeConfig = ProbeConfig(),
) -> ProbeResult:
    """Fits on ``train_mask`` tokens, reports macro-F1 on ``test_mask`` tokens.

    Tokens with label < 0 (unlabelled) are left out of both sides. To evaluate a control
    such as dropping each segment's first five tokens, AND its mask into both masks.
    """
    y_n = np.asarray(y_n)
    labelled = y_n >= 0
    train = np.asarray(train_mask, bool) & labelled
    test = np.asarray(test_mask, bool) & labelled
    if (train & test).any():
        raise ValueError("train and test masks overlap")
    if not train.any() or not test.any():
        raise ValueError(f"empty split: {train.sum()} train, {test.sum()} test labelled tokens")
    params = fit_logistic_probe(x_nd[train], y_n[train], num_classes, config)
    predicted = predict_probe(params, x_nd[test])
    majority = np.bincount(y_n[train], minlength=num_classes).argmax()
    return ProbeResult(
        macro_f1=macro_f1(y_n[test], predicted),
        majority_macro_f1=macro_f1(y_n[test], np.full(test.sum(), majority)),
        num_train=int(train.sum()),
        num_test=int(test.sum()),
    )


def probe_router_layers(
    router_logits_nlE: np.ndarray,
    y_n: np.ndarray,
    train_mask: np.ndarray,
    test_mask: np.ndarray,
    layer_groups: Sequence[Sequence[int]],
    num_classes: int,
    config: ProbeConfig = ProbeConfig(),
) -> dict[tuple[int, ...], ProbeResult]:
    """One probe per layer group: ``[(l,) for l in range(L)]`` for single layers, or
    :func:`layer_windows` for windows of consecutive layers."""
    results = {}
    for layers in layer_groups:
        x_nd = centered_router_features(router_logits_nlE, layers)
        results[tuple(layers)] = evaluate_probe(x_nd, y_n, train_mask, test_mask, num_classes, config)
    return results


def compare_feature_sets(
    feature_sets: Mapping[str, np.ndarray],
    y_n: np.ndarray,
    train_mask: np.ndarray,
    test_mask: np.ndarray,
    num_classes: int,
    config: ProbeConfig = ProbeConfig(),
) -> dict[str, ProbeResult]:
    """The same split and probe over several feature sets (router vs the controls)."""
    return {
        name: evaluate_probe(x_nd, y_n, train_mask, test_mask, num_classes, config)
        for name, x_nd in feature_sets.items()
    }
