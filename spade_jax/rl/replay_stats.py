"""Routing-mismatch telemetry for router replay: how far the trainer's own routing is
from the routing the sampler recorded, and what replay changes in the log-probs and the
importance ratio. One extra pair of forward passes (with and without replay, no
gradient) per step, microbatch by microbatch as the step runs, at the weights the step
differentiates.

Per role (``replay/<role>/...``):
  flip_rate        share of (token, MoE layer) decisions where the trainer's top-k expert
                   set, on the replayed forward (same inputs as the sampler had), differs
                   from the recorded one: the per-decision disagreement;
  flip_rate_free   the same against the trainer's free-running forward (no replay), where
                   a flip in one layer changes every later layer's input;
  logp_gap_replay / logp_gap_free   mean |trainer - sampler| log-prob over policy tokens
                   with and without replay (``..._max``: the largest);
  tis_clip_replay / tis_clip_free   share of policy tokens whose ratio pi_trainer /
                   pi_sampler is outside [0, C] (TIS would clip them; C = the role's
                   TIS clamp, or 2.0, the recipe's, when TIS is off);
  ratio_dev_replay / ratio_dev_free mean |ratio - 1| over policy tokens.
Decisions are counted on real tokens that feed a next token (the last token of a
sequence is never fed back, so it has no recorded route).
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from spade_jax import sharding
from spade_jax.rl.batch import ROLES, TrainBatch
from spade_jax.rl.terms import truncated_importance_weights
from spade_jax.rl.train_step import (
    COMPUTE_DTYPES,
    TrainConfig,
    policy_logprobs,
    row_temperatures,
    split_microbatches,
)

DEFAULT_TELEMETRY_CLAMP = 2.0  # the recipe's TIS C, used when a role's TIS is off

Array = jax.Array


def _flips(router_logits: list, replay: tuple, k: int, fed_bt: Array) -> tuple[Array, Array]:
    """[B] flipped decisions and [B] decisions: (token, layer) pairs whose top-k expert set
    differs from the recording, over MoE layers and fed tokens."""
    flips_b = jnp.zeros(fed_bt.shape[0], jnp.float32)
    layers = 0
    for logits_btE, recorded_btX in zip(router_logits, replay, strict=True):
        if logits_btE is None or recorded_btX is None:
            continue
        _, own_btX = jax.lax.top_k(logits_btE, k)
        differs_bt = jnp.any(jnp.sort(own_btX, -1) != jnp.sort(recorded_btX.astype(jnp.int32),
                                                               -1), axis=-1)
        flips_b = flips_b + jnp.sum(differs_bt * fed_bt, axis=1)
        layers += 1
    return flips_b, jnp.sum(fed_bt, axis=1) * layers


def telemetry_clamp(role) -> float:
    """The role's TIS clamp C when its importance correction is "tis", else the recipe's."""
    if role.importance_correction != "tis":
        return DEFAULT_TELEMETRY_CLAMP
    _, cfg = role.part("importance_correction")
    clamp = cfg.get("clamp") if isinstance(cfg, dict) else getattr(cfg, "clamp", None)
    return float(DEFAULT_TELEMETRY_CLAMP if clamp is None else clamp)


def microbatch_sums(params: nnx.State, batch: TrainBatch, *, graphdef: nnx.GraphDef,
                    config: TrainConfig, mesh: Mesh | None = None) -> dict[str, Array]:
    """Per-role sums ([R] each) of one microbatch's telemetry (pure; no gradient)."""
    model = nnx.merge(graphdef, jax.tree.map(
        lambda p: p.astype(COMPUTE_DTYPES[config.compute_dtype]), params))
    temperature = row_temperatures(config, batch)
    role_br = jax.nn.one_hot(batch.role_id, len(ROLES), dtype=jnp.float32)
    mask_bt = batch.loss_mask.astype(jnp.float32)
    real_bt = (jnp.ones_like(mask_bt) if batch.attention_mask is None
               else batch.attention_mask.astype(jnp.float32))
    fed_bt = real_bt * jnp.concatenate([real_bt[:, 1:], jnp.zeros_like(real_bt[:, :1])], 1)
    k = model.config.num_experts_per_tok
    clamp_b = jnp.asarray([telemetry_clamp(r) for r in config.roles],
                          jnp.float32)[batch.role_id]
    sums: dict[str, Array] = {"tokens": mask_bt.sum(1) @ role_br}
    for mode, replay in (("replay", True), ("free", False)):
        logp_bt, _, router_logits = policy_logprobs(model, batch, replay, config.logit_chunk,
                                                    temperature, mesh)
        flips_b, decisions_b = _flips(router_logits, batch.routing_replay, k, fed_bt)
        sums[f"flips_{mode}"], sums["decisions"] = flips_b @ role_br, decisions_b @ role_br
        gap_bt = jnp.abs(logp_bt - batch.old_logp) * mask_bt
        sums[f"gap_{mode}"] = gap_bt.sum(1) @ role_br
        sums[f"gap_max_{mode}"] = jnp.max(gap_bt.max(1)[:, None] * role_br, axis=0)
        tis = truncated_importance_weights(logp_bt, batch.old_logp, 1.0)
        clipped_bt = (tis.ratio > clamp_b[:, None]).astype(jnp.float32) * mask_bt
        sums[f"clip_{mode}"] = clipped_bt.sum(1) @ role_br
        sums[f"ratio_dev_{mode}"] = (jnp.abs(tis.ratio - 1.0) * mask_bt).sum(1) @ role_br
    return sums


def replay_telemetry(params: nnx.State, batch: TrainBatch, *, graphdef: nnx.GraphDef,
                     config: TrainConfig, mesh: Mesh | None = None) -> dict[str, Array]:
    """The per-role telemetry of the module docstring for one batch (pure)."""
    sums_m = jax.lax.map(
        functools.partial(microbatch_sums, params, graphdef=graphdef, config=config, mesh=mesh),
        split_microbatches(batch, config.microbatches))
    total = {key: (v.max(0) if key.startswith("gap_max") else v.sum(0))
             for key, v in sums_m.items()}
    out: dict[str, Array] = {}
    tokens, decisions = jnp.maximum(total["tokens"], 1.0), jnp.maximum(total["decisions"], 1.0)
    for r, name in enumerate(ROLES):
        prefix = f"replay/{name}/"
        out[prefix + "flip_rate"] = total["flips_replay"][r] / decisions[r]
        out[prefix + "flip_rate_free"] = total["flips_free"][r] / decisions[r]
        for mode in ("replay", "free"):
            out[f"{prefix}logp_gap_{mode}"] = total[f"gap_{mode}"][r] / tokens[r]
            out[f"{prefix}logp_gap_max_{mode}"] = total[f"gap_max_{mode}"][r]
            out[f"{prefix}tis_clip_{mode}"] = total[f"clip_{mode}"][r] / tokens[r]
            out[f"{prefix}ratio_dev_{mode}"] = total[f"ratio_dev_{mode}"][r] / tokens[r]
        out[prefix + "tokens"] = total["tokens"][r]
    return out


class ReplayTelemetry:
    """Jitted :func:`replay_telemetry`; ``telemetry(params, batch)`` returns host floats
    (roles without tokens in the batch are left out)."""

    def __init__(self, graphdef: nnx.GraphDef, config: TrainConfig, mesh: Mesh | None = None,
                 rules: sharding.Rules = sharding.DEFAULT_RULES) -> None:
        self.mesh, self.rules = mesh, rules
        self.jitted = jax.jit(functools.partial(replay_telemetry, graphdef=graphdef,
                                                config=config, mesh=mesh))

    def __call__(self, params: nnx.State, batch: TrainBatch) -> dict[str, float]:
        if batch.routing_replay is None:
            raise ValueError("router replay telemetry needs a batch with recorded routing")
        context = (sharding.activate(self.mesh, self.rules) if self.mesh
                   else contextlib.nullcontext())
        with context:
            values = jax.device_get(self.jitted(params, batch))
        out = {}
        for name in ROLES:
            if values[f"replay/{name}/tokens"] > 0:
                out.update({k: float(v) for k, v in values.items()
                            if k.startswith(f"replay/{name}/") and not k.endswith("/tokens")})
        return out
