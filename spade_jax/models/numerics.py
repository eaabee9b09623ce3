"""Batch-invariant numerics: contractions and reductions summed in one fixed order.

Why this exists: RL's importance ratio compares the sampler's log-probs with the
trainer's. The sampler runs a KV-cache decode (one token per row per call, so a matmul
has M = rows), the trainer a one-shot forward (M = rows x time), and XLA's matmul and
reduction kernels pick their blocking, vectorisation and reduction trees from the operand
shapes. The same token therefore rounds differently in the two programs (about 2 ulps on
XLA:CPU), even with router replay pinning the experts.

With ``ModelOptions(batch_invariant=True)`` every contraction and reduction that feeds a
forward value runs here instead. A sum of K terms is accumulated strictly left to right,
``((t_0 + t_1) + t_2) + ...``, as a chain of elementwise adds (``CHAIN`` terms per fused
step of a ``lax.scan``), so

* one output element depends only on its own K terms, never on how many other rows,
  tokens or key slots share the call (decode == prefill == training forward); and
* exact zero terms anywhere in the sum (masked key slots, padding) change nothing, so a
  decode over a cache of S slots equals a forward over T tokens.

Most elementwise ops (rsqrt, division, silu) round the same wherever they run and are left
alone; ``exp`` and ``log`` are replaced (below); RoPE and RMSNorm are arranged so that no
add has two product operands; max is exact in any order. Gradients use the ordinary XLA
ops (custom JVPs whose tangents are plain einsums / sums): they must be correct, not
batch-invariant.

The fixed order is necessary, not sufficient: the hardware must also round each step the
same way everywhere. On x86 XLA:CPU, LLVM fuses ``a * b + c`` into an FMA in vectorised
loops but not always in their scalar remainders, so the same sum can differ by an ulp
depending on where an element sits. Exactness therefore needs FMA off:
``XLA_FLAGS=--xla_cpu_max_isa=AVX`` (:data:`EXACT_CPU_XLA_FLAG`), set before JAX starts;
``python -m spade_jax.train`` sets it for experiments with ``model.batch_invariant``, and a
batch-invariant model built on CPU without it warns. With FMA on, the sampler/trainer gap
is usually, not always, exactly 0.

Cost: a contraction does a matmul's FLOPs as elementwise multiply-adds, without a GEMM
kernel (``benchmarks/train_step.py`` measures it). It is an exactness mode for checking
on-policy-ness and for runs that want a zero sampler/trainer gap, not the fast path.
On 8 simulated devices (data, fsdp, tensor and expert meshes) the forward gives the same
bits as one device: XLA gathers the operands of these chains rather than splitting their
sums. A partitioning that did split a sum would add partial sums in the collective's order.
"""

from __future__ import annotations

import functools
import math
import os
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np

CHAIN = 16  # terms added per fused step; any value gives the same order, this sets speed

# XLA:CPU without FMA instructions (x86): every multiply and add rounds on its own.
EXACT_CPU_XLA_FLAG = "--xla_cpu_max_isa=AVX"
_NO_FMA_ISAS = ("SSE4_2", "AVX")


def exact_cpu_math_enabled() -> bool:
    """Whether ``XLA_FLAGS`` caps XLA:CPU at an ISA without FMA (see the module note)."""
    found = re.findall(r"--xla_cpu_max_isa=(\S+)", os.environ.get("XLA_FLAGS", ""))
    return bool(found) and found[-1].upper() in _NO_FMA_ISAS


def request_exact_cpu_math() -> bool:
    """Adds :data:`EXACT_CPU_XLA_FLAG` to ``XLA_FLAGS`` unless a no-FMA ISA is set already.
    Takes effect only if JAX has not started its CPU backend yet (call it first thing in a
    launcher). Returns True if the flag was added."""
    if exact_cpu_math_enabled():
        return False
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {EXACT_CPU_XLA_FLAG}".strip()
    return True


def warn_if_inexact() -> None:
    """Warns when a batch-invariant model runs on XLA:CPU with FMA enabled."""
    if jax.default_backend() == "cpu" and not exact_cpu_math_enabled():
        warnings.warn(
            "batch_invariant=True on XLA:CPU with FMA enabled: sampler and trainer log-probs "
            "agree to about 1 ulp, not always bit for bit. Start the process with "
            f"XLA_FLAGS={EXACT_CPU_XLA_FLAG} for exact agreement.", stacklevel=3)


# ---- exp and log ---------------------------------------------------------------------------
# XLA:CPU evaluates exp and log with one routine in vectorised loops and another in a
# loop's scalar remainder, so the same input can round differently depending on where it
# sits in the array (a decode row of 16 cache slots vs a training row of 10 tokens). These
# are written with +, *, /, floor and exponent bit manipulation only, which every code path
# evaluates identically. Both are within 3 ulps of the correctly rounded value.
#
# Fused multiply-add: LLVM may fuse ``a * b + c`` into one FMA, and where an add has two
# product operands (``a * b + c * d``) which one it fuses differs between a vectorised loop
# and its scalar remainder. Every add below (and in the summation chains) therefore has at
# most one product operand: every code path fuses it (or not) the same way.

_LN2_HI, _LN2_LO = 0.693145751953125, 1.428606765330187e-06  # ln 2 = HI + LO, HI exact * int
_LOG2_E = 1.4426950408889634
_EXP_TAYLOR = tuple(1.0 / math.factorial(k) for k in range(8))  # |r| <= ln2 / 2: 7th order
# 2 atanh(u / 2) = u + sum_k u^(2k+1) / ((2k + 1) 4^k), k >= 1; the sum as a polynomial in u^2
_LOG_SERIES = tuple(1.0 / ((2 * k + 1) * 4**k) for k in range(1, 7))
_EXP_MIN, _EXP_MAX = -87.33654, 88.72283  # exp underflows below 2**-126, overflows above


def _exp_impl(x: jax.Array) -> jax.Array:
    x = jnp.asarray(x)
    x32 = jnp.clip(x.astype(jnp.float32), _EXP_MIN, _EXP_MAX)
    n = jnp.clip(jnp.floor(x32 * _LOG2_E + 0.5), -126.0, 127.0)
    r = (x32 - n * _LN2_HI) - n * _LN2_LO  # x = n ln2 + r
    poly = jnp.full_like(r, _EXP_TAYLOR[-1])
    for c in reversed(_EXP_TAYLOR[:-1]):
        poly = poly * r + c
    scale = jax.lax.bitcast_convert_type((n.astype(jnp.int32) + 127) << 23, jnp.float32)
    out = poly * scale
    out = jnp.where(x < _EXP_MIN, 0.0, out)
    return jnp.where(x > _EXP_MAX, jnp.inf, out).astype(x.dtype)


@jax.custom_jvp
def exp(x: jax.Array) -> jax.Array:
    """``exp(x)`` that rounds the same wherever ``x`` sits in an array (see above);
    inputs below -87.3 give exactly 0 (no subnormals)."""
    return _exp_impl(x)


@exp.defjvp
def _exp_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    out = exp(x)
    return out, out * dx


@jax.custom_jvp
def log(x: jax.Array) -> jax.Array:
    """``log(x)`` for positive normal ``x``, rounding the same wherever ``x`` sits in an
    array; 0 gives -inf and negative inputs NaN."""
    x = jnp.asarray(x)
    x32 = x.astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(x32, jnp.int32)
    exponent = ((bits >> 23) & 0xFF) - 127
    mantissa = jax.lax.bitcast_convert_type((bits & 0x7FFFFF) | 0x3F800000, jnp.float32)  # [1, 2)
    big = mantissa > math.sqrt(2.0)
    mantissa = jnp.where(big, mantissa * 0.5, mantissa)  # [sqrt(1/2), sqrt(2))
    e = (exponent + big.astype(jnp.int32)).astype(jnp.float32)
    # log m = 2 atanh(u / 2) = u + u^3/12 + u^5/80 + ..., u = 2 (m - 1) / (m + 1), |u| < 0.35
    u = (mantissa - 1.0) / (mantissa * 0.5 + 0.5)
    u2 = u * u
    poly = jnp.full_like(u, _LOG_SERIES[-1])
    for c in reversed(_LOG_SERIES[:-1]):
        poly = poly * u2 + c
    log_m = (u * u2) * poly + u
    out = e * _LN2_HI + (e * _LN2_LO + log_m)
    out = jnp.where(x32 == 0, -jnp.inf, jnp.where(x32 < 0, jnp.nan, out))
    return jnp.where(x32 == jnp.inf, jnp.inf, out).astype(x.dtype)


@log.defjvp
def _log_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    return log(x), dx / x


def _chained_sum(terms_k: jax.Array, out_shape: tuple[int, ...], product_with=None) -> jax.Array:
    """``sum_k terms[k] (* product_with[k])`` over the leading axis, left to right, in fp32."""
    k = terms_k.shape[0]
    steps = max(1, -(-k // CHAIN))
    pad = steps * CHAIN - k

    def chunks(x):  # [K, ...] -> [steps, CHAIN, ...], zero terms appended (exact no-ops)
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape(steps, CHAIN, *x.shape[1:])

    def body(acc, chunk):
        if product_with is None:
            for i in range(CHAIN):
                acc = acc + chunk[i]
        else:
            a_c, b_c = chunk
            for i in range(CHAIN):
                acc = acc + a_c[i] * b_c[i]
        return acc, None

    xs = chunks(terms_k) if product_with is None else (chunks(terms_k), chunks(product_with))
    # The barrier hides that the accumulator starts at zero: were XLA to fold ``0 + t_0``
    # into ``t_0`` (e.g. after unrolling a one-step scan), ``a_0 * b_0 + a_1 * b_1`` would
    # be an add of two products, fused either way (see the note on FMA above).
    init = jax.lax.optimization_barrier(jnp.zeros(out_shape, jnp.float32))
    acc, _ = jax.lax.scan(body, init, xs)
    return acc


# ---- reductions ---------------------------------------------------------------------------


@jax.custom_jvp
def _ordered_sum_last(x: jax.Array) -> jax.Array:
    terms = jnp.moveaxis(x.astype(jnp.float32), -1, 0)
    return _chained_sum(terms, terms.shape[1:]).astype(x.dtype)


@_ordered_sum_last.defjvp
def _ordered_sum_last_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    return _ordered_sum_last(x), jnp.sum(dx, axis=-1)


def ordered_sum(x: jax.Array, axis: int = -1, keepdims: bool = False) -> jax.Array:
    """``jnp.sum(x, axis)`` accumulated left to right along ``axis`` (fp32 accumulator)."""
    axis = axis % x.ndim
    out = _ordered_sum_last(jnp.moveaxis(x, axis, -1))
    return jnp.expand_dims(out, axis) if keepdims else out


def sum_(x: jax.Array, axis: int = -1, keepdims: bool = False, *, invariant: bool) -> jax.Array:
    """``jnp.sum``, or :func:`ordered_sum` when ``invariant``."""
    if invariant:
        return ordered_sum(x, axis, keepdims)
    return jnp.sum(x, axis=axis, keepdims=keepdims)


def square_sum(x: jax.Array, *, invariant: bool) -> jax.Array:
    """``sum(x * x)`` over the last axis; ordered (products inside the chain) when
    ``invariant``."""
    if not invariant:
        return jnp.sum(x * x, axis=-1)
    flat = x.reshape(-1, x.shape[-1])
    return einsum("md,md->m", flat, flat, invariant=True).reshape(x.shape[:-1])


def rotate(x: jax.Array, cos: jax.Array, rotated: jax.Array, sin: jax.Array, *,
           invariant: bool) -> jax.Array:
    """``x * cos + rotated * sin`` (RoPE). In invariant mode the first product is added to
    an opaque zero, so the add of two products cannot be fused two ways."""
    if not invariant:
        return x * cos + rotated * sin
    zero = jax.lax.optimization_barrier(jnp.zeros(jnp.broadcast_shapes(x.shape, cos.shape),
                                                  jnp.result_type(x, cos)))
    return (zero + x * cos) + rotated * sin


def softmax(x: jax.Array, axis: int = -1, *, invariant: bool) -> jax.Array:
    """``jax.nn.softmax`` (the same formula: ``exp(x - max) / sum``), with an ordered sum
    when ``invariant``."""
    if not invariant:
        return jax.nn.softmax(x, axis=axis)
    unnormalized = exp(x - jax.lax.stop_gradient(jnp.max(x, axis=axis, keepdims=True)))
    return unnormalized / ordered_sum(unnormalized, axis, keepdims=True)


def token_logprobs(logits: jax.Array, tokens: jax.Array, *, invariant: bool
                   ) -> tuple[jax.Array, jax.Array]:
    """``log_softmax(logits)[token]`` and ``logsumexp(logits)`` over the last axis.

    The sampler (recording a draw) and the trainer (re-scoring it) both call this, so in
    invariant mode they evaluate one formula, ``(logit - max) - log(sum exp(logits - max))``,
    with one summation order.
    """
    target = jnp.take_along_axis(logits, tokens[..., None], axis=-1)[..., 0]
    if not invariant:
        lse = jax.nn.logsumexp(logits, axis=-1)
        return target - lse, lse
    shift = jax.lax.stop_gradient(jnp.max(logits, axis=-1))
    log_z = log(ordered_sum(exp(logits - shift[..., None]), -1))
    return (target - shift) - log_z, shift + log_z


# ---- contractions -------------------------------------------------------------------------


def _parse(spec: str) -> tuple[str, str, str, str]:
    """(lhs, rhs, out, contracted letters in lhs order) of a two-operand einsum spec."""
    inputs, out = spec.replace(" ", "").split("->")
    lhs, rhs = inputs.split(",")
    for name, idx in (("lhs", lhs), ("rhs", rhs), ("output", out)):
        if len(set(idx)) != len(idx) or not idx.isalpha():
            raise ValueError(f"ordered einsum {spec!r}: {name} must be distinct letters")
    contracted = "".join(c for c in lhs if c in rhs and c not in out)
    for name, idx in (("lhs", lhs), ("rhs", rhs)):
        lost = [c for c in idx if c not in out and c not in contracted]
        if lost:
            raise ValueError(f"ordered einsum {spec!r}: {name} index {lost} is summed away "
                             "without being contracted (unsupported)")
    if not set(out) <= set(lhs) | set(rhs):
        raise ValueError(f"ordered einsum {spec!r}: output index not in any operand")
    return lhs, rhs, out, contracted


def _as_terms(x: jax.Array, idx: str, out: str, contracted: str) -> jax.Array:
    """x as [K, *output-broadcast]: contracted letters merged into one leading axis, then
    the output letters in output order (size 1 where x lacks the letter)."""
    present = [c for c in out if c in idx]
    x = jnp.transpose(x, [idx.index(c) for c in contracted] + [idx.index(c) for c in present])
    k = math.prod(x.shape[: len(contracted)])
    sizes = dict(zip(present, x.shape[len(contracted):], strict=True))
    return x.reshape(k, *(sizes.get(c, 1) for c in out))


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 3))
def _ordered_einsum(spec: str, a: jax.Array, b: jax.Array, out_dtype: np.dtype) -> jax.Array:
    lhs, rhs, out, contracted = _parse(spec)
    a_k = _as_terms(a.astype(jnp.float32), lhs, out, contracted)
    b_k = _as_terms(b.astype(jnp.float32), rhs, out, contracted)
    out_shape = jnp.broadcast_shapes(a_k.shape[1:], b_k.shape[1:])
    return _chained_sum(a_k, out_shape, product_with=b_k).astype(out_dtype)


@_ordered_einsum.defjvp
def _ordered_einsum_jvp(spec, out_dtype, primals, tangents):
    (a, b), (da, db) = primals, tangents

    def plain(x, y):
        return jnp.einsum(spec, x, y, preferred_element_type=out_dtype).astype(out_dtype)

    return _ordered_einsum(spec, a, b, out_dtype), plain(da, b) + plain(a, db)


def einsum(spec: str, a: jax.Array, b: jax.Array, *, invariant: bool,
           preferred_element_type=None) -> jax.Array:
    """Two-operand ``jnp.einsum``; when ``invariant`` the contracted index (several letters
    are flattened into one) is summed left to right in fp32, then cast to the result dtype
    (``preferred_element_type`` or the operands' promoted dtype)."""
    if not invariant:
        return jnp.einsum(spec, a, b, preferred_element_type=preferred_element_type)
    out_dtype = np.dtype(preferred_element_type or jnp.result_type(a, b))
    return _ordered_einsum(spec, a, b, out_dtype)
