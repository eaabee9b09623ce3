"""The policy update: one jitted, sharded GRPO-family step for both roles.

    state, metrics = train_step(state, batch)

Per microbatch m (a strided slice of the batch, accumulated with ``lax.scan``):

    logp_bt      = log_softmax(lm_head(hidden_{b,t-1}))[input_ids_bt]   (0 at t = 0)
    mask^r_bt    = loss_mask_bt * [role_id_b == r]
    A^r_bt       = token_weighting_r(advantages, entropy, mask^r)
    old^r, A^r   = importance_correction_r(logp, old_logp, A^r, mask^r, group_id)
                   ("none": old_logp, A^r unchanged; "tis": sg(logp), A^r * clip(ratio, 0, C))
    loss^r_m     = policy_loss_r(logp, old^r, ref_logp, A^r, mask^r)
    loss_m       = sum_r  w_r * (n^r_m / n^r) * loss^r_m  + aux_coef * aux_m / M   per_role
                 = sum_r  w_r * (n^r_m / N)   * loss^r_m  + aux_coef * aux_m / M   pooled

where ``n^r`` counts role r's sequences that have policy tokens (``n^r_m`` those in m) and
N = sum_r n^r, counted over the whole step, not per microbatch (pooled: at least
``pooled_min_denominator``). Summed over m, this is exactly the full-batch loss of every
per-sequence-mean rule (GRPO, GSPO): per role, or one mean over both roles' sequences
(pooled, the recipe's); for token-mean rules (DAPO, Dr.GRPO) it weights microbatches by
sequences, not tokens. Rows of the other role are masked out, so a rule that divides by B
(Dr.GRPO) still counts them in its denominator.

Replayed supervised rows (role_id 2, PPO-ptx; ``supervised_coef`` > 0) add
``supervised_coef * sum_{b in m} nll_b / n^sup``, with nll_b the row's mean token NLL at
temperature 1 and n^sup the step's supervised rows; no role's rule sees them.

Then global-norm clip + AdamW. A step whose loss or gradient norm is not finite leaves the
whole state (params, optimizer state, step, rng) unchanged and reports ``skipped=1``.

Mixed precision: parameters (the fp32 master copy) are cast to ``compute_dtype`` inside
the differentiated function, so gradients and Adam moments stay in the master dtype.

Router replay (MoE): with ``router_replay=True`` the forward pass uses the experts
recorded at rollout time (``batch.routing_replay``) instead of its own top-k, so the
trainer's log-probs match the sampler's. ``<role>/logp_gap_mean|max`` =
|logp - old_logp| over the role's policy tokens is logged either way.

Memory levers: the model's ``ModelOptions`` (``remat`` policy, ``scan_layers``,
``attention_chunk``); ``logit_chunk`` computes log-probs over time chunks (each
rematerialised) so [B, T, V] logits never exist at once; the state is donated.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh, SingleDeviceSharding

from spade_jax import sharding
from spade_jax.models import Qwen3, load_balancing_loss, numerics
from spade_jax.rl.batch import ROLES, ROW_ROLES, SUPERVISED, TrainBatch
from spade_jax.rl.optim import (
    MASTER_DTYPES,
    OptimizerConfig,
    learning_rate_schedule,
    make_optimizer,
)
from spade_jax.rl.update_rule import DEFAULT_DESIGNER_RULE, RoleConfig
from spade_jax.sharding import shard_batch, tree_shardings  # noqa: F401  (placement lives there)

Array = jax.Array
Metrics = dict[str, Array]
# RoleConfig (a role's whole update rule) lives in rl.update_rule; re-exported here.
__all__ = ["RoleConfig", "TrainConfig", "TrainState", "make_train_step", "train_step"]
COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
LOSS_AGGREGATIONS = ("per_role", "pooled")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Settings of the policy update.

    Attributes:
      optimizer: AdamW / schedule / clipping / master dtype.
      agent: the update rule (all its parts) and weight of role_id 0 sequences.
      designer: the same for role_id 1; by default mean-centred advantages ("dr_grpo"),
        which with the loop's skill groups and scale is the recipe's per-skill centring.
      microbatches: split the batch into this many microbatches and accumulate gradients
        (B must be divisible by it).
      compute_dtype: dtype the master parameters are cast to for the forward/backward pass
        ("bfloat16" with ``optimizer.master_dtype="float32"`` = bf16 compute, fp32 master
        weights and moments). Must equal the model's ``ModelOptions.dtype``.
      router_replay: run MoE layers on the experts recorded at rollout time.
      logit_chunk: time-chunk length for the log-prob computation (0 = all at once).
      aux_loss_coef: weight of the MoE load-balancing loss (0 = off).
      skip_nonfinite: leave the state unchanged when the loss or gradient is not finite.
      loss_aggregation: how the two roles' losses combine. "per_role": each role's rule
        averages over that role's sequences and the roles add, ``sum_r w_r loss_r``.
        "pooled" (the recipe): one mean over all sequences of both roles,
        ``sum_r w_r (n_r / N) loss_r`` with n_r the role's sequences and N = sum_r n_r,
        so a designer sample weighs as much as an agent sample.
      pooled_min_denominator: pooled aggregation divides by max(N, this) (0 = N). The
        recipe's slime divides the summed per-sample losses by the global batch (192)
        when a batch falls short and its rewards are not rescaled (the 8B launch, whose
        KL term turns the rescaling off: docs/reference_parity.md).
      update_epochs: optimizer steps taken on each batch (1 = on-policy, the recipe; more
        = PPO's reuse of a batch, bounded by the ratio clip).
      row_buckets: allowed batch sizes B (increasing); a batch is padded with empty rows
        (loss mask 0) up to the smallest that fits, so a run whose sequence count varies
        from step to step compiles a handful of step shapes, not one per count (() = pad
        to the microbatch multiple only).
      supervised_coef: weight of the NLL term on the batch's replayed supervised rows
        (role_id 2, ``SUPERVISED``; InstructGPT's PPO-ptx): ``coef`` times the mean over
        those rows of each row's mean token NLL (at temperature 1), added to the RL loss.
        0 = off (a supervised row then trains nothing). What is replayed is the caller's
        choice (the SPADE loop: ``spade.supervised_replay`` warm-start examples a step).
    """

    optimizer: OptimizerConfig = OptimizerConfig()
    agent: RoleConfig = RoleConfig()
    designer: RoleConfig = DEFAULT_DESIGNER_RULE
    microbatches: int = 1
    compute_dtype: str = "float32"
    router_replay: bool = False
    logit_chunk: int = 0
    aux_loss_coef: float = 0.0
    skip_nonfinite: bool = True
    loss_aggregation: str = "per_role"
    pooled_min_denominator: int = 0
    row_buckets: tuple[int, ...] = ()
    update_epochs: int = 1
    supervised_coef: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.supervised_coef) and self.supervised_coef >= 0):
            raise ValueError(f"supervised_coef must be finite and >= 0, got "
                             f"{self.supervised_coef}")
        if self.supervised_coef > 0 and self.router_replay:
            raise ValueError("supervised_coef > 0 needs router_replay=False: replayed "
                             "supervised examples have no experts recorded at rollout time")
        if self.update_epochs < 1:
            raise ValueError(f"update_epochs must be >= 1, got {self.update_epochs}")
        if any(b < 1 for b in self.row_buckets) or \
                tuple(sorted(set(self.row_buckets))) != tuple(self.row_buckets):
            raise ValueError(f"row_buckets must be increasing sizes >= 1, got {self.row_buckets}")
        if self.pooled_min_denominator < 0:
            raise ValueError(f"pooled_min_denominator must be >= 0, got "
                             f"{self.pooled_min_denominator}")
        if self.loss_aggregation not in LOSS_AGGREGATIONS:
            raise ValueError(f"loss_aggregation must be one of {LOSS_AGGREGATIONS}, got "
                             f"{self.loss_aggregation!r}")
        if self.microbatches < 1:
            raise ValueError(f"microbatches must be >= 1, got {self.microbatches}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(
                f"compute_dtype must be one of {sorted(COMPUTE_DTYPES)}, got {self.compute_dtype!r}"
            )
        if self.logit_chunk < 0:
            raise ValueError(f"logit_chunk must be >= 0 (0 = no chunking), got {self.logit_chunk}")
        if self.aux_loss_coef < 0:
            raise ValueError(f"aux_loss_coef must be >= 0, got {self.aux_loss_coef}")

    @property
    def roles(self) -> tuple[RoleConfig, RoleConfig]:
        """Role configs in ``ROLES`` order (index = role_id)."""
        return (self.agent, self.designer)


@struct.dataclass
class TrainState:
    """Everything the update changes.

    step: [] int32, number of applied (not skipped) updates; the schedule's step.
    params: nnx.State of the model's parameters (master dtype, logical axes in metadata).
    opt_state: optax state (moments carry the same axes metadata as ``params``).
    rng: a raw uint32[2] key for stochastic rules, advanced once per applied update.
    """

    step: Array
    params: nnx.State
    opt_state: optax.OptState
    rng: Array


# ---- log-probs of the sampled tokens ------------------------------------------------------


def _logprob_and_entropy(
    lm_head: Callable[[Array], Array], hidden_btd: Array, targets_bt: Array,
    invariant: bool = False,
) -> tuple[Array, Array]:
    logits_btv = lm_head(hidden_btd)  # fp32
    logp_bt, lse_bt = numerics.token_logprobs(logits_btv, targets_bt, invariant=invariant)
    probs_btv = jnp.exp(logits_btv - lse_bt[..., None])
    entropy_bt = lse_bt - jnp.sum(probs_btv * logits_btv, axis=-1)
    return logp_bt, jax.lax.stop_gradient(entropy_bt)


def sampled_token_logprobs(
    lm_head: Callable[[Array], Array], hidden_btd: Array, input_ids_bt: Array,
    logit_chunk: int = 0, invariant: bool = False,
) -> tuple[Array, Array]:
    """``logp[b, t] = log p(input_ids[b, t] | tokens < t)`` and the entropy of that
    prediction, both [B, T] fp32 and 0 at t = 0 (token 0 has no prediction).

    With ``logit_chunk > 0`` the vocabulary projection runs over time chunks under
    ``jax.checkpoint``, so only one [B, chunk, V] block of logits is live at a time.
    ``invariant``: the log-softmax sums in the fixed order the sampler of a batch-invariant
    model records with (:func:`spade_jax.models.numerics.token_logprobs`).
    """
    b, t = input_ids_bt.shape
    hidden_btd, targets_bt = hidden_btd[:, :-1], input_ids_bt[:, 1:]  # position t-1 predicts t
    if logit_chunk == 0 or t - 1 <= logit_chunk:
        logp_bt, entropy_bt = _logprob_and_entropy(lm_head, hidden_btd, targets_bt, invariant)
    else:
        chunks = -(-(t - 1) // logit_chunk)
        pad = chunks * logit_chunk - (t - 1)
        hidden_cbkd = jnp.pad(hidden_btd, ((0, 0), (0, pad), (0, 0)))
        hidden_cbkd = hidden_cbkd.reshape(b, chunks, logit_chunk, -1).swapaxes(0, 1)
        targets_cbk = jnp.pad(targets_bt, ((0, 0), (0, pad))).reshape(b, chunks, -1).swapaxes(0, 1)
        body = jax.checkpoint(functools.partial(_logprob_and_entropy, lm_head,
                                                invariant=invariant))
        logp_cbk, entropy_cbk = jax.lax.map(lambda xs: body(*xs), (hidden_cbkd, targets_cbk))
        logp_bt = logp_cbk.swapaxes(0, 1).reshape(b, -1)[:, : t - 1]
        entropy_bt = entropy_cbk.swapaxes(0, 1).reshape(b, -1)[:, : t - 1]
    zeros_b1 = jnp.zeros((b, 1), jnp.float32)
    return jnp.concatenate([zeros_b1, logp_bt], 1), jnp.concatenate([zeros_b1, entropy_bt], 1)


def policy_logprobs(
    model: Qwen3,
    batch: TrainBatch,
    router_replay: bool,
    logit_chunk: int = 0,
    temperature: float | Array = 1.0,
    mesh: Mesh | None = None,
) -> tuple[Array, Array, list]:
    """Runs the policy on ``batch``: (logp [B, T], entropy [B, T], router logits per layer).
    Log-probs are of ``softmax(logits / temperature)``, the distribution the sampler drew from;
    ``temperature`` is a float or one value per row ([B]). ``mesh`` goes to the model (its
    expert-parallel MoE dispatch)."""
    replay = None
    if router_replay:
        if batch.routing_replay is None:
            raise ValueError("router_replay=True but the batch has no routing_replay")
        replay = list(batch.routing_replay)
    out = model(
        batch.input_ids,
        attention_mask_bt=batch.attention_mask,
        routing_replay=replay,
        return_logits=False,
        mesh=mesh,
    )
    def lm_head(hidden_btd: Array) -> Array:
        logits_btv = model.lm_head(hidden_btd)
        if isinstance(temperature, float | int):
            return logits_btv if temperature == 1.0 else logits_btv / temperature
        return logits_btv / temperature[:, None, None]

    logp_bt, entropy_bt = sampled_token_logprobs(lm_head, out.hidden, batch.input_ids,
                                                 logit_chunk, model.options.batch_invariant)
    return logp_bt, entropy_bt, out.router_logits


# ---- the loss ---------------------------------------------------------------------------


def _masked_mean_parts(x_bt: Array, mask_bt: Array) -> tuple[Array, Array]:
    return jnp.sum(x_bt * mask_bt), jnp.sum(mask_bt)


def role_loss(
    role: RoleConfig,
    role_id: int,
    batch: TrainBatch,
    logp_bt: Array,
    entropy_bt: Array,
) -> tuple[Array, Metrics, Metrics]:
    """One role's rule on its rows: (loss, rule metrics, token statistics as sums/maxes)."""
    rows_b = (batch.role_id == role_id).astype(jnp.float32)
    mask_bt = batch.loss_mask.astype(jnp.float32) * rows_b[:, None]
    weighting_fn, weighting_config = role.part("token_weighting")
    advantages_bt, weighting_metrics = weighting_fn(
        batch.advantages, entropy_bt, mask_bt, weighting_config
    )
    correction_fn, correction_config = role.part("importance_correction")
    group_id = batch.group_id if batch.group_id is not None else jnp.full(
        batch.role_id.shape, -1, jnp.int32)
    corrected, correction_metrics = correction_fn(
        logp_bt, batch.old_logp, advantages_bt, mask_bt, group_id, correction_config
    )
    loss_fn, loss_config = role.part("policy_loss")
    loss, loss_metrics = loss_fn(
        logp_bt, corrected.old_logp, batch.ref_logp, corrected.advantages, mask_bt, loss_config
    )
    gap_bt = jnp.abs(jax.lax.stop_gradient(logp_bt) - batch.old_logp)
    gap_sum, tokens = _masked_mean_parts(gap_bt, mask_bt)
    entropy_sum, _ = _masked_mean_parts(entropy_bt, mask_bt)
    token_stats = {
        "logp_gap_sum": gap_sum,
        "logp_gap_max": jnp.max(jnp.where(mask_bt > 0, gap_bt, 0.0)),
        "entropy_sum": entropy_sum,
        "tokens": tokens,
    }
    return loss, {**loss_metrics, **weighting_metrics, **correction_metrics}, token_stats


def _row_temperatures(config: TrainConfig, batch: TrainBatch) -> float | Array:
    """The temperature each row was sampled at (its role's; 1.0 when unset): one float, or
    [B] when the roles differ."""
    role_temps = [1.0 if r.temperature is None else r.temperature for r in config.roles]
    if config.supervised_coef > 0:
        role_temps.append(1.0)  # a supervised row's NLL is of the model's own distribution
    if len(set(role_temps)) == 1:
        return role_temps[0]
    return jnp.asarray(role_temps, jnp.float32)[batch.role_id]


def supervised_nll(batch: TrainBatch, logp_bt: Array) -> tuple[Array, Array]:
    """(sum over the supervised rows of each row's mean token NLL, how many rows have a
    target token): the PPO-ptx term's parts (``TrainConfig.supervised_coef``)."""
    rows_b = (batch.role_id == ROW_ROLES.index(SUPERVISED)).astype(jnp.float32)
    mask_bt = batch.loss_mask.astype(jnp.float32) * rows_b[:, None]
    tokens_b = jnp.sum(mask_bt, axis=1)
    nll_b = -jnp.sum(logp_bt * mask_bt, axis=1) / jnp.maximum(tokens_b, 1.0)
    return jnp.sum(nll_b), jnp.sum((tokens_b > 0).astype(jnp.float32))


def microbatch_loss(
    params: nnx.State,
    graphdef: nnx.GraphDef,
    batch: TrainBatch,
    role_share_r: Array,
    config: TrainConfig,
    loss_share_r: Array | None = None,
    mesh: Mesh | None = None,
    supervised_rows: Array | float = 1.0,
) -> tuple[Array, tuple[Metrics, Metrics]]:
    """Loss of one microbatch as in the module docstring, plus (weighted, token) metrics.

    ``role_share_r``: n^r_m / n^r (weights the role's metrics into a role average);
    ``loss_share_r``: the role loss's weight in the total, ``role_share_r`` when None
    (per-role aggregation) or n^r_m / N (pooled); ``supervised_rows``: the step's
    supervised rows with a target token (the PPO-ptx term's mean is over the step)."""
    loss_share_r = role_share_r if loss_share_r is None else loss_share_r
    compute = COMPUTE_DTYPES[config.compute_dtype]
    model = nnx.merge(graphdef, jax.tree.map(lambda p: p.astype(compute), params))
    logp_bt, entropy_bt, router_logits = policy_logprobs(
        model, batch, config.router_replay, config.logit_chunk, _row_temperatures(config, batch),
        mesh,
    )
    total = jnp.zeros((), jnp.float32)
    weighted: Metrics = {}
    token_stats: Metrics = {}
    for role_id, (name, role) in enumerate(zip(ROLES, config.roles, strict=True)):
        loss, rule_metrics, stats = role_loss(role, role_id, batch, logp_bt, entropy_bt)
        share = role_share_r[role_id]
        total = total + role.weight * loss_share_r[role_id] * loss
        for key, value in rule_metrics.items():  # weighted by share: sums to a role average
            weighted[f"{name}/{key}"] = jnp.where(share > 0, value, 0.0) * share
        for key, value in stats.items():
            token_stats[f"{name}/{key}"] = value
    if config.supervised_coef > 0:
        nll_sum, rows = supervised_nll(batch, logp_bt)
        total = total + config.supervised_coef * nll_sum / jnp.maximum(supervised_rows, 1.0)
        token_stats[f"{SUPERVISED}/nll_sum"] = nll_sum
        token_stats[f"{SUPERVISED}/rows"] = rows
    if config.aux_loss_coef > 0:
        k = model.config.num_experts_per_tok
        aux = load_balancing_loss(router_logits, k, batch.attention_mask)
        total = total + config.aux_loss_coef * aux / config.microbatches
        token_stats["aux_loss_sum"] = aux
    return total, (weighted, token_stats)


# ---- the step ---------------------------------------------------------------------------


def _split_microbatches(batch: TrainBatch, microbatches: int) -> TrainBatch:
    """[B, ...] -> [M, B / M, ...] with microbatch m = rows m, m + M, ... (strided, so each
    data-parallel shard of the batch contributes equally to every microbatch)."""

    def split(x):
        rows = x.shape[0] // microbatches
        x = x.reshape(rows, microbatches, *x.shape[1:]).swapaxes(0, 1)
        return sharding.constrain(x, (None, "batch") + (None,) * (x.ndim - 2))

    return jax.tree.map(split, batch)


# Public for the replay telemetry (rl.replay_stats), which splits and scores as the step does.
row_temperatures, split_microbatches = _row_temperatures, _split_microbatches


def _scored_rows_per_role(batch_m: TrainBatch) -> Array:
    """[M, R]: sequences of each role with at least one policy token, per microbatch."""
    scored_mb = (jnp.sum(batch_m.loss_mask, axis=-1) > 0).astype(jnp.float32)
    role_mbr = jax.nn.one_hot(batch_m.role_id, len(ROLES), dtype=jnp.float32)
    return jnp.sum(scored_mb[..., None] * role_mbr, axis=1)


def _reduce_token_stats(stats_m: Metrics) -> Metrics:
    out: Metrics = {}
    for key, value in stats_m.items():
        if key.endswith("_max"):
            out[key] = jnp.max(value)
        elif key == "aux_loss_sum":
            out["aux_loss"] = jnp.mean(value)
    if f"{SUPERVISED}/rows" in stats_m:
        rows = jnp.sum(stats_m[f"{SUPERVISED}/rows"])
        out[f"{SUPERVISED}/sequences"] = rows
        out[f"{SUPERVISED}/nll"] = (jnp.sum(stats_m[f"{SUPERVISED}/nll_sum"])
                                    / jnp.maximum(rows, 1.0))
    for name in ROLES:
        tokens = jnp.sum(stats_m[f"{name}/tokens"])
        out[f"{name}/tokens"] = tokens
        out[f"{name}/logp_gap_mean"] = jnp.sum(stats_m[f"{name}/logp_gap_sum"]) / jnp.maximum(
            tokens, 1.0
        )
        out[f"{name}/entropy"] = jnp.sum(stats_m[f"{name}/entropy_sum"]) / jnp.maximum(tokens, 1.0)
    return out


def train_step(
    state: TrainState, batch: TrainBatch, *, graphdef: nnx.GraphDef, config: TrainConfig,
    mesh: Mesh | None = None,
) -> tuple[TrainState, Metrics]:
    """One update on ``batch`` (pure; jit it with ``donate_argnums=0``). With ``mesh`` the
    new state is pinned to the parameters' logical shardings and the model's MoE dispatch
    runs over it (call inside ``sharding.activate(mesh, rules)`` for the rules)."""
    optimizer = make_optimizer(config.optimizer)
    batch_m = _split_microbatches(batch, config.microbatches)
    scored_mr = _scored_rows_per_role(batch_m)
    share_mr = scored_mr / jnp.maximum(jnp.sum(scored_mr, axis=0, keepdims=True), 1.0)
    loss_share_mr = share_mr
    if config.loss_aggregation == "pooled":
        denominator = jnp.maximum(jnp.sum(scored_mr), max(config.pooled_min_denominator, 1))
        loss_share_mr = scored_mr / denominator
    grad_fn = jax.value_and_grad(microbatch_loss, has_aux=True)
    supervised_rows = (supervised_nll(batch, jnp.zeros(batch.loss_mask.shape))[1]
                       if config.supervised_coef > 0 else 1.0)

    def accumulate(grads_acc, inputs):
        microbatch, share_r, loss_share_r = inputs
        (loss, metrics), grads = grad_fn(state.params, graphdef, microbatch, share_r, config,
                                         loss_share_r, mesh, supervised_rows)
        grads_acc = jax.tree.map(lambda a, g: a + g.astype(a.dtype), grads_acc, grads)
        return grads_acc, (loss, metrics)

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
    grads, (loss_m, (weighted_m, stats_m)) = jax.lax.scan(
        accumulate, zeros, (batch_m, share_mr, loss_share_mr))
    loss = jnp.sum(loss_m)
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    new_state = TrainState(state.step + 1, params, opt_state, jax.random.split(state.rng)[0])
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    if config.skip_nonfinite:
        new_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_state, state)
    new_state = sharding.constrain_tree(new_state, mesh)

    metrics: Metrics = {key: jnp.sum(value) for key, value in weighted_m.items()}
    metrics.update(_reduce_token_stats(stats_m))
    skipped = jnp.logical_not(finite) if config.skip_nonfinite else jnp.zeros((), bool)
    metrics.update(
        loss=loss,
        grad_norm=grad_norm,
        update_norm=jnp.where(skipped, 0.0, optax.tree.norm(updates)),
        param_norm=optax.tree.norm(new_state.params),
        learning_rate=learning_rate_schedule(config.optimizer)(state.step),
        skipped=skipped.astype(jnp.int32),
    )
    for role_id, name in enumerate(ROLES):
        metrics[f"{name}/sequences"] = jnp.sum(scored_mr[:, role_id])
    return new_state, metrics


# ---- set-up: state, sharding, the jitted callable ----------------------------------------


def init_train_state(
    model: Qwen3,
    config: TrainConfig,
    *,
    seed: int = 0,
    mesh: Mesh | None = None,
    rules: sharding.Rules = sharding.DEFAULT_RULES,
) -> tuple[nnx.GraphDef, TrainState]:
    """Splits ``model`` into (graphdef, TrainState): params cast to the master dtype, fresh
    optimizer state, step 0; placed on ``mesh`` by the parameters' logical axes if given."""
    if model.options.dtype != config.compute_dtype:
        raise ValueError(
            f"the model runs in {model.options.dtype!r} (ModelOptions.dtype) but "
            f"TrainConfig.compute_dtype is {config.compute_dtype!r}; make them equal"
        )
    if config.router_replay and not model.config.is_moe:
        raise ValueError("router_replay=True needs an MoE model; this config has no MoE layer")
    graphdef, params = nnx.split(model)
    master = MASTER_DTYPES[config.optimizer.master_dtype]
    params = jax.tree.map(lambda p: p.astype(master), params)
    optimizer = make_optimizer(config.optimizer)

    def fresh(params):
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=optimizer.init(params),
            rng=jax.random.PRNGKey(seed),  # raw uint32[2]: checkpoints as a plain array
        )

    if mesh is None:
        # Committed to the default device: a freshly initialised model's arrays are
        # uncommitted, and so is a jitted function's output when all its inputs are. A
        # warm start or a checkpoint then swaps committed params in beside uncommitted
        # optimizer state, and the train step's second call, on its own committed outputs,
        # compiled the step a second time (~16 s of toy:check's first rounds).
        return graphdef, jax.jit(fresh, out_shardings=SingleDeviceSharding(
            jax.local_devices()[0]))(params)
    abstract = jax.eval_shape(fresh, params)
    shardings = sharding.tree_shardings(abstract, mesh, rules)
    params = jax.device_put(params, sharding.tree_shardings(params, mesh, rules))
    return graphdef, jax.jit(fresh, out_shardings=shardings)(params)


class TrainStep:
    """``train_step`` jitted with the state donated; validates batch shapes on the host and
    activates ``mesh`` (for the model's activation constraints) around each call."""

    def __init__(
        self,
        graphdef: nnx.GraphDef,
        config: TrainConfig,
        mesh: Mesh | None = None,
        rules: sharding.Rules = sharding.DEFAULT_RULES,
    ) -> None:
        self.config, self.mesh, self.rules = config, mesh, rules
        self.jitted = jax.jit(
            functools.partial(train_step, graphdef=graphdef, config=config, mesh=mesh),
            donate_argnums=0,
        )

    def _context(self):
        return sharding.activate(self.mesh, self.rules) if self.mesh else contextlib.nullcontext()

    def check(self, batch: TrainBatch) -> None:
        batch.validate()
        if batch.shape[0] % self.config.microbatches:
            raise ValueError(
                f"batch of {batch.shape[0]} rows is not divisible into "
                f"{self.config.microbatches} microbatches"
            )
        if self.config.router_replay and batch.routing_replay is None:
            raise ValueError("router_replay=True but the batch has no routing_replay")

    def __call__(self, state: TrainState, batch: TrainBatch) -> tuple[TrainState, Metrics]:
        self.check(batch)
        with self._context():
            return self.jitted(state, batch)

    def lower(self, state: TrainState, batch: TrainBatch) -> jax.stages.Lowered:
        """The lowered step (for cost analysis / HLO inspection). ``state`` and ``batch`` may
        be abstract (``jax.ShapeDtypeStruct`` leaves carrying their shardings): the AOT
        planner compiles the step this way without allocating anything."""
        self.check(batch)
        with self._context():
            return self.jitted.lower(state, batch)


def needs_reference(config: TrainConfig) -> bool:
    """Whether a role's rule has a KL term to the reference policy (``kl_coef > 0``)."""
    return any(getattr(role.loss, "kl_coef", 0.0) > 0 for role in config.roles)


def reference_logprobs(
    params: nnx.State, batch: TrainBatch, *, graphdef: nnx.GraphDef, config: TrainConfig,
    mesh: Mesh | None = None,
) -> Array:
    """[B, T] log-probs of the batch's tokens under ``params`` (pure; no gradient), computed
    microbatch by microbatch as the step computes its own, at the rows' temperatures."""
    compute = COMPUTE_DTYPES[config.compute_dtype]
    model = nnx.merge(graphdef, jax.tree.map(lambda p: p.astype(compute), params))

    def one(microbatch: TrainBatch) -> Array:
        temperature = _row_temperatures(config, microbatch)
        logp_bt, _, _ = policy_logprobs(model, microbatch, config.router_replay,
                                        config.logit_chunk, temperature, mesh)
        return logp_bt

    logp_mbt = jax.lax.map(one, _split_microbatches(batch, config.microbatches))
    return logp_mbt.swapaxes(0, 1).reshape(batch.shape)  # row r*M + m <- [m, r]


class ReferencePolicy:
    """The KL reference: a frozen copy of the initial policy (the recipe's ``--ref-load`` of
    the starting checkpoint), stored in the compute dtype; ``annotate(batch)`` fills
    ``batch.ref_logp``. Copied, not aliased: the train step donates the live parameters."""

    def __init__(
        self,
        graphdef: nnx.GraphDef,
        config: TrainConfig,
        params: nnx.State,
        mesh: Mesh | None = None,
        rules: sharding.Rules = sharding.DEFAULT_RULES,
    ) -> None:
        compute = COMPUTE_DTYPES[config.compute_dtype]
        self.params = jax.tree.map(lambda p: jnp.array(p, dtype=compute, copy=True), params)
        self.mesh, self.rules = mesh, rules
        self.jitted = jax.jit(
            functools.partial(reference_logprobs, graphdef=graphdef, config=config, mesh=mesh))

    def annotate(self, batch: TrainBatch) -> TrainBatch:
        context = (sharding.activate(self.mesh, self.rules) if self.mesh
                   else contextlib.nullcontext())
        with context:
            ref_logp = self.jitted(self.params, batch)
        # 0 off the mask, like old_logp; the rules mask ref_logp - logp before the
        # exponential (terms.k3_kl), so a prompt token at logp -100 cannot overflow.
        return batch.replace(ref_logp=ref_logp * jnp.asarray(batch.loss_mask, jnp.float32))


def make_train_step(
    graphdef: nnx.GraphDef,
    config: TrainConfig,
    mesh: Mesh | None = None,
    rules: sharding.Rules = sharding.DEFAULT_RULES,
) -> TrainStep:
    """The jitted ``(state, batch) -> (state, metrics)`` for ``graphdef`` under ``config``."""
    return TrainStep(graphdef, config, mesh, rules)
