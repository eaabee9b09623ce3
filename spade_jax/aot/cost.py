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


@dataclasses.dataclass(frozen=True)
class Parallelism:
    """Ways the slice splits the work: batch rows, FSDP parameter shards, expert shards,
    tensor-parallel shards (heads, MLP hidden, vocab)."""

    chips: int
    batch: int
    fsdp: int
    expert: int
    tensor: int = 1


def weight_split(arch) -> tuple[int, int]:
    """(dense, expert) parameter counts: what every chip multiplies through after FSDP
    gathers, and the routed experts (split over the expert axis)."""
    d, layers = arch.hidden_size, arch.num_layers
    moe_layers = sum(arch.is_moe_layer(i) for i in range(layers))
    experts = moe_layers * arch.num_experts * 3 * d * arch.moe_intermediate_size
    return arch.param_count() - experts, experts


def local_params(arch, par: Parallelism) -> float:
    """Parameters stored on one chip: dense weights split over FSDP x tensor ways, experts
    also over the expert ways (norms, split nowhere, are negligible)."""
    dense, experts = weight_split(arch)
    return dense / (par.fsdp * par.tensor) + experts / (par.fsdp * par.tensor * par.expert)


def reshard_bytes(arch, train: Parallelism, decode: Parallelism,
                  param_itemsize: float) -> float:
    """Bytes one chip receives to build its shard of the sampler's copy of the weights from
    the trainer's (once per step). The decode shard spans the whole embed dim, of which the
    chip's train shard holds one FSDP slice: it receives at least (fsdp - 1) / fsdp of its
    decode shard (at most all of it), ``param_itemsize`` bytes per parameter of the copy."""
    if decode == train:
        return 0.0
    return param_itemsize * local_params(arch, decode) * (train.fsdp - 1) / train.fsdp


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
                       fsdp=int(mesh_shape.get("fsdp", 1)), expert=int(mesh_shape.get("expert", 1)),
                       tensor=int(mesh_shape.get("tensor", 1)))


def analytic_cost(program: str, arch, options, par: Parallelism, *, rows: int, length: int,
                  keys: int, microbatches: int = 1, cache_itemsize: int = 2,
                  param_itemsize: int = 4) -> dict[str, float]:
    """FLOPs and bytes of one call, counted from the architecture (whole-slice FLOPs, per-chip
    bytes). ``rows`` x ``length`` tokens each attend to ``keys`` key slots (the full masked
    score matrix is computed, as the model does).

    FLOPs: a forward is 2 N_active per token plus 4 n h S per token and layer for attention
    (QK^T and PV); training is forward + 2x backward, plus what remat recomputes ("full": the
    forward again; "dots_no_batch": attention; a query-chunked attention recomputes its
    blocks once more). ``model_flops`` (for MFU, PaLM's definition) is 3 forwards for
    training and 1 for sampling, no recomputation.

    HBM bytes per chip (lower bound): the weights each pass reads, which with FSDP are the
    bf16 weights a chip multiplies through (after the all-gather: its tensor shard of every
    dense weight, its expert shard's experts), without FSDP its own parameter shard as
    stored (``param_itemsize``: the master dtype's, or the sampler's copy's bytes per
    parameter, ``MeshConfig.decode_param_dtype``); plus that shard once (read to gather / update); for
    decode also its rows' KV cache (its tensor shard of the kv heads).

    ICI bytes per chip (lower bound): FSDP all-gathers of bf16 weights per pass and a
    reduce-scatter of fp32 gradients per microbatch; expert-parallel all-to-alls of token
    rows (``"expert_parallel"`` is dropless: its buffers hold ``expert`` x the average
    load, and the whole buffer moves); with tensor parallelism the all-reduces of the bf16
    activations (attention output, MLP / MoE output per layer, the embedding lookup; a ring
    all-reduce receives 2 (t - 1) / t of the array) and, when sampling, the all-gather of
    the fp32 logits of the rows' last position.
    """
    n, h, layers, d = arch.num_heads, arch.head_dim, arch.num_layers, arch.hidden_size
    active = matmul_params(arch)
    moe_layers = sum(arch.is_moe_layer(i) for i in range(layers))
    dense_params, expert_params = weight_split(arch)
    tokens = rows * length
    attention = 4 * n * h * keys * layers  # per token
    forward = tokens * (2 * active + attention)
    # bf16 weights one chip multiplies through, after FSDP gathers (experts: its shard only).
    gathered = 2 * (dense_params + expert_params / par.expert) / par.tensor
    fsdp_gather = gathered * (par.fsdp - 1) / par.fsdp if par.fsdp > 1 else 0.0
    stored = param_itemsize * local_params(arch, par)  # the chip's own shard, master dtype
    # weights a pass reads: the gathered bf16 copy with FSDP, else the chip's own shard
    per_pass = gathered if par.fsdp > 1 else stored
    tokens_per_chip = tokens / par.batch  # over the whole call (all microbatches)
    ring = 2 * (par.tensor - 1) / par.tensor  # share of an all-reduced array received
    tp_allreduce = (2 * layers + 1) * ring * tokens_per_chip * d * 2  # per pass, bf16
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
            hbm_traffic=microbatches * passes * per_pass + 3 * stored,  # + the update
            # per microbatch: weight gathers per pass and a gradient reduction (fp32); the
            # token all-to-alls and activation all-reduces scale with tokens, so they are
            # counted for the whole call
            ici_traffic=(microbatches * (passes * fsdp_gather
                                         + 2 * gathered * (par.batch - 1) / par.batch)
                         + passes * (moe_layers * a2a_layer + tp_allreduce)),
        )
    kv_bytes = 0.0
    if program == "decode":
        kv_heads = arch.num_kv_heads / par.tensor
        kv_bytes = (rows / par.batch) * keys * layers * 2 * kv_heads * h * cache_itemsize
    logits_gather = (rows / par.batch) * arch.vocab_size * 4 * (par.tensor - 1) / par.tensor
    return dict(
        hardware_flops=forward,
        model_flops=forward,
        hbm_traffic=per_pass + (stored if par.fsdp > 1 else 0.0) + kv_bytes,
        ici_traffic=fsdp_gather + moe_layers * a2a_layer + tp_allreduce + logits_gather,
    )
