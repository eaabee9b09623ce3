"""Supervised warm start: teach a small policy the designer's output format.

A tiny CPU policy initialised at random cannot write a program that validates, so the
self-play loop would have nothing to train the agent on. A short pass of next-token
cross-entropy on (designer prompt -> example program + hint) pairs, built from the
project's own seed programs, fixes that. Real runs start from an instruct checkpoint and
skip this (``warm_start.steps = 0``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from spade_jax.rl.batch import PackConfig, TrainSequence, pack_sequences

log = logging.getLogger(__name__)


def supervised_pairs(tokenizer, pairs: Sequence[tuple[list[dict], str]]) -> list[TrainSequence]:
    """(chat messages, target text) -> sequences whose loss mask covers the target only."""
    seqs = []
    for messages, target in pairs:
        prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                    enable_thinking=False))
        answer = tokenizer.encode(target) + [min(tokenizer.eos_ids)]
        seqs.append(TrainSequence(prompt + answer, [0] * len(prompt) + [1] * len(answer),
                                  [0.0] * (len(prompt) + len(answer)), 0.0))
    return seqs


def _nll(params, graphdef, ids_bt, mask_bt, attn_bt):
    model = nnx.merge(graphdef, params)
    logits = model(ids_bt[:, :-1], attention_mask_bt=attn_bt[:, :-1]).logits
    logp = jax.nn.log_softmax(logits, axis=-1)
    target_logp = jnp.take_along_axis(logp, ids_bt[:, 1:, None], axis=-1)[..., 0]
    mask = mask_bt[:, 1:]
    return -jnp.sum(target_logp * mask) / jnp.maximum(jnp.sum(mask), 1.0)


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
) -> tuple[nnx.State, list[float]]:
    """Runs ``steps`` AdamW steps of masked NLL; returns new params and the loss curve."""
    if not sequences:
        raise ValueError("warm start needs at least one supervised sequence")
    optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                            optax.adamw(optax.warmup_cosine_decay_schedule(
                                0.0, learning_rate, max(1, steps // 10), max(2, steps)), b2=0.98))
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state, ids, mask, attn):
        loss, grads = jax.value_and_grad(_nll)(params, graphdef, ids, mask, attn)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(seed)
    pack = PackConfig(pad_id=pad_id)
    losses, start = [], time.time()
    for i in range(steps):
        batch = pack_sequences([sequences[j] for j in rng.choice(len(sequences), batch_size)], pack)
        params, opt_state, loss = step(params, opt_state, batch.input_ids, batch.loss_mask,
                                       batch.attention_mask)
        losses.append(float(loss))
        if (i + 1) % max(1, steps // 10) == 0 or i + 1 == steps:
            rate = (i + 1) / (time.time() - start)
            log.info("warm start %d/%d  loss %.3f  %.1f steps/s  eta %.0fs",
                     i + 1, steps, losses[-1], rate, (steps - i - 1) / rate)
    return params, losses
