"""Qwen3 (dense), Qwen3-MoE and the shared-expert MoE block, in Flax NNX.

Read top to bottom: options, norms and RoPE, attention (with an optional KV cache), the
dense MLP, the MoE block, the decoder layer, the model. The model holds the architecture
only; sampling lives in ``spade_jax.rollout``, conversion in ``spade_jax.models.hf_io``.

Shape legend:
  B batch, T query positions, S key positions (cache slots), D hidden, V vocab,
  N query heads, K kv heads, G = N / K query heads per kv head, H head_dim,
  F MLP hidden, E experts, X = k selected experts, L layers.

Parameters carry logical axis names in their ``axes`` metadata; activations are
constrained with :func:`spade_jax.sharding.constrain`. No device logic lives here: the
one device-aware piece, the expert-parallel MoE dispatch, is handed the mesh as the
model call's ``mesh=`` argument.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct

from spade_jax.models import moe, numerics
from spade_jax.models.config import ModelConfig
from spade_jax.sharding import constrain

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
_NEG_INF = -1e30  # finite, so fully-masked (padding) rows give uniform weights, not NaN

# Remat policies by name: which intermediates of a decoder layer the backward pass may keep
# (everything else is recomputed from the layer's input). None = no remat at all.
REMAT_POLICIES: dict[str, Any] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    """How the architecture is run (not what it is).

    Attributes:
      dtype: activation / matmul dtype ("float32" or "bfloat16"). Norms, RoPE tables,
        router softmax, attention softmax and logits are always computed in fp32.
      param_dtype: storage dtype of the parameters.
      moe_impl: MoE dispatch, a key of ``moe.DISPATCH`` ("ragged" grouped matmul; "dense"
        all-experts reference; "blocked" block-sorted, fast on CPU; "expert_parallel"
        all_to_all over the mesh's expert axis, "ragged" without one) or "auto" (the
        default): resolved when the model is built by :func:`auto_moe_impl` for the
        backend ("blocked" on CPU, "expert_parallel" on TPU, "dense" on GPU).
      remat: what the backward pass recomputes per decoder layer, a key of
        ``REMAT_POLICIES``: "none" (keep every activation), "full" (keep only the layer's
        input), "dots" (keep matmul outputs), "dots_no_batch" (keep weight matmuls, recompute
        attention scores). ``True`` means "full", ``False`` "none".
      attention_chunk: queries per block of the attention softmax (0 = all at once). With a
        block, the [queries, keys] score matrix exists one block at a time (each block
        recomputed in the backward pass), so attention memory is O(block x keys) instead of
        O(queries x keys): what long (8k) training sequences need to fit on a chip.
      scan_layers: store the decoder layers stacked ([L, ...] parameters, logical axis
        "layers") and run them with ``jax.lax.scan``: one compiled layer instead of L, so
        compile time and program size stop growing with depth. Needs every layer of one
        kind (all MoE or all dense).
      batch_invariant: run every contraction and reduction of the forward pass in one
        fixed summation order (``spade_jax.models.numerics``), so a token's logits do not
        depend on how many rows, tokens or cache slots share the call: the sampler's
        KV-cache decode and the trainer's forward then agree bit for bit, and router replay
        reproduces the rollout's log-probs exactly. MoE layers run every expert (the
        "dense" dispatch, whatever ``moe_impl`` says). Slower (1.4-2.3x the dense
        dispatch's train step on CPU, more where matmuls have matrix units); for exact
        on-policy runs and for checking them. Exact on XLA:CPU needs FMA off (see
        ``numerics``).
    """

    dtype: str = "float32"
    param_dtype: str = "float32"
    moe_impl: str = "auto"
    remat: bool | str = False
    attention_chunk: int = 0
    scan_layers: bool = False
    batch_invariant: bool = False

    def __post_init__(self):
        if self.moe_impl != "auto" and self.moe_impl not in moe.DISPATCH:
            raise ValueError(f"moe_impl must be 'auto' or one of {sorted(moe.DISPATCH)}, "
                             f"got {self.moe_impl!r}")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ValueError(f"{name} must be one of {sorted(_DTYPES)}, got {getattr(self, name)!r}")
        if self.attention_chunk < 0:
            raise ValueError(f"attention_chunk must be >= 0 (0 = no chunking), "
                             f"got {self.attention_chunk}")
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(f"remat must be a bool or one of {sorted(REMAT_POLICIES)}, "
                             f"got {self.remat!r}")

    @property
    def remat_policy(self) -> str:
        """The remat setting as a ``REMAT_POLICIES`` name."""
        if isinstance(self.remat, bool):
            return "full" if self.remat else "none"
        return self.remat

    @property
    def compute_dtype(self):
        return _DTYPES[self.dtype]

    @property
    def storage_dtype(self):
        return _DTYPES[self.param_dtype]


def auto_moe_impl(backend: str | None = None) -> str:
    """The MoE dispatch fastest on ``backend`` (default: JAX's default backend).

    CPU: "blocked" (XLA:CPU runs ``ragged_dot`` as a loop of full matmuls; measured in
    ``benchmarks/model_forward.py`` and ``benchmarks/sampler.py``). TPU: grouped matmuls,
    "expert_parallel" (all_to_all over the mesh's expert axis when the rules give it one,
    else exactly "ragged"). GPU: "dense". XLA:GPU (jax 0.11.2) lowers ``ragged_dot`` to a
    masked product over every expert that materialises [E, M, F]: on an H200 the
    30B-A3B-shaped prefill at B = 256 asked for 48 GiB and failed, and at B = 64 decode ran
    slower than "dense" (``benchmarks/device_check.sh``, docs/rollout.md). Multi-GPU
    expert parallelism is chosen explicitly."""
    backend = backend or jax.default_backend()
    return {"cpu": "blocked", "gpu": "dense"}.get(backend, "expert_parallel")


@struct.dataclass
class KVCache:
    """Preallocated keys/values per layer and which slots hold real tokens.

    ``index`` is the next slot to write. A scalar ``[]`` index is shared by the batch
    (prompts are left-padded, and ``valid_bs`` masks the padding). A per-row ``[B]`` index
    lets every row sit at its own length (the rollout engine's slots, whose episodes keep
    their cache from turn to turn): row b writes its T new tokens at slots
    ``index[b] .. index[b] + T - 1`` (slots past the end are dropped) and advances by its
    count of real tokens, so a row's padding goes on the right and is overwritten later.
    ``k``/``v`` are a tuple of L arrays, or one stacked [L, B, S, K, H] array for a model
    with ``scan_layers``.
    """

    k: tuple[jax.Array, ...] | jax.Array  # L x [B, S, K, H], or [L, B, S, K, H] stacked
    v: tuple[jax.Array, ...] | jax.Array
    valid_bs: jax.Array  # [B, S] bool
    index: jax.Array  # [] int32, or [B] int32 per row

    @classmethod
    def init(cls, config: ModelConfig, batch: int, max_len: int, dtype=jnp.float32,
             stacked: bool = False, per_row: bool = False) -> KVCache:
        shape = (batch, max_len, config.num_kv_heads, config.head_dim)
        if stacked:
            k = jnp.zeros((config.num_layers, *shape), dtype)
            v = jnp.zeros((config.num_layers, *shape), dtype)
        else:
            k = tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
            v = tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
        return cls(k=k, v=v, valid_bs=jnp.zeros((batch, max_len), bool),
                   index=jnp.zeros((batch,) if per_row else (), jnp.int32))

    @property
    def per_row(self) -> bool:
        return self.index.ndim == 1

    @property
    def stacked(self) -> bool:
        return not isinstance(self.k, tuple)

    def constrain(self) -> KVCache:
        """Shards the cache by logical axes (batch rows, kv heads) under the active mesh."""
        axes = ("batch", "cache_seq", "act_kv_heads", None)
        if self.stacked:
            return self.replace(k=constrain(self.k, (None, *axes)), v=constrain(self.v, (None, *axes)))
        return self.replace(k=tuple(constrain(x, axes) for x in self.k),
                            v=tuple(constrain(x, axes) for x in self.v))

    def take_rows(self, rows_b: jax.Array, length: int | None = None) -> KVCache:
        """The cache of the given batch rows (batch compaction), or only their first
        ``length`` slots (a window that holds everything the rows will attend to)."""
        seq = slice(None, length)
        if self.stacked:
            k, v = (jnp.take(x, rows_b, axis=1)[:, :, seq] for x in (self.k, self.v))
        else:
            k = tuple(jnp.take(x, rows_b, axis=0)[:, seq] for x in self.k)
            v = tuple(jnp.take(x, rows_b, axis=0)[:, seq] for x in self.v)
        index = jnp.take(self.index, rows_b, axis=0) if self.per_row else self.index
        return self.replace(k=k, v=v, valid_bs=jnp.take(self.valid_bs, rows_b, axis=0)[:, seq],
                            index=index)

    def put_rows(self, rows_k: jax.Array, part: KVCache) -> KVCache:
        """This cache with ``part``'s rows written at batch rows ``rows_k`` (a per-row cache;
        rows out of range are dropped, so padding entries may point past the batch). A part
        with fewer slots (a window from ``take_rows``) overwrites the first slots only."""
        def put(dst, src, axis):
            at = (slice(None),) * axis + (rows_k, slice(0, src.shape[axis + 1]))
            return dst.at[at].set(src.astype(dst.dtype), mode="drop")

        if self.stacked:
            k, v = put(self.k, part.k, 1), put(self.v, part.v, 1)
        else:
            k = tuple(put(x, y, 0) for x, y in zip(self.k, part.k, strict=True))
            v = tuple(put(x, y, 0) for x, y in zip(self.v, part.v, strict=True))
        return self.replace(k=k, v=v, valid_bs=put(self.valid_bs, part.valid_bs, 0),
                            index=self.index.at[rows_k].set(part.index, mode="drop"))

    def pad_to(self, max_len: int) -> KVCache:
        """The same cache with ``max_len`` slots (new slots empty and invalid)."""
        extra = max_len - self.valid_bs.shape[1]
        if extra < 0:
            raise ValueError(f"cannot shrink a cache of {self.valid_bs.shape[1]} slots to {max_len}")

        def pad(x, axis):
            widths = [(0, 0)] * x.ndim
            widths[axis] = (0, extra)
            return jnp.pad(x, widths)

        seq = 2 if self.stacked else 1
        k = pad(self.k, seq) if self.stacked else tuple(pad(x, seq) for x in self.k)
        v = pad(self.v, seq) if self.stacked else tuple(pad(x, seq) for x in self.v)
        return self.replace(k=k, v=v, valid_bs=pad(self.valid_bs, 1))


def write_slots(cache_bs: jax.Array, new_bt: jax.Array, index: jax.Array) -> jax.Array:
    """``new_bt`` written into ``cache_bs`` along axis 1 from ``index``: one shared slot for
    a scalar index, slot ``index[b]`` for row b with a [B] index (out-of-range slots dropped)."""
    new_bt = new_bt.astype(cache_bs.dtype)
    if index.ndim == 0:
        return jax.lax.dynamic_update_slice(cache_bs, new_bt, (0, index) + (0,) * (new_bt.ndim - 2))
    b, t = new_bt.shape[:2]
    slots_bt = index[:, None] + jnp.arange(t, dtype=index.dtype)
    return cache_bs.at[jnp.arange(b)[:, None], slots_bt].set(new_bt, mode="drop")


@struct.dataclass
class Packing:
    """A call's tokens fed with no padding, and where attention sees them.

    The tokens of a [B, T] layout (row b: one sequence, its real tokens first, as the
    attention mask says) are fed as ``input_ids`` [G, N]: G groups of N packed tokens, group
    g holding the tokens of layout rows g * B / G .. (g + 1) * B / G - 1 (G = the batch
    shards, so a group's rows and tokens stay on one shard). Position-wise work (norms,
    projections, router, MoE) runs on the G * N packed tokens; the cache writes and
    attention run on the layout. A prefill of ragged sequences then costs its real tokens,
    not B * T (the rollout engine's admits).

    slot_gn: [G, N] int32 layout slot within the group (row in group * T + t) of packed
      token n; ``B / G * T`` (no slot) for a padding token.
    token_gr: [G, B / G * T] int32 packed index within the group of each layout slot; N
      (no token) for a slot that holds none.
    """

    slot_gn: jax.Array
    token_gr: jax.Array

    def unpack(self, x_gn: jax.Array, rows: int) -> jax.Array:
        """[G, N, ...] -> [B, T, ...] (zeros where the layout holds no token)."""
        idx = self.token_gr.reshape(self.token_gr.shape + (1,) * (x_gn.ndim - 2))
        x_gr = jnp.take_along_axis(x_gn, idx, axis=1, mode="fill", fill_value=0)
        return x_gr.reshape(rows, -1, *x_gn.shape[2:])

    def pack(self, x_bt: jax.Array) -> jax.Array:
        """[B, T, ...] -> [G, N, ...] (zeros for padding tokens)."""
        x_gr = x_bt.reshape(self.slot_gn.shape[0], -1, *x_bt.shape[2:])
        idx = self.slot_gn.reshape(self.slot_gn.shape + (1,) * (x_gr.ndim - 2))
        return jnp.take_along_axis(x_gr, idx, axis=1, mode="fill", fill_value=0)


@struct.dataclass
class ModelOutput:
    """What a forward pass returns.

    logits: [B, T, V] fp32 (None when ``return_logits=False``).
    hidden: [B, T, D] final-norm hidden states.
    router_logits: per layer, [B, T, E] fp32 router logits before top-k (None: dense layer).
    selected_experts: per layer, [B, T, X] int32 expert indices (None: dense layer).
    cache: the updated KV cache when one was passed in.
    residuals: [B, T, R, D] the residual stream *entering* each requested decoder layer
      (``return_residuals``; None when not asked for). Entry r of layer l is the sum of the
      embedding and the outputs of layers 0..l-1, before layer l's input norm: exactly
      Hugging Face's ``output_hidden_states[l]`` for l < L (its last entry, after the final
      norm, is ``hidden``). Entering rather than leaving, so residual l and router l are both
      read before layer l's feed-forward runs, and residual 0 is the input embedding.
    """

    logits: jax.Array | None
    hidden: jax.Array
    router_logits: list
    selected_experts: list
    cache: KVCache | None = None
    residuals: jax.Array | None = None


def _init(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, axes: tuple, std: float = 0.02,
          **metadata: Any):
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, dtype), axes=axes, **metadata)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype, invariant: bool = False):
        self.eps, self.invariant = eps, invariant
        self.weight = nnx.Param(jnp.ones((dim,), dtype), axes=("norm",))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        if self.invariant:
            mean_sq = numerics.square_sum(x32, invariant=True)[..., None] / x32.shape[-1]
        else:
            mean_sq = jnp.mean(x32 * x32, axis=-1, keepdims=True)
        normed = x32 * jax.lax.rsqrt(mean_sq + self.eps)
        # Weight cast to the activation dtype: fp32 master weights must not promote bf16
        # activations back to fp32 (HF stores the weight in the model dtype).
        return self.weight[...].astype(x.dtype) * normed.astype(x.dtype)


def rope_tables(positions_bt: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """Half-split RoPE cos/sin tables [B, T, H] in fp32 (Hugging Face's default rope)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs_bth = positions_bt.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([freqs_bth, freqs_bth], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x_btnh: jax.Array, cos_bth: jax.Array, sin_bth: jax.Array,
               invariant: bool = False) -> jax.Array:
    half = x_btnh.shape[-1] // 2
    rotated = jnp.concatenate([-x_btnh[..., half:], x_btnh[..., :half]], axis=-1)
    cos, sin = cos_bth[:, :, None, :].astype(x_btnh.dtype), sin_bth[:, :, None, :].astype(x_btnh.dtype)
    return numerics.rotate(x_btnh, cos, rotated, sin, invariant=invariant)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, opts: ModelOptions, rngs: nnx.Rngs):
        d, n, k, h, pd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, opts.storage_dtype
        self.cfg, self.dtype, self.chunk = cfg, opts.compute_dtype, opts.attention_chunk
        self.invariant = opts.batch_invariant
        self.q_dnh = _init(rngs, (d, n, h), pd, ("embed", "heads", "head_dim"))
        self.k_dkh = _init(rngs, (d, k, h), pd, ("embed", "kv_heads", "head_dim"))
        self.v_dkh = _init(rngs, (d, k, h), pd, ("embed", "kv_heads", "head_dim"))
        self.o_nhd = _init(rngs, (n, h, d), pd, ("heads", "head_dim", "embed"))
        if cfg.qkv_bias:
            self.q_bias_nh = nnx.Param(jnp.zeros((n, h), pd), axes=("heads", "head_dim"))
            self.k_bias_kh = nnx.Param(jnp.zeros((k, h), pd), axes=("kv_heads", "head_dim"))
            self.v_bias_kh = nnx.Param(jnp.zeros((k, h), pd), axes=("kv_heads", "head_dim"))
        if cfg.o_bias:
            self.o_bias_d = nnx.Param(jnp.zeros((d,), pd), axes=("norm",))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(h, cfg.rms_norm_eps, pd, opts.batch_invariant)
            self.k_norm = RMSNorm(h, cfg.rms_norm_eps, pd, opts.batch_invariant)

    def __call__(
        self,
        x_btd: jax.Array,
        cos_bth: jax.Array,
        sin_bth: jax.Array,
        mask_bts: jax.Array,
        kv: tuple[jax.Array, jax.Array] | None,
        write_index: jax.Array | None,
        packing: Packing | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """``packing``: ``x_btd`` is packed tokens [G, N, D] (see :class:`Packing`), laid
        out as the mask's [B, T] rows for the cache writes and attention."""
        cfg, dt = self.cfg, self.dtype
        ein = functools.partial(numerics.einsum, invariant=self.invariant)
        q_btnh = ein("btd,dnh->btnh", x_btd, self.q_dnh[...].astype(dt))
        k_btkh = ein("btd,dkh->btkh", x_btd, self.k_dkh[...].astype(dt))
        v_btkh = ein("btd,dkh->btkh", x_btd, self.v_dkh[...].astype(dt))
        if cfg.qkv_bias:
            q_btnh += self.q_bias_nh[...].astype(dt)
            k_btkh += self.k_bias_kh[...].astype(dt)
            v_btkh += self.v_bias_kh[...].astype(dt)
        if cfg.qk_norm:
            q_btnh, k_btkh = self.q_norm(q_btnh), self.k_norm(k_btkh)
        q_btnh = apply_rope(q_btnh, cos_bth, sin_bth, self.invariant)
        if self.invariant:  # scale q, not the scores: "score * c - max" would be a fusable FMA
            q_btnh = q_btnh * jnp.asarray(cfg.head_dim ** -0.5, q_btnh.dtype)
        q_btnh = constrain(q_btnh, ("batch", "seq", "act_heads", None))
        k_btkh = apply_rope(k_btkh, cos_bth, sin_bth, self.invariant)
        if packing is not None:
            rows = mask_bts.shape[0]
            q_btnh, k_btkh, v_btkh = (packing.unpack(x, rows) for x in (q_btnh, k_btkh, v_btkh))

        if kv is not None:  # write this step's keys/values into the cache, attend to all slots
            k_cache, v_cache = kv
            k_cache = write_slots(k_cache, k_btkh, write_index)
            v_cache = write_slots(v_cache, v_btkh, write_index)
            kv = (k_cache, v_cache)
            k_bskh, v_bskh = k_cache.astype(dt), v_cache.astype(dt)
        else:
            k_bskh, v_bskh = k_btkh, v_btkh

        if self.chunk and q_btnh.shape[1] > self.chunk:
            out_btnh = _chunked_attention(q_btnh, k_bskh, v_bskh, mask_bts, self.chunk,
                                          self.invariant)
        else:
            out_btnh = _attention(q_btnh, k_bskh, v_bskh, mask_bts, self.invariant)
        if packing is not None:
            out_btnh = packing.pack(out_btnh)
        out_btd = ein("btnh,nhd->btd", out_btnh, self.o_nhd[...].astype(dt))
        if cfg.o_bias:
            out_btd += self.o_bias_d[...].astype(dt)
        return out_btd, kv


def _attention(q_btnh: jax.Array, k_bskh: jax.Array, v_bskh: jax.Array,
               mask_bts: jax.Array, invariant: bool = False) -> jax.Array:
    """Softmax attention with grouped kv heads; scores and softmax in fp32."""
    b, t, n, h = q_btnh.shape
    kh = k_bskh.shape[2]
    dt = q_btnh.dtype
    # Batched matmuls with the batch dims leading ([B, K] x [G*T, H] @ [H, S]): the
    # layouts XLA lowers to plain GEMMs on every backend, backward pass included.
    q_bkqh = q_btnh.reshape(b, t, kh, n // kh, h).transpose(0, 2, 3, 1, 4).reshape(b, kh, -1, h)
    k_bksh, v_bksh = k_bskh.transpose(0, 2, 1, 3), v_bskh.transpose(0, 2, 1, 3)
    scores_bkqs = numerics.einsum(
        "bkqh,bksh->bkqs", q_bkqh, k_bksh, invariant=invariant,
        preferred_element_type=jnp.float32,
    )
    if not invariant:  # invariant mode scaled q by h ** -0.5 already
        scores_bkqs = scores_bkqs * (h ** -0.5)
    mask_bqs = jnp.tile(mask_bts, (1, n // kh, 1))  # q = (g, t), g-major
    scores_bkqs = jnp.where(mask_bqs[:, None], scores_bkqs, _NEG_INF)
    probs_bkqs = numerics.softmax(scores_bkqs, axis=-1, invariant=invariant).astype(dt)
    # Masked slots have probability exactly 0, so in invariant mode a decode over S cache
    # slots sums the same nonzero terms, in the same order, as a forward over T tokens.
    out_bkqh = numerics.einsum("bkqs,bksh->bkqh", probs_bkqs, v_bksh, invariant=invariant)
    return out_bkqh.reshape(b, kh, n // kh, t, h).transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


def _chunked_attention(q_btnh: jax.Array, k_bskh: jax.Array, v_bskh: jax.Array,
                       mask_bts: jax.Array, chunk: int, invariant: bool = False) -> jax.Array:
    """:func:`_attention` over blocks of ``chunk`` queries (``lax.map``), each block
    rematerialised so its [chunk, S] scores are never saved for the backward pass.
    Queries are padded up to a whole number of blocks; padded rows are discarded."""
    b, t, n, h = q_btnh.shape
    blocks = -(-t // chunk)
    pad = blocks * chunk - t
    q = jnp.pad(q_btnh, ((0, 0), (0, pad), (0, 0), (0, 0)))
    mask = jnp.pad(mask_bts, ((0, 0), (0, pad), (0, 0)))
    q_cbtnh = q.reshape(b, blocks, chunk, n, h).swapaxes(0, 1)
    mask_cbts = mask.reshape(b, blocks, chunk, -1).swapaxes(0, 1)

    @jax.checkpoint
    def block(args):
        q_blk, mask_blk = args
        return _attention(q_blk, k_bskh, v_bskh, mask_blk, invariant)

    out_cbtnh = jax.lax.map(block, (q_cbtnh, mask_cbts))
    return out_cbtnh.swapaxes(0, 1).reshape(b, blocks * chunk, n, h)[:, :t]


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, d: int, f: int, opts: ModelOptions, rngs: nnx.Rngs):
        pd = opts.storage_dtype
        self.dtype, self.invariant = opts.compute_dtype, opts.batch_invariant
        self.gate_df = _init(rngs, (d, f), pd, ("embed", "mlp"))
        self.up_df = _init(rngs, (d, f), pd, ("embed", "mlp"))
        self.down_fd = _init(rngs, (f, d), pd, ("mlp", "embed"))

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        dt = self.dtype
        ein = functools.partial(numerics.einsum, invariant=self.invariant)
        gate = ein("btd,df->btf", x_btd, self.gate_df[...].astype(dt))
        up = ein("btd,df->btf", x_btd, self.up_df[...].astype(dt))
        h_btf = constrain(jax.nn.silu(gate) * up, ("batch", "seq", "act_mlp"))
        return ein("btf,fd->btd", h_btf, self.down_fd[...].astype(dt))


class MoEBlock(nnx.Module):
    """Router (linear -> fp32 softmax -> top-k -> optional renorm) over E SwiGLU experts,
    plus an optional sigmoid-gated shared expert (Qwen2-MoE / Qwen3-Next style)."""

    def __init__(self, cfg: ModelConfig, opts: ModelOptions, rngs: nnx.Rngs):
        d, e, f, pd = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, opts.storage_dtype
        self.cfg, self.opts = cfg, opts
        # read_dtype: read in fp32 whatever the compute dtype (see __call__), so a copy of
        # the weights in the compute dtype (sharding.decode_dtype) keeps it in fp32.
        self.router_de = _init(rngs, (d, e), pd, ("embed", None), read_dtype="float32")
        self.gate_edf = _init(rngs, (e, d, f), pd, ("expert", "embed", "expert_mlp"))
        self.up_edf = _init(rngs, (e, d, f), pd, ("expert", "embed", "expert_mlp"))
        self.down_efd = _init(rngs, (e, f, d), pd, ("expert", "expert_mlp", "embed"))
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(d, cfg.shared_expert_intermediate_size, opts, rngs)
            self.shared_gate_d1 = _init(rngs, (d, 1), pd, ("embed", None))

    def __call__(
        self,
        x_btd: jax.Array,
        layer_idx: int,
        router_hook: moe.RouterHook | None,
        replay_btX: jax.Array | None,
        mesh: jax.sharding.Mesh | None = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        cfg, dt, invariant = self.cfg, self.opts.compute_dtype, self.opts.batch_invariant
        ein = functools.partial(numerics.einsum, invariant=invariant)
        b, t, d = x_btd.shape
        # Router in fp32: tiny matmul, and routing decisions are precision-sensitive.
        logits_btE = ein(
            "btd,de->bte", x_btd.astype(jnp.float32), self.router_de[...].astype(jnp.float32)
        )
        edited_btE = logits_btE if router_hook is None else router_hook(logits_btE, layer_idx)
        weights_tX, experts_tX = moe.route(
            edited_btE.reshape(b * t, -1),
            cfg.num_experts_per_tok,
            cfg.norm_topk_prob,
            None if replay_btX is None else replay_btX.reshape(b * t, -1),
            invariant=invariant,
        )
        dispatch = moe.dispatcher(self.opts.moe_impl, mesh, invariant)
        y_td = dispatch(
            x_btd.reshape(b * t, d),
            self.gate_edf[...].astype(dt),
            self.up_edf[...].astype(dt),
            self.down_efd[...].astype(dt),
            weights_tX.astype(dt),
            experts_tX,
        )
        y_btd = y_td.reshape(b, t, d)
        if cfg.shared_expert_intermediate_size:
            gate_bt1 = jax.nn.sigmoid(ein("btd,dx->btx", x_btd, self.shared_gate_d1[...].astype(dt)))
            y_btd = y_btd + gate_bt1 * self.shared_expert(x_btd)
        return y_btd, logits_btE, experts_tX.reshape(b, t, -1)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, opts: ModelOptions, layer_idx: int, rngs: nnx.Rngs):
        self.layer_idx = layer_idx
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, opts.storage_dtype,
                                  opts.batch_invariant)
        self.attn = Attention(cfg, opts, rngs)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, opts.storage_dtype,
                                      opts.batch_invariant)
        if cfg.is_moe_layer(layer_idx):
            self.moe = MoEBlock(cfg, opts, rngs)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, opts, rngs)

    def __call__(self, x_btd, cos_bth, sin_bth, mask_bts, kv, write_index, router_hook, replay_btX,
                 layer_idx: int | jax.Array | None = None, mesh: jax.sharding.Mesh | None = None,
                 packing: Packing | None = None):
        """``layer_idx`` overrides the stored index (a traced one when layers are scanned);
        ``mesh`` goes to the MoE dispatch only (see ``Qwen3``'s ``mesh``); ``packing``: the
        tokens are packed (:class:`Packing`)."""
        layer_idx = self.layer_idx if layer_idx is None else layer_idx
        attn_out, kv = self.attn(self.input_norm(x_btd), cos_bth, sin_bth, mask_bts, kv, write_index,
                                 packing)
        h_btd = constrain(x_btd + attn_out, ("batch", "seq", "act_embed"))
        normed = self.post_attn_norm(h_btd)
        if hasattr(self, "moe"):
            ff, logits_btE, experts_btX = self.moe(normed, layer_idx, router_hook, replay_btX,
                                                   mesh)
        else:
            ff, logits_btE, experts_btX = self.mlp(normed), None, None
        out_btd = constrain(h_btd + ff, ("batch", "seq", "act_embed"))
        return out_btd, kv, logits_btE, experts_btX


class Qwen3(nnx.Module):
    """A Qwen3-family causal LM: ``out = model(input_ids)``.

    Call arguments:
      input_ids_bt: [B, T] int token ids.
      positions_bt: [B, T] RoPE positions (default: cache index + arange(T)).
      attention_mask_bt: [B, T] 1 for real tokens, 0 for padding (default: all ones).
      cache: a :class:`KVCache`; the new tokens are written at ``cache.index`` (shared, or
        per row: see :class:`KVCache`).
      router_hook: pure ``f(logits_btE fp32, layer_idx) -> logits_btE`` applied before
        softmax/top-k in every MoE layer (router steering plugs in here).
      routing_replay: per layer [B, T, X] expert indices to use instead of top-k.
      return_logits: False skips the LM head (callers that chunk the vocab projection).
      mesh: the device mesh, handed to the MoE dispatch and nothing else: the
        "expert_parallel" dispatch routes tokens across its expert axis (without a mesh it
        runs as "ragged"). The layers themselves only name logical axes.
      packing: feed ``input_ids_bt`` as packed tokens [G, N] (:class:`Packing`) laid out as
        ``attention_mask_bt``'s [B, T] rows (required, as is a per-row cache); hidden,
        logits and routing come back packed, [G, N, ...].
      return_residuals: False (default: nothing extra is traced, so every existing program
        is unchanged), True for every decoder layer, or a tuple of decoder-layer indices: the
        residual stream entering those layers comes back as ``ModelOutput.residuals``
        [B, T, R, D] in the order given. Asking for a few layers keeps only those: a scanned
        model writes them into a [B, T, R, D] buffer instead of stacking all L.
    """

    def __init__(self, config: ModelConfig, options: ModelOptions | None = None, *, rngs: nnx.Rngs):
        options = options or ModelOptions()
        if options.moe_impl == "auto":  # explicit values win; "auto" is fixed at build time
            options = dataclasses.replace(options, moe_impl=auto_moe_impl())
        if options.batch_invariant:
            numerics.warn_if_inexact()
        self.config, self.options = config, options
        pd = options.storage_dtype
        self.embed_vd = _init(rngs, (config.vocab_size, config.hidden_size), pd, ("vocab", "embed"))
        if options.scan_layers:
            self.layers = _stacked_layers(config, options, rngs)
        else:
            self.layers = nnx.List(
                [DecoderLayer(config, options, i, rngs) for i in range(config.num_layers)]
            )
        self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, pd,
                                  options.batch_invariant)
        if not config.tie_word_embeddings:
            self.lm_head_dv = _init(rngs, (config.hidden_size, config.vocab_size), pd, ("embed", "vocab"))

    def lm_head(self, hidden_btd: jax.Array) -> jax.Array:
        """Vocabulary projection in fp32 accumulation: [B, T, D] -> [B, T, V]."""
        dt = self.options.compute_dtype
        ein = functools.partial(numerics.einsum, invariant=self.options.batch_invariant,
                                preferred_element_type=jnp.float32)
        if self.config.tie_word_embeddings:
            return ein("btd,vd->btv", hidden_btd, self.embed_vd[...].astype(dt))
        return ein("btd,dv->btv", hidden_btd, self.lm_head_dv[...].astype(dt))

    def __call__(
        self,
        input_ids_bt: jax.Array,
        positions_bt: jax.Array | None = None,
        attention_mask_bt: jax.Array | None = None,
        cache: KVCache | None = None,
        router_hook: moe.RouterHook | None = None,
        routing_replay: list | None = None,
        return_logits: bool = True,
        mesh: jax.sharding.Mesh | None = None,
        packing: Packing | None = None,
        return_residuals: bool | tuple[int, ...] = False,
    ) -> ModelOutput:
        cfg, dt = self.config, self.options.compute_dtype
        residual_layers = _residual_layers(return_residuals, cfg.num_layers)
        input_ids_bt = jnp.asarray(input_ids_bt)
        if input_ids_bt.ndim != 2:
            raise ValueError(f"input_ids must be [batch, time], got shape {input_ids_bt.shape}")
        if packing is not None and (attention_mask_bt is None or cache is None
                                    or not cache.per_row):
            raise ValueError("packing needs the layout's attention_mask_bt and a per-row cache")
        b, t = input_ids_bt.shape if packing is None else jnp.shape(attention_mask_bt)
        mask_bt = (jnp.ones((b, t), bool) if attention_mask_bt is None
                   else jnp.asarray(attention_mask_bt).astype(bool))
        start = jnp.zeros((), jnp.int32) if cache is None else cache.index
        # Slot of each query: [1, T] with a shared index, [B, T] with per-row indices.
        query_slot_bt = jnp.reshape(start, (-1, 1)) + jnp.arange(t, dtype=jnp.int32)
        if positions_bt is None:
            positions_bt = jnp.broadcast_to(query_slot_bt, (b, t))
        if routing_replay is not None and len(routing_replay) != cfg.num_layers:
            raise ValueError(f"routing_replay needs {cfg.num_layers} entries, got {len(routing_replay)}")

        # Attention mask over key slots: causal by slot index, and only real tokens.
        if cache is None:
            key_valid_bs = mask_bt
        else:
            key_valid_bs = write_slots(cache.valid_bs, mask_bt, start)
        key_slot_s = jnp.arange(key_valid_bs.shape[1])
        mask_bts = (key_slot_s[None, None, :] <= query_slot_bt[:, :, None]) & key_valid_bs[:, None, :]

        x_btd = jnp.take(self.embed_vd[...], input_ids_bt, axis=0).astype(dt)
        x_btd = constrain(x_btd, ("batch", "seq", "act_embed"))
        if packing is not None:  # the packed tokens' positions
            positions_bt = packing.pack(jnp.broadcast_to(positions_bt, (b, t)))
        cos_bth, sin_bth = rope_tables(positions_bt, cfg.head_dim, cfg.rope_theta)

        # Remat only matters when differentiating; the cache (sampling) path never is.
        policy = REMAT_POLICIES[self.options.remat_policy] if cache is None else None
        layer_args = (cos_bth, sin_bth, mask_bts, start, router_hook, mesh, packing)
        if self.options.scan_layers:
            if cache is not None and not cache.stacked:
                raise ValueError("a model with scan_layers needs a stacked KVCache "
                                 "(model.init_cache builds one)")
            x_btd, kv, router_logits, selected, residuals = _scan_layers(
                self.layers, x_btd, layer_args, cache, routing_replay, policy, residual_layers)
        else:
            if cache is not None and cache.stacked:
                raise ValueError("a stacked KVCache needs a model with scan_layers")
            x_btd, kv, router_logits, selected, residuals = _loop_layers(
                self.layers, x_btd, layer_args, cache, routing_replay, policy, residual_layers)

        hidden_btd = self.final_norm(x_btd)
        logits = self.lm_head(hidden_btd) if return_logits else None
        new_cache = None
        if cache is not None:
            # A per-row index advances by the row's real tokens (its padding is on the right).
            advance = jnp.sum(mask_bt, axis=1, dtype=jnp.int32) if cache.per_row else t
            new_cache = KVCache(k=kv[0], v=kv[1], valid_bs=key_valid_bs, index=start + advance)
        return ModelOutput(logits, hidden_btd, router_logits, selected, new_cache, residuals)

    def init_cache(self, batch: int, max_len: int, dtype: Any = None,
                   per_row: bool = False) -> KVCache:
        return KVCache.init(self.config, batch, max_len, dtype or self.options.compute_dtype,
                            stacked=self.options.scan_layers, per_row=per_row)


def _residual_layers(return_residuals: bool | tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    """``return_residuals`` as a tuple of decoder-layer indices (empty: none asked for)."""
    if return_residuals is True:
        return tuple(range(num_layers))
    if return_residuals is False or return_residuals is None:
        return ()
    layers = tuple(return_residuals)
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers
               for i in layers) or len(set(layers)) != len(layers):
        raise ValueError(f"return_residuals must be a bool or distinct layer indices in "
                         f"[0, {num_layers}), got {return_residuals!r}")
    return layers


def _loop_layers(layers, x_btd, layer_args, cache, routing_replay, policy, residual_layers=()):
    """Runs the layers one after another in Python (any mix of dense and MoE layers); keeps
    the residual entering each of ``residual_layers``, stacked [B, T, R, D] (None if none)."""
    cos_bth, sin_bth, mask_bts, start, router_hook, mesh, packing = layer_args

    def run_layer(layer, x_btd, kv, replay_btX):
        return layer(x_btd, cos_bth, sin_bth, mask_bts, kv, start, router_hook, replay_btX,
                     mesh=mesh, packing=packing)

    if policy is not None:
        run_layer = nnx.remat(run_layer, policy=policy)
    router_logits, selected, new_k, new_v, entering = [], [], [], [], {}
    for i, layer in enumerate(layers):
        if i in residual_layers:
            entering[i] = x_btd
        kv = None if cache is None else (cache.k[i], cache.v[i])
        replay = None if routing_replay is None else routing_replay[i]
        x_btd, kv, logits_btE, experts_btX = run_layer(layer, x_btd, kv, replay)
        router_logits.append(logits_btE)
        selected.append(experts_btX)
        if kv is not None:
            new_k.append(kv[0])
            new_v.append(kv[1])
    residuals = (jnp.stack([entering[i] for i in residual_layers], axis=2) if residual_layers
                 else None)
    return x_btd, (tuple(new_k), tuple(new_v)), router_logits, selected, residuals


def _scan_layers(layers, x_btd, layer_args, cache, routing_replay, policy, residual_layers=()):
    """Runs stacked layers with ``jax.lax.scan``: the layer index, its parameters, its cache
    slice and its replayed routing are the scanned inputs; router logits, selected experts
    and the updated cache come back stacked and are split into per-layer lists.

    With ``residual_layers``, the carry also holds a [B, T, R, D] buffer that each requested
    layer writes its input into (slot R, past the end, is dropped): only R layers' residuals
    exist at once, where stacking a scanned output would keep all L."""
    cos_bth, sin_bth, mask_bts, start, router_hook, mesh, packing = layer_args
    graphdef, params = nnx.split(layers)
    num_layers = jax.tree.leaves(params)[0].shape[0]

    def body(x_btd, xs):
        layer_params, layer_idx, kv, replay_btX = xs
        layer = nnx.merge(graphdef, layer_params)
        x_btd, kv, logits_btE, experts_btX = layer(
            x_btd, cos_bth, sin_bth, mask_bts, kv, start, router_hook, replay_btX,
            layer_idx=layer_idx, mesh=mesh, packing=packing)
        return x_btd, (kv, logits_btE, experts_btX)

    if residual_layers:  # a separate body, so the default program is traced unchanged
        slot_L = jnp.full((num_layers,), len(residual_layers), jnp.int32).at[
            jnp.asarray(residual_layers)].set(jnp.arange(len(residual_layers), dtype=jnp.int32))
        layer_body = body

        def body(carry, xs):
            x_btd, res_btRd = carry
            res_btRd = res_btRd.at[:, :, slot_L[xs[1]]].set(x_btd, mode="drop")
            x_btd, ys = layer_body(x_btd, xs)
            return (x_btd, res_btRd), ys

    if policy is not None:
        body = jax.checkpoint(body, policy=policy, prevent_cse=False)
    kv = None if cache is None else (cache.k, cache.v)
    replay = (None if routing_replay is None or all(r is None for r in routing_replay)
              else jnp.stack(list(routing_replay)))  # a dense model replays nothing
    xs = (params, jnp.arange(num_layers, dtype=jnp.int32), kv, replay)
    if residual_layers:
        res_btRd = jnp.zeros((*x_btd.shape[:2], len(residual_layers), x_btd.shape[2]),
                             x_btd.dtype)
        (x_btd, residuals), (kv, logits_LbtE, experts_LbtX) = jax.lax.scan(
            body, (x_btd, res_btRd), xs)
    else:
        residuals = None
        x_btd, (kv, logits_LbtE, experts_LbtX) = jax.lax.scan(body, x_btd, xs)

    def unstack(a):  # dense layers return no routing
        return [None] * num_layers if a is None else list(a)

    return x_btd, kv, unstack(logits_LbtE), unstack(experts_LbtX), residuals


def _stacked_layers(config: ModelConfig, options: ModelOptions, rngs: nnx.Rngs) -> DecoderLayer:
    """One DecoderLayer whose parameters carry a leading layer axis (logical name "layers")."""
    kinds = {config.is_moe_layer(i) for i in range(config.num_layers)}
    if len(kinds) > 1:
        dense = [i for i in range(config.num_layers) if not config.is_moe_layer(i)]
        raise ValueError(
            f"scan_layers needs every decoder layer of one kind, but {config.architecture} has "
            f"dense layers {dense} among MoE layers; use ModelOptions(scan_layers=False)")

    @nnx.split_rngs(splits=config.num_layers)
    @nnx.vmap(in_axes=0, out_axes=0)
    def make(rngs: nnx.Rngs) -> DecoderLayer:
        # layer_idx 0 stands for the kind of every layer; the real index is passed in the scan.
        return DecoderLayer(config, options, 0, rngs)

    layers = make(rngs)
    for _, var in nnx.iter_graph(layers):
        if isinstance(var, nnx.Variable) and "axes" in var.get_metadata():
            var.set_metadata(axes=("layers", *var.get_metadata()["axes"]))
    return layers


def positions_from_mask(attention_mask_bt: jax.Array) -> jax.Array:
    """RoPE positions for left-padded rows: 0, 1, ... from each row's first real token."""
    mask = jnp.asarray(attention_mask_bt).astype(jnp.int32)
    return jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0)
