"""MoE routing and expert dispatch.

Shape legend: T tokens (batch and time flattened), D hidden, F expert hidden, E experts,
X = k selected experts per token, M = T * X token-expert assignments.

The dispatch implementations compute the same thing:
  ``ragged``  dropless: sort the M assignments by expert, run grouped matmuls with
              ``jax.lax.ragged_dot``, unsort. FLOPs scale with k, not E. The default.
  ``dense``   every expert on every token, combined with a [T, E] weight matrix that is
              zero off the selected experts. FLOPs scale with E; the reference for tests.
  ``blocked`` dropless: sort by expert, a loop over experts runs each group in blocks
              of a few rows; FLOPs scale with k; the fast path on CPU.
  ``expert_parallel``  tokens routed to the devices that hold their experts with
              all_to_all over the "expert" mesh axis (shard_map), local experts run as in
              ``ragged``; dropless by default. Without a mesh it is ``ragged``.

The expert-parallel dispatch is the one place in the models that touches the mesh, and it
is handed the mesh as an argument (:func:`dispatcher`); the model passes it down from its
call's ``mesh=``. Everything else in the models only names logical axes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from spade_jax.models import numerics
from spade_jax.sharding import logical_to_spec

# A pure function that may edit router logits (fp32, [..., E]) before softmax/top-k.
# It receives the decoder-layer index so per-layer expert sets are possible.
RouterHook = Callable[[jax.Array, int], jax.Array]


def route(
    logits_tE: jax.Array,
    k: int,
    norm_topk_prob: bool,
    replay_tX: jax.Array | None = None,
    invariant: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Softmax (fp32) -> top-k -> optional renormalisation, as Hugging Face Qwen-MoE does.

    With ``replay_tX`` the selected experts are taken from a recording (router replay)
    instead of top-k; their weights still come from the current probabilities.
    ``invariant`` sums in a fixed order (``numerics``; batch-invariant models).
    Returns (weights_tX fp32, experts_tX int32).
    """
    probs_tE = numerics.softmax(logits_tE.astype(jnp.float32), axis=-1, invariant=invariant)
    if replay_tX is None:
        weights_tX, experts_tX = jax.lax.top_k(probs_tE, k)
    else:
        experts_tX = replay_tX.astype(jnp.int32)
        weights_tX = jnp.take_along_axis(probs_tE, experts_tX, axis=-1)
    if norm_topk_prob:
        weights_tX = weights_tX / numerics.sum_(weights_tX, -1, keepdims=True, invariant=invariant)
    return weights_tX, experts_tX.astype(jnp.int32)


def _swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    return jax.nn.silu(gate) * up


def dispatch_dense(
    x_tD: jax.Array,
    w_gate_EDF: jax.Array,
    w_up_EDF: jax.Array,
    w_down_EFD: jax.Array,
    weights_tX: jax.Array,
    experts_tX: jax.Array,
    *,
    invariant: bool = False,
) -> jax.Array:
    """Reference path: all experts on all tokens, weighted by a sparse [T, E] combine.

    ``invariant`` sums every contraction in a fixed order (batch-invariant models): a
    token's output does not depend on the other tokens in the call; the combine sums over
    experts in index order, unselected experts adding an exact zero."""
    num_tokens, num_experts = x_tD.shape[0], w_gate_EDF.shape[0]
    ein = functools.partial(numerics.einsum, invariant=invariant)
    combine_tE = jnp.zeros((num_tokens, num_experts), jnp.float32)
    combine_tE = combine_tE.at[jnp.arange(num_tokens)[:, None], experts_tX].add(weights_tX)
    h_tEF = _swiglu(ein("td,edf->tef", x_tD, w_gate_EDF), ein("td,edf->tef", x_tD, w_up_EDF))
    y_tED = ein("tef,efd->ted", h_tEF, w_down_EFD)
    return ein("ted,te->td", y_tED, combine_tE.astype(y_tED.dtype))


def dispatch_ragged(
    x_tD: jax.Array,
    w_gate_EDF: jax.Array,
    w_up_EDF: jax.Array,
    w_down_EFD: jax.Array,
    weights_tX: jax.Array,
    experts_tX: jax.Array,
) -> jax.Array:
    """Dropless grouped-matmul path: sort assignments by expert, ragged_dot, unsort."""
    order_M, group_sizes_E = _sort_by_expert(experts_tX, w_gate_EDF.shape[0])
    x_MD = x_tD[order_M // experts_tX.shape[1]]
    h_MF = _swiglu(
        jax.lax.ragged_dot(x_MD, w_gate_EDF, group_sizes_E),
        jax.lax.ragged_dot(x_MD, w_up_EDF, group_sizes_E),
    )
    y_sorted_MD = jax.lax.ragged_dot(h_MF, w_down_EFD, group_sizes_E)
    return _unsort_and_combine(y_sorted_MD, order_M, weights_tX)


def _sort_by_expert(experts_tX: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """(order_M: assignment slots grouped by expert, stable; group_sizes_E int32)."""
    experts_M = experts_tX.reshape(-1)
    order_M = jnp.argsort(experts_M, stable=True)
    return order_M, jnp.bincount(experts_M, length=num_experts).astype(jnp.int32)


def _unsort_and_combine(y_sorted_MD: jax.Array, order_M: jax.Array,
                        weights_tX: jax.Array) -> jax.Array:
    """Expert outputs back in assignment order, summed per token with the router weights."""
    y_MD = jnp.zeros_like(y_sorted_MD).at[order_M].set(y_sorted_MD)
    y_tXD = y_MD.reshape(*weights_tX.shape, -1)
    return jnp.einsum("txd,tx->td", y_tXD, weights_tX.astype(y_tXD.dtype))


# ---- blocked: dropless and fast where ragged_dot is not (XLA:CPU lowers ragged_dot to a
# loop over groups that costs about E full matmuls). Two layouts, picked by shape:
#
#   capacity  (small groups: decode) each expert's first C sorted rows go into an [E, C, D]
#             buffer and run as three batched matmuls against the whole [E, D, F] weights;
#             a group larger than C sends its extra rows through the block loop below, so
#             nothing is dropped. C ~ 1.25 x the mean group: with a balanced router almost
#             never exceeded.
#   blocks    (large groups: prefill, training) a loop over the experts runs each group as
#             blocks of ``bs`` consecutive sorted rows, one small SwiGLU per block, written
#             back in place.
#
# Why: XLA:CPU copies a sliced weight (dynamic or static slice) before a matmul. The first
# version (a lax.map over blocks, each slicing its expert's three matrices) copied 3 x 256
# KiB per block: profiled in the decode loop of ``bench_moe_17m`` at B = 64, those copies
# took 12.7 of 42 ms per step (about 4 GB/s), more than the matmuls. The capacity layout
# slices no weights; the block loop slices each used expert's once.
# XLA:CPU, prefill of bench_moe_17m at B = 64 (T = 2048, groups of ~512): 32 rows per block
# 253 ms, 64 rows 292 ms, 8 rows 370 ms (a loaded box; CPU time about equal).
_MAX_BLOCK_ROWS = 32
_CAPACITY_FACTOR = 1.25
_CAPACITY_MAX_MEAN_GROUP = 64  # larger groups (prefill) ran faster as blocks


def _block_rows(num_assignments: int, num_experts: int) -> int:
    """Rows per block: the mean group size at most, so padding stays below half the work."""
    return max(1, min(_MAX_BLOCK_ROWS, num_assignments // num_experts))


def _capacity_rows(num_tokens: int, num_assignments: int, num_experts: int) -> int:
    """C: 1.25 x the mean group, a multiple of 8, at most the largest possible group (T)."""
    mean = num_assignments / num_experts
    return min(num_tokens, -(-math.ceil(_CAPACITY_FACTOR * mean) // 8) * 8)


def _swiglu_mlp(x_bD, w_gate_DF, w_up_DF, w_down_FD):
    return _swiglu(x_bD @ w_gate_DF, x_bD @ w_up_DF) @ w_down_FD


def _for_expert_blocks(start_E, count_E, bs, max_count, run_expert, carry):
    """``carry = run_expert(e, for_blocks, carry)`` for every expert e with rows, in
    increasing order; ``for_blocks(step, c)`` runs ``c = step(row, c)`` for the first rows
    ``start_E[e] + j * bs`` of its blocks, j * bs below ``count_E[e]``. ``max_count``: a
    static bound on ``count_E``.

    The loops have static trip counts (blocks past a group, and empty experts, are skipped
    with ``cond``), which reverse-mode AD needed before the block loop had its own backward
    pass; a ``while`` loop was a little faster. Both the forward and the backward run here,
    so the backward visits exactly the blocks the forward computed."""
    def run(e, c):
        def for_blocks(step, c):
            def block(j, c):
                return jax.lax.cond(j * bs < count_E[e],
                                    functools.partial(step, start_E[e] + j * bs), lambda c: c, c)
            return jax.lax.fori_loop(0, -(-max_count // bs), block, c)
        return run_expert(e, for_blocks, c)

    def maybe_run(e, c):
        return jax.lax.cond(count_E[e] > 0, functools.partial(run, e), lambda c: c, c)

    return jax.lax.fori_loop(0, count_E.shape[0], maybe_run, carry)


# The block loop has its own backward pass (custom_vjp), a second loop of the same shape.
# Reverse-mode AD of the forward loop (a scan of conds, carrying the whole [M, D] result)
# cost 16-30x its forward: bench_moe_17m's MoE layer on 256 tokens took 151 ms forward +
# backward against 9 ms forward (242 / 8 ms with every row in blocks), and the CPU train
# step ran 1.5x slower than with the earlier lax.map dispatch. The hand-written backward
# reruns each block's SwiGLU under jax.vjp (straight-line code) and accumulates each
# expert's weight gradients in [D, F] carries written once per expert: 38 / 13 ms there,
# and a value_and_grad of the whole model on [4, 64] tokens 0.19 s against 0.57 s (0.39 s
# with lax.map; docs/rollout.md). The forward compiles to the same program as before.
# A custom_vjp has no forward-mode rule: jax.jvp through this dispatch raises (nothing in
# the project uses forward mode; the other dispatches support it).
@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _expert_blocks(x_rows_MD, w_gate_EDF, w_up_EDF, w_down_EFD, start_E, count_E, bs,
                   max_count):
    """SwiGLU of rows ``start_E[e] .. start_E[e] + count_E[e] - 1`` with expert e, for every
    e, in blocks of ``bs`` rows; other rows of the result are unspecified (and get no
    gradient: callers must not use them). ``max_count``: a static bound on any
    ``count_E[e]``.

    A group's last block may run past it, into rows of later experts (recomputed when their
    turn comes: experts run in increasing order) or into ``bs`` zero rows appended at the
    end; an expert with no rows is skipped, its weights never sliced."""
    m = x_rows_MD.shape[0]
    x_rows = jnp.concatenate([x_rows_MD, jnp.zeros((bs, x_rows_MD.shape[1]), x_rows_MD.dtype)])

    def run_expert(e, for_blocks, y_rows):
        w_gate_DF, w_up_DF, w_down_FD = w_gate_EDF[e], w_up_EDF[e], w_down_EFD[e]

        def compute(row, y_rows):
            x_bsD = jax.lax.dynamic_slice_in_dim(x_rows, row, bs)
            y_bsD = _swiglu_mlp(x_bsD, w_gate_DF, w_up_DF, w_down_FD)
            return jax.lax.dynamic_update_slice_in_dim(y_rows, y_bsD.astype(y_rows.dtype), row, 0)

        return for_blocks(compute, y_rows)

    return _for_expert_blocks(start_E, count_E, bs, max_count, run_expert,
                              jnp.zeros_like(x_rows))[:m]


def _expert_blocks_fwd(x_rows_MD, w_gate_EDF, w_up_EDF, w_down_EFD, start_E, count_E, bs,
                       max_count):
    y = _expert_blocks(x_rows_MD, w_gate_EDF, w_up_EDF, w_down_EFD, start_E, count_E, bs,
                       max_count)
    return y, (x_rows_MD, w_gate_EDF, w_up_EDF, w_down_EFD, start_E, count_E)


def _expert_blocks_bwd(bs, max_count, residuals, dy_rows_MD):
    """Cotangents of the tokens and the three weight stacks, block by block: rows past a
    group (a block's overrun) get a zero cotangent from that expert, so each row's
    gradient comes from its own expert only, as its value does."""
    x_rows_MD, w_gate_EDF, w_up_EDF, w_down_EFD, start_E, count_E = residuals
    m, d = x_rows_MD.shape
    x_rows = jnp.concatenate([x_rows_MD, jnp.zeros((bs, d), x_rows_MD.dtype)])
    dy_rows = jnp.concatenate([dy_rows_MD, jnp.zeros((bs, d), dy_rows_MD.dtype)])
    weights = (w_gate_EDF, w_up_EDF, w_down_EFD)

    def run_expert(e, for_blocks, carry):
        dx_rows, dw_stacks = carry
        w_e = tuple(w[e] for w in weights)

        def grad_block(row, c):
            dx_rows, dw_e = c
            mine_bs1 = (row + jnp.arange(bs) < start_E[e] + count_E[e])[:, None]
            dy_bsD = jnp.where(mine_bs1, jax.lax.dynamic_slice_in_dim(dy_rows, row, bs), 0)
            _, vjp = jax.vjp(_swiglu_mlp, jax.lax.dynamic_slice_in_dim(x_rows, row, bs), *w_e)
            dx_bsD, *dw_block = vjp(dy_bsD)
            dx_rows = jax.lax.dynamic_update_slice_in_dim(
                dx_rows, jax.lax.dynamic_slice_in_dim(dx_rows, row, bs) + dx_bsD, row, 0)
            return dx_rows, tuple(a + b.astype(a.dtype) for a, b in zip(dw_e, dw_block,
                                                                         strict=True))

        dw_e = tuple(jnp.zeros(w.shape[1:], jnp.float32) for w in weights)
        dx_rows, dw_e = for_blocks(grad_block, (dx_rows, dw_e))
        return dx_rows, tuple(stack.at[e].set(g.astype(stack.dtype))
                              for stack, g in zip(dw_stacks, dw_e, strict=True))

    dx_rows, dw_stacks = _for_expert_blocks(
        start_E, count_E, bs, max_count, run_expert,
        (jnp.zeros_like(x_rows), tuple(jnp.zeros_like(w) for w in weights)))
    return (dx_rows[:m], *dw_stacks, None, None)


_expert_blocks.defvjp(_expert_blocks_fwd, _expert_blocks_bwd)


def dispatch_blocked(
    x_tD: jax.Array,
    w_gate_EDF: jax.Array,
    w_up_EDF: jax.Array,
    w_down_EFD: jax.Array,
    weights_tX: jax.Array,
    experts_tX: jax.Array,
) -> jax.Array:
    """Dropless sorted dispatch, capacity layout for small groups, blocks for large ones
    (see above); equal to the other dispatches up to float rounding."""
    num_tokens, k = experts_tX.shape
    num_experts, m = w_gate_EDF.shape[0], num_tokens * k
    order_M, group_E = _sort_by_expert(experts_tX, num_experts)
    start_E = jnp.cumsum(group_E) - group_E
    x_sorted_MD = x_tD[order_M // k]
    bs = _block_rows(m, num_experts)
    cap = _capacity_rows(num_tokens, m, num_experts)
    if m > num_experts * _CAPACITY_MAX_MEAN_GROUP or num_experts * cap > 2 * m:
        y_sorted_MD = _expert_blocks(x_sorted_MD, w_gate_EDF, w_up_EDF, w_down_EFD, start_E,
                                     group_E, bs, num_tokens)
        return _unsort_and_combine(y_sorted_MD, order_M, weights_tX)
    sorted_expert_M = experts_tX.reshape(-1)[order_M]
    rank_M = jnp.arange(m) - start_E[sorted_expert_M]  # row within its group
    fits_M = rank_M < cap
    slot_M = jnp.where(fits_M, sorted_expert_M * cap + rank_M, num_experts * cap)
    x_ECD = (jnp.zeros((num_experts * cap, x_tD.shape[1]), x_tD.dtype)
             .at[slot_M].set(x_sorted_MD, mode="drop").reshape(num_experts, cap, -1))
    h_ECF = _swiglu(jnp.einsum("ecd,edf->ecf", x_ECD, w_gate_EDF),
                    jnp.einsum("ecd,edf->ecf", x_ECD, w_up_EDF))
    y_ECD = jnp.einsum("ecf,efd->ecd", h_ECF, w_down_EFD)
    y_sorted_MD = y_ECD.reshape(num_experts * cap, -1).at[slot_M].get(mode="fill",
                                                                       fill_value=0)
    if cap < num_tokens:  # a group may hold more than C rows: those run as blocks
        over_E = jnp.maximum(group_E - cap, 0)
        y_over_MD = _expert_blocks(x_sorted_MD, w_gate_EDF, w_up_EDF, w_down_EFD,
                                   start_E + cap, over_E, bs, num_tokens - cap)
        y_sorted_MD = jnp.where(fits_M[:, None], y_sorted_MD, y_over_MD)
    return _unsort_and_combine(y_sorted_MD, order_M, weights_tX)


# ---- expert_parallel: explicit token routing across the expert mesh axis.
#
# Given a mesh, the MoE layer runs inside a jax.shard_map over it. Tokens are split over the batch axes (rule "batch"), expert weights over
# the expert axis (rule "expert"; their embed dim over "embed" -> fsdp, all-gathered inside
# as FSDP does, and their F dim over "expert_mlp" -> tensor, summed at the end). Each
# shard, with its t local tokens and M = t * k assignments:
#   1. sorts its assignments by destination shard (the one holding the expert) and packs
#      them into a [N, C, D] send buffer: C slots per (source, destination) pair;
#   2. all_to_all over the expert axis: shard j now holds what every shard sent it;
#   3. runs its E / N local experts on the N * C received rows (sort by local expert,
#      grouped matmul; empty slots carry a sentinel expert and are masked);
#   4. the reverse all_to_all returns each row to its sender, which unsorts and combines
#      with the router weights.
# Capacity: by default C = t * min(k, E / N), the most one source can ever send one
# destination, so nothing is dropped and the result equals the other dispatches exactly
# (what RL needs: the trainer's log-probs must be the sampler's). The price is buffers and
# grouped-matmul rows N x larger than the mean load. ``capacity_factor=c`` instead uses
# C = ceil(c * M / N) (capped at the dropless bound) and drops the assignments past a
# pair's C-th (in token order): a dropped assignment contributes zero and the token's
# other experts keep their weights (no renormalisation), as in GShard / Switch;
# :func:`expert_parallel_with_drops` returns how many were dropped.
_EMPTY = -1  # not a real shard / expert: padding tokens and empty slots


def _mesh_axes(logical: str, mesh) -> tuple[str, ...]:
    """Mesh axes (size > 1) of ``mesh`` that the rules map one logical name to (the rules
    made active by ``sharding.activate``, else the default table)."""
    entry = logical_to_spec((logical,), mesh=mesh)[0]
    return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


def _axes_size(mesh, axes: Sequence[str]) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def _local_experts(x_RD: jax.Array, expert_R: jax.Array, w_gate_EDF: jax.Array,
                   w_up_EDF: jax.Array, w_down_EFD: jax.Array, local_impl: str) -> jax.Array:
    """SwiGLU of each received row with its (local) expert; zero rows for empty slots."""
    num_local = w_gate_EDF.shape[0]
    valid_R = expert_R >= 0
    if local_impl == "ragged":
        # Empty slots sort last and are left out of the group sizes (bincount ignores the
        # out-of-range id), so the grouped matmul need not compute them.
        order_R, group_E = _sort_by_expert(
            jnp.where(valid_R, expert_R, num_local)[:, None], num_local)
        x_sorted = x_RD[order_R]
        h_RF = _swiglu(jax.lax.ragged_dot(x_sorted, w_gate_EDF, group_E),
                       jax.lax.ragged_dot(x_sorted, w_up_EDF, group_E))
        y_sorted = jax.lax.ragged_dot(h_RF, w_down_EFD, group_E)
        y_RD = jnp.zeros_like(y_sorted).at[order_R].set(y_sorted)
    elif local_impl == "blocked":
        # Empty slots hold zero rows, and SwiGLU(0) = 0, whichever expert they land on.
        ones_R1 = jnp.ones((x_RD.shape[0], 1), x_RD.dtype)
        y_RD = dispatch_blocked(x_RD, w_gate_EDF, w_up_EDF, w_down_EFD, ones_R1,
                                jnp.maximum(expert_R, 0)[:, None])
    else:
        raise ValueError(f"local_impl must be 'ragged' or 'blocked', got {local_impl!r}")
    # where, not a multiply: whatever a backend leaves in skipped rows cannot leak (NaN).
    return jnp.where(valid_R[:, None], y_RD, 0)


def _expert_parallel_shard(
    x_tD, valid_t, w_gate_EDF, w_up_EDF, w_down_EFD, weights_tX, experts_tX, *,
    ep_axes, embed_axes, mlp_axes, token_axes, num_shards, capacity, local_impl,
):
    """One device's part of :func:`expert_parallel_with_drops` (inside shard_map)."""
    if embed_axes:  # FSDP: whole embed dim for the matmuls; grads reduce-scatter back
        w_gate_EDF = jax.lax.all_gather(w_gate_EDF, embed_axes, axis=1, tiled=True)
        w_up_EDF = jax.lax.all_gather(w_up_EDF, embed_axes, axis=1, tiled=True)
        w_down_EFD = jax.lax.all_gather(w_down_EFD, embed_axes, axis=2, tiled=True)
    num_local = w_gate_EDF.shape[0]
    t, k = experts_tX.shape
    m, n, cap, d = t * k, num_shards, capacity, x_tD.shape[1]

    # 1. Assignments sorted (stably) by destination shard; padding tokens go nowhere.
    valid_M = jnp.repeat(valid_t, k)
    dest_M = jnp.where(valid_M, experts_tX.reshape(-1) // num_local, n)  # n: not sent
    order_M, count_N = _sort_by_expert(dest_M[:, None], n)
    dest_sorted = dest_M[order_M]
    start_N = jnp.cumsum(count_N) - count_N
    rank_M = jnp.arange(m) - start_N[jnp.minimum(dest_sorted, n - 1)]
    sent_M = (dest_sorted < n) & (rank_M < cap)
    slot_M = jnp.where(sent_M, dest_sorted * cap + rank_M, n * cap)  # n * cap: dropped
    dropped = jnp.sum(valid_M) - jnp.sum(sent_M)

    send_x = jnp.zeros((n * cap, d), x_tD.dtype).at[slot_M].set(x_tD[order_M // k], mode="drop")
    local_expert_M = experts_tX.reshape(-1)[order_M] % num_local
    send_e = jnp.full((n * cap,), _EMPTY, jnp.int32).at[slot_M].set(local_expert_M, mode="drop")

    # 2.-4. To the expert shards, through the local experts, and back.
    recv_x = jax.lax.all_to_all(send_x, ep_axes, 0, 0, tiled=True)
    recv_e = jax.lax.all_to_all(send_e, ep_axes, 0, 0, tiled=True)
    y_recv = _local_experts(recv_x, recv_e, w_gate_EDF, w_up_EDF, w_down_EFD, local_impl)
    y_back = jax.lax.all_to_all(y_recv, ep_axes, 0, 0, tiled=True)
    y_sorted_MD = y_back.at[slot_M].get(mode="fill", fill_value=0)
    y_tD = _unsort_and_combine(y_sorted_MD, order_M, weights_tX)
    if mlp_axes:  # each shard of the F dim holds a partial sum of the down projection
        y_tD = jax.lax.psum(y_tD, mlp_axes)
    return y_tD, jax.lax.psum(dropped, token_axes)


def expert_parallel_with_drops(
    x_tD: jax.Array,
    w_gate_EDF: jax.Array,
    w_up_EDF: jax.Array,
    w_down_EFD: jax.Array,
    weights_tX: jax.Array,
    experts_tX: jax.Array,
    *,
    mesh: jax.sharding.Mesh | None = None,
    capacity_factor: float | None = None,
    local_impl: str = "ragged",
) -> tuple[jax.Array, jax.Array]:
    """Expert-parallel dispatch over ``mesh``; also returns the dropped count.

    Returns (y_tD, dropped): ``dropped`` is the number of token-expert assignments, over
    the whole batch, that did not fit their (source, destination) capacity (always 0 with
    ``capacity_factor=None``). Without a mesh, or when the rule for "expert" gives a single
    shard, this is :func:`dispatch_ragged` and ``dropped`` is 0.
    """
    if local_impl not in ("ragged", "blocked"):
        raise ValueError(f"local_impl must be 'ragged' or 'blocked', got {local_impl!r}")
    ep_axes = _mesh_axes("expert", mesh) if mesh is not None else ()
    if not ep_axes:
        y_tD = dispatch_ragged(x_tD, w_gate_EDF, w_up_EDF, w_down_EFD, weights_tX, experts_tX)
        return y_tD, jnp.zeros((), jnp.int32)
    if capacity_factor is not None and capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be positive or None, got {capacity_factor}")
    num_experts, d, f = w_gate_EDF.shape
    n = _axes_size(mesh, ep_axes)
    if num_experts % n:
        raise ValueError(
            f"expert_parallel: {num_experts} experts cannot be split over the expert mesh axes "
            f"{ep_axes} of size {n}; use an expert axis size that divides the expert count")
    # Weight dims are split only where the split is even; elsewhere they enter replicated.
    embed_axes = tuple(a for a in _mesh_axes("embed", mesh) if a not in ep_axes)
    if d % _axes_size(mesh, embed_axes):
        embed_axes = ()
    mlp_axes = tuple(a for a in _mesh_axes("expert_mlp", mesh) if a not in ep_axes + embed_axes)
    if f % _axes_size(mesh, mlp_axes):
        mlp_axes = ()
    # Tokens must differ across the expert axis (each shard sends its own) and be whole on
    # the F-split axis (every F shard sees the same rows).
    token_axes = tuple(a for a in _mesh_axes("batch", mesh) if a not in mlp_axes)
    token_axes += tuple(a for a in ep_axes if a not in token_axes)
    ways = _axes_size(mesh, token_axes)

    num_tokens, k = experts_tX.shape
    pad = -num_tokens % ways  # e.g. a decode step with fewer rows than devices
    valid_t = jnp.arange(num_tokens + pad) < num_tokens
    if pad:
        x_tD = jnp.pad(x_tD, ((0, pad), (0, 0)))
        weights_tX = jnp.pad(weights_tX, ((0, pad), (0, 0)))
        experts_tX = jnp.pad(experts_tX, ((0, pad), (0, 0)))
    t = (num_tokens + pad) // ways  # tokens per shard
    most = t * min(k, num_experts // n)  # one source never sends one destination more
    capacity = most if capacity_factor is None else min(
        most, max(1, math.ceil(capacity_factor * t * k / n)))

    tok = P(token_axes, None)
    w_in, w_out = P(ep_axes, embed_axes or None, mlp_axes or None), P(
        ep_axes, mlp_axes or None, embed_axes or None)
    body = functools.partial(
        _expert_parallel_shard, ep_axes=ep_axes, embed_axes=embed_axes, mlp_axes=mlp_axes,
        token_axes=token_axes, num_shards=n, capacity=capacity, local_impl=local_impl)
    y_tD, dropped = jax.shard_map(
        body, mesh=mesh,
        in_specs=(tok, P(token_axes), w_in, w_in, w_out, tok, tok),
        out_specs=(tok, P()),
    )(x_tD, valid_t, w_gate_EDF, w_up_EDF, w_down_EFD, weights_tX, experts_tX)
    return y_tD[:num_tokens], dropped


def dispatch_expert_parallel(
    x_tD: jax.Array,
    w_gate_EDF: jax.Array,
    w_up_EDF: jax.Array,
    w_down_EFD: jax.Array,
    weights_tX: jax.Array,
    experts_tX: jax.Array,
    *,
    mesh: jax.sharding.Mesh | None = None,
    capacity_factor: float | None = None,
    local_impl: str = "ragged",
) -> jax.Array:
    """Explicit expert parallelism (all_to_all over ``mesh``'s expert axis); dropless by
    default; :func:`dispatch_ragged` without a mesh."""
    return expert_parallel_with_drops(
        x_tD, w_gate_EDF, w_up_EDF, w_down_EFD, weights_tX, experts_tX, mesh=mesh,
        capacity_factor=capacity_factor, local_impl=local_impl)[0]


DISPATCH: dict[str, Callable[..., jax.Array]] = {
    "ragged": dispatch_ragged,
    "dense": dispatch_dense,
    "blocked": dispatch_blocked,
    "expert_parallel": dispatch_expert_parallel,
}
# The dispatches that place tokens on devices themselves and so take ``mesh=``.
MESH_DISPATCH = frozenset({"expert_parallel"})


def dispatcher(impl: str, mesh: jax.sharding.Mesh | None = None,
               invariant: bool = False) -> Callable[..., jax.Array]:
    """The dispatch function ``(x_tD, w_gate, w_up, w_down, weights_tX, experts_tX) -> y_tD``
    for ``impl`` (a ``DISPATCH`` key), handed ``mesh`` if it places tokens itself.
    ``invariant`` (batch-invariant models) always runs every expert in a fixed order."""
    if invariant:
        return functools.partial(dispatch_dense, invariant=True)
    if impl not in DISPATCH:
        raise ValueError(f"moe_impl must be one of {sorted(DISPATCH)}, got {impl!r}")
    if impl in MESH_DISPATCH:
        return functools.partial(DISPATCH[impl], mesh=mesh)
    return DISPATCH[impl]


def load_balancing_loss(
    router_logits: Sequence[jax.Array | None],
    k: int,
    attention_mask_bt: jax.Array | None = None,
) -> jax.Array:
    """Switch-style auxiliary loss, Hugging Face's formula for Qwen-MoE.

    aux = E * sum_e f_e * P_e, with f_e the share of top-k assignments that go to expert e
    and P_e its mean router probability, both pooled over every MoE layer and every
    (unmasked) token.
    """
    layers = [z for z in router_logits if z is not None]
    if not layers:
        return jnp.zeros((), jnp.float32)
    num_experts = layers[0].shape[-1]
    counts_E = jnp.zeros((num_experts,), jnp.float32)
    prob_sum_E = jnp.zeros((num_experts,), jnp.float32)
    rows = jnp.zeros((), jnp.float32)
    for logits_btE in layers:
        logits_tE = logits_btE.reshape(-1, num_experts).astype(jnp.float32)
        mask_t = (
            jnp.ones(logits_tE.shape[0], jnp.float32)
            if attention_mask_bt is None
            else attention_mask_bt.reshape(-1).astype(jnp.float32)
        )
        probs_tE = jax.nn.softmax(logits_tE, axis=-1)
        _, experts_tX = jax.lax.top_k(probs_tE, k)
        onehot_tE = jax.nn.one_hot(experts_tX, num_experts, dtype=jnp.float32).sum(axis=1)
        counts_E += jnp.sum(onehot_tE * mask_t[:, None], axis=0)
        prob_sum_E += jnp.sum(probs_tE * mask_t[:, None], axis=0)
        rows += jnp.sum(mask_t)
    return num_experts * jnp.sum((counts_E / rows) * (prob_sum_E / rows))
