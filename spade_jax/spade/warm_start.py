"""Supervised warm start: teach a small policy the designer's output format.

A tiny CPU policy initialised at random cannot write a program that validates, so the
self-play loop would have nothing to train the agent on. A short pass of next-token
cross-entropy on (designer prompt -> example program + hint) pairs, built from the
project's own seed programs, fixes that. Real runs start from an instruct checkpoint and
skip this (``warm_start.steps = 0``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import SingleDeviceSharding

from spade_jax.models import numerics
from spade_jax.rl.batch import PackConfig, TrainSequence, pack_sequences
from spade_jax.rollout.sampler import round_up

log = logging.getLogger(__name__)

LOSS_MEANS = ("token", "sequence")


def turn_end_id(tokenizer) -> int:
    """The token that closes an assistant turn in the chat template (``<|im_end|>`` when it
    is one of the tokenizer's stop tokens): a reply taught to end with it continues into
    the next turn as the template renders a conversation."""
    ids = list(tokenizer.encode("<|im_end|>"))
    if len(ids) == 1 and ids[0] in tokenizer.eos_ids:
        return ids[0]
    return min(tokenizer.eos_ids)


def supervised_pairs(tokenizer, pairs: Sequence[tuple[list[dict], str]]) -> list[TrainSequence]:
    """(chat messages, target text) -> sequences whose loss mask covers the target only."""
    return [supervised_sequence(list(tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, enable_thinking=False)),
        tokenizer.encode(target) + [turn_end_id(tokenizer)]) for messages, target in pairs]


def without_target_chars(tokenizer, sequence: TrainSequence, target: str, start: int, end: int,
                         stand_in: str) -> TrainSequence:
    """``sequence`` (``supervised_pairs``' row for ``target``) with its loss mask off on the
    target tokens that spell ``target[start:end]``: the tokens that change when those
    characters are replaced by ``stand_in`` (found by tokenizing both texts and cutting
    their common prefix and suffix, so a token that merges the span with a neighbour is
    masked too). ``stand_in`` should differ from the span at every character: a token of
    a character the two share can match and stay trained."""
    if not 0 <= start < end <= len(target) or stand_in == target[start:end]:
        raise ValueError(f"need a non-empty span of the target and a different stand-in, got "
                         f"[{start}, {end}) and {stand_in!r}")
    ids, other = tokenizer.encode(target), tokenizer.encode(target[:start] + stand_in + target[end:])
    prefix = 0
    while prefix < min(len(ids), len(other)) and ids[prefix] == other[prefix]:
        prefix += 1
    suffix = 0
    while (suffix < min(len(ids), len(other)) - prefix
           and ids[-1 - suffix] == other[-1 - suffix]):
        suffix += 1
    answer_start = len(sequence.token_ids) - len(ids) - 1  # the turn-end token follows
    if list(sequence.token_ids[answer_start:answer_start + len(ids)]) != list(ids):
        raise ValueError("the sequence does not end with the target's tokens and a turn end")
    mask = list(sequence.loss_mask)
    for position in range(answer_start + prefix, answer_start + len(ids) - suffix):
        mask[position] = 0
    return dataclasses.replace(sequence, loss_mask=mask)


def supervised_sequence(prompt_ids: Sequence[int], answer_ids: Sequence[int]) -> TrainSequence:
    """A prompt and its target as one sequence whose loss mask covers the target only."""
    prompt, answer = list(prompt_ids), list(answer_ids)
    return TrainSequence(prompt + answer, [0] * len(prompt) + [1] * len(answer),
                         [0.0] * (len(prompt) + len(answer)), 0.0)


def _loss_positions(loss_mask_bt: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Where each row's loss is: ``positions[b, k]`` is a position whose hidden state predicts
    a masked token (``loss_mask[b, positions + 1] > 0``), ``weights[b, k]`` that token's mask;
    right-padded to ``width`` with position 0, weight 0."""
    positions = np.zeros((loss_mask_bt.shape[0], width), np.int32)
    weights = np.zeros((loss_mask_bt.shape[0], width), np.float32)
    for row, mask_t in enumerate(loss_mask_bt):
        predicts = np.nonzero(mask_t[1:] > 0)[0]
        positions[row, : len(predicts)] = predicts
        weights[row, : len(predicts)] = mask_t[1:][predicts]
    return positions, weights


def _nll(params, graphdef, ids_bt, attn_bt, positions_bk, weights_bk):
    """Masked next-token NLL with the LM head and log-softmax only at ``positions_bk``. Over
    every position of the packed batch (over half of it prompt and padding, which the loss
    ignores) the vocabulary projection took ~40% of a CPU step for the tiny experiment.
    The mean is over the batch's target tokens, or over its sequences when ``weights_bk``
    rows are pre-divided by their token counts (``per_sequence_weights``)."""
    model = nnx.merge(graphdef, params)
    hidden_btd = model(ids_bt, attention_mask_bt=attn_bt, return_logits=False).hidden
    hidden_bkd = jnp.take_along_axis(hidden_btd, positions_bk[..., None], axis=1)
    targets_bk = jnp.take_along_axis(ids_bt, positions_bk + 1, axis=1)
    logp_bk, _ = numerics.token_logprobs(model.lm_head(hidden_bkd), targets_bk,
                                         invariant=model.options.batch_invariant)
    return -jnp.sum(logp_bk * weights_bk) / jnp.maximum(jnp.sum(weights_bk), 1.0)


def per_sequence_weights(weights_bk: np.ndarray) -> np.ndarray:
    """Loss weights that make the token mean of ``_nll`` a mean over sequences: each row's
    weights sum to 1 (a 6-token answer then counts as much as a 220-token program)."""
    totals = weights_bk.sum(axis=1, keepdims=True)
    return np.where(totals > 0, weights_bk / np.maximum(totals, 1e-9), 0.0).astype(np.float32)


def _length_groups(sequences: Sequence[TrainSequence], groups: int, pad_id: int
                   ) -> list[tuple[np.ndarray, PackConfig, int]]:
    """(member indices, packing to the group's length, loss width) per length group."""
    lengths = [len(s.token_ids) for s in sequences]
    bounds = padded_lengths(lengths, groups)
    which = np.searchsorted(bounds, lengths)  # the smallest padded length that holds each
    out = []
    for g, bound in enumerate(bounds):
        members = np.nonzero(which == g)[0]
        width = round_up(max(1, *(int(np.count_nonzero(sequences[j].loss_mask))
                                  for j in members)), 16)
        out.append((members, PackConfig(buckets=(bound,), pad_id=pad_id), width))
    return out


def _optimizer(steps: int, learning_rate: float) -> optax.GradientTransformation:
    """Clipped AdamW, linear warm-up over the first tenth, then cosine decay."""
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(optax.warmup_cosine_decay_schedule(
                           0.0, learning_rate, max(1, steps // 10), max(2, steps)), b2=0.98))


def padded_lengths(lengths: Sequence[int], groups: int, multiple: int = 16) -> list[int]:
    """At most ``groups`` padded lengths (multiples of ``multiple``, ascending, the last
    holding the longest sequence) that minimise the tokens of the whole set when each
    sequence is padded to the smallest one that holds it: an exact dynamic programme over
    the distinct rounded lengths (a few dozen), so a set of short answers and long programs
    splits where the padding is, not at a quantile."""
    if groups < 1:
        raise ValueError(f"groups must be >= 1, got {groups}")
    values, counts = np.unique([round_up(max(1, n), multiple) for n in lengths],
                               return_counts=True)
    m = len(values)
    prefix = np.concatenate([[0], np.cumsum(counts)])
    # best[k][j]: fewest tokens for the j smallest values in k groups; cut[k][j]: where the
    # last group starts.
    best = np.full((groups + 1, m + 1), np.inf)
    cut = np.zeros((groups + 1, m + 1), np.int64)
    best[0][0] = 0.0
    for k in range(1, groups + 1):
        for j in range(1, m + 1):
            for i in range(j):  # the last group is values[i:j], padded to values[j - 1]
                cost = best[k - 1][i] + values[j - 1] * (prefix[j] - prefix[i])
                if cost < best[k][j]:
                    best[k][j], cut[k][j] = cost, i
    k = int(np.argmin(best[:, m]))  # fewer groups when more do not help (m < groups)
    out, j = [], m
    while j > 0:
        out.append(int(values[j - 1]))
        j, k = int(cut[k][j]), k - 1
    return out[::-1]


def warm_start(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    sequences: Sequence[TrainSequence],
    *,
    steps: int,
    batch_size: int,
    learning_rate: float,
    seed: int = 0,
    pad_id: int = 0,
    loss_mean: str = "token",
    length_buckets: int = 1,
) -> tuple[nnx.State, list[float]]:
    """Runs ``steps`` AdamW steps of masked NLL; returns new params and the loss curve.
    ``loss_mean``: "token" (every target token of a batch weighs the same) or "sequence"
    (every example does: short targets are not drowned by long ones).

    ``length_buckets``: 1 pads every batch to the longest sequence of the set. With more,
    the sequences are split into that many length groups (:func:`padded_lengths`) and each
    step draws a group with probability proportional to its size, then its batch from that
    group, padded to the group's length: a set of short agent answers beside ~600-token
    programs then no longer pads the answers to 600. Every example is drawn as often as
    with one group; under ``loss_mean="sequence"`` the expected gradient is the same too
    (each step's loss is a mean over examples), under "token" the short examples' steps
    weigh as much as the long ones' (in a mixed batch the long targets' tokens dominate).
    But Adam scales every step to the learning rate, so a group gets as many updates as it
    has steps: a few long examples among many short ones learn less than in mixed batches
    (docs/toy_world.md, "The learning checks"). One compile per group."""
    if loss_mean not in LOSS_MEANS:
        raise ValueError(f"warm start loss_mean must be one of {LOSS_MEANS}, got {loss_mean!r}")
    if not sequences:
        raise ValueError("warm start needs at least one supervised sequence")
    if length_buckets < 1:
        raise ValueError(f"warm start length_buckets must be >= 1, got {length_buckets}")
    optimizer = _optimizer(steps, learning_rate)
    devices = {d for leaf in jax.tree.leaves(params) for d in leaf.devices()}
    if len(devices) == 1:
        # Params and optimizer state committed to their device: a run's params are, optax's
        # init leaves its state uncommitted, and the step's second call (on its own
        # committed outputs) compiled the step again (4-5 s of a toy warm start). A jit
        # with out_shardings commits every leaf (device_put left the 0-d step counters
        # uncommitted).
        on_device = SingleDeviceSharding(devices.pop())
        params = jax.device_put(params, on_device)
        opt_state = jax.jit(optimizer.init, out_shardings=on_device)(params)
    else:
        opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state, ids, attn, positions, weights):
        loss, grads = jax.value_and_grad(_nll)(params, graphdef, ids, attn, positions, weights)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(seed)
    # One padded length and one loss width per group (one compile each), each the longest
    # member's rounded up: the default power-of-two buckets padded ~600-token sequences to
    # 1024, and the model's cost grows faster than linearly in the length.
    groups = _length_groups(sequences, length_buckets, pad_id)
    shares = np.asarray([len(members) for members, _, _ in groups], np.float64) / len(sequences)
    losses, start = [], time.time()
    for i in range(steps):
        # One group: the draws of a plain uniform choice (the same batches as before groups).
        members, pack, width = groups[int(rng.choice(len(groups), p=shares))
                                      if len(groups) > 1 else 0]
        batch = pack_sequences([sequences[j] for j in members[rng.choice(len(members),
                                                                          batch_size)]], pack)
        positions, weights = _loss_positions(np.asarray(batch.loss_mask), width)
        if loss_mean == "sequence":
            weights = per_sequence_weights(weights)
        params, opt_state, loss = step(params, opt_state, batch.input_ids, batch.attention_mask,
                                       positions, weights)
        losses.append(float(loss))
        if (i + 1) % max(1, steps // 10) == 0 or i + 1 == steps:
            rate = (i + 1) / (time.time() - start)
            log.info("warm start %d/%d  loss %.3f  %.1f steps/s  eta %.0fs",
                     i + 1, steps, losses[-1], rate, (steps - i - 1) / rate)
    return params, losses
