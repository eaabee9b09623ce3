"""Named expert sets on disk: from risk-difference scores to the steering hook's masks.

A file holds, per behaviour, the experts to steer in each decoder layer::

    {"format": "spade_jax.expert_sets/1", "num_experts": 128, "top_k": 8,
     "sets": {"planning":   {"12": [3, 77, 101]},
              "reflection": {"12": [5], "13": [40, 41]}}}

Layer keys are *decoder-layer* indices (what the model hands the router hook), not the
telemetry's MoE-layer rows; :func:`expert_sets_from_scores` maps one to the other with the
telemetry's ``moe_layers``. :func:`steering_masks` turns "suppress these behaviours,
activate those" into ``{layer: (activate_mask[E], suppress_mask[E])}`` for
:func:`spade_jax.steering.operator.make_steering_hook`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from spade_jax.steering.experts import top_n_experts
from spade_jax.steering.labels import BEHAVIOURS
from spade_jax.steering.operator import validate_expert_sets

FORMAT = "spade_jax.expert_sets/1"


class ExpertSetError(ValueError):
    """An expert-set file or request the steering hook cannot use."""


@dataclasses.dataclass(frozen=True)
class ExpertSets:
    """Experts per behaviour and decoder layer.

    Attributes:
      num_experts: E, routed experts per MoE layer of the model the sets belong to.
      top_k: k, experts selected per token (bounds how many may be activated/suppressed).
      sets: behaviour name -> decoder layer -> sorted expert ids.
      scores: optional, the score that chose each expert (e.g. its risk difference), in the
        same shape as ``sets`` and aligned with its sorted ids; a dose sweep
        (``steer run --dose``) takes each layer's top n by it. None: no ranking known.
    """

    num_experts: int
    top_k: int
    sets: Mapping[str, Mapping[int, tuple[int, ...]]]
    scores: Mapping[str, Mapping[int, tuple[float, ...]]] | None = None

    def __post_init__(self) -> None:
        if self.num_experts < 1 or not 1 <= self.top_k <= self.num_experts:
            raise ExpertSetError(
                f"need num_experts >= 1 and 1 <= top_k <= num_experts, got "
                f"num_experts={self.num_experts}, top_k={self.top_k}")
        if not self.sets:
            raise ExpertSetError("no behaviours in 'sets'")
        clean: dict[str, dict[int, tuple[int, ...]]] = {}
        for name, layers in self.sets.items():
            if not isinstance(name, str) or not name:
                raise ExpertSetError(f"behaviour names must be non-empty strings, got {name!r}")
            if not isinstance(layers, Mapping) or not layers:
                raise ExpertSetError(f"behaviour {name!r}: expected a non-empty {{layer: experts}}")
            clean[name] = {}
            for layer, experts in layers.items():
                where = f"behaviour {name!r} layer {layer}"
                if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
                    raise ExpertSetError(f"{where}: layer must be an int >= 0")
                ids = list(experts) if isinstance(experts, Sequence) else None
                if not ids or any(isinstance(e, bool) or not isinstance(e, int) for e in ids):
                    raise ExpertSetError(f"{where}: experts must be a non-empty list of ints")
                bad = [e for e in ids if not 0 <= e < self.num_experts]
                if bad:
                    raise ExpertSetError(
                        f"{where}: expert ids {bad} outside [0, {self.num_experts})")
                if len(set(ids)) != len(ids):
                    raise ExpertSetError(f"{where}: duplicate expert ids in {ids}")
                clean[name][layer] = tuple(sorted(ids))
        object.__setattr__(self, "sets", clean)
        if self.scores is not None:
            object.__setattr__(self, "scores", self._aligned_scores(clean))

    def _aligned_scores(self, clean: Mapping[str, Mapping[int, tuple[int, ...]]]
                        ) -> dict[str, dict[int, tuple[float, ...]]]:
        """``scores`` re-ordered with the ids they were given with (now sorted)."""
        aligned: dict[str, dict[int, tuple[float, ...]]] = {}
        for name, layers in clean.items():
            given = (self.scores or {}).get(name)
            if given is None:
                continue
            aligned[name] = {}
            for layer, ids in layers.items():
                values = given.get(layer)
                if values is None:
                    continue
                listed = list(self.sets[name][layer])
                if len(values) != len(listed) or not all(
                        isinstance(v, int | float) and not isinstance(v, bool) for v in values):
                    raise ExpertSetError(
                        f"behaviour {name!r} layer {layer}: scores must list one number per "
                        f"expert ({len(listed)}), got {values!r}")
                by_id = dict(zip(listed, values, strict=True))
                aligned[name][layer] = tuple(float(by_id[e]) for e in ids)
        return aligned

    def sizes(self, name: str) -> dict[int, int]:
        return {layer: len(e) for layer, e in self.sets[name].items()}


def expert_sets_from_scores(
    scores_cle: np.ndarray,
    n: int,
    moe_layers: Sequence[int],
    top_k: int,
    behaviours: Sequence[str] = BEHAVIOURS,
    layer: int | None = None,
) -> ExpertSets:
    """Top-``n`` (layer, expert) pairs per behaviour from ``[C, L, E]`` scores (e.g. risk
    difference), with the telemetry row ``l`` mapped to decoder layer ``moe_layers[l]``.

    ``layer`` (a decoder-layer index) restricts the competition to one layer, as the
    paper's per-layer Top-10 sets do.
    """
    scores = np.asarray(scores_cle)
    if scores.ndim != 3 or scores.shape[0] != len(behaviours) or scores.shape[1] != len(moe_layers):
        raise ValueError(f"scores must be [C={len(behaviours)}, L={len(moe_layers)}, E], got "
                         f"{scores.shape}")
    row = None
    if layer is not None:
        if layer not in moe_layers:
            raise ValueError(f"layer {layer} is not an MoE layer {tuple(moe_layers)}")
        row = list(moe_layers).index(layer)
    sets: dict[str, dict[int, list[int]]] = {}
    chosen_scores: dict[str, dict[int, list[float]]] = {}
    for c, (name, chosen) in enumerate(zip(behaviours, top_n_experts(scores, n, row),
                                           strict=True)):
        per_layer: dict[int, list[int]] = {}
        per_layer_scores: dict[int, list[float]] = {}
        for telemetry_row, expert in sorted(chosen):
            layer_id = int(moe_layers[telemetry_row])
            per_layer.setdefault(layer_id, []).append(expert)
            per_layer_scores.setdefault(layer_id, []).append(
                float(scores[c, telemetry_row, expert]))
        sets[name], chosen_scores[name] = per_layer, per_layer_scores
    return ExpertSets(scores.shape[2], top_k, sets, chosen_scores)


def save_expert_sets(path: str | Path, sets: ExpertSets) -> None:
    payload = {
        "format": FORMAT,
        "num_experts": sets.num_experts,
        "top_k": sets.top_k,
        "sets": {name: {str(layer): list(experts) for layer, experts in sorted(layers.items())}
                 for name, layers in sets.sets.items()},
    }
    if sets.scores:  # aligned with the listed ids: the dose sweep ranks by them
        payload["scores"] = {
            name: {str(layer): list(values) for layer, values in sorted(layers.items())}
            for name, layers in sets.scores.items()}
    Path(path).write_text(json.dumps(payload, indent=1) + "\n")


def load_expert_sets(path: str | Path) -> ExpertSets:
    """Reads an expert-set file; every error names the file and what is wrong."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ExpertSetError(f"{path}: no such expert-set file") from None
    except json.JSONDecodeError as err:
        raise ExpertSetError(f"{path}: invalid JSON ({err.msg}, line {err.lineno})") from None
    try:
        if not isinstance(raw, dict):
            raise ExpertSetError("expected a JSON object")
        if raw.get("format") != FORMAT:
            raise ExpertSetError(f"'format' must be {FORMAT!r}, got {raw.get('format')!r}")
        missing = [k for k in ("num_experts", "top_k", "sets") if k not in raw]
        if missing:
            raise ExpertSetError(f"missing key(s) {missing}")
        if not isinstance(raw["sets"], dict):
            raise ExpertSetError("'sets' must be an object {behaviour: {layer: [experts]}}")
        sets = {}
        for name, layers in raw["sets"].items():
            if not isinstance(layers, dict):
                raise ExpertSetError(f"behaviour {name!r}: expected {{layer: [experts]}}")
            try:
                sets[name] = {int(layer): experts for layer, experts in layers.items()}
            except ValueError:
                raise ExpertSetError(
                    f"behaviour {name!r}: layer keys must be integers, got {list(layers)}"
                ) from None
        for key in ("num_experts", "top_k"):
            if isinstance(raw[key], bool) or not isinstance(raw[key], int):
                raise ExpertSetError(f"'{key}' must be an int, got {raw[key]!r}")
        scores = raw.get("scores")
        if scores is not None:
            if not isinstance(scores, dict) or not all(isinstance(v, dict)
                                                       for v in scores.values()):
                raise ExpertSetError("'scores' must be an object {behaviour: {layer: [scores]}}")
            try:
                scores = {name: {int(layer): values for layer, values in layers.items()}
                          for name, layers in scores.items()}
            except ValueError:
                raise ExpertSetError("'scores' layer keys must be integers") from None
        return ExpertSets(raw["num_experts"], raw["top_k"], sets, scores)
    except ExpertSetError as err:
        raise ExpertSetError(f"{path}: {err}") from None


def steering_masks(
    sets: ExpertSets,
    suppress: Sequence[str] = (),
    activate: Sequence[str] = (),
) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """``{layer: (activate_mask, suppress_mask)}`` for the union of the named behaviours' sets.

    Raises ExpertSetError for unknown names, an expert both activated and suppressed, or a
    layer whose sets break the operator's size rules (|A| <= k, E - |S| >= k).
    """
    if not suppress and not activate:
        raise ExpertSetError("name at least one behaviour to suppress or activate")
    unknown = sorted(name for name in {*suppress, *activate} if name not in sets.sets)
    if unknown:
        raise ExpertSetError(f"behaviour(s) {unknown} not in the expert-set file; it has "
                             f"{sorted(sets.sets)}")
    num_experts = sets.num_experts
    masks: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for names, slot in ((activate, 0), (suppress, 1)):
        for name in names:
            for layer, experts in sets.sets[name].items():
                pair = masks.setdefault(layer, (np.zeros(num_experts, bool),
                                                np.zeros(num_experts, bool)))
                pair[slot][list(experts)] = True
    for layer, (activate_mask, suppress_mask) in masks.items():
        try:
            validate_expert_sets(activate_mask, suppress_mask, num_experts, sets.top_k)
        except ValueError as err:
            raise ExpertSetError(f"layer {layer}: {err}") from None
    return masks
