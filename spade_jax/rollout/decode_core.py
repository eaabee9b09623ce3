"""What every decode path shares: one state type, one draw, one record, one routing record,
one stop-string pass. :func:`spade_jax.rollout.sampler.sample` (a batch of prompts, one
shared cache index) and :class:`spade_jax.rollout.engine.SlotEngine` (slots with a cache
index each) keep their own schedules; what a row carries, how it draws, what it records,
when it is done and where a stop string cuts it are defined here once, so the two cannot
drift.

A row that is running at a step has drawn ``num_generated_b`` tokens, so its next draw goes
to that column and uses that step number: a row's tokens depend on its (seed, stream) and
its own history only, never on which rows share its batch or call.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from spade_jax.models import KVCache
from spade_jax.rollout import sampling

DONE_REASONS = ("running", "eos", "stop_string", "max_tokens")
RUNNING, EOS, STOP_STRING, MAX_TOKENS = range(4)


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


def draw_and_record(state: DecodeState, logits_bv: jax.Array, running_b: jax.Array,
                    scalars: Any, static: Any) -> tuple[DecodeState, jax.Array]:
    """Every running row draws its next token from ``logits_bv`` with its own stream and
    records it; returns the state and the drawn tokens ([B], a done row's are dropped)."""
    token_b, logprob_b = draw(logits_bv, state.seed_b, state.stream_b, state.num_generated_b,
                              scalars, static)
    return record(state, token_b, logprob_b, running_b, state.stop_bm), token_b


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


def cut(state: Any, cut_b: jax.Array) -> Any:
    """Ends the rows with ``cut_b >= 0`` after their first ``cut_b`` tokens (a stop string
    completed there): reason "stop_string". The caller rolls back whatever else the dropped
    tokens touched (the slot engine: its cache)."""
    is_cut = cut_b >= 0
    return state.replace(
        num_generated_b=jnp.where(is_cut, cut_b, state.num_generated_b),
        done_b=state.done_b | is_cut,
        reason_b=jnp.where(is_cut, STOP_STRING, state.reason_b))


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
