"""Recorded MoE routing (router replay): the experts each token was routed to when it was
sampled, kept compactly from the sampler to the train step.

A recording is one array per sequence, ``[T_fed, L, X]``: for each fed token (position
0 .. T_fed-1 of the token stream), for each MoE layer (``L`` = the model's MoE layers in
order), the ``X`` experts the router selected. The dtype is the smallest unsigned type
that holds the expert ids (uint8 up to 256 experts, else uint16): 1 byte per
(token, layer, expert) for Qwen3-30B-A3B (128 experts, k = 8, 48 layers = 384 bytes per
token). The last sampled token is never fed back, so ``T_fed`` is the stream's length or
one less; :func:`routing_per_layer` expands a recording into ``TrainSequence.routing``.

Multi-turn streams: each token keeps the routing of the sampler call that first fed it
(:func:`extend_routing`), the call whose KV cache later tokens attended to.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

import numpy as np


def routing_dtype(num_experts: int) -> np.dtype:
    """The compact dtype for expert ids below ``num_experts``."""
    if num_experts <= 256:
        return np.dtype(np.uint8)
    if num_experts <= 65536:
        return np.dtype(np.uint16)
    raise ValueError(f"{num_experts} experts do not fit a 16-bit expert id")


def compact_routing(selected_tlx: np.ndarray, num_experts: int) -> np.ndarray:
    """``selected_tlx`` ([T, L, X] expert ids, any int dtype) in the compact dtype."""
    selected = np.asarray(selected_tlx)
    if selected.ndim != 3:
        raise ValueError(f"routing must be [T, L, X], got shape {selected.shape}")
    if selected.size and (selected.min() < 0 or selected.max() >= num_experts):
        raise ValueError(f"expert ids outside [0, {num_experts}) in the routing")
    return selected.astype(routing_dtype(num_experts))


def extend_routing(recorded: np.ndarray | None, call_tlx: np.ndarray) -> np.ndarray:
    """The stream's recording after a sampler call that fed positions ``0 ..
    len(call_tlx)-1``: positions already recorded keep their first routing, new ones are
    appended from ``call_tlx``."""
    if recorded is None:
        return np.ascontiguousarray(call_tlx)
    if call_tlx.shape[1:] != recorded.shape[1:]:
        raise ValueError(f"routing layout changed between calls: {recorded.shape[1:]} -> "
                         f"{call_tlx.shape[1:]}")
    if len(call_tlx) < len(recorded):
        raise ValueError(f"a later call fed {len(call_tlx)} positions, fewer than the "
                         f"{len(recorded)} already recorded")
    return np.concatenate([recorded, call_tlx[len(recorded):].astype(recorded.dtype)], axis=0)


def routing_per_layer(routing_tlx: np.ndarray, moe_layers: Sequence[int], num_layers: int
                      ) -> list[np.ndarray | None]:
    """A recording as ``TrainSequence.routing``: per model layer, ``[T_fed, X]`` int32
    experts (None for dense layers)."""
    routing = np.asarray(routing_tlx)
    if routing.ndim != 3 or routing.shape[1] != len(moe_layers):
        raise ValueError(f"routing of shape {routing.shape} does not match {len(moe_layers)} "
                         "MoE layers")
    out: list[np.ndarray | None] = [None] * num_layers
    for j, layer in enumerate(moe_layers):
        out[layer] = routing[:, j].astype(np.int32)
    return out


def bytes_per_token(num_moe_layers: int, experts_per_token: int, num_experts: int) -> int:
    """Host bytes a recording costs per token (the train batch holds int32: 4x this)."""
    return num_moe_layers * experts_per_token * routing_dtype(num_experts).itemsize


def encode_routing(routing: np.ndarray | None) -> dict[str, Any] | None:
    """JSON-able form for run state: dtype, shape and the base64 of the raw bytes."""
    if routing is None:
        return None
    routing = np.ascontiguousarray(routing)
    return {"dtype": routing.dtype.str, "shape": list(routing.shape),
            "data": base64.b64encode(routing.tobytes()).decode("ascii")}


def decode_routing(data: dict[str, Any] | None) -> np.ndarray | None:
    """Inverse of :func:`encode_routing`."""
    if data is None:
        return None
    raw = base64.b64decode(data["data"])
    return np.frombuffer(raw, dtype=np.dtype(data["dtype"])).reshape(data["shape"]).copy()
