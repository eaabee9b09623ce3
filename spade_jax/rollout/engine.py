"""Slot engine: continuous batching over a fixed set of decode slots, each holding one
sequence's KV cache from request to request (turn to turn of an episode).

    engine = SlotEngine(model, num_slots=8, config=SamplerConfig(max_new_tokens=64),
                        stop_tokens=[eos], stop_strings=["</answer>"], tokenizer=tok)
    engine.admit([Request(slot=0, tokens=prompt, fresh=True, limit=64, seed=s)])
    engine.decode(32)
    for done in engine.finished(): ...

How it runs:
  * The cache has a per-row write index (``KVCache.index`` of shape [B]): slot b's stream
    occupies cache slots 0 .. index[b] - 1 at RoPE positions 0 .. index[b] - 1, the
    positions the trainer's forward gives the same stream.
  * ``admit`` prefills only the tokens a request adds to its slot's stream (a fresh request:
    the whole prompt; a continuing one: what came after its last cached token) into the
    slots named, in one jitted call over the admitted rows only (or, with
    ``max_prefill_tokens``, consecutive calls each within that budget of rows x prompt
    bucket), and draws their first token. The added tokens are fed packed
    (``models.qwen3.Packing``): padding costs no position-wise work, only attention sees
    them laid out as rows. Fresh requests with the same prompt are prefilled once and the
    result copied into each of their slots (prefix sharing).
  * ``decode`` runs up to n one-token steps of every slot in a ``lax.while_loop``; rows that
    are done (waiting for their next request, or empty) are masked: they write nothing
    valid and do not advance.
  * Stop strings (they need the tokenizer) are checked on the host when results are
    collected, as :func:`spade_jax.rollout.sampler.sample` checks them between decode chunks
    (its helper): a row whose decoded text contains one is cut to the shortest prefix that
    does, done reason "stop_string", and its cache rolled back to that prefix, so a
    continuation sees the stream the record holds. The tokens it drew past the cut are
    dropped; what a request returns does not depend on when the check ran.
  * A row's draw at its step n uses ``fold_in(fold_in(key(seed), 0), n)`` with the seed of
    its request: the key :func:`spade_jax.rollout.sampler.sample` gives a one-prompt call
    with that seed. A request's tokens therefore depend on its seed and its stream only,
    not on its slot, the slot count, or which rows share the batch (log-probs: to float
    rounding, bit for bit with a batch-invariant model).

Slot-contiguous, not paged: the cache row of a slot is one [S, K, H] block per layer, so a
decode step reads it with no gather (paged attention on XLA gathers every page of every
row per token); the price is that a slot's length is the longest stream's, grown by
doubling when a request needs more.
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

from spade_jax import sharding
from spade_jax.models import KVCache
from spade_jax.models.qwen3 import Packing
from spade_jax.rollout import decode_core
from spade_jax.rollout.decode_core import (
    DONE_REASONS,
    DecodeScalars,
    DecodeState,
    DecodeStatic,
    StopStrings,
    moe_stack,
    to_device,
    to_host,
)
from spade_jax.rollout.sampler import SamplerConfig, batch_shards, next_pow2, round_up


@dataclasses.dataclass(frozen=True)
class Request:
    """One turn to generate in a slot.

    slot: the decode slot (its cache holds the stream so far unless ``fresh``).
    tokens: the tokens to append to the slot's stream before generating (fresh: the prompt).
    fresh: start an empty stream (a new sequence takes the slot).
    limit: new tokens at most.
    seed: the request's PRNG seed (``derive_seed(...)`` of who asks).
    """

    slot: int
    tokens: Sequence[int]
    fresh: bool
    limit: int
    seed: int


@dataclasses.dataclass(frozen=True)
class Finished:
    """A request's result: generated tokens (a stop token that ended it included; a stop
    string's tokens up to the one completing it), their log-probs and the done reason
    ("eos", "stop_string" or "max_tokens").

    routing: with ``SamplerConfig.return_router`` on an MoE model, the experts every token
      this request *fed* was routed to, ``[len(tokens of the request) + len(tokens) - 1, L,
      X]`` in the compact dtype (:mod:`spade_jax.rollout.routing`): the request's added
      tokens, then each generated token but the last (never fed). Else None.
    """

    slot: int
    tokens: list[int]
    logprobs: list[float]
    reason: str
    routing: np.ndarray | None = None


@functools.partial(jax.jit, static_argnames=("graphdef", "static"), donate_argnames=("state",))
def _admit(graphdef, params, state: DecodeState, home_u, fresh_u, ids_gn, packing: Packing, mask_ut,
           last_gu, src_k, slots_k, limit_k, seed_k, scalars: DecodeScalars, *,
           static: DecodeStatic):
    """Prefills U unique requests (row u extends the cache of slot ``home_u[u]``, emptied
    first when ``fresh_u[u]``; its added tokens are the real ones of ``mask_ut[u]``, fed
    packed as ``ids_gn`` with ``packing``, so padding costs no position-wise work; its last
    token is packed token ``last_gu`` of its group) and installs them in K slots (slot
    ``slots_k[k]`` gets the result of row ``src_k[k]``), each drawing its first token with
    its own seed. Returns the state and, when routing is recorded, the prefill's packed
    [G, N, L, X] experts."""
    model = nnx.merge(graphdef, params)
    part = state.cache.take_rows(jnp.clip(home_u, 0, state.done_b.shape[0] - 1))
    part = part.replace(valid_bs=part.valid_bs & ~fresh_u[:, None],
                        index=jnp.where(fresh_u, 0, part.index))
    out = model(ids_gn, attention_mask_bt=mask_ut, cache=part, router_hook=static.router_hook,
                return_logits=False, mesh=static.mesh, packing=packing)
    hidden_u1d = jnp.take_along_axis(out.hidden, last_gu[..., None], axis=1).reshape(
        home_u.shape[0], 1, -1)
    logits_kv = jnp.take(model.lm_head(hidden_u1d)[:, 0], src_k, axis=0)
    cache = state.cache.put_rows(slots_k, out.cache.take_rows(src_k))

    k = src_k.shape[0]
    rows = decode_core.new_rows(  # the admitted rows' fresh request state (no routing yet)
        None, new_buffer=state.tokens_bn.shape[1], limit_b=limit_k, seed_b=seed_k,
        stream_b=jnp.zeros((k,), jnp.int32), stop_bm=state.stop_bm)
    rows = decode_core.draw_and_record(rows, logits_kv, jnp.ones((k,), bool), scalars,
                                       static)[0]

    def put(dst, src):
        return dst.at[slots_k].set(src, mode="drop")

    fields = [f for f in _PER_ROW if getattr(rows, f) is not None]
    state = state.replace(cache=cache, **{f: put(getattr(state, f), getattr(rows, f))
                                          for f in fields})
    layers = decode_core.recorded_layers(model.config, static)
    if not layers:
        return state, None
    experts_dtype = decode_core.routing_shapes(model.config, static)[0][2]
    return state, moe_stack(out.selected_experts, layers).astype(experts_dtype)


@dataclasses.dataclass(frozen=True)
class _Packed:
    """Host arrays of one admit's packed prefill (see :class:`spade_jax.models.Packing`):
    ``start[j]`` is where unique request j's tokens begin in its group ``group[j]``."""

    ids_gn: np.ndarray
    slot_gn: np.ndarray
    token_gr: np.ndarray
    mask_ut: np.ndarray
    last_gu: np.ndarray
    group: list[int]
    start: list[int]


def packed_bucket(tokens: int, floor: int) -> int:
    """Packed tokens per group of an admit: ``tokens`` rounded up to an eighth of the next
    power of two (less than 25% padding; four shapes between consecutive powers of two), at
    least ``floor``."""
    return max(floor, round_up(tokens, max(1, next_pow2(tokens) // 8)))


def _pack(token_lists: Sequence[Sequence[int]], rows: int, width: int, groups: int,
          floor: int) -> _Packed:
    """Lays ``token_lists`` out as ``rows`` rows of ``width`` (row j: list j, then empty
    rows) and packs each group of ``rows / groups`` consecutive rows' tokens back to back."""
    per = rows // groups
    totals = [0] * groups
    group, start = [], []
    for j, tokens in enumerate(token_lists):
        group.append(j // per)
        start.append(totals[j // per])
        totals[j // per] += len(tokens)
    n = packed_bucket(max(totals), floor)
    ids_gn = np.zeros((groups, n), np.int32)
    slot_gn = np.full((groups, n), per * width, np.int32)
    token_gr = np.full((groups, per * width), n, np.int32)
    mask_ut = np.zeros((rows, width), bool)
    last_gu = np.zeros((groups, per), np.int32)
    for j, tokens in enumerate(token_lists):
        g, row, lo, count = group[j], j % per, start[j], len(tokens)
        ids_gn[g, lo:lo + count] = tokens
        slot_gn[g, lo:lo + count] = row * width + np.arange(count)
        token_gr[g, row * width:row * width + count] = lo + np.arange(count)
        mask_ut[j, :count] = True
        last_gu[g, row] = lo + count - 1
    return _Packed(ids_gn, slot_gn, token_gr, mask_ut, last_gu, group, start)


# The per-row fields (the engine leaves the sampler's own fields None): every row's
# request state; the cache goes by its own methods, the stop ids are shared ([1, M]).
_PER_ROW = tuple(f.name for f in dataclasses.fields(DecodeState)
                 if f.name not in ("cache", "stop_bm", "position_b", "row_id_b", "step",
                                   "router_bnle", "answer_state"))
_MIN_WINDOW = 64  # smallest cache window a call works on (fewer shapes to compile)


def _share_key(request: Request) -> tuple:
    """Requests with one key are prefilled once: a fresh prompt is shared, a continuation
    extends its own slot."""
    return ("fresh", tuple(request.tokens)) if request.fresh else ("slot", request.slot)


def row_bucket(rows: int, shards: int = 1) -> int:
    """Rows a call runs on: the next of 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, ... (powers of
    two and their halfway points: at most a third of the rows idle, two shapes per octave),
    a multiple of ``shards``. On CPU a decode step costs about in proportion to its rows
    (bench_moe_17m, W = 512: 2.0 / 3.5 / 5.8 / 10.6 ms for 1 / 2 / 4 / 8 rows)."""
    pow2 = next_pow2(rows)
    return round_up(3 * pow2 // 4 if pow2 >= 4 and rows <= 3 * pow2 // 4 else pow2, shards)


@functools.partial(jax.jit, static_argnames=("window",))
def _gather(state: DecodeState, rows_k, *, window: int) -> DecodeState:
    """Slots ``rows_k`` of the state, with only the first ``window`` slots of their caches."""
    per_row = {f: None if getattr(state, f) is None else jnp.take(getattr(state, f), rows_k, axis=0)
               for f in _PER_ROW}
    return state.replace(cache=state.cache.take_rows(rows_k, window), **per_row)


@functools.partial(jax.jit, donate_argnames=("state",))
def _scatter(state: DecodeState, rows_k, part: DecodeState) -> DecodeState:
    """``state`` with ``part`` (from :func:`_gather`) written back at slots ``rows_k``."""
    per_row = {f: None if getattr(state, f) is None
               else getattr(state, f).at[rows_k].set(getattr(part, f)) for f in _PER_ROW}
    return state.replace(cache=state.cache.put_rows(rows_k, part.cache), **per_row)


@functools.partial(jax.jit, static_argnames=("max_len",))  # new shapes: nothing to donate to
def _grow(state: DecodeState, *, max_len: int) -> DecodeState:
    return state.replace(cache=state.cache.pad_to(max_len))


@functools.partial(jax.jit, static_argnames=(
    "config", "stacked", "slots", "cache_len", "cache_dtype", "new_buffer", "routing", "mesh"))
def _empty_state(stop_bm, *, config, stacked: bool, slots: int, cache_len: int, cache_dtype,
                 new_buffer: int, routing: tuple, mesh) -> DecodeState:
    """Every slot empty (done, waiting for a request). Module-level (static shapes and
    mesh), so a new engine with the same settings, e.g. one per ``run_episodes`` call,
    reuses the compiled program."""
    del mesh  # a static key only: the cache's sharding follows the active mesh
    cache = KVCache.init(config, slots, cache_len, cache_dtype, stacked=stacked,
                         per_row=True).constrain()
    zeros = jnp.zeros((slots,), jnp.int32)
    return decode_core.new_rows(cache, new_buffer=new_buffer, limit_b=zeros + 1, seed_b=zeros,
                                stream_b=zeros, stop_bm=stop_bm,
                                done_b=jnp.ones((slots,), bool), routing=routing)


class SlotEngine:
    """Host side of the slot engine: which slots are generating, what they produced.

    Multi-host: every process builds the engine with the same arguments and makes the same
    ``admit`` / ``decode`` / ``finished`` calls with the same values (one global batch);
    host reads of sharded state are all-gathered (:func:`sampler.to_host`).
    """

    def __init__(self, model: nnx.Module, num_slots: int, config: SamplerConfig, *,
                 stop_tokens: Sequence[int], stop_strings: Sequence[str] = (),
                 tokenizer: Any = None, router_hook: Callable | None = None,
                 mesh: jax.sharding.Mesh | None = None, cache_len: int = 256,
                 max_prefill_tokens: int = 0):
        """stop_strings: end a request once its decoded text contains one (needs
        ``tokenizer``), checked by :meth:`finished`; shared by every request.

        max_prefill_tokens: prefill budget of one jitted admit call (0 = unlimited), counted
          as :meth:`prefill_size`: its padded rows times its prompt bucket. :meth:`admit`
          splits its requests into consecutive calls within it."""
        if max_prefill_tokens < 0:
            raise ValueError(f"max_prefill_tokens must be >= 0 (0 = unlimited), "
                             f"got {max_prefill_tokens}")
        self.max_prefill_tokens = max_prefill_tokens
        self.mesh, self.config = mesh, config
        self.num_slots = round_up(num_slots, batch_shards(mesh))
        self.stop_text = StopStrings([list(stop_strings)] * self.num_slots, tokenizer)
        self.graphdef, self.params = nnx.split(model)
        # Experts only (never router logits), in the compact routing dtype.
        self.static = decode_core.static_for(config, model.options, router_hook=router_hook,
                                             mesh=mesh, router_logits=False)
        self.scalars = DecodeScalars(temperature=jnp.float32(config.temperature),
                                     top_p=jnp.float32(config.top_p))
        self.new_buffer = round_up(config.max_new_tokens, config.new_tokens_bucket)
        stop_bm = np.full((1, max(1, len(stop_tokens))), -1, np.int32)  # shared by all rows
        stop_bm[0, :len(stop_tokens)] = list(stop_tokens)
        with self._mesh():
            self.state = self._init_state(model, next_pow2(cache_len), stop_bm)
        self.busy = np.zeros((self.num_slots,), bool)  # generating a request now
        # Host copies of the cache index: a slot's stream length when it is not generating
        # (its index after the prefill while it is), and the most it can reach.
        self.length = np.zeros((self.num_slots,), np.int64)
        self.reach = np.zeros((self.num_slots,), np.int64)
        self.prefill_routing: dict[int, np.ndarray] = {}  # slot -> its request's prefill
        self.stats = {"prefill_tokens": 0, "prefill_fed_tokens": 0, "prefill_rows": 0,
                      "shared_prefills": 0, "prefill_calls": 0, "decode_calls": 0,
                      "decode_steps": 0, "busy_slot_steps": 0, "decode_row_steps": 0,
                      "partial_calls": 0, "cache_len": self.cache_len}

    def _mesh(self):
        import contextlib

        return sharding.activate(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def _init_state(self, model, cache_len, stop_bm) -> DecodeState:
        return _empty_state(jnp.asarray(stop_bm), config=model.config,
                            stacked=model.options.scan_layers, slots=self.num_slots,
                            cache_len=cache_len, cache_dtype=self.static.cache_dtype,
                            new_buffer=self.new_buffer,
                            routing=decode_core.routing_shapes(model.config, self.static),
                            mesh=self.mesh)

    @property
    def cache_len(self) -> int:
        return int(self.state.cache.valid_bs.shape[1])

    def ensure_cache(self, length: int) -> None:
        """Grows every slot's cache (to a power of two) so ``length`` tokens fit."""
        if length > self.cache_len:
            with self._mesh():
                self.state = _grow(self.state, max_len=next_pow2(length))
            self.stats["cache_len"] = self.cache_len

    def _check(self, requests: Sequence[Request]) -> None:
        slots = [r.slot for r in requests]
        if len(set(slots)) != len(slots):
            raise ValueError(f"one request per slot at a time, got slots {slots}")
        for r in requests:
            if not 0 <= r.slot < self.num_slots or self.busy[r.slot]:
                raise ValueError(f"slot {r.slot} is busy or outside [0, {self.num_slots})")
            if not r.tokens or not 1 <= r.limit <= self.config.max_new_tokens:
                raise ValueError(f"request for slot {r.slot}: needs tokens and a limit in "
                                 f"[1, {self.config.max_new_tokens}]")
        filled = self._filled(requests)
        for r in requests:  # checked for every call of a split admit before the first runs
            if filled[r.slot] + r.limit - 1 > self.cache_len:
                raise ValueError(f"slot {r.slot}: {filled[r.slot]} tokens plus {r.limit} new "
                                 f"exceed the cache ({self.cache_len}); call ensure_cache first")

    def _filled(self, requests: Sequence[Request]) -> dict[int, int]:
        """Slot -> its stream's length once the request's tokens are in."""
        return {r.slot: (0 if r.fresh else int(self.length[r.slot])) + len(r.tokens)
                for r in requests}

    def _working_set(self, slots: Sequence[int], length: int) -> tuple[np.ndarray | None, int]:
        """The slots and cache window a call on ``slots`` runs over: ``slots`` first,
        padded with idle slots to a :func:`row_bucket` count, and the first ``length`` cache
        slots rounded up to a power of two (>= ``_MIN_WINDOW``; the whole cache when that
        is more than half of it). None: the whole state (every slot, every cache slot)."""
        k = min(self.num_slots, row_bucket(len(slots), batch_shards(self.mesh)))
        window = max(_MIN_WINDOW, next_pow2(length))
        window = self.cache_len if 2 * window > self.cache_len else window
        if k == self.num_slots and window == self.cache_len:
            return None, window
        taken = set(slots)
        idle = sorted((s for s in range(self.num_slots) if s not in taken),
                      key=lambda s: (bool(self.busy[s]), s))  # a row that is not generating
        return np.array(list(slots) + idle[:k - len(slots)], np.int32), window

    def _run(self, fn: Callable, rows: np.ndarray | None, window: int):
        """``fn(state)`` (-> (state, extra)) on the working set ``rows``/``window`` (None:
        the whole state), written back into the engine's state; returns ``extra``."""
        with self._mesh():
            if rows is None:
                self.state, extra = fn(self.state)
                return extra
            self.stats["partial_calls"] += 1
            rows_k = to_device(rows, self.mesh)
            part, extra = fn(_gather(self.state, rows_k, window=window))
            self.state = _scatter(self.state, rows_k, part)
        return extra

    def prefill_size(self, requests: Sequence[Request]) -> int:
        """What an admit call of ``requests`` costs against ``max_prefill_tokens``: its rows
        (``row_bucket`` of the request count, a multiple of the batch shards; every
        request is a row of the call, one sharing a prompt too) times its prompt
        bucket (the longest added tokens, a power of two >= ``prompt_bucket_min``). The
        attention and cache writes see the added tokens as these ``[rows, T]`` rows, and
        the packed position-wise work (MLP / MoE dispatch) feeds the real tokens among them
        (to the packing's rounding). The cache window they attend over is not counted: it
        is the slots' resident cache."""
        rows = min(self.num_slots, row_bucket(len(requests), batch_shards(self.mesh)))
        return rows * self._prompt_bucket(requests)

    def _prompt_bucket(self, requests: Sequence[Request]) -> int:
        return max(self.config.prompt_bucket_min, next_pow2(max(len(r.tokens) for r in requests)))

    def _prefill_calls(self, requests: Sequence[Request]) -> list[list[Request]]:
        """``requests`` cut into consecutive admit calls of at most ``max_prefill_tokens``
        (:meth:`prefill_size`), in order of first appearance of their prompts. Requests
        that share a fresh prompt go in one call unless together they alone exceed the
        budget; a single request over the budget runs alone (no chunked prefill)."""
        budget = self.max_prefill_tokens
        if not budget:
            return [list(requests)]
        groups: dict[Any, list[Request]] = {}
        for r in requests:
            groups.setdefault(_share_key(r), []).append(r)
        calls, current = [], []
        for group in groups.values():
            if current and self.prefill_size(current + group) > budget:
                calls.append(current)
                current = []
            current += group
            while len(current) > 1 and self.prefill_size(current) > budget:  # one big group
                n = len(current) - 1
                while n > 1 and self.prefill_size(current[:n]) > budget:
                    n -= 1
                calls.append(current[:n])
                current = current[n:]
        return calls + [current]

    def admit(self, requests: Sequence[Request]) -> None:
        """Prefills the requests into their slots; they start generating. One jitted call,
        or with ``max_prefill_tokens`` consecutive calls within it (:meth:`_prefill_calls`);
        a request's tokens do not depend on which call it ran in. Each call works on its
        requests' slots and the cache window their streams fill."""
        if not requests:
            return
        self._check(requests)
        for part in self._prefill_calls(requests):
            self._admit_call(part)

    def _admit_call(self, requests: Sequence[Request]) -> None:
        unique: dict[Any, int] = {}  # fresh prompts are shared; a continuation is its own
        home, src = [], []
        for r in requests:
            key = _share_key(r)
            if key not in unique:
                unique[key] = len(home)
                home.append(r)
            src.append(unique[key])
        filled = self._filled(requests)
        rows, window = self._working_set([r.slot for r in requests], max(filled.values()))
        at = ({s: s for s in range(self.num_slots)} if rows is None
              else {int(s): j for j, s in enumerate(rows)})  # slot -> row of the call
        pad = self.num_slots if rows is None else len(rows)  # a row index that is dropped
        # One bucket for both row counts (U <= K): fewer shapes to compile.
        shards = batch_shards(self.mesh)
        u = k = min(pad, row_bucket(len(requests), shards))
        t = self._prompt_bucket(home)
        packed = _pack([r.tokens for r in home], u, t, shards, self.config.prompt_bucket_min)
        pad_u, pad_k = u - len(home), k - len(requests)
        home_u = np.array([at[r.slot] for r in home] + [pad] * pad_u, np.int32)
        fresh_u = np.array([r.fresh for r in home] + [True] * pad_u)
        src_k = np.array(src + [0] * pad_k, np.int32)
        slots_k = np.array([at[r.slot] for r in requests] + [pad] * pad_k, np.int32)
        limit_k = np.array([r.limit for r in requests] + [1] * pad_k, np.int32)
        seed_k = np.array([r.seed for r in requests] + [0] * pad_k, np.int32)
        home_u, fresh_u, ids_gn, slot_gn, token_gr, mask_ut, last_gu, src_k, slots_k, limit_k, \
            seed_k = (to_device(a, self.mesh) for a in (
                home_u, fresh_u, packed.ids_gn, packed.slot_gn, packed.token_gr, packed.mask_ut,
                packed.last_gu, src_k, slots_k, limit_k, seed_k))
        packing = Packing(slot_gn=slot_gn, token_gr=token_gr)
        routing = self._run(lambda state: _admit(
            self.graphdef, self.params, state, home_u, fresh_u, ids_gn, packing, mask_ut,
            last_gu, src_k, slots_k, limit_k, seed_k, self.scalars, static=self.static),
            rows, window)
        if routing is not None:
            routing = to_host(routing)
            for r, j in zip(requests, src, strict=True):
                lo = packed.start[j]
                self.prefill_routing[r.slot] = routing[packed.group[j], lo:lo + len(r.tokens)]
        for r in requests:  # cache slots the request can fill: its stream, its draws but one
            self.length[r.slot], self.reach[r.slot] = filled[r.slot], filled[r.slot] + r.limit - 1
        self.busy[[r.slot for r in requests]] = True
        self.stop_text.reopen(r.slot for r in requests)
        self.stats["prefill_tokens"] += sum(len(r.tokens) for r in home)
        self.stats["prefill_fed_tokens"] += packed.ids_gn.size
        self.stats["prefill_rows"] += len(home)
        self.stats["shared_prefills"] += len(requests) - len(home)
        self.stats["prefill_calls"] += 1

    @property
    def generating(self) -> bool:
        return bool(self.busy.any())

    def decode(self, max_steps: int) -> int:
        """Runs up to ``max_steps`` decode steps (fewer if every request finishes first) on
        the generating slots and the cache window they can fill."""
        slots = np.flatnonzero(self.busy)
        if len(slots) == 0:
            return 0
        rows, window = self._working_set(slots.tolist(), int(self.reach[slots].max()))
        counts = self._run(lambda state: decode_core.decode(
            self.graphdef, self.params, state, jnp.int32(max_steps), self.scalars,
            static=self.static), rows, window)
        steps, busy = (int(c) for c in to_host(counts))
        self.stats["decode_calls"] += 1
        self.stats["decode_steps"] += steps
        self.stats["busy_slot_steps"] += busy
        self.stats["decode_row_steps"] += steps * (self.num_slots if rows is None else len(rows))
        return steps

    def finished(self) -> list[Finished]:
        """Results of the requests that finished since the last call, in slot order; their
        slots keep their caches (for a continuation) and may be admitted again."""
        self._apply_stop_strings()
        done_b = to_host(self.state.done_b)
        slots = np.flatnonzero(self.busy & done_b)
        if len(slots) == 0:
            return []
        fields = (self.state.tokens_bn, self.state.logprobs_bn, self.state.num_generated_b,
                  self.state.reason_b)
        tokens, logprobs, num, reason = (to_host(x)[slots] for x in fields)
        experts = (None if self.state.experts_bnlx is None  # only the finished rows move
                   else to_host(self.state.experts_bnlx[jnp.asarray(slots)]))
        self.busy[slots] = False
        self.length[slots] += num - 1  # fed: every token drawn but the last
        out = []
        for j, s in enumerate(slots):
            routing = None
            if experts is not None:
                routing = np.concatenate([self.prefill_routing.pop(int(s)),
                                          experts[j, :max(int(num[j]) - 1, 0)]], axis=0)
            out.append(Finished(int(s), tokens[j, :num[j]].tolist(),
                                logprobs[j, :num[j]].tolist(), DONE_REASONS[int(reason[j])],
                                routing))
        return out

    def _apply_stop_strings(self) -> None:
        """Cuts the busy rows whose decoded text now contains a stop string. A row that
        finished is checked once more (it may have passed a stop string before its stop
        token or budget), then settled."""
        with self._mesh():
            self.state = decode_core.apply_stop_strings(
                self.state, self.stop_text, [(int(s), int(s)) for s in np.flatnonzero(self.busy)])
