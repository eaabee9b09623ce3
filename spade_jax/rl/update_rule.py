"""The update rule an experiment picks: one registry name (plus overrides) per stage.

An experiment file states the rule by name only; a variant changes names, not code::

    UpdateRuleConfig(policy_loss="gspo", policy_loss_overrides={"clip_eps_high": 5e-4})

Construction checks every name against its registry and builds every stage's own config,
so a typo or an unknown field fails when the experiment is loaded, not mid-run. The pure
functions below chain the stages on arrays; the jitted train step calls them with the
model's log-probabilities and entropies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax

from spade_jax.rl import rules as _rules  # noqa: F401  (import registers the built-ins)
from spade_jax.rl.registry import (
    Metrics,
    advantage_estimators,
    group_filters,
    load_rule_modules,
    policy_losses,
    step_advantage_estimators,
    token_weightings,
)

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class UpdateRuleConfig:
    """Which registered rule runs at each stage, and overrides of its config defaults.

    Attributes:
      advantage_estimator: name in ``advantage_estimators`` (outcome rewards -> A_i).
      token_weighting: name in ``token_weightings`` (A_i, entropy -> A_it).
      group_filter: name in ``group_filters`` (which prompt groups to train on).
      policy_loss: name in ``policy_losses``.
      step_advantage_estimator: optional name in ``step_advantage_estimators``; its
        per-token advantages are added to the outcome advantage (:func:`add_step_advantages`).
      *_overrides: fields of that rule's config dataclass to change from its defaults.
      rule_modules: extra modules to import first, for rules defined outside the package.
    """

    advantage_estimator: str = "grpo"
    token_weighting: str = "none"
    group_filter: str = "keep_all"
    policy_loss: str = "grpo"
    step_advantage_estimator: str | None = None
    advantage_overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    token_weighting_overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    group_filter_overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    policy_loss_overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    step_advantage_overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    rule_modules: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        load_rule_modules(self.rule_modules)
        self.configs()  # unknown names / fields / invalid values fail here

    def configs(self) -> dict[str, Any]:
        """Each stage's validated config dataclass, keyed by stage."""
        step_config = None
        if self.step_advantage_estimator is not None:
            step_config = step_advantage_estimators.get(self.step_advantage_estimator).make_config(
                **self.step_advantage_overrides
            )
        elif self.step_advantage_overrides:
            raise ValueError("step_advantage_overrides given without a step_advantage_estimator")
        return {
            "step_advantage": step_config,
            "advantage": advantage_estimators.get(self.advantage_estimator).make_config(
                **self.advantage_overrides
            ),
            "token_weighting": token_weightings.get(self.token_weighting).make_config(
                **self.token_weighting_overrides
            ),
            "group_filter": group_filters.get(self.group_filter).make_config(
                **self.group_filter_overrides
            ),
            "policy_loss": policy_losses.get(self.policy_loss).make_config(
                **self.policy_loss_overrides
            ),
        }


def _prefixed(prefix: str, metrics: Metrics) -> Metrics:
    return {f"{prefix}/{name}": value for name, value in metrics.items()}


def advantages_and_keep(
    rule: UpdateRuleConfig, rewards: Array, group_size: int
) -> tuple[Array, Array, Metrics]:
    """Outcome advantages ``[B]`` and the group keep-mask expanded to sequences ``[B]``
    (the caller zeroes ``loss_mask`` rows where it is False, or refills the batch)."""
    configs = rule.configs()
    estimator = advantage_estimators.get(rule.advantage_estimator)
    advantages, adv_metrics = estimator.fn(rewards, group_size, configs["advantage"])
    group_filter = group_filters.get(rule.group_filter)
    keep_g, filter_metrics = group_filter.fn(
        rewards.reshape(-1, group_size), configs["group_filter"]
    )
    keep_b = jax.numpy.repeat(keep_g, group_size)
    metrics = {**_prefixed("advantage", adv_metrics), **_prefixed("group_filter", filter_metrics)}
    return advantages, keep_b, metrics


def add_step_advantages(
    rule: UpdateRuleConfig,
    advantages: Array,
    step_rewards: Array,
    step_mask: Array,
    token_step: Array,
) -> tuple[Array, Metrics]:
    """``A_it = A_i + A^step_it`` (``[B, T]``) with the chosen step-level estimator; the
    outcome advantages broadcast unchanged when the rule has none."""
    if rule.step_advantage_estimator is None:
        return jax.numpy.broadcast_to(advantages[:, None], token_step.shape), {}
    estimator = step_advantage_estimators.get(rule.step_advantage_estimator)
    step_adv_bt, metrics = estimator.fn(
        step_rewards, step_mask, token_step, rule.configs()["step_advantage"]
    )
    return advantages[:, None] + step_adv_bt, _prefixed("step_advantage", metrics)


def policy_loss(
    rule: UpdateRuleConfig,
    logp: Array,
    old_logp: Array,
    ref_logp: Array | None,
    advantages: Array,
    entropy: Array,
    loss_mask: Array,
) -> tuple[Array, Metrics]:
    """Token weighting, then the policy loss. ``advantages`` ``[B]`` or ``[B, T]``."""
    configs = rule.configs()
    weighting = token_weightings.get(rule.token_weighting)
    token_adv, weight_metrics = weighting.fn(
        advantages, entropy, loss_mask, configs["token_weighting"]
    )
    loss_fn = policy_losses.get(rule.policy_loss)
    loss, loss_metrics = loss_fn.fn(
        logp, old_logp, ref_logp, token_adv, loss_mask, configs["policy_loss"]
    )
    metrics = {**_prefixed("token_weighting", weight_metrics), **_prefixed("policy_loss", loss_metrics)}
    return loss, metrics
