"""Update rules for the RL trainer: registries plus the built-in rules.

Importing this package registers every built-in rule (see :mod:`spade_jax.rl.rules`). A
role's whole rule is one :class:`spade_jax.rl.update_rule.RoleConfig`."""

from spade_jax.rl import rules as _rules  # noqa: F401  (import registers the built-ins)
from spade_jax.rl.registry import (
    advantage_estimators,
    group_filters,
    importance_corrections,
    load_rule_modules,
    policy_losses,
    step_credits,
    token_weightings,
)

__all__ = [
    "advantage_estimators",
    "group_filters",
    "importance_corrections",
    "load_rule_modules",
    "policy_losses",
    "step_credits",
    "token_weightings",
]
