"""The train step's input: :class:`TrainBatch`, and :func:`pack_sequences`, which builds one
from plain per-sequence records (what a rollout produces), right-padded to a bucketed length.

Shape legend: B sequences, T tokens (padded), X experts per token (MoE top-k).

Alignment: ``input_ids[b, t]`` is token t; ``old_logp[b, t]`` is the sampler's log-prob of
token t (predicted from tokens < t); ``loss_mask[b, t]`` is 1 where token t was generated
by the policy and is trained on. Token 0 has no prediction, so its mask must be 0.
``routing_replay[l][b, t]`` are the experts layer l chose for input token t at rollout time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np
from flax import struct

from spade_jax.rollout.routing import routing_per_layer

ROLES = ("agent", "designer")  # role_id 0 and 1: the roles the RL rules train
# role_id 2: replayed supervised examples, trained by a masked NLL term of their own
# (``TrainConfig.supervised_coef``, PPO-ptx), never by a role's rule.
SUPERVISED = "supervised"
ROW_ROLES = ROLES + (SUPERVISED,)
DEFAULT_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


@struct.dataclass
class TrainBatch:
    """One update's worth of sequences (all arrays, a pytree).

    Attributes:
      input_ids: [B, T] int32 token ids, right-padded.
      loss_mask: [B, T] float32, 1 on policy tokens to train on.
      old_logp: [B, T] float32 sampler log-probs of the tokens (0 off the mask).
      advantages: [B] or [B, T] float32.
      role_id: [B] int32, index into ROW_ROLES (0 agent, 1 designer, 2 a replayed
        supervised example).
      ref_logp: [B, T] float32 reference-policy log-probs, or None (rules with KL need it).
      routing_replay: per layer, [B, T, X] int32 experts recorded at rollout time (None for
        dense layers), or None when routing was not recorded.
      attention_mask: [B, T] int32, 1 on real tokens, or None (all real). With right padding
        no real token attends to padding anyway; the mask keeps padding out of the MoE
        load-balancing statistics.
      group_id: [B] int32, the advantage group of each row (rows of one prompt's group share
        an id; -1 = a group of its own), or None (every row its own group). Group-wise
        importance corrections (GMC) read it.
    """

    input_ids: jax.Array
    loss_mask: jax.Array
    old_logp: jax.Array
    advantages: jax.Array
    role_id: jax.Array
    ref_logp: jax.Array | None = None
    routing_replay: tuple[jax.Array | None, ...] | None = None
    attention_mask: jax.Array | None = None
    group_id: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)  # type: ignore[return-value]

    def validate(self) -> None:
        """Raises a ValueError naming the first array whose shape or rank is wrong."""
        if np.ndim(self.input_ids) != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {np.shape(self.input_ids)}")
        b, t = np.shape(self.input_ids)
        for name in ("attention_mask", "loss_mask", "old_logp", "ref_logp"):
            value = getattr(self, name)
            if value is not None and np.shape(value) != (b, t):
                raise ValueError(f"{name} has shape {np.shape(value)}, expected [B, T] = {(b, t)}")
        if np.shape(self.advantages) not in ((b,), (b, t)):
            raise ValueError(
                f"advantages has shape {np.shape(self.advantages)}, expected [B] = {(b,)} or "
                f"[B, T] = {(b, t)}"
            )
        if np.shape(self.role_id) != (b,):
            raise ValueError(f"role_id has shape {np.shape(self.role_id)}, expected {(b,)}")
        if self.group_id is not None and np.shape(self.group_id) != (b,):
            raise ValueError(f"group_id has shape {np.shape(self.group_id)}, expected {(b,)}")
        for layer, experts in enumerate(self.routing_replay or ()):
            if experts is not None and (np.ndim(experts) != 3 or np.shape(experts)[:2] != (b, t)):
                raise ValueError(
                    f"routing_replay[{layer}] has shape {np.shape(experts)}, expected [B, T, X] "
                    f"with [B, T] = {(b, t)}"
                )


@dataclasses.dataclass(frozen=True)
class TrainSequence:
    """One sampled sequence, as plain Python / NumPy values.

    Attributes:
      token_ids: the whole sequence (prompt, policy tokens, observations).
      loss_mask: 1 on tokens the policy generated (same length; the first entry must be 0).
      logprobs: the sampler's log-prob of each token (same length; ignored off the mask).
      advantage: a float for the whole sequence or one float per token.
      role: "agent" / "designer" / "supervised" or the role id 0 / 1 / 2 ("supervised": a
        replayed example, trained by the NLL term ``TrainConfig.supervised_coef``).
      ref_logprobs: reference-policy log-probs per token, if the loss uses a KL term.
      routing: per model layer, the [len, X] (or [len - 1, X]: the last token is never fed
        back) experts chosen at rollout time; None for dense layers. Or one recording
        ``[len or len - 1, L, X]`` over the MoE layers ``PackConfig.moe_layers``
        (:mod:`spade_jax.rollout.routing`, what the rollout records).
      group: index of the sequence's advantage group in this update (-1: none); the batch's
        ``group_id`` (the role is part of the id, so the roles' groups never mix).
    """

    token_ids: Sequence[int]
    loss_mask: Sequence[float]
    logprobs: Sequence[float]
    advantage: float | Sequence[float]
    role: str | int = "agent"
    ref_logprobs: Sequence[float] | None = None
    routing: Sequence[np.ndarray | None] | None = None
    group: int = -1


@dataclasses.dataclass(frozen=True)
class PackConfig:
    """How :func:`pack_sequences` pads.

    Attributes:
      buckets: allowed padded lengths T; the smallest one that fits the longest sequence is
        used, so a handful of shapes are ever compiled.
      pad_id: token id written into padding.
      batch_multiple: pad B with empty rows (loss mask 0) up to a multiple of this (e.g.
        microbatches x data-parallel devices).
      moe_layers, num_layers: the model layers the L axis of a ``[T, L, X]`` routing
        recording refers to, and the model's layer count (needed only for recordings).
      row_buckets: allowed B (``TrainConfig.row_buckets``): B is the smallest that holds
        the sequences (rounded up to ``batch_multiple``); past the largest, B is the
        ``batch_multiple`` multiple alone.
    """

    buckets: tuple[int, ...] = DEFAULT_BUCKETS
    pad_id: int = 0
    batch_multiple: int = 1
    moe_layers: tuple[int, ...] = ()
    num_layers: int = 0
    row_buckets: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.buckets or any(b <= 1 for b in self.buckets):
            raise ValueError(f"buckets must be lengths > 1, got {self.buckets}")
        if tuple(sorted(self.buckets)) != tuple(self.buckets):
            raise ValueError(f"buckets must be increasing, got {self.buckets}")
        if self.pad_id < 0:
            raise ValueError(f"pad_id must be >= 0, got {self.pad_id}")
        if self.batch_multiple < 1:
            raise ValueError(f"batch_multiple must be >= 1, got {self.batch_multiple}")


def bucket_length(length: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= ``length``."""
    for bucket in buckets:
        if bucket >= length:
            return bucket
    raise ValueError(f"sequence of {length} tokens is longer than the largest bucket {buckets[-1]}")


def _role_id(role: str | int, index: int) -> int:
    if isinstance(role, str):
        if role not in ROW_ROLES:
            raise ValueError(f"sequence {index}: unknown role {role!r}; known: {ROW_ROLES}")
        return ROW_ROLES.index(role)
    if role not in range(len(ROW_ROLES)):
        raise ValueError(f"sequence {index}: role id {role} not in [0, {len(ROW_ROLES)})")
    return int(role)


def _check_sequence(seq: TrainSequence, index: int) -> int:
    n = len(seq.token_ids)
    if n < 2:
        raise ValueError(f"sequence {index}: needs at least 2 tokens, got {n}")
    for name in ("loss_mask", "logprobs", "ref_logprobs"):
        value = getattr(seq, name)
        if value is not None and len(value) != n:
            raise ValueError(f"sequence {index}: {name} has {len(value)} entries, token_ids {n}")
    if np.ndim(seq.advantage) == 1 and len(seq.advantage) != n:  # type: ignore[arg-type]
        raise ValueError(f"sequence {index}: per-token advantage has {len(seq.advantage)} "  # type: ignore[arg-type]
                         f"entries, token_ids {n}")
    if seq.loss_mask[0]:
        raise ValueError(f"sequence {index}: loss_mask[0] must be 0 (token 0 has no prediction)")
    return n


def _per_layer(sequences: Sequence[TrainSequence], config: PackConfig) -> list[TrainSequence]:
    """Sequences whose routing is one ``[T, L, X]`` recording, expanded per model layer."""
    out = []
    for seq in sequences:
        if isinstance(seq.routing, np.ndarray) and seq.routing.ndim == 3:
            if not config.num_layers:
                raise ValueError("a [T, L, X] routing recording needs PackConfig.moe_layers "
                                 "and num_layers")
            seq = dataclasses.replace(seq, routing=routing_per_layer(
                seq.routing, config.moe_layers, config.num_layers))
        out.append(seq)
    return out


def _pack_routing(
    sequences: Sequence[TrainSequence], rows: int, length: int
) -> tuple[np.ndarray | None, ...] | None:
    has_routing = [s.routing is not None for s in sequences]
    if not any(has_routing):
        return None
    if not all(has_routing):
        missing = has_routing.index(False)
        raise ValueError(f"sequence {missing} has no routing but others do; record it for all")
    layout = [None if r is None else np.shape(r)[-1] for r in sequences[0].routing]  # type: ignore[union-attr]
    for i, seq in enumerate(sequences):
        seq_layout = [None if r is None else np.shape(r)[-1] for r in seq.routing]  # type: ignore[union-attr]
        if seq_layout != layout:
            raise ValueError(
                f"sequence {i}: routing layout (experts per layer, None = dense) {seq_layout} "
                f"differs from sequence 0's {layout}"
            )
    out: list[np.ndarray | None] = []
    for layer, k in enumerate(layout):
        if k is None:
            out.append(None)
            continue
        # Padding rows/positions get experts 0..X-1: valid, distinct, and never trained on.
        experts = np.broadcast_to(np.arange(k, dtype=np.int32), (rows, length, k)).copy()
        for i, seq in enumerate(sequences):
            rec = np.asarray(seq.routing[layer])  # type: ignore[index]
            n = len(seq.token_ids)
            if rec.ndim != 2 or rec.shape[0] not in (n, n - 1):
                raise ValueError(
                    f"sequence {i}: routing[{layer}] has shape {rec.shape}, expected "
                    f"[{n} or {n - 1}, {k}]"
                )
            experts[i, : rec.shape[0]] = rec
        out.append(experts)
    return tuple(out)


def pack_sequences(
    sequences: Sequence[TrainSequence], config: PackConfig | None = None
) -> TrainBatch:
    """Right-pads ``sequences`` to one bucketed length and stacks them into a TrainBatch."""
    config = config or PackConfig()
    if not sequences:
        raise ValueError("pack_sequences needs at least one sequence")
    lengths = [_check_sequence(s, i) for i, s in enumerate(sequences)]
    sequences = _per_layer(sequences, config)
    length = bucket_length(max(lengths), config.buckets)
    rows = -(-len(sequences) // config.batch_multiple) * config.batch_multiple
    rows = next((-(-b // config.batch_multiple) * config.batch_multiple
                 for b in config.row_buckets if b >= rows), rows)
    per_token_adv = any(np.ndim(s.advantage) == 1 for s in sequences)
    has_ref = [s.ref_logprobs is not None for s in sequences]
    if any(has_ref) and not all(has_ref):
        raise ValueError(f"sequence {has_ref.index(False)} has no ref_logprobs but others do")

    input_ids = np.full((rows, length), config.pad_id, np.int32)
    attention_mask = np.zeros((rows, length), np.int32)
    loss_mask = np.zeros((rows, length), np.float32)
    old_logp = np.zeros((rows, length), np.float32)
    ref_logp = np.zeros((rows, length), np.float32) if all(has_ref) else None
    advantages = np.zeros((rows, length) if per_token_adv else (rows,), np.float32)
    role_id = np.zeros((rows,), np.int32)
    group_id = np.full((rows,), -1, np.int32)
    for i, (seq, n) in enumerate(zip(sequences, lengths, strict=True)):
        input_ids[i, :n] = seq.token_ids
        attention_mask[i, :n] = 1
        loss_mask[i, :n] = np.asarray(seq.loss_mask, np.float32)
        old_logp[i, :n] = np.where(loss_mask[i, :n] > 0, np.asarray(seq.logprobs, np.float32), 0)
        if ref_logp is not None:
            ref_logp[i, :n] = seq.ref_logprobs
        if per_token_adv:
            advantages[i, :n] = np.broadcast_to(np.asarray(seq.advantage, np.float32), (n,))
        else:
            advantages[i] = seq.advantage
        role_id[i] = _role_id(seq.role, i)
        # ids unique per (role, group): one group never spans both roles; a supervised row
        # is in no group (no rule reads it).
        if seq.group >= 0 and role_id[i] < len(ROLES):
            group_id[i] = seq.group * len(ROLES) + role_id[i]
    if not np.all(np.isfinite(old_logp)):
        bad = int(np.argwhere(~np.isfinite(old_logp))[0, 0])
        raise ValueError(f"sequence {bad}: non-finite sampler log-prob on a policy token")
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        old_logp=old_logp,
        advantages=advantages,
        role_id=role_id,
        ref_logp=ref_logp,
        routing_replay=_pack_routing(sequences, rows, length),
        group_id=group_id if np.any(group_id >= 0) else None,
    )
