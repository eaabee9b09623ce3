"""Read: L2-regularised multinomial logistic probes on router logits, scored by macro-F1.

Features per token are the router logits before top-k of one layer, minus their per-token
mean (the softmax is shift-invariant, so the mean carries no routing information), or the
concatenation over a window of consecutive layers (Qwen3-30B-A3B: L12 alone 0.608 macro-F1,
L8-L16 0.659); the baseline is the residual stream of a layer or window
(:func:`residual_window_features`; best layer L14 0.658).

Two fits of the same objective (mean cross-entropy plus ``0.5 * l2 * ||W||^2`` on
standardised features):

  * :func:`fit_logistic_probe`: full batch, L-BFGS, every token in memory. Exact and quick
    for sweeps up to some 1e5 tokens x 1e3 dims.
  * :func:`fit_streaming_probe`: minibatch Adam over a source of ``(x_nd, y_n, weight_n)``
    chunks (e.g. :func:`telemetry_feature_chunks`), re-read every epoch. One pass first for
    the standardisation (per-chunk moments merged with Chan's formula) and the class counts;
    memory is one chunk plus one minibatch whatever the token count (the paper's ~1.3M
    tokens x 1,152 router dims, or residual windows of 9 x 2,048). Its confusion-matrix
    twin :func:`evaluate_streaming_probe` scores a held-out source chunk by chunk.

Train/test splits are by *group* (trace or segment), never by token: tokens of one segment
share a label and near-identical context, so a token split would leak. For streamed
telemetry, split the sequence ids and pass the split as the chunk weights.

Legend: ``N`` tokens, ``L`` layers, ``E`` experts, ``D`` feature dims, ``C`` classes,
``R`` residual layers, ``B`` minibatch rows.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from spade_jax.steering.telemetry import TelemetryChunk, TelemetryReader

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


def residual_window_features(residuals_nrd: np.ndarray, rows: Sequence[int]) -> np.ndarray:
    """``[N, len(rows) * D]``: the recorded residual rows ``rows`` (indices into R, see
    ``TelemetryReader.residual_layers``) concatenated, as float32. Not centred: unlike router
    logits, a residual's mean over D is not a free shift."""
    residuals = np.asarray(residuals_nrd)
    if residuals.ndim != 3:
        raise ValueError(f"residuals must be [N, R, D], got shape {residuals.shape}")
    if not rows or any(not 0 <= r < residuals.shape[1] for r in rows):
        raise ValueError(f"rows {list(rows)} must be non-empty and in [0, {residuals.shape[1]})")
    return residuals[:, list(rows), :].reshape(residuals.shape[0], -1).astype(np.float32)


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


def macro_f1_from_confusion(confusion_cc: np.ndarray) -> float:
    """:func:`macro_f1` from a ``[true, predicted]`` count matrix: the mean F1 over every
    class with a true or a predicted token."""
    confusion = np.asarray(confusion_cc, np.float64)
    if confusion.ndim != 2 or confusion.shape[0] != confusion.shape[1] or confusion.sum() == 0:
        raise ValueError(f"need a non-empty square confusion matrix, got shape {confusion.shape}")
    actual_c, predicted_c = confusion.sum(axis=1), confusion.sum(axis=0)
    present = (actual_c + predicted_c) > 0
    f1_c = 2.0 * np.diag(confusion)[present] / (actual_c + predicted_c)[present]
    return float(f1_c.mean())


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


# ---------------------------------------------------------------- streaming (minibatch) probe

# A source of training or test tokens: ``(x_nd, y_n)`` or ``(x_nd, y_n, weight_n)`` chunks.
# Rows with label < 0 or weight <= 0 are left out (weights double as the train/test mask).
FeatureChunk = tuple[np.ndarray, ...]
ChunkSource = Callable[[], Iterable[FeatureChunk]] | Iterable[FeatureChunk]


@dataclasses.dataclass(frozen=True)
class StreamingProbeConfig:
    """Minibatch probe hyper-parameters (the objective is :class:`ProbeConfig`'s).

    Attributes:
      l2: weight of ``0.5 * ||W||^2`` added to the mean (weighted) cross-entropy.
      num_epochs: passes over the source after the statistics pass.
      batch_size: rows per Adam step. Every step has this shape (a source's last rows are
        padded with weight-0 rows) and the feature width is bucketed, so one compiled step
        serves a whole fit and most of a sweep.
      learning_rate: Adam's step size at the start, cosine-decayed to 0 over all steps: a
        constant step keeps jittering around the optimum, a decayed one settles on it.
      class_weighting: "none", or "balanced" (class c's tokens weighted by
        W / (C * W_c), from the statistics pass), as :class:`ProbeConfig`.
      shuffle: visit each chunk's rows in a fresh random order every epoch. Telemetry comes in
        sequence order, where a minibatch of consecutive tokens is mostly one segment, one
        label: a biased step. (Chunks themselves keep the source's order.)
      seed: the shuffling's seed.
    """

    l2: float = 1e-3
    num_epochs: int = 5
    batch_size: int = 1024
    learning_rate: float = 0.05
    class_weighting: str = "none"
    shuffle: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.l2 < 0:
            raise ValueError(f"l2 must be >= 0, got {self.l2}")
        if self.num_epochs < 1 or self.batch_size < 1:
            raise ValueError(f"num_epochs and batch_size must be >= 1, got {self.num_epochs}, "
                             f"{self.batch_size}")
        if self.learning_rate <= 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        if self.class_weighting not in CLASS_WEIGHTINGS:
            raise ValueError(
                f"class_weighting must be one of {CLASS_WEIGHTINGS}, got {self.class_weighting!r}"
            )


class FeatureMoments:
    """Per-feature count, mean and sum of squared deviations over a stream of row chunks.

    The moments of each block of rows are computed in float64 and merged into the running
    ones with Chan et al.'s pairwise formula (Welford's update, a block at a time): as exact
    as one pass over all rows, without holding them. A block holds at most ``block_values``
    values, so a wide chunk (a residual window) is never copied whole to float64.
    """

    def __init__(self, num_features: int, block_values: int = 1 << 22) -> None:
        self.count = 0
        self.mean_d = np.zeros(num_features)
        self.m2_d = np.zeros(num_features)
        self.block_rows = max(1, block_values // max(num_features, 1))

    def update(self, x_nd: np.ndarray, rows_k: np.ndarray | None = None) -> FeatureMoments:
        """Adds the rows of ``x_nd`` (only ``rows_k``, when given)."""
        x_nd = np.asarray(x_nd)
        if x_nd.ndim != 2 or x_nd.shape[1] != self.mean_d.size:
            raise ValueError(f"need rows [N, {self.mean_d.size}], got {x_nd.shape}")
        for x in _row_blocks(x_nd, rows_k, self.block_rows, np.float64):
            mean_d = x.mean(axis=0)
            self._merge(len(x), mean_d, ((x - mean_d) ** 2).sum(axis=0))
        return self

    def merge(self, other: FeatureMoments) -> FeatureMoments:
        """Adds another stream's moments (e.g. one computed on another host)."""
        if other.count:
            self._merge(other.count, other.mean_d, other.m2_d)
        return self

    def _merge(self, count: int, mean_d: np.ndarray, m2_d: np.ndarray) -> None:
        total = self.count + count
        delta_d = mean_d - self.mean_d
        self.mean_d = self.mean_d + delta_d * (count / total)
        self.m2_d = self.m2_d + m2_d + delta_d**2 * (self.count * count / total)
        self.count = total

    @property
    def var_d(self) -> np.ndarray:
        """Population variance (``np.var``'s ddof=0, as the full-batch fit standardises)."""
        return self.m2_d / max(self.count, 1)

    def scale_d(self) -> np.ndarray:
        """Standard deviation, 1 for constant features (they stay at 0 once centred)."""
        std_d = np.sqrt(self.var_d)
        return np.where(std_d > 1e-8, std_d, 1.0).astype(np.float32)


class StreamingProbeFit(NamedTuple):
    params: ProbeParams  # same form as fit_logistic_probe's: predict_probe applies
    class_counts_c: np.ndarray  # training tokens per class (the majority baseline's input)
    num_train: int
    num_steps: int
    last_epoch_loss: float  # mean minibatch objective over the last epoch


class StreamingEvaluation(NamedTuple):
    confusion_cc: np.ndarray  # [true, predicted] token counts
    macro_f1: float
    majority_macro_f1: float | None  # predicting ``majority_class`` everywhere, if given
    num_tokens: int


def _open_source(chunks: ChunkSource, passes: int) -> Iterator[FeatureChunk]:
    if callable(chunks):
        return iter(chunks())
    if passes > 1 and isinstance(chunks, Iterator):
        raise TypeError("the streaming fit reads its source 1 + num_epochs times; pass a "
                        "callable returning a fresh iterator (or a re-iterable), not an iterator")
    return iter(chunks)


def _row_blocks(x_nd: np.ndarray, rows_k: np.ndarray | None, block_rows: int,
                dtype=np.float32) -> Iterator[np.ndarray]:
    """``x_nd[rows_k]`` (all rows when None) as ``dtype``, ``block_rows`` at a time,
    checked finite: never a copy of the whole chunk."""
    total = len(x_nd) if rows_k is None else len(rows_k)
    for start in range(0, total, block_rows):
        stop = min(start + block_rows, total)
        block = x_nd[start:stop] if rows_k is None else x_nd[rows_k[start:stop]]
        block = np.asarray(block, dtype)
        if not np.isfinite(block).all():
            raise ValueError("features contain NaN or inf")
        yield block


def _kept_rows(chunks: ChunkSource, passes: int, num_features: int, num_classes: int):
    """The source's chunks, checked: ``(x_nd, y_k, weight_k, rows_k)`` with ``rows_k`` the
    rows that count (label >= 0, weight > 0; None: all of them) and their int32 labels and
    float32 weights. ``x_nd`` is passed on as given (gathered later, a block at a time)."""
    for index, chunk in enumerate(_open_source(chunks, passes)):
        if len(chunk) not in (2, 3):
            raise ValueError(f"chunk {index}: need (x_nd, y_n) or (x_nd, y_n, weight_n)")
        x_nd = chunk[0] if isinstance(chunk[0], np.ndarray) else np.asarray(chunk[0], np.float32)
        y_n = np.asarray(chunk[1])
        weight = chunk[2] if len(chunk) == 3 else None
        weight_n = np.ones(y_n.shape, np.float32) if weight is None else np.asarray(weight, np.float32)
        if x_nd.ndim != 2 or x_nd.shape[1] != num_features or y_n.shape != (len(x_nd),) \
                or weight_n.shape != y_n.shape:
            raise ValueError(f"chunk {index}: need x [N, {num_features}], y [N], weight [N]; "
                             f"got {x_nd.shape}, {y_n.shape}, {weight_n.shape}")
        if not np.issubdtype(y_n.dtype, np.integer):
            raise ValueError(f"chunk {index}: labels must be integers, got {y_n.dtype}")
        keep_n = (y_n >= 0) & (weight_n > 0)
        rows_k = None
        if not keep_n.all():
            rows_k = np.flatnonzero(keep_n)
            y_n, weight_n = y_n[rows_k], weight_n[rows_k]
        if y_n.size and y_n.max() >= num_classes:
            raise ValueError(f"chunk {index}: labels must be < {num_classes}, got {y_n.max()}")
        yield x_nd, y_n.astype(np.int32), weight_n, rows_k


def _minibatches(rows: Iterator[tuple[np.ndarray, ...]], batch_size: int, width: int,
                 rng: np.random.Generator | None) -> Iterator[tuple[np.ndarray, ...]]:
    """Fixed-shape ``[B, width]`` minibatches across chunk boundaries (a chunk's tail waits
    for the next chunk's head), the last one padded with weight-0 rows. Holds at most one
    chunk and one minibatch."""
    pending: list[tuple[np.ndarray, ...]] = []
    pending_rows = 0
    for x_nd, y_k, weight_k, rows_k in rows:
        order_k = rng.permutation(len(y_k)) if rng is not None else np.arange(len(y_k))
        start = 0
        while start < len(order_k):
            take = order_k[start : start + batch_size - pending_rows]
            x_taken = x_nd[take if rows_k is None else rows_k[take]]
            pending.append((np.asarray(x_taken, np.float32), y_k[take], weight_k[take]))
            pending_rows += len(take)
            start += len(take)
            if pending_rows == batch_size:
                yield _pack(pending, batch_size, width)
                pending, pending_rows = [], 0
    if pending_rows:
        yield _pack(pending, batch_size, width)


def _pack(pieces, batch_size: int, width: int) -> tuple[np.ndarray, ...]:
    x_bd = np.zeros((batch_size, width), np.float32)
    y_b = np.zeros(batch_size, np.int32)
    weight_b = np.zeros(batch_size, np.float32)
    row = 0
    for x_nd, y_n, weight_n in pieces:
        x_bd[row : row + len(y_n), : x_nd.shape[1]] = x_nd
        y_b[row : row + len(y_n)], weight_b[row : row + len(y_n)] = y_n, weight_n
        row += len(y_n)
    if not np.isfinite(x_bd).all():
        raise ValueError("features contain NaN or inf")
    return x_bd, y_b, weight_b


_ADAM = optax.scale_by_adam()


@jax.jit
def _streaming_step(params, opt_state, loss_sum, x_bd, y_b, weight_b, mean_d, inv_scale_d,
                    learning_rate, l2, norm):
    """One Adam step on a minibatch. ``norm`` = B x the mean token weight, so the data term
    summed over an epoch's steps is the full objective's (an unbiased minibatch gradient
    for any class weighting and for a padded last minibatch)."""

    def loss_fn(p):
        x_std = (x_bd - mean_d) * inv_scale_d  # padded columns: inv_scale 0 -> feature 0
        logits_bc = x_std @ p["w_dc"] + p["b_c"]
        nll_b = -jnp.take_along_axis(jax.nn.log_softmax(logits_bc), y_b[:, None], axis=1)[:, 0]
        return jnp.sum(weight_b * nll_b) / norm + 0.5 * l2 * jnp.sum(p["w_dc"] ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = _ADAM.update(grads, opt_state)
    params = jax.tree.map(lambda p, u: p - learning_rate * u, params, updates)
    return params, opt_state, loss_sum + loss


def _stream_statistics(chunks: ChunkSource, num_features: int, num_classes: int, passes: int):
    """One pass: feature moments, training tokens and weight mass per class."""
    moments = FeatureMoments(num_features)
    counts_c = np.zeros(num_classes, np.int64)
    mass_c = np.zeros(num_classes)
    for x_nd, y_n, weight_n, rows_k in _kept_rows(chunks, passes, num_features, num_classes):
        moments.update(x_nd, rows_k)
        counts_c += np.bincount(y_n, minlength=num_classes)
        mass_c += np.bincount(y_n, weights=weight_n, minlength=num_classes)
    if moments.count == 0:
        raise ValueError("the source holds no training token (label >= 0, weight > 0)")
    return moments, counts_c, mass_c


def fit_streaming_probe(
    chunks: ChunkSource,
    num_features: int,
    num_classes: int,
    config: StreamingProbeConfig = StreamingProbeConfig(),
) -> StreamingProbeFit:
    """Fits ``softmax(standardise(x) @ W + b)`` by minibatch Adam, never holding the tokens.

    ``chunks``: a callable returning a fresh iterable of ``(x_nd, y_n[, weight_n])`` chunks
    (or a re-iterable such as a list), read ``1 + num_epochs`` times: once for the
    standardisation and class weights, then once per epoch. Labels in ``[0, num_classes)``;
    rows with label < 0 or weight <= 0 are ignored, so the weights can carry a split.
    """
    if num_features < 1 or num_classes < 2:
        raise ValueError(f"need num_features >= 1 and num_classes >= 2, got {num_features}, "
                         f"{num_classes}")
    passes = 1 + config.num_epochs
    moments, counts_c, mass_c = _stream_statistics(chunks, num_features, num_classes, passes)
    class_factor_c = np.ones(num_classes, np.float32)
    if config.class_weighting == "balanced":
        present = mass_c > 0
        class_factor_c[present] = mass_c.sum() / (num_classes * mass_c[present])
    norm = np.float32(config.batch_size * (mass_c * class_factor_c).sum() / moments.count)

    width = _bucket(num_features, 32)
    mean_d = np.zeros(width, np.float32)
    mean_d[:num_features] = moments.mean_d
    scale_d = moments.scale_d()
    inv_scale_d = np.zeros(width, np.float32)
    inv_scale_d[:num_features] = 1.0 / scale_d
    params = {"w_dc": jnp.zeros((width, num_classes), jnp.float32),
              "b_c": jnp.zeros((num_classes,), jnp.float32)}
    opt_state = _ADAM.init(params)
    steps_per_epoch = math.ceil(moments.count / config.batch_size)
    total_steps = steps_per_epoch * config.num_epochs
    step, last_epoch_loss = 0, jnp.zeros((), jnp.float32)
    for epoch in range(config.num_epochs):
        rng = np.random.default_rng([config.seed, epoch]) if config.shuffle else None
        loss_sum = jnp.zeros((), jnp.float32)
        rows = _kept_rows(chunks, passes, num_features, num_classes)
        for x_bd, y_b, weight_b in _minibatches(rows, config.batch_size, width, rng):
            learning_rate = config.learning_rate * 0.5 * (
                1.0 + math.cos(math.pi * min(step, total_steps) / total_steps))
            previous = loss_sum
            params, opt_state, loss_sum = _streaming_step(
                params, opt_state, loss_sum, x_bd, y_b, weight_b * class_factor_c[y_b],
                mean_d, inv_scale_d, np.float32(learning_rate), np.float32(config.l2), norm)
            # At most two steps in flight: dispatch is asynchronous, and a host loop that ran
            # ahead would queue (and keep alive) a minibatch per step, unbounded.
            previous.block_until_ready()
            step += 1
        last_epoch_loss = loss_sum / max(steps_per_epoch, 1)
    probe = ProbeParams(moments.mean_d.astype(np.float32), scale_d,
                        np.asarray(params["w_dc"])[:num_features], np.asarray(params["b_c"]))
    return StreamingProbeFit(probe, counts_c, int(moments.count), step, float(last_epoch_loss))


def evaluate_streaming_probe(
    params: ProbeParams,
    chunks: ChunkSource,
    num_classes: int,
    majority_class: int | None = None,
) -> StreamingEvaluation:
    """Accumulates the ``[true, predicted]`` confusion matrix over the source's tokens
    (label >= 0, weight > 0: pass the test split as weights) one chunk at a time and
    reports its macro-F1; with ``majority_class`` (e.g. ``fit.class_counts_c.argmax()``),
    also the macro-F1 of predicting that class everywhere."""
    num_features = params.w_dc.shape[0]
    confusion_cc = np.zeros((num_classes, num_classes), np.int64)
    block_rows = max(1, (1 << 22) // num_features)
    for x_nd, y_k, _, rows_k in _kept_rows(chunks, 1, num_features, num_classes):
        predicted_k = np.concatenate(
            [predict_probe(params, block) for block in _row_blocks(x_nd, rows_k, block_rows)]
            or [np.zeros(0, np.int64)])
        confusion_cc += np.bincount(y_k * num_classes + predicted_k,
                                    minlength=num_classes * num_classes).reshape(confusion_cc.shape)
    if confusion_cc.sum() == 0:
        raise ValueError("the source holds no test token (label >= 0, weight > 0)")
    majority = None
    if majority_class is not None:
        always_cc = np.zeros_like(confusion_cc)
        always_cc[:, majority_class] = confusion_cc.sum(axis=1)
        majority = macro_f1_from_confusion(always_cc)
    return StreamingEvaluation(confusion_cc, macro_f1_from_confusion(confusion_cc), majority,
                               int(confusion_cc.sum()))


def telemetry_feature_chunks(
    directory: str | Path,
    features: Callable[[TelemetryChunk], np.ndarray],
    labels: Callable[[TelemetryChunk], np.ndarray],
    weights: Callable[[TelemetryChunk], np.ndarray] | None = None,
    residuals: bool = False,
) -> Callable[[], Iterator[FeatureChunk]]:
    """A chunk source over a telemetry directory for the streaming fit and evaluation: each
    call re-opens it and yields ``(features(c), labels(c), weights(c))`` per telemetry chunk
    ``c``. ``residuals=True`` loads the residual arrays (skipped otherwise: they are the
    largest). E.g. router window features and a split by sequence id::

        source = telemetry_feature_chunks(
            path, lambda c: centered_router_features(c.router_logits, range(8, 17)),
            labels_of, weights=lambda c: np.isin(c.sequence_ids, train_ids))
    """

    def source() -> Iterator[FeatureChunk]:
        for chunk in TelemetryReader(directory).iter_chunks(residuals=residuals):
            weight_n = None if weights is None else np.asarray(weights(chunk), np.float32)
            yield features(chunk), labels(chunk), weight_n

    return source
