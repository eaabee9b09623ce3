"""The analytic cost model: FLOPs and HBM / ICI bytes of one program counted from the
architecture, and the parallelism a mesh gives.

XLA's cost analysis counts the body of every loop once, and with scan over layers, the
microbatch scan and query-chunked attention most of the work is in loops; so the step time
is a roofline on these counts (``Plan.seconds``): max(FLOPs / peak FLOP/s, HBM bytes / HBM
bandwidth, ICI bytes / ICI bandwidth) per chip, perfect overlap assumed, a lower bound; MFU
is then an upper bound. Model FLOPs follow PaLM: 3 forwards for training (6 N_active per
token plus attention), 1 for sampling; N_active = parameters a token multiplies through
(active parameters less the untied input embedding).
"""

from __future__ import annotations

import dataclasses

import numpy as np


def matmul_params(arch) -> int:
    """Parameters a token multiplies through (N_active of the MFU): the active parameters
    less the input embedding table, a gather (unless it is tied to the LM head)."""
    embedding = 0 if arch.tie_word_embeddings else arch.vocab_size * arch.hidden_size
    return arch.param_count(active=True) - embedding


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class Parallelism:
    """Ways the slice splits the work: batch rows, FSDP parameter shards, expert shards."""

    chips: int
    batch: int
    fsdp: int
    expert: int


def batch_axes(rules, mesh=None) -> tuple[str, ...]:
    """Mesh axes the "batch" rule splits rows over (size-1 axes dropped when ``mesh``)."""
    from spade_jax import sharding  # jax is imported late: the CLI picks its platform first

    axes = sharding.logical_to_spec(("batch",), rules, mesh)[0]
    return (axes,) if isinstance(axes, str) else tuple(axes or ())


def parallelism(mesh_shape: dict[str, int], chips: int, rules=None) -> Parallelism:
    """Ways a mesh of ``mesh_shape`` splits rows (by the "batch" rule), parameters and experts."""
    from spade_jax import sharding

    batch = batch_axes(rules or sharding.DEFAULT_RULES)
    return Parallelism(chips=chips, batch=int(np.prod([mesh_shape.get(a, 1) for a in batch])),
                       fsdp=int(mesh_shape.get("fsdp", 1)), expert=int(mesh_shape.get("expert", 1)))


def analytic_cost(program: str, arch, options, par: Parallelism, *, rows: int, length: int,
                  keys: int, microbatches: int = 1, cache_itemsize: int = 2) -> dict[str, float]:
    """FLOPs and bytes of one call, counted from the architecture (whole-slice FLOPs, per-chip
    bytes). ``rows`` x ``length`` tokens each attend to ``keys`` key slots (the full masked
    score matrix is computed, as the model does).

    FLOPs: a forward is 2 N_active per token plus 4 n h S per token and layer for attention
    (QK^T and PV); training is forward + 2x backward, plus what remat recomputes ("full": the
    forward again; "dots_no_batch": attention; a query-chunked attention recomputes its
    blocks once more). ``model_flops`` (for MFU, PaLM's definition) is 3 forwards for
    training and 1 for sampling, no recomputation.

    HBM bytes per chip (lower bound): the bf16 weights a chip multiplies through (after the
    FSDP all-gather: every dense weight, and its expert shard's experts) once per pass, plus
    its fp32 parameter shard; for decode also its rows' KV cache.

    ICI bytes per chip (lower bound): FSDP all-gathers of bf16 weights per pass and a
    reduce-scatter of fp32 gradients per microbatch; expert-parallel all-to-alls of token
    rows (``"expert_parallel"`` is dropless: its buffers hold ``expert`` x the average
    load, and the whole buffer moves).
    """
    n, h, layers, d = arch.num_heads, arch.head_dim, arch.num_layers, arch.hidden_size
    active = matmul_params(arch)
    total = arch.param_count()
    moe_layers = sum(arch.is_moe_layer(i) for i in range(layers))
    expert_params = moe_layers * arch.num_experts * 3 * d * arch.moe_intermediate_size
    tokens = rows * length
    attention = 4 * n * h * keys * layers  # per token
    forward = tokens * (2 * active + attention)
    # bf16 weights one chip multiplies through, after FSDP gathers (experts: its shard only).
    gathered = 2 * ((total - expert_params) + expert_params / par.expert)
    fsdp_gather = gathered * (par.fsdp - 1) / par.fsdp if par.fsdp > 1 else 0.0
    tokens_per_chip = tokens / par.batch  # over the whole call (all microbatches)
    a2a_layer = 0.0  # bytes one chip receives per MoE layer per pass, whole call
    if options.moe_impl == "expert_parallel" and par.expert > 1 and moe_layers:
        # dropless: N x C slots, C = t * min(k, E / N) per (source, destination) pair
        per_pair = min(arch.num_experts_per_tok, arch.num_experts // par.expert)
        buffer = tokens_per_chip * per_pair * par.expert
        a2a_layer = 2 * buffer * d * 2 * (par.expert - 1) / par.expert  # there and back, bf16

    if program == "train":
        policy = options.remat_policy
        recompute = {"full": forward, "dots_no_batch": tokens * attention}.get(policy, 0.0)
        if options.attention_chunk and length > options.attention_chunk:
            recompute += tokens * attention
        passes = 3 if policy != "none" else 2  # forward (+ remat forward) + backward
        return dict(
            hardware_flops=3 * forward + recompute,
            model_flops=3 * forward,
            hbm_traffic=microbatches * passes * gathered + 3 * 4 * total / par.chips,
            # per microbatch: weight gathers per pass and a gradient reduction (fp32); the
            # token all-to-alls scale with tokens, so they are counted for the whole call
            ici_traffic=(microbatches * (passes * fsdp_gather
                                         + 2 * gathered * (par.batch - 1) / par.batch)
                         + passes * moe_layers * a2a_layer),
        )
    kv_bytes = 0.0
    if program == "decode":
        kv_bytes = (rows / par.batch) * keys * layers * 2 * arch.num_kv_heads * h * cache_itemsize
    return dict(
        hardware_flops=forward,
        model_flops=forward,
        hbm_traffic=gathered + 4 * total / par.chips + kv_bytes,
        ici_traffic=fsdp_gather + moe_layers * a2a_layer,
    )


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
