"""Batched autoregressive generation under ``jit``: prefill, then an in-XLA decode loop.

    from spade_jax.rollout import generate
    out = generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=64, temperature=0.7, top_p=0.9)
    out.tokens[0], out.logprobs[0], out.done_reasons[0]

How it runs:
  1. Prompts are left-padded to a *bucketed* length (a power of two >= ``prompt_bucket_min``)
     and the batch to a bucketed size, so a handful of shapes compile, not one per call.
  2. ``_prefill`` (jitted) writes the prompts into a preallocated KV cache and samples the
     first token (over ``max_prefill_tokens``: ``_prefill_rows`` calls over row groups,
     each writing into one full-batch state). ``decode_core.decode`` (jitted, state
     donated; the slot engine's decode too) runs a ``lax.while_loop`` of one-token steps
     until every row is done or a chunk boundary is reached: no Python per token.
  3. Between chunks the host (a) checks stop strings, which need the tokenizer, and
     (b) compacts the batch: when at most half of the rows are still running, the live rows
     are gathered into the next smaller batch bucket, so finished sequences stop costing
     decode compute.

Log-probabilities are those of the untruncated temperature-scaled policy (see
``sampling.py``). Legend: B batch rows, P prompt bucket, N new-token buffer, S = P + N cache
slots, V vocab, L MoE layers, E experts, X experts per token, M stop ids per row.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from spade_jax import preemption, sharding
from spade_jax.models import KVCache, positions_from_mask
from spade_jax.rollout import decode_core
from spade_jax.rollout.decode_core import (  # noqa: F401 - DONE_REASONS .. re-exported
    CACHE_DTYPES,
    DONE_REASONS,
    EOS,
    MAX_TOKENS,
    RUNNING,
    STOP_STRING,
    DecodeScalars,
    DecodeState,
    DecodeStatic,
    StopStrings,
    moe_stack,
    to_device,
    to_host,
)

_ROUTER_MODES = (False, True, "experts")


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    """Settings of one generation call.

    Attributes:
      max_new_tokens: tokens generated per sequence at most (the stop token included).
      temperature: T of ``softmax(logits / T)``; 0 means greedy (argmax).
      top_p: nucleus mass in (0, 1]; 1 disables the filter.
      top_k: keep the k most likely tokens; 0 disables the filter.
      seed: PRNG seed; row i at step n draws with ``fold_in(fold_in(key(seed), i), n)``.
      cache_dtype: KV-cache storage dtype, "float32" or "bfloat16"; None = the model's
        compute dtype.
      return_router: record routing. True: per-token fp32 router logits and int32 selected
        experts (steering and evaluation read the logits); "experts": only the selected
        experts, kept on device in the compact dtype of :mod:`spade_jax.rollout.routing`
        (uint8 up to 256 experts): what router replay consumes, with ``4 * (E + X) / X``
        times less decode-state memory than True (68x for Qwen3-30B-A3B). False: nothing.
      prompt_bucket_min: smallest prompt-length bucket (buckets are powers of two).
      new_tokens_bucket: the new-token buffer is rounded up to a multiple of this.
      chunk_steps: decode steps per jitted call between host checks (stop strings, batch
        compaction). 0 = one call for the whole decode when neither is needed.
      compact_batch: shrink the batch to the next bucket when half the rows have finished.
      max_rows: prompts per prefill/decode batch at most (0 = all at once); more prompts are
        generated in consecutive batches with the same tokens (row i keeps its random
        stream; log-probs agree to float rounding, bit for bit with a batch-invariant
        model), bounding the KV cache and prefill activations of a large round.
      max_prefill_tokens: prefill budget of one jitted call, counted as its padded rows x
        prompt bucket (0 = unlimited). A batch over it is prefilled in consecutive groups
        of :func:`prefill_chunk_rows` rows (the budget's rows rounded down to a multiple of
        the mesh's batch shards), each written into one full-batch decode state: the peak
        is that state plus one group's activations, and the decode batch (unlike with
        ``max_rows``) stays whole. A budget under one row's prompt bucket per batch shard
        still prefills one row per shard a call. Same tokens as one call; log-probs to
        float rounding (bit for bit with a batch-invariant model).
    """

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    cache_dtype: str | None = None
    return_router: bool | str = False
    prompt_bucket_min: int = 16
    new_tokens_bucket: int = 64
    chunk_steps: int = 32
    compact_batch: bool = True
    max_rows: int = 0
    max_prefill_tokens: int = 0

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {self.max_new_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if self.return_router not in _ROUTER_MODES:
            raise ValueError(f"return_router must be True, False or \"experts\", "
                             f"got {self.return_router!r}")
        if self.cache_dtype is not None and self.cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"cache_dtype must be one of {sorted(CACHE_DTYPES)} or None, "
                             f"got {self.cache_dtype!r}")
        for name in ("prompt_bucket_min", "new_tokens_bucket"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.chunk_steps < 0:
            raise ValueError(f"chunk_steps must be >= 0, got {self.chunk_steps}")
        if self.max_rows < 0:
            raise ValueError(f"max_rows must be >= 0 (0 = all prompts at once), got {self.max_rows}")
        if not isinstance(self.max_prefill_tokens, int) or self.max_prefill_tokens < 0:
            raise ValueError(f"max_prefill_tokens must be an int >= 0 (0 = unlimited), "
                             f"got {self.max_prefill_tokens!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def records_router_logits(self) -> bool:
        """Whether the router logits are recorded (``return_router=True``)."""
        return bool(self.return_router) and self.return_router != "experts"


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    """Per sequence, in prompt order.

    tokens: generated ids (prompt excluded; a stop token that ended the row is included).
    logprobs: ``log_softmax(logits / T)[token]`` for each generated token (T = 1 if greedy).
    done_reasons: "eos" (a stop token), "stop_string" or "max_tokens".
    router_logits: with ``return_router=True``, per sequence a [P_i + n_i - 1, L, E] fp32
      array over the MoE layers ``moe_layers``: one row per token *fed* to the model (the
      prompt, then every generated token but the last, which was never fed). Else None.
    selected_experts: with ``return_router`` True or "experts", likewise [P_i + n_i - 1, L,
      X]: int32 with True, the compact routing dtype with "experts" (what router replay
      consumes). Else None.
    moe_layers: decoder-layer indices the router arrays' L axis refers to.
    stats: shapes compiled and steps run, for cost accounting.
    """

    tokens: list[list[int]]
    logprobs: list[list[float]]
    done_reasons: list[str]
    router_logits: list[np.ndarray] | None = None
    selected_experts: list[np.ndarray] | None = None
    moe_layers: tuple[int, ...] = ()
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)


def _initial_state(cache: KVCache, position_b, limit_b, row_id_b, stop_bm, scalars, *, cfg,
                   static: DecodeStatic, new_buffer: int) -> DecodeState:
    """The decode state of rows about to draw their first token (nothing generated yet).
    Row b draws with the call's seed on stream ``row_id_b[b]`` + the call's row offset
    (its prompt's index in the whole request); ``scalars`` None: seeds and streams 0 (rows
    a row-group prefill overwrites)."""
    state = decode_core.new_rows(
        cache, new_buffer=new_buffer, limit_b=limit_b, stop_bm=stop_bm, done_b=row_id_b < 0,
        seed_b=(jnp.zeros_like(row_id_b) if scalars is None
                else jnp.full_like(row_id_b, scalars.seed)),
        stream_b=(jnp.zeros_like(row_id_b) if scalars is None
                  else row_id_b + scalars.row_offset),
        routing=decode_core.routing_shapes(cfg, static), answer_detector=static.answer_detector)
    return state.replace(position_b=position_b, row_id_b=row_id_b, step=jnp.zeros((), jnp.int32))


def _prefill_state(model, ids_bp, mask_bp, limit_b, row_id_b, stop_bm, scalars: DecodeScalars, *,
                   static: DecodeStatic, new_buffer: int):
    """The model over these prompt rows: their decode state after the first draw (a cache
    of these rows only) and their prompt routing (None, or (logits or None, experts))."""
    cfg = model.config
    cache = model.init_cache(ids_bp.shape[0], static.cache_len, static.cache_dtype).constrain()
    positions_bp = positions_from_mask(mask_bp)
    state = _initial_state(cache, positions_bp[:, -1] + 1, limit_b, row_id_b, stop_bm, scalars,
                           cfg=cfg, static=static, new_buffer=new_buffer)
    # Only the last position's logits are sampled from: the LM head over every prompt
    # position would be a [B, P, V] fp32 array (119 GiB per chip for 24 rows of 8k tokens
    # with Qwen3's 152k vocabulary).
    out = model(ids_bp, positions_bp, mask_bp, cache=cache,
                router_hook=decode_core.router_hook_for(static, state.answer_state),
                return_logits=False, mesh=static.mesh)
    last_logits_bv = model.lm_head(out.hidden[:, -1:])[:, -1]
    layers = decode_core.recorded_layers(cfg, static)
    prompt_router = None
    if layers:
        experts, logits = decode_core.routing_shapes(cfg, static)
        prompt_router = (None if logits is None else moe_stack(out.router_logits, layers),
                         moe_stack(out.selected_experts, layers).astype(experts[2]))
    state, _ = decode_core.draw_and_record(state.replace(cache=out.cache), last_logits_bv,
                                           ~state.done_b, scalars, static)
    return state, prompt_router


@functools.partial(jax.jit, static_argnames=("graphdef", "static", "new_buffer"))
def _prefill(graphdef, params, ids_bp, mask_bp, limit_b, row_id_b, stop_bm, scalars: DecodeScalars,
             *, static: DecodeStatic, new_buffer: int):
    """Every row of the batch in one call: (decode state, prompt routing)."""
    return _prefill_state(nnx.merge(graphdef, params), ids_bp, mask_bp, limit_b, row_id_b,
                          stop_bm, scalars, static=static, new_buffer=new_buffer)


# ---- the prefill in row groups (``SamplerConfig.max_prefill_tokens``) -------------------
# The batch's rows are split into ``shards`` equal blocks, block s living on batch shard s.
# Group g prefills, in every block, the rows ``lo_g .. lo_g + rows / shards - 1``, so each
# shard computes and writes only rows it holds (a write at a dynamic offset along a
# sharded axis would make XLA gather the whole cache).


def _constrain_rows(state: DecodeState) -> DecodeState:
    """Splits every per-row array of ``state`` over the batch axes (no-op without a mesh)."""

    def rows(x):
        return x if x.ndim == 0 else sharding.constrain(x, ("batch",) + (None,) * (x.ndim - 1))

    rest = jax.tree.map(rows, state.replace(cache=None))
    cache = state.cache.replace(valid_bs=rows(state.cache.valid_bs)).constrain()
    return rest.replace(cache=cache)


@functools.partial(jax.jit, static_argnames=("config", "stacked", "static", "new_buffer"))
def _empty_state(limit_b, row_id_b, stop_bm, *, config, stacked: bool, static: DecodeStatic,
                 new_buffer: int) -> DecodeState:
    """The full batch's decode state with an empty cache: what the row groups write into."""
    cache = KVCache.init(config, row_id_b.shape[0], static.cache_len, static.cache_dtype,
                         stacked=stacked)
    return _constrain_rows(_initial_state(
        cache, jnp.zeros_like(row_id_b), limit_b, row_id_b, stop_bm, None, cfg=config,
        static=static, new_buffer=new_buffer))


def _put_rows(full, part, lo, shards: int, axis: int = 0):
    """``part``'s rows written into ``full`` at rows ``lo ..`` of each of ``shards`` blocks
    along ``axis`` (scalars: ``part``'s)."""
    if full.ndim == 0:
        return part

    def blocks(x):
        return x.reshape(x.shape[:axis] + (shards, x.shape[axis] // shards) + x.shape[axis + 1:])

    starts = [0] * (full.ndim + 1)
    starts[axis + 1] = lo
    out = jax.lax.dynamic_update_slice(blocks(full), blocks(part).astype(full.dtype), starts)
    return out.reshape(full.shape)


@functools.partial(jax.jit, static_argnames=("graphdef", "static", "new_buffer", "shards"),
                   donate_argnames=("state",))
def _prefill_rows(graphdef, params, state: DecodeState, ids_bp, mask_bp, limit_b, row_id_b,
                  stop_bm, scalars: DecodeScalars, lo, *, static: DecodeStatic, new_buffer: int,
                  shards: int):
    """One row group (see above) prefilled and written into the donated full-batch
    ``state`` at rows ``lo ..`` of every block: (the state, the group's prompt routing)."""
    part, prompt_router = _prefill_state(nnx.merge(graphdef, params), ids_bp, mask_bp, limit_b,
                                         row_id_b, stop_bm, scalars, static=static,
                                         new_buffer=new_buffer)
    kv_axis = 1 if state.cache.stacked else 0
    cache = state.cache.replace(
        k=jax.tree.map(lambda f, p: _put_rows(f, p, lo, shards, kv_axis), state.cache.k,
                       part.cache.k),
        v=jax.tree.map(lambda f, p: _put_rows(f, p, lo, shards, kv_axis), state.cache.v,
                       part.cache.v),
        valid_bs=_put_rows(state.cache.valid_bs, part.cache.valid_bs, lo, shards),
        index=part.cache.index)
    rest = jax.tree.map(lambda f, p: _put_rows(f, p, lo, shards), state.replace(cache=None),
                        part.replace(cache=None))
    return _constrain_rows(rest.replace(cache=cache)), prompt_router


def prefill_chunk_rows(batch: int, prompt_len: int, budget: int, shards: int = 1) -> int:
    """Rows of one prefill call of ``batch`` rows of ``prompt_len`` tokens within ``budget``
    tokens (``SamplerConfig.max_prefill_tokens``; 0 = unlimited): ``batch`` when it fits,
    else ``budget // prompt_len`` rounded down to a multiple of ``shards``, at least
    ``shards`` (one row per batch shard), at most ``batch``."""
    if not budget or batch * prompt_len <= budget:
        return batch
    return min(batch, max(shards, (budget // prompt_len) // shards * shards))


def _row_groups(batch: int, rows: int, shards: int) -> list[tuple[int, np.ndarray]]:
    """The row groups of a prefill in groups of ``rows`` (a multiple of ``shards``): per
    group its offset within each block and the batch rows it covers, in block order. The
    last group is moved back to end at the block's end when ``rows`` does not divide the
    batch: it prefills a few rows again (the later result is kept, the same to float
    rounding) rather than compile a smaller shape."""
    block, per_block = batch // shards, rows // shards
    groups = []
    for lo in range(0, block, per_block):
        lo = min(lo, block - per_block)
        idx = (np.arange(shards)[:, None] * block + lo + np.arange(per_block)).reshape(-1)
        groups.append((lo, idx))
    return groups


# ---- public lowering (ahead-of-time compilation, e.g. ``spade_jax.aot``) ----------------


def _abstract_scalars() -> DecodeScalars:
    f32, i32 = jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32)
    return DecodeScalars(temperature=f32, top_p=f32, seed=i32, row_offset=i32)


def lower_prefill(
    graphdef: nnx.GraphDef, params: Any, model_options: Any, config: SamplerConfig, *,
    rows: int, prompt_len: int, mesh: jax.sharding.Mesh | None = None,
    rules: sharding.Rules = sharding.DEFAULT_RULES, batch: int | None = None,
) -> jax.stages.Lowered:
    """The sampler's jitted prefill, lowered for ``rows`` prompts of ``prompt_len`` tokens
    and a decode buffer of ``config.max_new_tokens`` (rounded up to ``new_tokens_bucket``),
    as :func:`sample` runs it. ``params`` may be abstract (``jax.ShapeDtypeStruct`` leaves
    carrying their shardings); the prompt arrays are abstract, rows split over ``mesh``'s
    batch axes. ``lowered.out_info[0]`` is the :class:`DecodeState` that
    :func:`lower_decode_step` takes. Nothing is allocated.

    ``batch`` > ``rows``: one row group of a batch of ``batch`` rows prefilled within
    ``max_prefill_tokens`` (``rows`` from :func:`prefill_chunk_rows`): the program that
    writes the group into the donated full-batch state, which is an argument and
    ``out_info[0]``, as :func:`sample` runs it."""
    new_buffer = round_up(config.max_new_tokens, config.new_tokens_bucket)
    static = decode_core.static_for(config, model_options, cache_len=prompt_len + new_buffer,
                                    mesh=mesh)

    def rows_of(*shape: int) -> jax.ShapeDtypeStruct:
        axes = ("batch",) + (None,) * (len(shape) - 1)
        placed = None if mesh is None else sharding.named_sharding(axes, mesh, rules)
        return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=placed)

    ids_bp, mask_bp = rows_of(rows, prompt_len), rows_of(rows, prompt_len)
    limit_b, row_id_b, stop_bm = rows_of(rows), rows_of(rows), rows_of(rows, 1)
    with sharding.activate(mesh, rules):
        if batch is None or batch == rows:
            return _prefill.lower(graphdef, params, ids_bp, mask_bp, limit_b, row_id_b,
                                  stop_bm, _abstract_scalars(), static=static,
                                  new_buffer=new_buffer)
        shards = 1 if mesh is None else sharding.data_ways(mesh, rules)
        if batch < rows or rows % shards or batch % shards:
            raise ValueError(f"a prefill row group needs batch ({batch}) >= rows ({rows}), "
                             f"both multiples of the mesh's {shards} batch shards")

        def empty(params):
            model = nnx.merge(graphdef, params)
            per_row = (jnp.zeros((batch,), jnp.int32),) * 2 + (jnp.zeros((batch, 1), jnp.int32),)
            return _empty_state(*per_row, config=model.config, stacked=model_options.scan_layers,
                                static=static, new_buffer=new_buffer)

        state = place_decode_state(jax.eval_shape(empty, params), mesh, rules)
        return _prefill_rows.lower(graphdef, params, state, ids_bp, mask_bp, limit_b, row_id_b,
                                   stop_bm, _abstract_scalars(), jax.ShapeDtypeStruct((), jnp.int32),
                                   static=static,
                                   new_buffer=new_buffer, shards=shards)


def place_decode_state(info: DecodeState, mesh: jax.sharding.Mesh | None,
                       rules: sharding.Rules = sharding.DEFAULT_RULES) -> DecodeState:
    """An abstract :class:`DecodeState` (shapes, e.g. a lowered prefill's ``out_info``)
    placed as the sampler places it: the KV cache by its logical axes
    (``KVCache.constrain``), per-row arrays split over the batch axes, the rest replicated.
    Without a mesh: unchanged."""
    if mesh is None:
        return info
    rows = info.row_id_b.shape[0]

    def placed(x, axes):
        return jax.ShapeDtypeStruct(x.shape, x.dtype,
                                    sharding=sharding.named_sharding(axes, mesh, rules))

    def row_wise(x):
        per_row = x.ndim > 0 and x.shape[0] == rows
        return placed(x, (("batch",) if per_row else (None,)) + (None,) * (x.ndim - 1)
                      if x.ndim else ())

    def kv(x):
        return placed(x, (None,) * (x.ndim - 4) + ("batch", "cache_seq", "act_kv_heads", None))

    cache = info.cache
    cache = cache.replace(k=jax.tree.map(kv, cache.k), v=jax.tree.map(kv, cache.v),
                          valid_bs=row_wise(cache.valid_bs), index=row_wise(cache.index))
    return jax.tree.map(row_wise, info.replace(cache=None)).replace(cache=cache)


def lower_decode_step(
    graphdef: nnx.GraphDef, params: Any, model_options: Any, config: SamplerConfig,
    state: DecodeState, *, mesh: jax.sharding.Mesh | None = None,
    rules: sharding.Rules = sharding.DEFAULT_RULES,
) -> jax.stages.Lowered:
    """One step of the decode loop (one token per row), jitted with the state donated and
    lowered for ``state`` (abstract, e.g. from :func:`lower_prefill`'s output with the
    compiled prefill's output shardings). The decode loop runs this body once per token."""
    cache_len = jax.tree.leaves(state.cache.valid_bs)[0].shape[1]
    static = decode_core.static_for(config, model_options, cache_len=cache_len, mesh=mesh)

    def one_step(params, state, scalars):
        return decode_core.decode_step(nnx.merge(graphdef, params), state, scalars, static)

    step = jax.jit(one_step, donate_argnums=1)
    with sharding.activate(mesh, rules):
        return step.lower(params, state, _abstract_scalars())


@jax.jit  # no donation: the output rows are fewer, so the input buffers cannot be reused
def _take_rows(state: DecodeState, rows_b: jax.Array) -> DecodeState:
    """Gathers the given batch rows of every per-row array (batch compaction)."""

    def take(x):
        return x if x.ndim == 0 else jnp.take(x, rows_b, axis=0)

    cache = state.cache.take_rows(rows_b)
    rest = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)
            if f.name not in ("cache", "step")}
    return state.replace(cache=cache, **jax.tree.map(take, rest))


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def batch_shards(mesh) -> int:
    return 1 if mesh is None else sharding.data_ways(mesh)


def batch_bucket(n: int, shards: int) -> int:
    return round_up(next_pow2(n), shards)


def _per_sequence(value, n: int, name: str) -> list:
    """A shared list (applies to all rows) or one list per row -> one list per row."""
    if value is None:
        return [[] for _ in range(n)]
    value = list(value)
    if value and all(isinstance(v, list | tuple) for v in value):
        if len(value) != n:
            raise ValueError(f"{name}: got {len(value)} per-sequence lists for {n} prompts")
        return [list(v) for v in value]
    return [value for _ in range(n)]


def _default_stop_tokens(config) -> list[int]:
    eos = config.eos_token_id
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


def _validate_prompts(prompts, vocab_size: int) -> list[list[int]]:
    if isinstance(prompts, str | bytes) or not hasattr(prompts, "__len__") or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    out = []
    for i, p in enumerate(prompts):
        ids = [int(t) for t in np.asarray(p).reshape(-1)]
        if not ids:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab_size})")
        out.append(ids)
    return out


def sample(
    model: nnx.Module,
    prompts: Sequence[Sequence[int]],
    config: SamplerConfig,
    *,
    stop_tokens: Sequence[int] | Sequence[Sequence[int]] | None = None,
    stop_strings: Sequence[str] | Sequence[Sequence[str]] | None = None,
    tokenizer: Any = None,
    router_hook: Callable | None = None,
    mesh: jax.sharding.Mesh | None = None,
    max_new_per_seq: Sequence[int] | None = None,
    answer_detector: Any = None,
    _row_offset: int = 0,
) -> GenerationResult:
    """Generates continuations of ragged ``prompts`` with settings from ``config``.

    stop_tokens: ids that end a row (kept as its last token), shared or one list per
      prompt; None = the model config's ``eos_token_id``.
    stop_strings: strings that end a row once its decoded text contains them (shared or
      per prompt); needs ``tokenizer``. Checked every ``config.chunk_steps`` steps.
    router_hook: pure ``f(logits_btE, layer_idx)`` applied in every MoE layer before top-k.
    mesh: run sharded; params must already be placed (``load_hf(..., mesh=mesh)``). Rows are
      split over the mesh's batch axes, weights as their logical axes say.
    max_new_per_seq: a smaller per-prompt budget (each in [1, config.max_new_tokens]).
    answer_detector: a device-side first-answer detector (``init(B)``, ``update(state,
      token_b)`` with a sticky ``fired_b``, e.g. ``steering.schedule.TokenPatternDetector``);
      the hook is then called as ``router_hook(logits, layer, active=fired_b)``, so the
      "after_first_answer" steering schedule edits a row from the token that fired on.
    """
    mcfg = model.config
    prompts = _validate_prompts(prompts, mcfg.vocab_size)
    n = len(prompts)
    if config.max_rows and n > config.max_rows:
        return _sample_in_batches(model, prompts, config, stop_tokens, stop_strings, tokenizer,
                                  router_hook, mesh, max_new_per_seq, answer_detector)
    stop_ids = _per_sequence(
        _default_stop_tokens(mcfg) if stop_tokens is None else stop_tokens, n, "stop_tokens")
    if any(not 0 <= t < mcfg.vocab_size for row in stop_ids for t in row):
        raise ValueError(f"stop_tokens must be ids in [0, {mcfg.vocab_size})")
    stop_text = StopStrings(_per_sequence(stop_strings, n, "stop_strings"), tokenizer)

    shards = batch_shards(mesh)
    batch = batch_bucket(n, shards)
    prompt_len = max(config.prompt_bucket_min, next_pow2(max(len(x) for x in prompts)))
    new_buffer = round_up(config.max_new_tokens, config.new_tokens_bucket)
    static = decode_core.static_for(config, model.options, cache_len=prompt_len + new_buffer,
                                    router_hook=router_hook, answer_detector=answer_detector,
                                    mesh=mesh)
    cache_dtype = static.cache_dtype
    ids_bp = np.zeros((batch, prompt_len), np.int32)
    mask_bp = np.zeros((batch, prompt_len), np.int32)
    for i, p in enumerate(prompts):  # left padding: the last column is every row's last token
        ids_bp[i, prompt_len - len(p):] = p
        mask_bp[i, prompt_len - len(p):] = 1
    stop_bm = np.full((batch, max(1, max(map(len, stop_ids)))), -1, np.int32)
    for i, row in enumerate(stop_ids):
        stop_bm[i, :len(row)] = row
    row_id_b = np.where(np.arange(batch) < n, np.arange(batch), -1).astype(np.int32)
    limit_b = np.full((batch,), config.max_new_tokens, np.int32)
    if max_new_per_seq is not None:
        if len(max_new_per_seq) != n or not all(
                1 <= m <= config.max_new_tokens for m in max_new_per_seq):
            raise ValueError(f"max_new_per_seq needs {n} values in [1, {config.max_new_tokens}]")
        limit_b[:n] = max_new_per_seq
    scalars = DecodeScalars(temperature=jnp.float32(config.temperature),
                            top_p=jnp.float32(config.top_p), seed=jnp.int32(config.seed),
                            row_offset=jnp.int32(_row_offset))
    chunk = config.chunk_steps
    if chunk == 0 and (any(stop_text.per_row) or config.compact_batch):
        chunk = 32

    graphdef, params = nnx.split(model)
    stats = {"batch_bucket": batch, "prompt_bucket": prompt_len, "cache_len": static.cache_len,
             "cache_dtype": jnp.dtype(cache_dtype).name,
             "prefill_calls": 0, "decode_calls": 0, "compactions": 0, "row_steps": 0}
    finished: dict[int, tuple] = {}
    with sharding.activate(mesh) if mesh is not None else contextlib.nullcontext():
        state, prompt_router = _prefill_batch(
            model, graphdef, params, (ids_bp, mask_bp, limit_b, row_id_b, stop_bm), scalars,
            config=config, static=static, new_buffer=new_buffer, mesh=mesh, stats=stats)
        step = 1
        while True:
            until = config.max_new_tokens if chunk == 0 else min(step + chunk, config.max_new_tokens)
            state, _ = decode_core.decode(graphdef, params, state, jnp.int32(until - step),
                                          scalars, static=static)
            stats["decode_calls"] += 1
            new_step = int(state.step)
            stats["row_steps"] += (new_step - step) * int(state.done_b.shape[0])
            step = new_step
            if any(stop_text.per_row):
                rows = [(b, int(r)) for b, r in enumerate(to_host(state.row_id_b)) if r >= 0]
                state = decode_core.apply_stop_strings(state, stop_text, rows)
            done_b = to_host(state.done_b)
            if done_b.all() or step >= config.max_new_tokens:
                break
            preemption.check_safe_point()  # a stop requested mid-step: drop the step here
            live = int((~done_b).sum())
            smaller = batch_bucket(live, shards)
            if config.compact_batch and smaller <= done_b.shape[0] // 2:
                _harvest(state, np.flatnonzero(done_b & (to_host(state.row_id_b) >= 0)), finished)
                keep = np.concatenate([np.flatnonzero(~done_b),
                                       np.flatnonzero(done_b)[: smaller - live]])
                state = _take_rows(state, to_device(keep.astype(np.int32), mesh))
                stats["compactions"] += 1
        _harvest(state, np.flatnonzero(to_host(state.row_id_b) >= 0), finished)
    return _assemble(prompts, finished, prompt_router, prompt_len, mcfg, stats)


def _prefill_batch(model: nnx.Module, graphdef: nnx.GraphDef, params: Any,
                   arrays: tuple[np.ndarray, ...], scalars: DecodeScalars, *, config: SamplerConfig,
                   static: DecodeStatic, new_buffer: int, mesh: jax.sharding.Mesh | None,
                   stats: dict) -> tuple[DecodeState, Any]:
    """The batch's prompts ``(ids_bp, mask_bp, limit_b, row_id_b, stop_bm)`` (host arrays)
    prefilled: in one call, or in row groups within ``config.max_prefill_tokens``. Returns
    the full-batch decode state and the prompt routing on the host in batch-row order.
    ``graphdef, params``: ``nnx.split(model)``."""
    batch, prompt_len = arrays[0].shape
    shards = batch_shards(mesh)
    rows = prefill_chunk_rows(batch, prompt_len, config.max_prefill_tokens, shards)
    if rows == batch:
        state, router = _prefill(graphdef, params, *_place_prompts(arrays, mesh), scalars,
                                 static=static, new_buffer=new_buffer)
        stats["prefill_calls"] += 1
        return state, _router_to_host([(np.arange(batch), router)], batch)
    _, _, limit_b, row_id_b, stop_bm = arrays
    state = _empty_state(limit_b, row_id_b, stop_bm, config=model.config,
                         stacked=model.options.scan_layers, static=static,
                         new_buffer=new_buffer)
    routers = []
    for lo, rows_k in _row_groups(batch, rows, shards):
        state, router = _prefill_rows(
            graphdef, params, state, *_place_prompts(tuple(a[rows_k] for a in arrays), mesh),
            scalars, jnp.int32(lo), static=static, new_buffer=new_buffer, shards=shards)
        routers.append((rows_k, router))
        stats["prefill_calls"] += 1
    return state, _router_to_host(routers, batch)


def _place_prompts(arrays: tuple[np.ndarray, ...], mesh) -> tuple:
    """The prompt arrays as the prefill takes them: ids, mask and stop ids split over the
    mesh's batch axes (the per-row limit and prompt index stay host arrays)."""
    ids_bp, mask_bp, limit_b, row_id_b, stop_bm = arrays
    if mesh is not None:
        rows = sharding.named_sharding(("batch", None), mesh)
        ids_bp, mask_bp, stop_bm = (jax.device_put(a, rows) for a in (ids_bp, mask_bp, stop_bm))
    return ids_bp, mask_bp, limit_b, row_id_b, stop_bm


def _router_to_host(parts: list[tuple[np.ndarray, Any]], batch: int) -> tuple | None:
    """Prompt routing of the prefill calls ``(batch rows, (logits or None, experts))``
    assembled on the host into [batch, ...] arrays (a row prefilled twice: its last)."""
    if parts[0][1] is None:
        return None
    if len(parts) == 1:
        return tuple(None if x is None else to_host(x) for x in parts[0][1])
    out = []
    for k, first in enumerate(parts[0][1]):
        full = None if first is None else np.zeros((batch,) + first.shape[1:], first.dtype)
        for rows_k, router in ([] if first is None else parts):
            full[rows_k] = to_host(router[k])
        out.append(full)
    return tuple(out)


def _sample_in_batches(model, prompts, config, stop_tokens, stop_strings, tokenizer,
                       router_hook, mesh, max_new_per_seq, answer_detector) -> GenerationResult:
    """:func:`sample` over consecutive batches of ``config.max_rows`` prompts, concatenated.
    Each batch draws with its prompts' global row indices, so the result equals one call."""
    n = len(prompts)
    stops = _per_sequence(_default_stop_tokens(model.config) if stop_tokens is None
                          else stop_tokens, n, "stop_tokens")
    strings = None if stop_strings is None else _per_sequence(stop_strings, n, "stop_strings")
    budgets = None if max_new_per_seq is None else list(max_new_per_seq)
    if budgets is not None and len(budgets) != n:
        raise ValueError(f"max_new_per_seq needs {n} values, got {len(budgets)}")
    one_batch = dataclasses.replace(config, max_rows=0)
    parts = []
    for lo in range(0, n, config.max_rows):
        hi = min(n, lo + config.max_rows)
        parts.append(sample(
            model, prompts[lo:hi], one_batch, stop_tokens=stops[lo:hi],
            stop_strings=None if strings is None else strings[lo:hi], tokenizer=tokenizer,
            router_hook=router_hook, mesh=mesh,
            max_new_per_seq=None if budgets is None else budgets[lo:hi],
            answer_detector=answer_detector, _row_offset=lo))
    logits, experts = parts[0].router_logits is not None, parts[0].selected_experts is not None
    stats = {"batches": [p.stats for p in parts]}
    for key in ("prefill_calls", "decode_calls", "compactions", "row_steps"):
        stats[key] = sum(p.stats.get(key, 0) for p in parts)
    return GenerationResult(
        tokens=[t for p in parts for t in p.tokens],
        logprobs=[lp for p in parts for lp in p.logprobs],
        done_reasons=[r for p in parts for r in p.done_reasons],
        router_logits=[x for p in parts for x in p.router_logits] if logits else None,
        selected_experts=[x for p in parts for x in p.selected_experts] if experts else None,
        moe_layers=parts[0].moe_layers, stats=stats)


def _harvest(state: DecodeState, batch_rows: np.ndarray, finished: dict) -> None:
    """Copies the given rows' results to the host, keyed by prompt index."""
    if len(batch_rows) == 0:
        return
    fields = [state.row_id_b, state.tokens_bn, state.logprobs_bn, state.num_generated_b,
              state.reason_b, state.router_bnle, state.experts_bnlx]
    host = [None if x is None else to_host(x)[batch_rows] for x in fields]
    for j in range(len(batch_rows)):
        row_id, tokens, logprobs, num, reason, router, experts = (
            None if h is None else h[j] for h in host)
        n = int(num)
        finished[int(row_id)] = (
            tokens[:n].tolist(), logprobs[:n].tolist(),
            DONE_REASONS[int(reason)] if int(reason) != RUNNING else "max_tokens",
            None if router is None else router[: max(n - 1, 0)],
            None if experts is None else experts[: max(n - 1, 0)],
        )


def _assemble(prompts, finished, prompt_router, prompt_len, mcfg, stats) -> GenerationResult:
    moe_layers = tuple(i for i in range(mcfg.num_layers) if mcfg.is_moe_layer(i))
    rows = [finished[i] for i in range(len(prompts))]
    router_logits = selected = None
    if prompt_router is not None and moe_layers:
        prompt_logits, prompt_experts = prompt_router  # host arrays (_router_to_host)
        router_logits = None if prompt_logits is None else []
        selected = []
        for i, (p, row) in enumerate(zip(prompts, rows, strict=True)):
            start = prompt_len - len(p)
            if router_logits is not None:
                router_logits.append(np.concatenate([prompt_logits[i, start:], row[3]], axis=0))
            selected.append(np.concatenate([prompt_experts[i, start:], row[4]], axis=0))
    return GenerationResult(
        tokens=[r[0] for r in rows], logprobs=[r[1] for r in rows],
        done_reasons=[r[2] for r in rows], router_logits=router_logits,
        selected_experts=selected, moe_layers=moe_layers, stats=stats,
    )


def generate(
    model: nnx.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    *,
    stop_tokens: Sequence[int] | Sequence[Sequence[int]] | None = None,
    stop_strings: Sequence[str] | Sequence[Sequence[str]] | None = None,
    tokenizer: Any = None,
    router_hook: Callable | None = None,
    return_router: bool | str | None = None,
    cache_dtype: str | None = None,
    mesh: jax.sharding.Mesh | None = None,
    config: SamplerConfig | None = None,
    answer_detector: Any = None,
) -> GenerationResult:
    """Samples up to ``max_new_tokens`` per prompt; see :func:`sample` for the keywords.

    ``config`` supplies the remaining settings (buckets, chunking, cache dtype, router
    recording); the explicit arguments always win over its fields.
    """
    base = config or SamplerConfig(max_new_tokens=max_new_tokens)
    overrides = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                     top_k=top_k, seed=seed)
    if return_router is not None:
        overrides["return_router"] = return_router
    if cache_dtype is not None:
        overrides["cache_dtype"] = cache_dtype
    return sample(model, prompts, dataclasses.replace(base, **overrides),
                  stop_tokens=stop_tokens, stop_strings=stop_strings, tokenizer=tokenizer,
                  router_hook=router_hook, mesh=mesh, answer_detector=answer_detector)
