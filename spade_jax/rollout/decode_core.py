"""What every decode path shares: one static config, one scalars type, one state type, one
decode step and loop, one draw, one record, one routing record, one stop-string pass.
:func:`spade_jax.rollout.sampler.sample` (a batch of prompts, one shared cache index) and
:class:`spade_jax.rollout.engine.SlotEngine` (slots with a cache index each) keep their own
prefill and schedule; what a row carries, how a step feeds it, how it draws, what it
records, when it is done and where a stop string cuts it are defined here once, so the two
cannot drift.

A row that is running at a step has drawn ``num_generated_b`` tokens, so its next draw goes
to that column and uses that step number: a row's tokens depend on its (seed, stream) and
its own history only, never on which rows share its batch or call.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from spade_jax.models import KVCache
from spade_jax.rollout import sampling
from spade_jax.rollout.routing import routing_dtype

DONE_REASONS = ("running", "eos", "stop_string", "max_tokens")
RUNNING, EOS, STOP_STRING, MAX_TOKENS = range(4)
CACHE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class DecodeStatic:
    """Everything a compiled decode program depends on besides array shapes (hashable: a
    jit static argument), for both paths.

    greedy, top_k, use_top_p, batch_invariant: how rows draw (:func:`draw`).
    router_hook: pure ``f(logits_btE, layer_idx)`` in every MoE layer before top-k; with an
      ``answer_detector`` called as ``f(logits, layer, active=fired_b)``.
    mesh: handed to the model (its expert-parallel MoE dispatch).
    return_router: record the experts every fed token was routed to; router_logits: and
      its router logits (then the experts are recorded as int32, else in the compact
      routing dtype).
    answer_detector: a device-side first-answer detector (the sampler's; None in the engine).
    cache_dtype, cache_len: the KV cache a prefill allocates (the engine grows its own
      between calls and leaves these unset)."""

    greedy: bool
    top_k: int
    use_top_p: bool
    batch_invariant: bool = False
    router_hook: Callable | None = None
    mesh: Any = None
    return_router: bool = False
    router_logits: bool = False
    answer_detector: Any = None
    cache_dtype: Any = None
    cache_len: int = 0


def static_for(config: Any, model_options: Any, *, cache_len: int = 0,
               router_hook: Callable | None = None, answer_detector: Any = None,
               mesh: jax.sharding.Mesh | None = None,
               router_logits: bool | None = None) -> DecodeStatic:
    """The decode programs' static settings for a :class:`~spade_jax.rollout.sampler.
    SamplerConfig` and the model's options. ``router_logits`` None: as ``config`` says."""
    return DecodeStatic(
        greedy=config.greedy, top_k=config.top_k,
        use_top_p=config.top_p < 1 and not config.greedy,
        batch_invariant=getattr(model_options, "batch_invariant", False),
        router_hook=router_hook, mesh=mesh, return_router=bool(config.return_router),
        router_logits=(config.records_router_logits if router_logits is None
                       else router_logits),
        answer_detector=answer_detector, cache_dtype=cache_dtype_for(config, model_options),
        cache_len=cache_len)


def cache_dtype_for(config: Any, model_options: Any) -> Any:
    """The KV cache's dtype: ``config.cache_dtype`` when set, else the compute dtype."""
    return (CACHE_DTYPES[config.cache_dtype] if config.cache_dtype
            else model_options.compute_dtype)


class DecodeScalars(struct.PyTreeNode):
    """Traced sampling settings (changing them does not recompile). ``seed`` and
    ``row_offset`` (prompt index of a batch's row 0) are the sampler's, from which its
    prefill derives each row's ``seed_b`` / ``stream_b``; the engine's requests carry their
    own seeds and leave them None."""

    temperature: jax.Array
    top_p: jax.Array
    seed: jax.Array | None = None
    row_offset: jax.Array | None = None


class DecodeState(struct.PyTreeNode):
    """The decode carry of every path: B rows (the sampler's prompts, the engine's slots),
    each generating one request into an N-token buffer. A field a path does not use is
    None (the tree has no leaf there, so no program carries it).

    Both paths: ``cache`` (the sampler's has one shared index, the engine's one per row),
    ``last_token_b`` (the token to feed next), the request's draws ``tokens_bn`` /
    ``logprobs_bn``, ``num_generated_b``, ``done_b``, ``reason_b`` (an index into
    :data:`DONE_REASONS`), ``limit_b`` (the row's max new tokens), ``seed_b`` /
    ``stream_b`` (its PRNG stream: :func:`draw`), ``stop_bm`` (stop ids, -1 = unused:
    [B, M] per row, or [1, M] shared) and ``experts_bnlx`` (the experts of each fed
    generated token, when routing is recorded).

    The sampler only: ``position_b`` (RoPE position of ``last_token_b``: its prompts are
    left-padded, so a position is not a cache slot), ``row_id_b`` (prompt index, -1 for a
    padding row), ``step`` (buffer columns written so far: its calls end at a step),
    ``router_bnle`` (fp32 router logits, ``return_router=True``) and ``answer_state``
    (the first-answer detector's per-row state)."""

    cache: KVCache
    last_token_b: jax.Array  # [B] int32
    tokens_bn: jax.Array  # [B, N] int32
    logprobs_bn: jax.Array  # [B, N] fp32
    num_generated_b: jax.Array  # [B] int32
    done_b: jax.Array  # [B] bool
    reason_b: jax.Array  # [B] int32
    limit_b: jax.Array  # [B] int32
    seed_b: jax.Array  # [B] int32
    stream_b: jax.Array  # [B] int32
    stop_bm: jax.Array  # [B, M] or [1, M] int32
    experts_bnlx: jax.Array | None = None  # [B, N, L, X] (compact dtype, or int32)
    position_b: jax.Array | None = None  # [B] int32
    row_id_b: jax.Array | None = None  # [B] int32
    step: jax.Array | None = None  # [] int32
    router_bnle: jax.Array | None = None  # [B, N, L, E] fp32
    answer_state: Any = None


def recorded_layers(cfg: Any, static: DecodeStatic) -> tuple[int, ...]:
    """The MoE layers whose routing is recorded (empty: none recorded)."""
    if not static.return_router:
        return ()
    return tuple(i for i in range(cfg.num_layers) if cfg.is_moe_layer(i))


def routing_shapes(cfg: Any, static: DecodeStatic) -> tuple[tuple | None, tuple | None]:
    """Per generated token, the recorded experts' ``(L, X, dtype)`` and router logits'
    ``(L, E)``, each None when not recorded. The experts are int32 beside the logits (as
    they always were), else in the compact routing dtype (the recording is all there is)."""
    layers = recorded_layers(cfg, static)
    if not layers:
        return None, None
    logits = static.router_logits
    experts = (len(layers), cfg.num_experts_per_tok,
               jnp.dtype(jnp.int32) if logits else jnp.dtype(routing_dtype(cfg.num_experts)))
    return experts, ((len(layers), cfg.num_experts) if logits else None)


def moe_stack(per_layer: list, moe_layers: Sequence[int]) -> jax.Array | None:
    """The MoE layers' entries of a per-layer list stacked on axis 2 ([B, T, L, ...])."""
    if not moe_layers:
        return None
    return jnp.stack([per_layer[i] for i in moe_layers], axis=2)


def new_rows(cache: KVCache | None, *, new_buffer: int, limit_b: jax.Array, seed_b: jax.Array,
             stream_b: jax.Array, stop_bm: jax.Array, done_b: jax.Array | None = None,
             routing: tuple[tuple | None, tuple | None] = (None, None),
             answer_detector: Any = None) -> DecodeState:
    """B rows about to draw their first token (nothing generated): the request state every
    path starts from. ``done_b`` rows (padding rows, empty slots) are done as
    "max_tokens" and never draw. ``routing``: :func:`routing_shapes`, the buffers to
    allocate. The sampler's own fields are left None (it sets them)."""
    b = limit_b.shape[0]
    done_b = jnp.zeros((b,), bool) if done_b is None else done_b
    experts, logits = routing
    return DecodeState(
        cache=cache,
        last_token_b=jnp.zeros((b,), jnp.int32),
        tokens_bn=jnp.zeros((b, new_buffer), jnp.int32),
        logprobs_bn=jnp.zeros((b, new_buffer), jnp.float32),
        num_generated_b=jnp.zeros((b,), jnp.int32),
        done_b=done_b,
        reason_b=jnp.where(done_b, MAX_TOKENS, RUNNING).astype(jnp.int32),
        limit_b=limit_b, seed_b=seed_b, stream_b=stream_b, stop_bm=stop_bm,
        experts_bnlx=(None if experts is None
                      else jnp.zeros((b, new_buffer, experts[0], experts[1]), experts[2])),
        router_bnle=None if logits is None else jnp.zeros((b, new_buffer) + logits, jnp.float32),
        answer_state=None if answer_detector is None else answer_detector.init(b),
    )


def router_hook_for(static: DecodeStatic, answer_state: Any) -> Callable | None:
    """The router hook as the model calls it; with a detector it also sees ``active=[B]``."""
    if static.router_hook is None or static.answer_detector is None:
        return static.router_hook
    return functools.partial(static.router_hook, active=answer_state.fired_b)


def draw_and_record(state: DecodeState, logits_bv: jax.Array, running_b: jax.Array,
                    scalars: DecodeScalars, static: DecodeStatic) -> tuple[DecodeState, jax.Array]:
    """Every running row draws its next token from ``logits_bv`` with its own stream and
    records it; the sampler's step counter and answer detector advance. Returns the state
    and the drawn tokens ([B], a done row's are dropped)."""
    token_b, logprob_b = draw(logits_bv, state.seed_b, state.stream_b, state.num_generated_b,
                              scalars, static)
    state = record(state, token_b, logprob_b, running_b, state.stop_bm)
    if state.step is not None:
        state = state.replace(step=state.step + 1)
    if static.answer_detector is not None:
        state = state.replace(answer_state=static.answer_detector.update(state.answer_state,
                                                                         token_b))
    return state, token_b


def decode_step(model: nnx.Module, state: DecodeState, scalars: DecodeScalars,
                static: DecodeStatic) -> DecodeState:
    """One token for every running row: the model fed each row's last token, its routing
    recorded, the next token drawn and recorded. The sampler's rows share one cache index
    and carry their RoPE position (left-padded prompts); the engine's slots each have their
    own index, and a done slot's write is masked out so its stream stays as it was."""
    running_b = ~state.done_b
    shared_index = state.position_b is not None
    out = model(state.last_token_b[:, None],
                state.position_b[:, None] if shared_index else None,
                None if shared_index else running_b[:, None],
                cache=state.cache, router_hook=router_hook_for(static, state.answer_state),
                mesh=static.mesh)
    if state.experts_bnlx is not None:  # the routing of the token just fed
        layers = recorded_layers(model.config, static)
        state = state.replace(experts_bnlx=record_routing(
            state.experts_bnlx, moe_stack(out.selected_experts, layers)[:, 0], running_b,
            state.num_generated_b))
        if state.router_bnle is not None:
            state = state.replace(router_bnle=record_routing(
                state.router_bnle, moe_stack(out.router_logits, layers)[:, 0], running_b,
                state.num_generated_b))
    state = state.replace(cache=out.cache)
    if shared_index:
        state = state.replace(position_b=state.position_b + 1)
    return draw_and_record(state, out.logits[:, -1], running_b, scalars, static)[0]


@functools.partial(jax.jit, static_argnames=("graphdef", "static"), donate_argnames=("state",))
def decode(graphdef: nnx.GraphDef, params: Any, state: DecodeState, max_steps: jax.Array,
           scalars: DecodeScalars, *, static: DecodeStatic) -> tuple[DecodeState, jax.Array]:
    """Up to ``max_steps`` :func:`decode_step` s in one ``lax.while_loop``, fewer when every
    row is done: no Python per token. Returns the state and ``[steps, busy]`` (steps run,
    running rows summed over them)."""
    model = nnx.merge(graphdef, params)

    def keep_going(carry):
        steps, _, s = carry
        return (steps < max_steps) & ~jnp.all(s.done_b)

    def body(carry):
        steps, busy, s = carry
        busy = busy + jnp.sum(~s.done_b, dtype=jnp.int32)
        return steps + 1, busy, decode_step(model, s, scalars, static)

    zero = jnp.zeros((), jnp.int32)
    steps, busy, state = jax.lax.while_loop(keep_going, body, (zero, zero, state))
    return state, jnp.stack([steps, busy])


def draw(logits_bv: jax.Array, seed_b: jax.Array, stream_b: jax.Array, step_b: jax.Array,
         scalars: Any, static: Any) -> tuple[jax.Array, jax.Array]:
    """Each row's next token and its log-prob under the temperature-scaled policy.

    Row b draws with ``fold_in(fold_in(key(seed_b[b]), stream_b[b]), step_b[b])``: the
    sampler's row r of a call with seed s uses (s, r, n), a slot-engine request with seed s
    uses (s, 0, n), so a one-prompt sample and a request with the same seed draw alike.
    ``scalars``: traced ``temperature`` and ``top_p``; ``static``: ``greedy``, ``top_k``,
    ``use_top_p`` and ``batch_invariant``."""
    keys_b = jax.vmap(lambda s, r, n: jax.random.fold_in(
        jax.random.fold_in(jax.random.key(s), r), n))(seed_b, stream_b, step_b)
    return sampling.sample_tokens(
        logits_bv, keys_b, temperature=scalars.temperature, top_k=static.top_k,
        top_p=scalars.top_p, greedy=static.greedy, use_top_p=static.use_top_p,
        invariant=static.batch_invariant)


def record(state: Any, token_b: jax.Array, logprob_b: jax.Array, running_b: jax.Array,
           stop_bm: jax.Array) -> Any:
    """``state`` with the drawn token of each running row written to its next column and
    its done / reason updated: a token among the row's stop ids ``stop_bm[b]`` (-1 =
    unused) ends it as "eos", reaching ``limit_b`` as "max_tokens". Rows not running keep
    everything (their draws are dropped)."""
    n = state.tokens_bn.shape[1]
    rows_b = jnp.arange(token_b.shape[0])
    col_b = jnp.where(running_b, state.num_generated_b, n)  # column n: dropped
    num_b = state.num_generated_b + running_b.astype(jnp.int32)
    hit_stop_b = running_b & jnp.any(token_b[:, None] == stop_bm, axis=-1)
    hit_limit_b = running_b & ~hit_stop_b & (num_b >= state.limit_b)
    return state.replace(
        tokens_bn=state.tokens_bn.at[rows_b, col_b].set(token_b, mode="drop"),
        logprobs_bn=state.logprobs_bn.at[rows_b, col_b].set(logprob_b, mode="drop"),
        num_generated_b=num_b,
        done_b=state.done_b | hit_stop_b | hit_limit_b,
        reason_b=jnp.where(hit_stop_b, EOS, jnp.where(hit_limit_b, MAX_TOKENS, state.reason_b)),
        last_token_b=jnp.where(running_b, token_b, state.last_token_b),
    )


def record_routing(buffer_bn: jax.Array, value_b: jax.Array, running_b: jax.Array,
                   num_generated_b: jax.Array) -> jax.Array:
    """``buffer_bn`` ([B, N, ...]) with ``value_b`` (what the model computed for the token
    each row just fed: its experts or router logits) written at the column of the draw that
    produced that token, ``num_generated_b - 1``, for running rows."""
    rows_b = jnp.arange(running_b.shape[0])
    col_b = jnp.where(running_b, num_generated_b - 1, buffer_bn.shape[1])
    return buffer_bn.at[rows_b, col_b].set(value_b.astype(buffer_bn.dtype), mode="drop")


@functools.partial(jax.jit, donate_argnums=0)
def cut(state: DecodeState, cut_b: jax.Array) -> DecodeState:
    """Ends the rows with ``cut_b >= 0`` after their first ``cut_b`` tokens (a stop string
    completed there): reason "stop_string". With a cache index per row (the engine's
    slots, kept for a continuation) a cut row's cache goes back to the stream before its
    last kept token (drawn, never fed), as if it had stopped there: every step of a running
    row fed one token and drew one, so ``index - num_generated`` is the same at any step
    of a request. A shared index (the sampler's rows, discarded when done) stays."""
    is_cut = cut_b >= 0
    if state.cache.index.ndim == 1:
        index_b = jnp.where(is_cut, state.cache.index - (state.num_generated_b - cut_b),
                            state.cache.index)
        slots_s = jnp.arange(state.cache.valid_bs.shape[1])
        valid_bs = state.cache.valid_bs & (~is_cut[:, None]
                                           | (slots_s[None, :] < index_b[:, None]))
        state = state.replace(cache=state.cache.replace(index=index_b, valid_bs=valid_bs))
    return state.replace(
        num_generated_b=jnp.where(is_cut, cut_b, state.num_generated_b),
        done_b=state.done_b | is_cut,
        reason_b=jnp.where(is_cut, STOP_STRING, state.reason_b))


def apply_stop_strings(state: DecodeState, stop_text: StopStrings,
                       rows: list[tuple[int, int]]) -> DecodeState:
    """The stop-string pass of both paths: candidate ``rows`` (batch row, its key in
    ``stop_text``) whose decoded text now contains a stop string are :func:`cut`. Run
    under the caller's mesh."""
    if not any(stop_text.per_row):
        return state
    cut_b = stop_text.cuts(rows, to_host(state.done_b), to_host(state.num_generated_b),
                           lambda: to_host(state.tokens_bn))
    return state if cut_b is None else cut(state, to_device(cut_b, like=state.done_b))


def to_host(x: jax.Array) -> np.ndarray:
    """``x`` as a NumPy array on this host. A row-sharded array on a mesh spanning several
    processes holds other hosts' rows, which ``np.asarray`` cannot read: it is all-gathered
    instead (a collective; every process reaches the same reads, as all run the same
    decode loop on the same global batch). One process: a plain device-to-host copy."""
    if x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def to_device(x: np.ndarray, mesh: jax.sharding.Mesh | None = None, *,
              like: jax.Array | None = None) -> jax.Array:
    """A host array back on the devices: with ``like``'s sharding, else replicated over
    ``mesh``. On a mesh spanning several processes every process passes the same values
    (computed from gathered arrays) and fills its own shards; otherwise an uncommitted
    array, as a one-process run always had."""
    target = like.sharding if like is not None else (
        None if mesh is None else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    if target is None or target.is_fully_addressable:
        return jnp.asarray(x)
    return jax.device_put(x, target)


class StopStrings:
    """Host-side stop-string check on decoded text (strings span token boundaries).

    ``per_row[key]``: the strings that end the row known as ``key`` (a prompt index, a
    slot). A row is checked on every pass until it is cut or has been checked once after it
    finished (it may have passed a stop string before its stop token or budget); then it
    is settled until :meth:`reopen`."""

    def __init__(self, per_row: list[list[str]], tokenizer: Any):
        if any(per_row) and tokenizer is None:
            raise ValueError("stop_strings need a tokenizer= to decode the generated tokens")
        self.per_row, self.tokenizer = per_row, tokenizer
        self.settled: set[int] = set()  # rows already finished and checked

    def first_stop(self, row: int, tokens: list[int]) -> int | None:
        """Smallest n such that decode(tokens[:n]) contains a stop string, else None."""
        stops = self.per_row[row]
        if not stops or not any(s in self.tokenizer.decode(tokens) for s in stops):
            return None
        for n in range(1, len(tokens) + 1):
            text = self.tokenizer.decode(tokens[:n])
            if any(s in text for s in stops):
                return n
        return None

    def cuts(self, rows: list[tuple[int, int]], done_b: np.ndarray, num_b: np.ndarray,
             read_tokens: Any) -> np.ndarray | None:
        """The stop-string pass: for candidate ``rows`` (batch row b, its key), the token
        count to cut each at (-1: none) as a [B] int32 array, or None when nothing is cut.
        ``read_tokens()`` gives the [B, N] tokens; it is called at most once, and only when
        some row needs checking (on several processes every one reaches it at the same row:
        the arrays are equal gathered state)."""
        cut_b = np.full(done_b.shape, -1, np.int32)
        tokens_bn = None
        for b, key in rows:
            if not self.per_row[key] or key in self.settled:
                continue
            tokens_bn = read_tokens() if tokens_bn is None else tokens_bn
            at = self.first_stop(key, tokens_bn[b, :num_b[b]].tolist())
            if at is not None:
                cut_b[b] = at
            if at is not None or done_b[b]:  # its tokens will not change any more
                self.settled.add(key)
        return cut_b if (cut_b >= 0).any() else None

    def reopen(self, keys: Any) -> None:
        """Rows starting a new request are checked again."""
        self.settled.difference_update(keys)
