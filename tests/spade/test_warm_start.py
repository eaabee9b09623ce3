"""The supervised warm start trains exactly as the plain masked NLL over every position.

``warm_start`` computes the loss with the LM head only at the target positions and packs to a
tight length; the reference here is the straightforward formulation it replaced (full logits,
log-softmax over the vocabulary at every position, default power-of-two buckets), driven by
the same batch draws and optimizer. Losses and final parameters must agree to float rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from spade_jax.models import ModelConfig, Qwen3
from spade_jax.rl.batch import PackConfig, TrainSequence, pack_sequences
from spade_jax.spade.warm_start import (
    _loss_positions,
    _nll,
    _optimizer,
    padded_lengths,
    per_sequence_weights,
    warm_start,
)


def _tiny_moe(seed: int = 0) -> Qwen3:
    config = ModelConfig(architecture="Qwen3MoeForCausalLM", vocab_size=96, hidden_size=32,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                         intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=16, norm_topk_prob=True)
    return Qwen3(config, rngs=nnx.Rngs(seed))


def _sequences() -> list[TrainSequence]:
    """Prompts then answers of uneven lengths (longest 139: old bucket 256, new 144)."""
    rng = np.random.default_rng(5)
    seqs = []
    for prompt_len, answer_len in [(40, 30), (90, 49), (20, 60), (70, 25), (55, 55)]:
        ids = rng.integers(2, 96, prompt_len + answer_len).tolist()
        seqs.append(TrainSequence(ids, [0] * prompt_len + [1] * answer_len,
                                  [0.0] * len(ids), 0.0))
    return seqs


def _reference_nll(params, graphdef, ids_bt, mask_bt, attn_bt):
    """The warm start's original loss: log-softmax over the vocabulary at every position."""
    model = nnx.merge(graphdef, params)
    logits = model(ids_bt[:, :-1], attention_mask_bt=attn_bt[:, :-1]).logits
    logp = jax.nn.log_softmax(logits, axis=-1)
    target_logp = jnp.take_along_axis(logp, ids_bt[:, 1:, None], axis=-1)[..., 0]
    mask = mask_bt[:, 1:]
    return -jnp.sum(target_logp * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def _reference_sequence_mean_nll(params, graphdef, ids_bt, mask_bt, attn_bt):
    """``loss_mean="sequence"``'s loss the plain way: the mean of each row's token mean."""
    return jnp.mean(jnp.stack([_reference_nll(params, graphdef, ids_bt[i:i + 1],
                                              mask_bt[i:i + 1], attn_bt[i:i + 1])
                               for i in range(ids_bt.shape[0])]))


def _reference_warm_start(graphdef, params, seqs, *, steps, batch_size, learning_rate, seed,
                          groups=None, loss_fn=_reference_nll, drawn=None):
    """``groups``: lists of sequence indices; a step draws one with probability
    proportional to its size, then its batch from it (``length_buckets``' draws); the
    index of each step's group is appended to ``drawn``."""
    optimizer = _optimizer(steps, learning_rate)
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state, ids, mask, attn):
        loss, grads = jax.value_and_grad(loss_fn)(params, graphdef, ids, mask, attn)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng, losses = np.random.default_rng(seed), []
    groups = groups or [list(range(len(seqs)))]
    shares = np.array([len(g) for g in groups]) / len(seqs)
    for _ in range(steps):
        g = int(rng.choice(len(groups), p=shares)) if len(groups) > 1 else 0
        if drawn is not None:
            drawn.append(g)
        group = groups[g]
        batch = pack_sequences([seqs[group[j]] for j in rng.choice(len(group), batch_size)],
                               PackConfig(pad_id=0))
        params, opt_state, loss = step(params, opt_state, batch.input_ids, batch.loss_mask,
                                       batch.attention_mask)
        losses.append(float(loss))
    return params, losses


def test_loss_positions_point_at_the_tokens_before_each_masked_token():
    mask = np.array([[0, 0, 1, 1, 0], [0, 1, 0, 1, 1]], np.float32)
    positions, weights = _loss_positions(mask, 4)
    np.testing.assert_array_equal(positions, [[1, 2, 0, 0], [0, 2, 3, 0]])
    np.testing.assert_array_equal(weights, [[1, 1, 0, 0], [1, 1, 1, 0]])


@pytest.mark.slow  # two compiles of a 2-layer MoE step, ~15 s
def test_warm_start_matches_the_full_logits_reference_losses_and_params():
    graphdef, params = nnx.split(_tiny_moe())
    kwargs = dict(steps=6, batch_size=3, learning_rate=3e-3, seed=11)
    seqs = _sequences()
    new_params, new_losses = warm_start(graphdef, params, seqs, pad_id=0, **kwargs)
    ref_params, ref_losses = _reference_warm_start(graphdef, params, seqs, **kwargs)
    assert ref_losses[-1] < ref_losses[0] - 0.05  # it trains: the comparison is not vacuous
    np.testing.assert_allclose(new_losses, ref_losses, rtol=1e-5)
    # Adam divides by sqrt(v): on a near-zero gradient it turns rounding into a visible
    # change, so parameters get an absolute slack of 1e-5, 0.3% of one step (lr 3e-3).
    for new, ref in zip(jax.tree.leaves(new_params), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(np.asarray(new), np.asarray(ref), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_sequence_mean_loss_weighs_every_example_the_same():
    """loss_mean="sequence": the mean over examples of each one's token-mean NLL, against
    the full-logits formulation computed row by row."""
    graphdef, params = nnx.split(_tiny_moe())
    batch = pack_sequences(_sequences()[:3], PackConfig(pad_id=0))
    mask = np.asarray(batch.loss_mask)
    positions, weights = _loss_positions(mask, 64)
    got = float(_nll(params, graphdef, batch.input_ids, batch.attention_mask, positions,
                     per_sequence_weights(weights)))  # weights sum to the row count
    per_row = [float(_reference_nll(params, graphdef, batch.input_ids[i:i + 1],
                                    batch.loss_mask[i:i + 1], batch.attention_mask[i:i + 1]))
               for i in range(len(mask))]
    np.testing.assert_allclose(got, np.mean(per_row), rtol=1e-5)
    # (at random init every token's NLL is ~log V, so the two means agree closely here;
    # the weights are what differ: a 2-token target's tokens weigh 1/2, a 4-token one's 1/4)
    np.testing.assert_allclose(per_sequence_weights(np.array([[1, 1, 0, 0], [1, 1, 1, 1],
                                                              [0, 0, 0, 0]], np.float32)),
                               [[.5, .5, 0, 0], [.25, .25, .25, .25], [0, 0, 0, 0]])
    with pytest.raises(ValueError, match="loss_mean"):
        warm_start(graphdef, params, _sequences(), steps=1, batch_size=1, learning_rate=1e-3,
                   loss_mean="example")


def _brute_force_padded_lengths(lengths, groups, multiple=16):
    """Every way to cut the sorted distinct rounded lengths into at most ``groups`` runs."""
    import itertools

    values = sorted({-(-max(1, n) // multiple) * multiple for n in lengths})
    best = None
    for k in range(1, min(groups, len(values)) + 1):
        for cuts in itertools.combinations(range(1, len(values)), k - 1):
            bounds = [values[c - 1] for c in cuts] + [values[-1]]
            cost = sum(next(b for b in bounds if b >= n) for n in
                       (-(-max(1, n) // multiple) * multiple for n in lengths))
            if best is None or cost < best[0]:
                best = (cost, bounds)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_padded_lengths_minimise_the_padded_tokens(seed):
    rng = np.random.default_rng(seed)
    # short answers and long programs, as the toy world's warm start has them
    lengths = np.concatenate([rng.integers(20, 90, rng.integers(5, 60)),
                              rng.integers(400, 700, rng.integers(1, 12))]).tolist()
    for groups in (1, 2, 3):
        got = padded_lengths(lengths, groups)
        cost = sum(next(b for b in got if b >= -(-n // 16) * 16) for n in lengths)
        assert len(got) <= groups and got == sorted(got) and got[-1] >= max(lengths)
        assert cost == _brute_force_padded_lengths(lengths, groups)[0]
    assert padded_lengths([30, 35, 600], 2) == [48, 608]  # the cut is where the padding is
    assert padded_lengths([30, 31], 4) == [32]  # never more groups than lengths
    with pytest.raises(ValueError, match="groups"):
        padded_lengths([3], 0)


@pytest.mark.slow  # two compiles of a 2-layer MoE step per side
def test_length_buckets_train_as_the_full_logits_reference_on_the_same_draws():
    """Two length groups: each step draws a group by its size, then a batch from it, padded
    to the group's length; losses and parameters equal the full-logits reference driven by
    the same draws (which pads each batch to a power of two: padding changes nothing)."""
    rng = np.random.default_rng(9)
    seqs = _sequences()  # 70-139 tokens
    for n in (6, 9, 7, 8):  # and short ones
        ids = rng.integers(2, 96, n + 3).tolist()
        seqs.append(TrainSequence(ids, [0] * n + [1] * 3, [0.0] * len(ids), 0.0))
    graphdef, params = nnx.split(_tiny_moe())
    kwargs = dict(steps=5, batch_size=2, learning_rate=3e-3, seed=3)
    assert padded_lengths([len(s.token_ids) for s in seqs], 2) == [16, 144]
    new_params, new_losses = warm_start(graphdef, params, seqs, pad_id=0, length_buckets=2,
                                        loss_mean="sequence", **kwargs)
    drawn = []
    ref_params, ref_losses = _reference_warm_start(
        graphdef, params, seqs, groups=[[5, 6, 7, 8], [0, 1, 2, 3, 4]],
        loss_fn=_reference_sequence_mean_nll, drawn=drawn, **kwargs)
    assert set(drawn) == {0, 1}, drawn  # both groups, so both padded lengths, are exercised
    np.testing.assert_allclose(new_losses, ref_losses, rtol=1e-5)
    moved = 0
    for new, ref, init in zip(jax.tree.leaves(new_params), jax.tree.leaves(ref_params),
                              jax.tree.leaves(params), strict=True):
        np.testing.assert_allclose(np.asarray(new), np.asarray(ref), rtol=1e-5, atol=1e-5)
        moved += not np.array_equal(np.asarray(new), np.asarray(init))
    assert moved > len(jax.tree.leaves(params)) // 2  # it trained: the comparison is not vacuous
    with pytest.raises(ValueError, match="length_buckets"):
        warm_start(graphdef, params, seqs, steps=1, batch_size=1, learning_rate=1e-3,
                   length_buckets=0)


def test_each_length_group_compiles_its_step_once(caplog):
    """A run hands the warm start committed parameters (``init_train_state``); the
    optimizer's state must be committed beside them, or the step's second call, on its own
    committed outputs, compiles the step again (4-5 s of every toy warm start)."""
    import logging

    rng = np.random.default_rng(9)
    seqs = _sequences()
    for n in (6, 9, 7, 8):
        ids = rng.integers(2, 96, n + 3).tolist()
        seqs.append(TrainSequence(ids, [0] * n + [1] * 3, [0.0] * len(ids), 0.0))
    graphdef, params = nnx.split(_tiny_moe())
    committed = jax.device_put(params, jax.local_devices()[0])  # as a run's are
    for given in (committed, params):  # and as a direct call's may be
        caplog.clear()
        with caplog.at_level(logging.WARNING), jax.log_compiles(True):
            warm_start(graphdef, given, seqs, steps=6, batch_size=2, learning_rate=3e-3,
                       seed=3, pad_id=0, length_buckets=2)
        compiles = [r.getMessage() for r in caplog.records
                    if "Finished XLA compilation of jit(step)" in r.getMessage()]
        assert len(compiles) == 2, compiles  # one per length group


def test_without_target_chars_leaves_the_spans_tokens_untrained(chat_tokenizer):
    """``spade.supervised_replay_masks_level``'s cut: the loss mask goes off on exactly
    the target tokens that spell the stated level (they change with it), the prompt and
    every other target token keep theirs, whatever the level's digit count."""
    from spade_jax.run import _level_untrained
    from spade_jax.spade.env_stats import stated_level_span
    from spade_jax.spade.warm_start import supervised_pairs, without_target_chars

    messages = [{"role": "user", "content": "alpha start"}]
    for level in ("7", "12"):
        target = f"```python\nLEVEL = {level}\nBASE = 5\nseed obs {level}\n```"
        (row,) = supervised_pairs(chat_tokenizer, [(messages, target)])
        cut = _level_untrained(chat_tokenizer, row, target)
        off = [i for i, (a, b) in enumerate(zip(row.loss_mask, cut.loss_mask, strict=True)) if a != b]
        assert off and all(row.loss_mask[i] == 1 and cut.loss_mask[i] == 0 for i in off)
        assert off == list(range(off[0], off[-1] + 1))  # one run of tokens
        spelled = chat_tokenizer.decode([row.token_ids[i] for i in off])
        assert level in spelled and "BASE" not in spelled and "seed" not in spelled
        kept = [t for t, m in zip(cut.token_ids, cut.loss_mask, strict=True) if m]
        assert f"= {level}\n" not in chat_tokenizer.decode(kept)  # the level's tokens left
        assert sum(cut.loss_mask) == sum(row.loss_mask) - len(off)
        assert cut.token_ids == row.token_ids and cut.role == row.role
        assert f"obs {level}" in chat_tokenizer.decode(kept)  # a later mention stays trained
        assert stated_level_span(target) == (target.index(level), target.index(level) + len(level))
    plain = "```python\nBASE = 5\n```"
    (row,) = supervised_pairs(chat_tokenizer, [(messages, plain)])
    assert _level_untrained(chat_tokenizer, row, plain) is row  # states no level: kept whole
    with pytest.raises(ValueError, match="different stand-in"):
        without_target_chars(chat_tokenizer, row, plain, 3, 3, "x")
    with pytest.raises(ValueError, match="does not end with the target"):
        without_target_chars(chat_tokenizer, row, "something else", 0, 4, "else")
