"""Router telemetry from a real model: teacher-forced scoring and generation-time capture.

Both paths stream into a :class:`~spade_jax.steering.telemetry.TelemetryWriter` one batch at
a time, so a corpus of traces never sits in memory (the writer holds at most one chunk).

  * :func:`score_and_record` -- teacher forcing: run the model over given token sequences
    (e.g. traces sampled earlier, or a labelled corpus) and record every token's routing.
  * :func:`generate_and_record` -- sample through ``spade_jax.rollout.generate`` with
    ``return_router=True`` and record the routing of every token the model was fed
    (prompt + generated tokens except the last, which is never fed).

Per token the record is: token id, position, sequence id, router logits before top-k of
every MoE layer ``[L, E]`` and the selected experts ``[L, k]``. The L axis counts MoE
layers only; :func:`moe_layer_indices` maps it back to decoder-layer indices (what the
steering hook is keyed by). Both functions write it into the manifest under
``metadata["moe_layers"]``.

Teacher forcing can also record the residual stream entering chosen decoder layers
(``CaptureConfig.residual_layers``; ``metadata["residual_layers"]``): the residual-probe
baseline of the Read step. Only the layers asked for are kept, since each costs D values per
token where a router costs E.

Both functions skip the sequence ids a resumed writer (``TelemetryWriter(..., resume=True)``)
found on disk, so re-running a crashed capture into its directory finishes it without
duplicating a sequence.

Legend: ``B`` batch, ``T`` padded length, ``L`` MoE layers, ``E`` experts, ``k`` top-k,
``R`` recorded residual layers, ``D`` hidden size.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from spade_jax.steering.telemetry import TelemetryWriter


@dataclasses.dataclass(frozen=True)
class CaptureConfig:
    """Attributes:
    batch_size: sequences per forward (teacher forcing) or per ``generate`` call.
    length_bucket_min: padded lengths are powers of two >= this, so few shapes compile.
    residual_layers: decoder-layer indices whose incoming residual stream teacher forcing
      also records (``ModelOutput.residuals``, Hugging Face's ``hidden_states[l]``); empty
      (the default) records routing only, with the same compiled program as before.
    """

    batch_size: int = 8
    length_bucket_min: int = 16
    residual_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.length_bucket_min < 1:
            raise ValueError(f"length_bucket_min must be >= 1, got {self.length_bucket_min}")
        layers = tuple(self.residual_layers)
        if any(not isinstance(i, int) or i < 0 for i in layers) or len(set(layers)) != len(layers):
            raise ValueError(f"residual_layers must be distinct non-negative layer indices, "
                             f"got {self.residual_layers!r}")
        object.__setattr__(self, "residual_layers", layers)  # hashable: a static jit argument


def moe_layer_indices(model: Any) -> tuple[int, ...]:
    """Decoder-layer indices of the model's MoE layers (the telemetry's L axis, in order)."""
    config = model.config
    layers = tuple(i for i in range(config.num_layers)
                   if config.num_experts and config.is_moe_layer(i))
    if not layers:
        raise ValueError("the model has no MoE layers, so there is no router to record")
    return layers


def _bucket(length: int, minimum: int) -> int:
    return max(minimum, 1 << max(0, length - 1).bit_length())


@functools.partial(jax.jit, static_argnames=("graphdef", "router_hook", "residual_layers"))
def _forward_router(graphdef, params, ids_bt, mask_bt, router_hook: Callable | None,
                    residual_layers: tuple[int, ...] = ()):
    """Router logits and selections of the MoE layers for one right-padded batch, and the
    residuals entering ``residual_layers`` when any are asked for."""
    model = nnx.merge(graphdef, params)
    out = model(ids_bt, attention_mask_bt=mask_bt, router_hook=router_hook, return_logits=False,
                return_residuals=residual_layers or False)
    logits = [x for x in out.router_logits if x is not None]
    selected = [x for x in out.selected_experts if x is not None]
    routing = jnp.stack(logits, axis=2), jnp.stack(selected, axis=2)  # [B,T,L,E], [B,T,L,k]
    return (*routing, out.residuals) if residual_layers else routing  # + [B,T,R,D]


def _check_sequences(sequences: Sequence[Sequence[int]], vocab_size: int) -> list[np.ndarray]:
    arrays = []
    for i, seq in enumerate(sequences):
        ids = np.asarray(seq, np.int64)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"sequence {i} must be a non-empty 1-D list of token ids")
        if ids.min() < 0 or ids.max() >= vocab_size:
            raise ValueError(f"sequence {i} has token ids outside [0, {vocab_size})")
        arrays.append(ids.astype(np.int32))
    return arrays


def _sequence_ids(sequence_ids: Sequence[int] | None, count: int) -> np.ndarray:
    ids = np.arange(count) if sequence_ids is None else np.asarray(sequence_ids, np.int64)
    if ids.shape != (count,):
        raise ValueError(f"sequence_ids must have one id per sequence ({count}), got {ids.shape}")
    return ids


def _not_yet_recorded(seq_ids: np.ndarray, writer: TelemetryWriter) -> list[int]:
    """Indices of the sequences whose ids a resumed writer did not find on disk."""
    done = writer.resumed_sequence_ids
    return [i for i, sid in enumerate(seq_ids.tolist()) if sid not in done]


def _record_residual_layers(model: Any, writer: TelemetryWriter, layers: tuple[int, ...]) -> None:
    """Checks ``layers`` against the model and notes them in the manifest (a resumed
    directory must have recorded the same ones)."""
    if not layers:
        return
    if max(layers) >= model.config.num_layers:
        raise ValueError(f"residual_layers {list(layers)} must be in "
                         f"[0, {model.config.num_layers})")
    recorded = writer.metadata.setdefault("residual_layers", list(layers))
    if list(recorded) != list(layers):
        raise ValueError(f"this telemetry records residual layers {recorded}, "
                         f"not {list(layers)}")


def score_and_record(
    model: Any,
    sequences: Sequence[Sequence[int]],
    writer: TelemetryWriter,
    sequence_ids: Sequence[int] | None = None,
    config: CaptureConfig = CaptureConfig(),
    router_hook: Callable | None = None,
) -> int:
    """Teacher-forced routing of ``sequences`` appended to ``writer``; returns tokens written.

    Sequences are right-padded to a power-of-two bucket and masked, so padding never
    reaches a real token's attention; only real tokens are written (positions 0..n-1).
    ``router_hook`` (e.g. a steering hook) is applied exactly as during sampling. With
    ``config.residual_layers`` each token also gets its residual stream entering those
    layers ``[R, D]``. Sequences whose ids a resumed writer already holds are skipped.
    """
    arrays = _check_sequences(sequences, model.config.vocab_size)
    seq_ids = _sequence_ids(sequence_ids, len(arrays))
    todo = _not_yet_recorded(seq_ids, writer)
    arrays, seq_ids = [arrays[i] for i in todo], seq_ids[todo]
    writer.metadata.setdefault("moe_layers", list(moe_layer_indices(model)))
    _record_residual_layers(model, writer, config.residual_layers)
    graphdef, params = nnx.split(model)
    written = 0
    for start in range(0, len(arrays), config.batch_size):
        batch = arrays[start : start + config.batch_size]
        rows = _bucket(len(batch), 1)
        width = _bucket(max(len(a) for a in batch), config.length_bucket_min)
        ids_bt = np.zeros((rows, width), np.int32)
        mask_bt = np.zeros((rows, width), bool)
        for b, ids in enumerate(batch):
            ids_bt[b, : len(ids)], mask_bt[b, : len(ids)] = ids, True
        outputs = _forward_router(graphdef, params, ids_bt, mask_bt, router_hook,
                                  config.residual_layers)
        n = len(batch)
        writer.append_batch(
            ids_bt[:n],
            np.moveaxis(np.asarray(outputs[0])[:n], 2, 0),
            np.moveaxis(np.asarray(outputs[1])[:n], 2, 0),
            seq_ids[start : start + n],
            valid_bt=mask_bt[:n],
            residuals_btrd=np.asarray(outputs[2])[:n] if config.residual_layers else None,
        )
        written += int(mask_bt[:n].sum())
    return written


def generate_and_record(
    model: Any,
    prompts: Sequence[Sequence[int]],
    writer: TelemetryWriter,
    max_new_tokens: int,
    sequence_ids: Sequence[int] | None = None,
    config: CaptureConfig = CaptureConfig(),
    **generate_kwargs: Any,
):
    """Samples ``prompts`` (``rollout.generate``; keyword arguments pass through: temperature,
    seed, router_hook, answer_detector, stop_tokens, ...) and records the routing of every
    fed token. Returns the list of ``GenerationResult`` objects, one per batch.

    Row ``i`` of sequence ``s`` in the telemetry is the token ``(prompt + generated)[i]`` at
    position ``i``; the routing is what the model used while predicting token ``i + 1``.
    Prompts whose ids a resumed writer already holds are skipped (the rest are sampled
    afresh, so a resumed run's samples need not equal an uninterrupted run's). Residuals
    are not recorded here (``config.residual_layers`` must be empty): record them by
    teacher-forcing the generated sequences with :func:`score_and_record`.
    """
    from spade_jax.rollout import generate

    if generate_kwargs.pop("return_router", True) is not True:
        raise ValueError("generate_and_record always records the router (return_router=True)")
    if config.residual_layers:
        raise ValueError("generate_and_record does not record residuals; teacher-force the "
                         "generated sequences with score_and_record instead")
    _check_sequences(prompts, model.config.vocab_size)
    seq_ids = _sequence_ids(sequence_ids, len(prompts))
    todo = _not_yet_recorded(seq_ids, writer)
    prompts, seq_ids = [prompts[i] for i in todo], seq_ids[todo]
    writer.metadata.setdefault("moe_layers", list(moe_layer_indices(model)))
    results = []
    for start in range(0, len(prompts), config.batch_size):
        batch = [list(p) for p in prompts[start : start + config.batch_size]]
        result = generate(model, batch, max_new_tokens, return_router=True, **generate_kwargs)
        for b, prompt in enumerate(batch):
            fed = np.asarray(prompt + list(result.tokens[b]), np.int32)[:-1]
            logits_tle = np.asarray(result.router_logits[b])
            selected_tlk = np.asarray(result.selected_experts[b])
            if logits_tle.shape[0] != len(fed):
                raise RuntimeError(f"sampler returned {logits_tle.shape[0]} router rows for "
                                   f"{len(fed)} fed tokens")
            writer.append(fed, np.arange(len(fed)), np.full(len(fed), seq_ids[start + b]),
                          logits_tle, selected_tlk)
        results.append(result)
    return results
