"""The training-free steering operator (Routes of Reasoning eqs. 5-6) and its router hook.

Router logits ``z`` of one token over the E routed experts are edited before the model's
usual ``softmax -> top-k -> (optional) renormalisation``:

    s      = log_softmax(z)
    s_max  = max_e s_e,  s_min = min_e s_e        (taken before editing)
    s'_e   = s_max + eps   if e in the activate set A
             s_min - eps   if e in the suppress set S
             s_e           otherwise

Why this guarantees the paper's behaviour: every activated expert ends strictly above every
other expert, so with |A| <= k all of A lands in the top-k; every suppressed expert ends
strictly below every other expert, so with E - |S| >= k top-k never has to reach into S.
Untouched experts keep ``s_e = z_e - logsumexp(z)``, so their softmax ratios are
``exp(z_i - z_j)`` exactly as before.

Shared experts (e.g. Qwen3.6's one always-on expert) are not part of the router logits the
model hands to the hook, so they are untouched by construction.

Legend: ``E`` routed experts, ``B`` batch, ``T`` tokens, ``k`` experts chosen per token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

RouterHook = Callable[..., jax.Array]

SCHEDULES = ("always", "after_first_answer", "before_first_answer", "window")
# Schedules whose hook gates rows by the sampler's per-sequence ``active`` flag (the sticky
# ``fired_b`` of its detector), and which kind of detector sets that flag:
#   after_first_answer   edit rows whose first-answer detector HAS fired (the paper's
#                        "suppress after the cut");
#   before_first_answer  edit rows whose first-answer detector has NOT fired (the cut
#                        schedule's other half: steer only until the first answer);
#   window               edit rows whose token-count detector has NOT fired, i.e. clamp the
#                        first W generated tokens, then release (``TokenCountDetector(W)``).
SCHEDULE_DETECTORS = {"after_first_answer": "first_answer",
                      "before_first_answer": "first_answer", "window": "token_count"}
# Schedules that edit the rows whose flag is NOT set.
_INVERTED = frozenset({"before_first_answer", "window"})


def _is_concrete(x: object) -> bool:
    return not isinstance(x, jax.core.Tracer)


def validate_expert_sets(
    activate_mask: np.ndarray,
    suppress_mask: np.ndarray,
    num_experts: int,
    k: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Checks one layer's activate / suppress masks and returns them as NumPy bool arrays.

    Raises ValueError when a mask is not shape ``[num_experts]``, when the sets overlap,
    when more than ``k`` experts are activated (they could not all be selected), or when
    suppression leaves fewer than ``k`` experts (top-k would have to pick a suppressed one).
    """
    activate = np.asarray(activate_mask)
    suppress = np.asarray(suppress_mask)
    for name, mask in (("activate_mask", activate), ("suppress_mask", suppress)):
        if mask.shape != (num_experts,):
            raise ValueError(
                f"{name} must have shape ({num_experts},) to match the router's "
                f"{num_experts} experts, got {mask.shape}"
            )
        if mask.dtype != np.bool_:
            raise ValueError(f"{name} must be a bool mask, got dtype {mask.dtype}")
    overlap = np.flatnonzero(activate & suppress)
    if overlap.size:
        raise ValueError(f"experts {overlap.tolist()} are in both the activate and suppress set")
    if k is not None:
        if not 1 <= k <= num_experts:
            raise ValueError(f"k must be in [1, {num_experts}], got {k}")
        n_activate = int(activate.sum())
        if n_activate > k:
            raise ValueError(
                f"{n_activate} experts activated but only k={k} are selected per token; "
                f"at most k may be activated"
            )
        remaining = num_experts - int(suppress.sum())
        if remaining < k:
            raise ValueError(
                f"suppressing {int(suppress.sum())} of {num_experts} experts leaves {remaining} "
                f"< k={k}; at least k experts must remain selectable"
            )
    return activate, suppress


def steer_router_logits(
    logits: jax.Array,
    activate_mask: jax.Array | np.ndarray,
    suppress_mask: jax.Array | np.ndarray,
    eps: float = 0.01,
    k: int | None = None,
) -> jax.Array:
    """Applies the activate/suppress edit to router logits of any leading shape ``[..., E]``.

    Args:
      logits: router logits before top-k, last axis = routed experts.
      activate_mask: bool ``[E]``; these experts are clamped to ``max(log_softmax) + eps``.
      suppress_mask: bool ``[E]``; these experts are clamped to ``min(log_softmax) - eps``.
      eps: the margin; must be > 0 so the clamped experts are strictly above / below.
      k: experts selected per token; when given, the set-size constraints are checked.

    Returns:
      ``logits`` itself when both masks are (concretely) empty; otherwise the edited
      log-softmax values, whose softmax is what the model's router consumes. The edit runs
      in at least float32 because bf16 spacing near typical log-probabilities (~0.1-0.25)
      would swallow ``eps`` and break the strict ordering.

    Mask contents are validated only when the masks are concrete (NumPy or non-traced);
    under ``jit`` build the hook with :func:`make_steering_hook`, which validates up front.
    """
    if eps <= 0:
        raise ValueError(f"eps must be > 0 so clamped experts are strictly ordered, got {eps}")
    num_experts = logits.shape[-1]
    # Plain Python sequences are accepted as concrete masks.
    activate_mask = activate_mask if hasattr(activate_mask, "shape") else np.asarray(activate_mask)
    suppress_mask = suppress_mask if hasattr(suppress_mask, "shape") else np.asarray(suppress_mask)
    for name, mask in (("activate_mask", activate_mask), ("suppress_mask", suppress_mask)):
        if tuple(mask.shape) != (num_experts,):
            raise ValueError(
                f"{name} must have shape ({num_experts},) to match logits' last axis, "
                f"got {tuple(mask.shape)}"
            )
    if _is_concrete(activate_mask) and _is_concrete(suppress_mask):
        activate_np, suppress_np = validate_expert_sets(
            np.asarray(activate_mask), np.asarray(suppress_mask), num_experts, k
        )
        if not activate_np.any() and not suppress_np.any():
            return logits
    compute_dtype = jnp.promote_types(logits.dtype, jnp.float32)
    s = jax.nn.log_softmax(logits.astype(compute_dtype), axis=-1)
    s_max = jnp.max(s, axis=-1, keepdims=True)
    s_min = jnp.min(s, axis=-1, keepdims=True)
    activate = jnp.asarray(activate_mask, dtype=bool)
    suppress = jnp.asarray(suppress_mask, dtype=bool)
    steered = jnp.where(activate, s_max + eps, s)
    steered = jnp.where(suppress, s_min - eps, steered)
    return steered


@dataclasses.dataclass(frozen=True)
class SteeringConfig:
    """How the steering hook behaves.

    Attributes:
      k: experts selected per token by the model's router (top-k); used to enforce
        |activate| <= k and E - |suppress| >= k on every layer.
      eps: the margin epsilon of eqs. 5-6 (log-probability units).
      schedule: "always" edits every token; "after_first_answer" edits only sequences whose
        per-sequence ``active`` flag is set (the sampler sets it once a first-answer
        detector fires; the paper finds the effect lives almost entirely after that point);
        "before_first_answer" (the cut schedule) edits only sequences whose flag is NOT set
        yet; "window" likewise, with a token-count detector: the first W generated tokens.
    """

    k: int
    eps: float = 0.01
    schedule: str = "always"

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k}")
        if self.eps <= 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")


ExpertSets = Mapping[int, tuple[np.ndarray, np.ndarray]]


def make_steering_hook(
    expert_sets: ExpertSets,
    k: int,
    eps: float = 0.01,
    schedule: str = "always",
) -> RouterHook:
    """Builds ``hook(logits_btE, layer_idx, *, active=None) -> logits`` for the model/sampler.

    ``expert_sets`` maps a layer index to its ``(activate_mask[E], suppress_mask[E])``;
    layers not in the map are returned unchanged. All masks are validated here, once, on
    concrete NumPy arrays. ``layer_idx`` may be a Python int (layers unrolled in Python) or
    a traced integer (layers under ``scan``); the masks are then gathered from a stacked
    ``[L, E]`` table. ``active`` is a bool ``[B]`` per-sequence flag (the sampler passes its
    detector's sticky ``fired_b``): with "after_first_answer" only rows where it is True are
    edited; with "before_first_answer" and "window" only rows where it is False (steer until
    the first answer / for the first W generated tokens, then release); it is required for
    those three and ignored by "always". Which detector each schedule needs:
    ``SCHEDULE_DETECTORS`` and ``steering.schedule.detector_for_schedule``.
    """
    config = SteeringConfig(k=k, eps=eps, schedule=schedule)
    if not expert_sets:
        raise ValueError("expert_sets is empty; pass at least one layer (or skip the hook)")
    sizes = {np.asarray(a).shape for a, _ in expert_sets.values()}
    if len(sizes) != 1 or len(next(iter(sizes))) != 1:
        raise ValueError(f"all activate masks must be 1-D with one shared size, got {sizes}")
    num_experts = next(iter(sizes))[0]
    checked: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for layer, (activate, suppress) in expert_sets.items():
        if int(layer) < 0:
            raise ValueError(f"layer indices must be >= 0, got {layer}")
        try:
            checked[int(layer)] = validate_expert_sets(activate, suppress, num_experts, config.k)
        except ValueError as err:
            raise ValueError(f"layer {layer}: {err}") from None
    num_table_layers = max(checked) + 1
    activate_le = np.zeros((num_table_layers, num_experts), bool)
    suppress_le = np.zeros((num_table_layers, num_experts), bool)
    for layer, (activate, suppress) in checked.items():
        activate_le[layer], suppress_le[layer] = activate, suppress

    def _gate_rows(steered: jax.Array, logits: jax.Array, active: jax.Array | None) -> jax.Array:
        if config.schedule == "always":
            return steered
        if active is None:
            raise ValueError(
                f"schedule={config.schedule!r} needs the per-sequence `active` flag [B]: run "
                f"the sampler with an answer_detector (a {SCHEDULE_DETECTORS[config.schedule]} "
                f"detector, see steering.schedule.detector_for_schedule)"
            )
        active_b = jnp.asarray(active, dtype=bool)
        if active_b.ndim != 1 or active_b.shape[0] != logits.shape[0]:
            raise ValueError(
                f"active must be bool [B={logits.shape[0]}], got shape {active_b.shape}"
            )
        if config.schedule in _INVERTED:
            active_b = ~active_b
        active_b11 = active_b.reshape((-1,) + (1,) * (logits.ndim - 1))
        return jnp.where(active_b11, steered, logits.astype(steered.dtype))

    def hook(logits_btE: jax.Array, layer_idx, *, active: jax.Array | None = None) -> jax.Array:
        if logits_btE.shape[-1] != num_experts:
            raise ValueError(
                f"hook built for {num_experts} experts but got logits with last axis "
                f"{logits_btE.shape[-1]}"
            )
        if _is_concrete(layer_idx) and not isinstance(layer_idx, jax.Array):
            layer = int(layer_idx)
            if layer not in checked:
                return logits_btE
            activate, suppress = checked[layer]
            steered = steer_router_logits(logits_btE, activate, suppress, config.eps)
            return _gate_rows(steered, logits_btE, active)
        # Traced (or device) layer index: gather this layer's masks; layers outside the
        # table read as empty and must come back unchanged (not as log-softmax values).
        activate = jnp.take(jnp.asarray(activate_le), layer_idx, axis=0, mode="fill",
                            fill_value=False)
        suppress = jnp.take(jnp.asarray(suppress_le), layer_idx, axis=0, mode="fill",
                            fill_value=False)
        steered = steer_router_logits(logits_btE, activate, suppress, config.eps)
        steered = _gate_rows(steered, logits_btE, active)
        any_edit = jnp.any(activate) | jnp.any(suppress)
        return jnp.where(any_edit, steered, logits_btE.astype(steered.dtype))

    return hook


# The paper's prompt control: ask for brevity in natural language instead of editing the
# router (it saved fewer tokens than routing in all 16 model x benchmark cells).
CONCISE_SYSTEM_PROMPT = (
    "Be concise. Reason only as much as needed, answer directly, and skip unnecessary "
    "re-checking of work you have already verified."
)


def _excluded_mask(entry: object, num_experts: int, layer: int) -> np.ndarray:
    """One layer of ``disjoint_from`` as a bool ``[E]`` mask: a mask itself, or the union
    of an ``(activate, suppress)`` pair."""
    masks = entry if isinstance(entry, tuple) else (entry,)
    excluded = np.zeros(num_experts, bool)
    for mask in masks:
        mask = np.asarray(mask)
        if mask.shape != (num_experts,) or mask.dtype != np.bool_:
            raise ValueError(
                f"disjoint_from layer {layer}: masks must be bool ({num_experts},), got "
                f"{mask.dtype} {mask.shape}"
            )
        excluded |= mask
    return excluded


def random_expert_sets_like(
    expert_sets: ExpertSets,
    num_experts: int,
    seed: int,
    disjoint_from: Mapping[int, np.ndarray | tuple[np.ndarray, np.ndarray]] | None = None,
) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """The paper's random control: per layer, sets of the same sizes drawn uniformly at random.

    Random activate and suppress sets are drawn disjoint, so they pass the same constraints
    as the sets they imitate.

    Args:
      expert_sets: ``{layer: (activate_mask[E], suppress_mask[E])}`` to imitate.
      num_experts: E, the *routed* experts. Masks index the router logits only, so a
        shared expert (the always-on expert of shared-expert MoE blocks, which has no
        router logit and which the hook never edits) can never be drawn.
      seed: one ``np.random.default_rng(seed)`` draws every layer in ascending layer order;
        the same inputs and seed give the same sets.
      disjoint_from: per layer, experts the random sets must avoid -- a bool ``[E]`` mask
        or an ``(activate, suppress)`` pair (their union is avoided). Pass ``expert_sets``
        itself so the control shares no expert with the steered sets (otherwise a random
        draw may re-pick some of them and understate the contrast), or the union of every
        behaviour's sets. Layers missing from it avoid nothing. Raises ValueError when a
        layer has fewer remaining experts than the sets need. None (default) draws from all
        ``E`` experts, exactly as before the option existed.
    """
    rng = np.random.default_rng(seed)
    random_sets: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for layer in sorted(expert_sets):
        activate, suppress = (np.asarray(m) for m in expert_sets[layer])
        for name, mask in (("activate", activate), ("suppress", suppress)):
            if mask.shape != (num_experts,):
                raise ValueError(
                    f"layer {layer}: {name} mask must have shape ({num_experts},), got "
                    f"{mask.shape}"
                )
        activate, suppress = activate.astype(bool), suppress.astype(bool)
        n_activate, n_suppress = int(activate.sum()), int(suppress.sum())
        if n_activate + n_suppress > num_experts:
            raise ValueError(f"layer {layer}: sets larger than {num_experts} experts")
        excluded = np.zeros(num_experts, bool)
        if disjoint_from is not None and layer in disjoint_from:
            excluded = _excluded_mask(disjoint_from[layer], num_experts, layer)
        available = np.flatnonzero(~excluded)
        if n_activate + n_suppress > available.size:
            raise ValueError(
                f"layer {layer}: need {n_activate + n_suppress} random experts disjoint from "
                f"the {int(excluded.sum())} excluded, but only {available.size} of "
                f"{num_experts} remain"
            )
        # permutation(arange(E)) consumes the generator exactly as permutation(E) did.
        chosen = rng.permutation(available)[: n_activate + n_suppress]
        new_activate = np.zeros(num_experts, bool)
        new_suppress = np.zeros(num_experts, bool)
        new_activate[chosen[:n_activate]] = True
        new_suppress[chosen[n_activate:]] = True
        random_sets[layer] = (new_activate, new_suppress)
    return random_sets
