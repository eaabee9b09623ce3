"""The train step against independent references: NumPy log-softmax, NumPy AdamW, and a
straightforward full-batch loss that slices each role's rows (no masking, no microbatches,
no chunking); plus skip-on-nonfinite, bf16 compute, sharding and the batch packer.

Compilation dominates on CPU, so one tiny model and one compiled step are shared.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spade_jax import sharding
from spade_jax.models import (
    ModelConfig,
    ModelOptions,
    Qwen3,
    abstract_model,
    load_balancing_loss,
)
from spade_jax.rl.batch import PackConfig, TrainBatch, TrainSequence, pack_sequences
from spade_jax.rl.optim import (
    OptimizerConfig,
    decay_mask,
    learning_rate_schedule,
    make_optimizer,
)
from spade_jax.rl.train_step import (
    ReferencePolicy,
    RoleConfig,
    TrainConfig,
    init_train_state,
    make_train_step,
    needs_reference,
    sampled_token_logprobs,
    shard_batch,
)

REPO = Path(__file__).resolve().parents[2]
VOCAB = 24


def tiny_config(**overrides) -> ModelConfig:
    base = dict(
        architecture="Qwen3MoeForCausalLM", vocab_size=VOCAB, hidden_size=16, num_layers=1,
        num_heads=2, num_kv_heads=2, head_dim=8, intermediate_size=24, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=8, norm_topk_prob=True,
    )
    return ModelConfig(**{**base, **overrides})


def log_softmax_np(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


# ---- log-probs of sampled tokens ---------------------------------------------------------


@pytest.mark.parametrize("chunk", [0, 3, 16])
def test_sampled_token_logprobs_match_numpy(chunk):
    rng = np.random.RandomState(0)
    hidden = rng.randn(3, 8, 5).astype(np.float32)
    w_dv = rng.randn(5, 11).astype(np.float32)
    ids = rng.randint(0, 11, (3, 8))
    logp, entropy = sampled_token_logprobs(lambda h: h @ w_dv, hidden, ids, chunk)
    logp_ref = log_softmax_np(hidden[:, :-1] @ w_dv)  # position t-1 predicts token t
    expected = np.take_along_axis(logp_ref, ids[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(logp)[:, 1:], expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(logp)[:, 0], 0.0)
    entropy_ref = -(np.exp(logp_ref) * logp_ref).sum(-1)
    np.testing.assert_allclose(np.asarray(entropy)[:, 1:], entropy_ref, rtol=1e-5, atol=1e-5)

    # The chunked path is differentiable and gives the same gradient.
    @jax.jit
    def grads(w):
        def total(w, c):
            return jnp.sum(sampled_token_logprobs(lambda h: h @ w, hidden, ids, c)[0])

        return jax.grad(total)(w, chunk), jax.grad(total)(w, 0)

    chunked, whole = grads(w_dv)
    np.testing.assert_allclose(chunked, whole, rtol=1e-5, atol=1e-5)


# ---- optimizer ---------------------------------------------------------------------------


def test_schedule_matches_closed_form():
    cfg = OptimizerConfig(learning_rate=2.0, warmup_steps=4, schedule="cosine", total_steps=14,
                          end_lr_ratio=0.25)
    schedule = learning_rate_schedule(cfg)
    for s in range(18):
        if s < 4:
            want = 2.0 * (s + 1) / 4
        else:
            p = min((s - 4) / 10, 1.0)
            want = 2.0 * (0.25 + 0.75 * 0.5 * (1 + math.cos(math.pi * p)))
        assert float(schedule(s)) == pytest.approx(want, rel=1e-6), s
    constant = learning_rate_schedule(OptimizerConfig(learning_rate=3.0, warmup_steps=2))
    assert [float(constant(s)) for s in range(4)] == pytest.approx([1.5, 3.0, 3.0, 3.0])


def test_optimizer_matches_numpy_adamw():
    cfg = OptimizerConfig(learning_rate=0.1, warmup_steps=2, schedule="cosine", total_steps=5,
                          weight_decay=0.3, clip_norm=0.5, b1=0.8, b2=0.9, eps=1e-3)
    rng = np.random.RandomState(1)
    # Decay by name, not shape: a matrix and a vector are decayed, a bias and a stacked
    # (2-D, as under scan_layers) norm scale are not.
    params = {"w": rng.randn(3, 4).astype(np.float32), "v": rng.randn(4).astype(np.float32),
              "bias": rng.randn(4).astype(np.float32),
              "input_norm": {"weight": rng.randn(2, 4).astype(np.float32)}}
    grads_per_step = [
        jax.tree.map(lambda v, s=scale: (rng.randn(*v.shape) * s).astype(np.float32), params)
        for scale in (1.0, 0.01, 3.0)
    ]
    optimizer = make_optimizer(cfg)
    state, got = optimizer.init(params), params
    for g in grads_per_step:
        updates, state = optimizer.update(g, state, got)
        got = jax.tree.map(lambda p, u: p + u, got, updates)

    flat = lambda tree: {"/".join(str(getattr(k, "key", k)) for k in path): leaf  # noqa: E731
                         for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}
    decayed = {"w": True, "v": True, "bias": False, "input_norm/weight": False}
    p = {k: x.astype(np.float64) for k, x in flat(params).items()}
    m = {k: np.zeros_like(x) for k, x in p.items()}
    v = {k: np.zeros_like(x) for k, x in p.items()}
    for t, g in enumerate(grads_per_step, start=1):
        g = flat(g)
        norm = math.sqrt(sum(float(np.sum(x.astype(np.float64) ** 2)) for x in g.values()))
        scale = min(1.0, 0.5 / norm)
        lr = float(learning_rate_schedule(cfg)(t - 1))
        for k in p:
            gk = g[k] * scale
            m[k] = 0.8 * m[k] + 0.2 * gk
            v[k] = 0.9 * v[k] + 0.1 * gk**2
            step = (m[k] / (1 - 0.8**t)) / (np.sqrt(v[k] / (1 - 0.9**t)) + 1e-3)
            decay = 0.3 * p[k] if decayed[k] else 0.0  # biases and norms are not decayed
            p[k] = p[k] - lr * (step + decay)
    for k, x in flat(got).items():
        np.testing.assert_allclose(x, p[k], rtol=1e-5, atol=1e-6)


DECAY_ARCHITECTURES = {  # every kind of parameter the model family has
    "dense_o_bias": dict(architecture="Qwen3ForCausalLM", o_bias=True),
    "qwen3_moe": {},
    "qwen2_moe": dict(architecture="Qwen2MoeForCausalLM", qkv_bias=True, qk_norm=False,
                      shared_expert_intermediate_size=8),
}


@pytest.mark.parametrize("arch", sorted(DECAY_ARCHITECTURES))
@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned"])
def test_weight_decay_skips_every_norm_and_bias_of_the_model(scan, arch):
    """Issue 30 item 15: Megatron decays no norm and no bias (its rule: a bias, or a 1-D
    parameter of a layer); with stacked layers the norm scales are 2-D, so a rule by the
    array's dimensions decayed them. Checked against Megatron's rule on each parameter's
    per-layer shape (the stacked layer axis dropped): every kernel, router and shared-
    expert gate included, is decayed; every norm scale and bias is not."""
    config = tiny_config(num_layers=2, **DECAY_ARCHITECTURES[arch])
    _, params = nnx.split(abstract_model(config, ModelOptions(scan_layers=scan)))
    mask = decay_mask(params)
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    kinds = collections.Counter()
    for (path, leaf), decayed in zip(leaves, jax.tree_util.tree_leaves(mask), strict=True):
        name = jax.tree_util.keystr(path)
        stacked = scan and name.startswith("['layers']")
        layer_shape = leaf.shape[1:] if stacked else leaf.shape
        megatron = not ("bias" in name or len(layer_shape) == 1)
        assert decayed == megatron, (name, leaf.shape)
        kinds["norm" if "norm" in name else "bias" if "bias" in name else "decayed"] += 1
        if stacked and not decayed:
            assert leaf.ndim >= 2, name  # a rule by the array's dimensions decays it
    assert kinds["norm"] >= 3 and kinds["decayed"] >= 6
    assert (kinds["bias"] > 0) == (arch != "qwen3_moe")


# ---- the step against a full-batch reference ---------------------------------------------

AGENT = RoleConfig(policy_loss="grpo", loss=dict(clip_eps=0.2, kl_coef=0.05))
DESIGNER = RoleConfig(policy_loss="gspo", loss=dict(clip_eps_low=0.1, clip_eps_high=0.1),
                      weight=0.5)
STEP_CONFIG = TrainConfig(
    optimizer=OptimizerConfig(learning_rate=1e-2, eps=1e-4, weight_decay=0.1, clip_norm=100.0),
    agent=AGENT, designer=DESIGNER, microbatches=2, logit_chunk=3, aux_loss_coef=0.01,
)


def random_batch(seed: int, rows: int = 8) -> TrainBatch:
    """Rows of both roles (unevenly spread), ragged lengths, KL reference log-probs."""
    rng = np.random.RandomState(seed)
    roles = [0, 0, 1, 0, 1, 1, 0, 0][:rows]
    seqs = []
    for i in range(rows):
        n = rng.randint(4, 11)
        prompt = rng.randint(1, 3)
        seqs.append(TrainSequence(
            token_ids=rng.randint(0, VOCAB, n).tolist(),
            loss_mask=np.r_[np.zeros(prompt), rng.rand(n - prompt) < 0.8],
            logprobs=-rng.rand(n) * 3 - 1.5,
            advantage=float(rng.randn()),
            role=roles[i],
            ref_logprobs=-rng.rand(n) * 3 - 1.5,
        ))
    return pack_sequences(seqs, PackConfig(buckets=(12,)))


def reference_loss(params, graphdef, batch: TrainBatch):
    """Full logits, role rows sliced out with NumPy indices, each role's rule called once.
    (``batch`` is NumPy, closed over: the row indices are static.)"""
    logits = nnx.merge(graphdef, params)(batch.input_ids).logits
    logp_all = jax.nn.log_softmax(logits[:, :-1], -1)
    logp = jnp.take_along_axis(logp_all, batch.input_ids[:, 1:, None], -1)[..., 0]
    logp = jnp.pad(logp, ((0, 0), (1, 0)))
    total, per_role = 0.0, {}
    for role_id, role in enumerate((AGENT, DESIGNER)):
        rows = np.flatnonzero(np.asarray(batch.role_id) == role_id)
        loss_fn, _ = role.part("policy_loss")
        loss, _ = loss_fn(logp[rows], batch.old_logp[rows], batch.ref_logp[rows],
                          batch.advantages[rows], batch.loss_mask[rows], role.loss)
        total += role.weight * loss
        per_role[role_id] = (loss, logp[rows])
    # The load-balancing loss is not additive over rows; the step defines it as the mean
    # over its (strided) microbatches.
    m = STEP_CONFIG.microbatches
    model = nnx.merge(graphdef, params)
    aux = sum(
        load_balancing_loss(model(batch.input_ids[i::m]).router_logits, 2,
                            batch.attention_mask[i::m])
        for i in range(m)
    ) / m
    return total + STEP_CONFIG.aux_loss_coef * aux, per_role


def numpy_adamw_first_step(params, grads, cfg: OptimizerConfig):
    """One AdamW step from zero moments (clip not active: the test keeps clip_norm large)."""
    def one(p, g, decayed):
        p, g = np.asarray(p, np.float64), np.asarray(g, np.float64)
        step = g / (np.abs(g) + cfg.eps)  # m_hat = g, sqrt(v_hat) = |g| at t = 1
        return p - cfg.learning_rate * (step + cfg.weight_decay * p * decayed)

    return jax.tree.map(one, params, grads, decay_mask(params))


_INITIAL_STATES = {}


@pytest.fixture(scope="module")
def compiled():
    """(model, graphdef, compiled step) shared by the step tests."""
    model = Qwen3(tiny_config(), ModelOptions(), rngs=nnx.Rngs(0))
    graphdef, state = init_train_state(model, STEP_CONFIG)
    _INITIAL_STATES[id(model)] = jax.device_get(state)
    return model, graphdef, make_train_step(graphdef, STEP_CONFIG)


def fresh_state(model):
    """A new step-0 state (fresh buffers, since the step donates its input)."""
    return jax.device_put(_INITIAL_STATES[id(model)])


@pytest.mark.slow  # ~110 s loaded with the shared compiled step
def test_step_matches_full_batch_reference(compiled):
    model, graphdef, step = compiled
    state, batch = fresh_state(model), random_batch(0)
    params0 = jax.tree.map(np.asarray, state.params)
    reference = jax.jit(jax.value_and_grad(
        lambda params: reference_loss(params, graphdef, batch), has_aux=True
    ))
    (want_loss, per_role), want_grads = reference(state.params)
    new_state, metrics = step(state, batch)

    assert float(metrics["loss"]) == pytest.approx(float(want_loss), rel=1e-5, abs=1e-6)
    assert float(metrics["grad_norm"]) == pytest.approx(
        float(np.sqrt(sum(np.sum(np.square(g)) for g in jax.tree.leaves(want_grads)))), rel=1e-4
    )
    expected = numpy_adamw_first_step(params0, want_grads, STEP_CONFIG.optimizer)
    for got, want in zip(jax.tree.leaves(new_state.params), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-6)
    assert int(new_state.step) == 1 and int(metrics["skipped"]) == 0

    role_id = np.asarray(batch.role_id)
    for rid, name in enumerate(("agent", "designer")):
        loss, logp = per_role[rid]
        mask = np.asarray(batch.loss_mask)[role_id == rid] > 0
        gap = np.abs(np.asarray(logp) - np.asarray(batch.old_logp)[role_id == rid])[mask]
        assert float(metrics[f"{name}/loss"]) == pytest.approx(float(loss), rel=1e-5, abs=1e-6)
        assert float(metrics[f"{name}/logp_gap_mean"]) == pytest.approx(gap.mean(), rel=1e-5)
        assert float(metrics[f"{name}/logp_gap_max"]) == pytest.approx(gap.max(), rel=1e-5)
        assert float(metrics[f"{name}/tokens"]) == mask.sum()
        assert float(metrics[f"{name}/sequences"]) == np.sum(mask.any(axis=1))


RECIPE_LOSS = dict(clip_eps=0.2, clip_eps_high=0.28)
POOLED_CONFIG = TrainConfig(
    optimizer=STEP_CONFIG.optimizer, microbatches=2, loss_aggregation="pooled",
    agent=RoleConfig(policy_loss="grpo", loss=RECIPE_LOSS, importance_correction="tis",
                     importance=dict(clamp=1.5)),
    designer=RoleConfig(policy_loss="grpo", loss=RECIPE_LOSS, weight=0.5),
)


def np_pooled_tis_loss(logp, batch: TrainBatch, aggregation: str, floor: int = 0) -> float:
    """POOLED_CONFIG's loss by loops in float64: per-token clipped term (agent: ratio 1 against
    the trainer's own log-probs, times min(pi_trainer / pi_sampler, 1.5)), mean over each
    sequence's tokens, then one mean over all sequences (pooled) or a mean per role."""
    means = {0: [], 1: []}
    for b in range(logp.shape[0]):
        role = int(batch.role_id[b])
        tokens = []
        for t in np.flatnonzero(np.asarray(batch.loss_mask)[b]):
            a, old = float(batch.advantages[b]), float(batch.old_logp[b, t])
            if role == 0:
                w, r = min(np.exp(logp[b, t] - old), 1.5), 1.0
            else:
                w, r = 1.0, np.exp(logp[b, t] - old)
            tokens.append(w * max(-a * r, -a * min(max(r, 0.8), 1.28)))
        if tokens:
            means[role].append((1.0 if role == 0 else 0.5) * np.mean(tokens))
    if aggregation == "pooled":
        return sum(map(sum, means.values())) / max(sum(map(len, means.values())), floor)
    return sum(np.mean(m) for m in means.values())


@pytest.mark.slow
def test_pooled_aggregation_with_tis_matches_numpy():
    model = Qwen3(tiny_config(), ModelOptions(), rngs=nnx.Rngs(0))
    graphdef, state = init_train_state(model, POOLED_CONFIG)
    params0 = jax.tree.map(np.asarray, state.params)
    batch = random_batch(4)
    logits = np.asarray(model(batch.input_ids).logits, np.float64)
    logp = np.take_along_axis(log_softmax_np(logits)[:, :-1], batch.input_ids[:, 1:, None],
                              -1)[..., 0]
    logp = np.pad(logp, ((0, 0), (1, 0)))
    want = np_pooled_tis_loss(logp, batch, "pooled")
    assert abs(want - np_pooled_tis_loss(logp, batch, "per_role")) > 1e-3  # they differ

    def jax_reference(params):  # the same formula, differentiable, for the gradient
        out = nnx.merge(graphdef, params)(batch.input_ids).logits
        lp = jnp.take_along_axis(jax.nn.log_softmax(out[:, :-1], -1),
                                 batch.input_ids[:, 1:, None], -1)[..., 0]
        lp = jnp.pad(lp, ((0, 0), (1, 0)))
        agent = np.asarray(batch.role_id)[:, None] == 0
        sg = jax.lax.stop_gradient(lp)
        w = jnp.where(agent, jnp.minimum(jnp.exp(sg - batch.old_logp), 1.5), 1.0)
        r = jnp.exp(lp - jnp.where(agent, sg, batch.old_logp))
        a = batch.advantages[:, None]
        token = w * jnp.maximum(-a * r, -a * jnp.clip(r, 0.8, 1.28))
        mask = np.asarray(batch.loss_mask)
        seq = jnp.sum(token * mask, 1) / np.maximum(mask.sum(1), 1)
        weight = np.where(np.asarray(batch.role_id) == 0, 1.0, 0.5) * (mask.sum(1) > 0)
        return jnp.sum(weight * seq) / np.sum(mask.sum(1) > 0)

    grads = jax.grad(jax_reference)(state.params)
    new_state, metrics = make_train_step(graphdef, POOLED_CONFIG)(state, batch)
    assert float(metrics["loss"]) == pytest.approx(want, rel=1e-5, abs=1e-6)
    expected = numpy_adamw_first_step(params0, grads, POOLED_CONFIG.optimizer)
    for got, ref in zip(jax.tree.leaves(new_state.params), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-4, atol=1e-6)
    agent_mask = (np.asarray(batch.loss_mask) > 0) & (np.asarray(batch.role_id) == 0)[:, None]
    ratio = np.exp(logp - np.asarray(batch.old_logp, np.float64))[agent_mask]
    # Rule metrics are weighted per microbatch by its share of the role's sequences.
    assert float(metrics["agent/tis/weight_mean"]) == pytest.approx(
        np.minimum(ratio, 1.5).mean(), rel=0.05)
    assert float(metrics["agent/tis/clip_frac"]) > 0
    assert "designer/tis/weight_mean" not in metrics


@pytest.mark.slow  # three step compiles
def test_pooled_loss_divides_by_the_floor_when_the_batch_is_short():
    """Issue 30 item 1 (the 8B recipe): slime divides the summed per-sample losses by the
    global batch even when fewer samples are real, so a short batch's loss and gradient are
    scaled by n / floor. The floor applies to the step's global count, not to each
    microbatch's: a floor under the global count but over every microbatch's changes
    nothing (a per-microbatch floor would divide by it)."""
    model = Qwen3(tiny_config(), ModelOptions(), rngs=nnx.Rngs(0))
    batch = random_batch(4)
    logits = np.asarray(model(batch.input_ids).logits, np.float64)
    logp = np.take_along_axis(log_softmax_np(logits)[:, :-1], batch.input_ids[:, 1:, None],
                              -1)[..., 0]
    logp = np.pad(logp, ((0, 0), (1, 0)))
    scored_b = np.asarray(batch.loss_mask).sum(1) > 0
    scored = int(np.sum(scored_b))
    per_microbatch = [int(np.sum(scored_b[m::POOLED_CONFIG.microbatches]))
                      for m in range(POOLED_CONFIG.microbatches)]
    assert scored < 12 and max(per_microbatch) < scored - 1, per_microbatch

    def step_metrics(config):
        graphdef, state = init_train_state(model, config)
        return make_train_step(graphdef, config)(state, batch)[1]

    plain_loss, plain = np_pooled_tis_loss(logp, batch, "pooled"), step_metrics(POOLED_CONFIG)
    assert float(plain["loss"]) == pytest.approx(plain_loss, rel=1e-5, abs=1e-6)
    for floor, divisor in ((12, 12), (scored - 1, scored)):
        config = dataclasses.replace(POOLED_CONFIG, pooled_min_denominator=floor)
        want = np_pooled_tis_loss(logp, batch, "pooled", floor=floor)
        assert want == pytest.approx(plain_loss * scored / divisor)
        metrics = step_metrics(config)
        assert float(metrics["loss"]) == pytest.approx(want, rel=1e-5, abs=1e-6), floor
        assert float(metrics["grad_norm"]) == pytest.approx(
            float(plain["grad_norm"]) * scored / divisor, rel=1e-4), floor


@pytest.mark.slow  # ~80 s loaded: compiles two steps
def test_reference_policy_is_the_frozen_initial_policy():
    """ref_logp = NumPy log-softmax of the initial model, for every row (microbatches
    re-interleaved), and still after steps that update (and donate) the live parameters."""
    config = TrainConfig(optimizer=OptimizerConfig(learning_rate=1e-2), microbatches=2,
                         agent=RoleConfig(loss=dict(kl_coef=0.1)))
    assert needs_reference(config) and not needs_reference(TrainConfig())
    model = Qwen3(tiny_config(), ModelOptions(), rngs=nnx.Rngs(3))
    logits = np.asarray(model(random_batch(5).input_ids).logits, np.float64)
    graphdef, state = init_train_state(model, config)
    reference = ReferencePolicy(graphdef, config, state.params)
    step = make_train_step(graphdef, config)
    batch = random_batch(5)
    want = np.take_along_axis(log_softmax_np(logits)[:, :-1], batch.input_ids[:, 1:, None],
                              -1)[..., 0]
    want = np.pad(want, ((0, 0), (1, 0))) * batch.loss_mask
    for _ in range(2):
        annotated = reference.annotate(batch)
        np.testing.assert_allclose(np.asarray(annotated.ref_logp), want, rtol=1e-5, atol=1e-5)
        state, metrics = step(state, annotated)
        assert int(metrics["skipped"]) == 0 and float(metrics["agent/kl"]) >= 0
    assert float(metrics["agent/kl"]) > 0  # the policy moved away from the reference


@pytest.mark.slow  # ~40 s loaded: compiles a step and a reference pass
def test_kl_step_with_a_rare_prompt_token_is_not_skipped():
    """Issue 37 item 2 through the real step: the 8B recipe's KL (0.005 to the initial
    policy, ``ReferencePolicy.annotate``: 0 off the mask) on a policy whose logits are
    sharp (LM head x 1000), so prompt tokens sit at log-probs far below -88.7: the KL term
    must not overflow there, and the update is applied (not skipped as non-finite)."""
    config = TrainConfig(optimizer=OptimizerConfig(learning_rate=1e-3),
                         agent=RoleConfig(loss=dict(kl_coef=0.005)))
    model = Qwen3(tiny_config(), ModelOptions(), rngs=nnx.Rngs(4))
    model.lm_head_dv[...] = model.lm_head_dv[...] * 1000.0
    batch = random_batch(6)
    logp = np.take_along_axis(log_softmax_np(np.asarray(model(batch.input_ids).logits,
                                                        np.float64))[:, :-1],
                              batch.input_ids[:, 1:, None], -1)[..., 0]
    prompt = (np.asarray(batch.attention_mask)[:, 1:] > 0) & (batch.loss_mask[:, 1:] == 0)
    assert logp[prompt].min() < -100  # the rare token in context
    graphdef, state = init_train_state(model, config)
    annotated = ReferencePolicy(graphdef, config, state.params).annotate(batch)
    before = jax.tree.map(np.array, state.params)
    state, metrics = make_train_step(graphdef, config)(state, annotated)
    assert int(metrics["skipped"]) == 0 and int(state.step) == 1
    assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["grad_norm"]))
    assert float(metrics["agent/kl"]) == pytest.approx(0.0, abs=1e-6)  # the step-0 policy
    moved = [np.abs(np.asarray(a) - b).max() for a, b in
             zip(jax.tree.leaves(state.params), jax.tree.leaves(before), strict=True)]
    assert max(moved) > 0


@pytest.mark.slow  # uses the compiled step (~40 s loaded)
def test_nonfinite_batch_is_skipped_then_training_continues(compiled):
    model, _, step = compiled
    state = fresh_state(model)
    before = jax.tree.map(np.array, (state.step, state.params, state.opt_state))
    good = random_batch(1)
    bad = good.replace(advantages=np.asarray(good.advantages).copy())
    bad.advantages[3] = np.nan
    state, metrics = step(state, bad)
    assert int(metrics["skipped"]) == 1 and float(metrics["update_norm"]) == 0.0
    after = (state.step, state.params, state.opt_state)
    for got, want in zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)
    state, metrics = step(state, good)
    assert int(metrics["skipped"]) == 0 and int(state.step) == 1
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.params))


@pytest.mark.slow  # ~40 s loaded: sharded compile
def test_sharded_step_equals_single_device(compiled):
    if jax.device_count() < 8:
        pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
    model, _, step = compiled
    batch = random_batch(2)
    single, single_metrics = step(fresh_state(model), batch)

    mesh = sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=2, tensor=2, expert=2))
    graphdef, state = init_train_state(model, STEP_CONFIG, mesh=mesh)
    specs = {str(leaf.sharding.spec) for leaf in jax.tree.leaves(state.params)}
    assert len(specs) > 1, "parameters should actually be sharded"
    sharded_step = make_train_step(graphdef, STEP_CONFIG, mesh=mesh)
    sharded, metrics = sharded_step(state, shard_batch(batch, mesh))
    for got, want in zip(jax.tree.leaves(sharded.params), jax.tree.leaves(single.params),
                         strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    assert float(metrics["loss"]) == pytest.approx(float(single_metrics["loss"]), rel=1e-5)
    mu_specs = {str(x.sharding.spec) for x in jax.tree.leaves(sharded.opt_state)}
    assert mu_specs & specs - {"PartitionSpec()"}, "Adam moments should follow the params"


@pytest.mark.slow  # ~25 s loaded
def test_bf16_compute_keeps_fp32_master_weights():
    config = TrainConfig(compute_dtype="bfloat16",
                         optimizer=OptimizerConfig(learning_rate=1e-3, master_dtype="float32"))
    dense = tiny_config(architecture="Qwen3ForCausalLM", num_experts=0, num_experts_per_tok=0,
                        moe_intermediate_size=0)
    model = Qwen3(dense, ModelOptions(dtype="bfloat16", param_dtype="float32"),
                  rngs=nnx.Rngs(1))
    graphdef, state = init_train_state(model, config)
    batch = random_batch(3)
    # old_logp := the fp32 model's log-probs, so the logged gap is the bf16 rounding error.
    fp32_model = Qwen3(dense, ModelOptions(), rngs=nnx.Rngs(1))
    logp_all = log_softmax_np(np.asarray(fp32_model(batch.input_ids).logits, np.float64))
    fp32_logp = np.take_along_axis(logp_all[:, :-1], batch.input_ids[:, 1:, None], -1)[..., 0]
    old_logp = np.pad(fp32_logp, ((0, 0), (1, 0))) * batch.loss_mask
    batch = batch.replace(old_logp=old_logp.astype(np.float32))
    state, metrics = make_train_step(graphdef, config)(state, batch)
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim]
    assert moments and {x.dtype for x in moments} == {jnp.dtype(jnp.float32)}
    assert int(metrics["skipped"]) == 0 and np.isfinite(float(metrics["loss"]))
    gap = float(metrics["agent/logp_gap_max"])
    assert 1e-5 < gap < 0.1, f"bf16 forward should be close to, not equal to, fp32 (gap {gap})"


@pytest.mark.slow  # ~20 s loaded
def test_resume_from_checkpoint_is_bitwise_identical(compiled, tmp_path):
    """6 steps straight == 3 steps, save, restore into a fresh process state, 3 steps. (The
    kill -9 variant of this test, on a toy state, is in test_checkpoint.py; here the point is
    that the real TrainState, its nnx metadata and optimizer state round-trip exactly.)"""
    from spade_jax.checkpoint import CheckpointConfig, CheckpointManager

    model, _, step = compiled
    batches = [random_batch(10 + i) for i in range(6)]
    straight = fresh_state(model)
    for batch in batches:
        straight, _ = step(straight, batch)

    state = fresh_state(model)
    for batch in batches[:3]:
        state, _ = step(state, batch)
    with CheckpointManager(CheckpointConfig(directory=tmp_path / "ckpt")) as manager:
        manager.save(3, state, {"batches_done": 3})
    template = fresh_state(model)
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), template
    )
    with CheckpointManager(CheckpointConfig(directory=tmp_path / "ckpt")) as manager:
        restored = manager.restore_latest(abstract)
    assert restored.step == 3 and restored.run_state == {"batches_done": 3}
    resumed = restored.state
    assert jax.tree.structure(resumed) == jax.tree.structure(template)
    for batch in batches[restored.run_state["batches_done"]:]:
        resumed, _ = step(resumed, batch)
    for got, want in zip(jax.tree.leaves(resumed), jax.tree.leaves(straight), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# ---- validation --------------------------------------------------------------------------


@pytest.mark.slow  # uses the compiled step (~40 s loaded)
def test_config_and_batch_errors_name_the_problem(compiled):
    with pytest.raises(KeyError, match="unknown policy_losses rule 'nope'"):
        RoleConfig(policy_loss="nope")
    with pytest.raises(ValueError, match="unknown field"):
        RoleConfig(policy_loss="grpo", loss=dict(clip=0.1))
    with pytest.raises(ValueError, match="microbatches"):
        TrainConfig(microbatches=0)
    with pytest.raises(ValueError, match="cosine schedule needs total_steps"):
        OptimizerConfig(schedule="cosine", warmup_steps=5, total_steps=5)
    model, _, step = compiled
    with pytest.raises(ValueError, match="compute_dtype"):
        init_train_state(model, TrainConfig(compute_dtype="bfloat16"))
    with pytest.raises(ValueError, match="not divisible into 2 microbatches"):
        step(fresh_state(model), random_batch(0, rows=7))
    with pytest.raises(ValueError, match="router_replay=True but the batch has no routing"):
        make_train_step(compiled[1], TrainConfig(router_replay=True))(
            fresh_state(model), random_batch(0))
    bad = random_batch(0).replace(old_logp=np.zeros((8, 11), np.float32))
    with pytest.raises(ValueError, match="old_logp has shape"):
        step(fresh_state(model), bad)


# ---- packing -----------------------------------------------------------------------------


def test_pack_sequences_layout_and_padding():
    seqs = [
        TrainSequence([5, 6, 7], [0, 1, 1], [0.0, -0.5, -0.25], 1.5, role="designer",
                      routing=[None, np.array([[0, 1], [2, 3], [1, 2]])]),
        TrainSequence([8, 9], [0, 1], [-9.0, -0.75], [0.0, 2.0], role="agent",
                      routing=[None, np.array([[3, 2]])]),  # last token's routing absent
    ]
    batch = pack_sequences(seqs, PackConfig(buckets=(2, 4, 8), pad_id=0, batch_multiple=4))
    np.testing.assert_array_equal(batch.input_ids[:2], [[5, 6, 7, 0], [8, 9, 0, 0]])
    np.testing.assert_array_equal(batch.attention_mask[:2], [[1, 1, 1, 0], [1, 1, 0, 0]])
    np.testing.assert_array_equal(batch.loss_mask, [[0, 1, 1, 0], [0, 1, 0, 0]] + [[0] * 4] * 2)
    np.testing.assert_allclose(batch.old_logp[:2], [[0, -0.5, -0.25, 0], [0, -0.75, 0, 0]])
    np.testing.assert_allclose(batch.advantages[:2], [[1.5, 1.5, 1.5, 0], [0, 2, 0, 0]])
    np.testing.assert_array_equal(batch.role_id, [1, 0, 0, 0])
    assert batch.routing_replay[0] is None
    np.testing.assert_array_equal(batch.routing_replay[1][1], [[3, 2], [0, 1], [0, 1], [0, 1]])
    assert batch.ref_logp is None
    batch.validate()


@pytest.mark.parametrize(
    ("seq", "message"),
    [
        (TrainSequence([1, 2], [1, 1], [0, 0], 0.0), r"loss_mask\[0\] must be 0"),
        (TrainSequence([1, 2, 3], [0, 1], [0, 0, 0], 0.0), "loss_mask has 2 entries"),
        (TrainSequence([1] * 9, [0] * 9, [0] * 9, 0.0), "longer than the largest bucket 8"),
        (TrainSequence([1, 2], [0, 1], [0, 0], 0.0, role="critic"), "unknown role 'critic'"),
        (TrainSequence([1, 2], [0, 1], [0, float("nan")], 0.0), "non-finite sampler log-prob"),
    ],
)
def test_pack_sequences_rejects_bad_input(seq, message):
    with pytest.raises(ValueError, match=message):
        pack_sequences([seq], PackConfig(buckets=(4, 8)))


def test_pack_sequences_rejects_mixed_routing_layouts():
    a = TrainSequence([1, 2], [0, 1], [0, 0], 0.0, routing=[None, np.zeros((2, 2))])
    b = TrainSequence([1, 2], [0, 1], [0, 0], 0.0, routing=[np.zeros((2, 2)), None])
    with pytest.raises(ValueError, match="routing layout"):
        pack_sequences([a, b])
    with pytest.raises(ValueError, match="has no routing but others do"):
        pack_sequences([a, TrainSequence([1, 2], [0, 1], [0, 0], 0.0)])


# ---- benchmark entry point ---------------------------------------------------------------


@pytest.mark.slow  # JAX subprocess, ~30 s loaded
def test_benchmark_runs_at_tiny_size(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "train_step.py"), "--tiny", "--impls=ragged",
         f"--json={out}"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    import json

    rows = json.loads(out.read_text())["results"]
    assert [r["moe_impl"] for r in rows] == ["ragged"]
    assert rows[0]["tokens_per_s"] > 0 and 0 < rows[0]["roofline_fraction"] < 1.5


# ---- the supervised (PPO-ptx) term --------------------------------------------------------

PTX_CONFIG = TrainConfig(
    optimizer=OptimizerConfig(learning_rate=1e-2, eps=1e-4, clip_norm=100.0),
    agent=RoleConfig(policy_loss="grpo", temperature=0.7),
    designer=RoleConfig(policy_loss="grpo", temperature=0.7), microbatches=2,
    supervised_coef=0.3)


def test_supervised_rows_add_their_mean_nll_and_nothing_else():
    """Replayed rows (role "supervised") add coef x the mean over rows of each row's mean
    token NLL at temperature 1 (NumPy, float64), whatever the roles' temperatures; the RL
    rows' loss is the same with or without them, and at coef 0 they train nothing."""
    model = Qwen3(tiny_config(), ModelOptions(), rngs=nnx.Rngs(0))
    rng = np.random.RandomState(3)
    rl = [TrainSequence(rng.randint(0, VOCAB, 9).tolist(), [0, 0, 0, 1, 1, 1, 1, 1, 1],
                        (-rng.rand(9) - 1).tolist(), float(rng.randn()), role=r)
          for r in ("agent", "designer", "agent", "designer")]
    replay = [TrainSequence(rng.randint(0, VOCAB, n).tolist(), [0] * 3 + [1] * (n - 3),
                            [0.0] * n, 0.0, role="supervised") for n in (11, 6)]
    pack = PackConfig(buckets=(12,))
    mixed, plain = pack_sequences(rl + replay, pack), pack_sequences(rl, pack)
    assert list(np.asarray(mixed.role_id)) == [0, 1, 0, 1, 2, 2]

    logits = np.asarray(model(mixed.input_ids).logits, np.float64)
    logp = np.take_along_axis(log_softmax_np(logits)[:, :-1], mixed.input_ids[:, 1:, None],
                              -1)[..., 0]
    nll = [-logp[b, np.flatnonzero(np.asarray(mixed.loss_mask)[b, 1:])].mean() for b in (4, 5)]

    def loss_of(config, batch):
        graphdef, state = init_train_state(model, config)
        _, metrics = make_train_step(graphdef, config)(state, batch)
        return metrics

    with_ptx = loss_of(PTX_CONFIG, mixed)
    without = loss_of(dataclasses.replace(PTX_CONFIG, supervised_coef=0.0), mixed)
    rl_only = loss_of(PTX_CONFIG, plain)
    assert float(with_ptx["supervised/nll"]) == pytest.approx(np.mean(nll), rel=1e-5)
    assert float(with_ptx["supervised/sequences"]) == 2
    assert float(with_ptx["loss"]) - float(without["loss"]) == pytest.approx(
        0.3 * np.mean(nll), rel=1e-4)
    assert float(without["loss"]) == pytest.approx(float(rl_only["loss"]), rel=1e-6)
    assert float(with_ptx["agent/sequences"]) == 2 and float(with_ptx["designer/sequences"]) == 2
    assert "supervised/nll" not in without


def test_supervised_coef_is_checked():
    with pytest.raises(ValueError, match="supervised_coef must be finite and >= 0"):
        TrainConfig(supervised_coef=-1.0)
    with pytest.raises(ValueError, match="router_replay=False"):
        TrainConfig(supervised_coef=0.5, router_replay=True)
