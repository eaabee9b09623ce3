"""Name -> rule registries for the update rule: a dict and a decorator per category.

An update rule is a pure function of arrays plus its own small frozen config dataclass.
Registering it under a name makes it selectable from an experiment file::

    @policy_losses.register("grpo", config=GRPOLossConfig)
    def grpo_loss(logp, old_logp, ref_logp, advantages, loss_mask, cfg): ...

    rule = policy_losses.get("grpo")          # RegisteredRule(fn, config_cls, name)
    cfg = rule.make_config(clip_eps=0.1)      # validated GRPOLossConfig
    loss, metrics = rule.fn(logp, old_logp, ref_logp, adv, mask, cfg)

Categories (one typed Protocol each):
  advantage_estimators       outcome rewards [B] grouped by ``group_size`` -> advantages [B]
  step_advantage_estimators  per-step env rewards -> per-token advantages [B, T]
  token_weightings           (advantages, entropy, mask) -> reweighted advantages [B, T]
  group_filters              grouped rewards [G, N] -> keep-mask [G] (dynamic sampling)
  policy_losses              (logp, old_logp, ref_logp, advantages, mask) -> (loss, metrics)

Built-in rules live one per file in :mod:`spade_jax.rl.rules`, which imports every module
it contains; a new rule is one new file there (or any module listed in the experiment's
``rule_modules``, loaded with :func:`load_rule_modules`).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Generic, Protocol, TypeVar

import jax

Array = jax.Array
Metrics = dict[str, Array]


class AdvantageEstimator(Protocol):
    """``(rewards [B], group_size, cfg) -> (advantages [B], metrics)``.

    ``rewards`` is flat with the ``group_size`` samples of one prompt contiguous, so
    ``rewards.reshape(-1, group_size)`` is ``[G, N]``.
    """

    def __call__(self, rewards: Array, group_size: int, cfg: Any) -> tuple[Array, Metrics]: ...


class StepAdvantageEstimator(Protocol):
    """``(step_rewards [B, S], step_mask [B, S], token_step [B, T], cfg) -> ([B, T], metrics)``.

    ``token_step[b, t]`` is the index of the environment step that token ``t`` belongs to,
    or -1 for tokens the policy did not generate (prompt, observations, padding).
    """

    def __call__(
        self, step_rewards: Array, step_mask: Array, token_step: Array, cfg: Any
    ) -> tuple[Array, Metrics]: ...


class TokenWeighting(Protocol):
    """``(advantages [B] or [B, T], entropy [B, T], loss_mask [B, T], cfg) -> ([B, T], metrics)``."""

    def __call__(
        self, advantages: Array, entropy: Array, loss_mask: Array, cfg: Any
    ) -> tuple[Array, Metrics]: ...


class GroupFilter(Protocol):
    """``(rewards [G, N], cfg) -> (keep [G] bool, metrics)``."""

    def __call__(self, rewards_gn: Array, cfg: Any) -> tuple[Array, Metrics]: ...


class PolicyLoss(Protocol):
    """``(logp, old_logp, ref_logp, advantages, loss_mask, cfg) -> (scalar loss, metrics)``.

    ``logp``/``old_logp``/``ref_logp``/``loss_mask`` are ``[B, T]``; ``ref_logp`` may be
    None when the rule's KL coefficient is 0; ``advantages`` is ``[B]`` or ``[B, T]``.

    Truncated importance sampling (``RoleConfig.tis_clamp``) reaches every rule through
    its inputs: per-token advantages times ``w >= 0`` and ``old_logp`` = the trainer's own
    log-probs. That equals weighting the token's policy term by ``w`` for any rule whose
    policy term is positively homogeneous in A (every clipped surrogate is).
    """

    def __call__(
        self,
        logp: Array,
        old_logp: Array,
        ref_logp: Array | None,
        advantages: Array,
        loss_mask: Array,
        cfg: Any,
    ) -> tuple[Array, Metrics]: ...


F = TypeVar("F", bound=Callable[..., Any])


@dataclasses.dataclass(frozen=True)
class RegisteredRule(Generic[F]):
    """A registered function together with the config dataclass it expects."""

    name: str
    fn: F
    config_cls: type

    def make_config(self, **overrides: Any) -> Any:
        """Builds the rule's config from its defaults plus ``overrides`` (validated)."""
        known = {f.name for f in dataclasses.fields(self.config_cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(
                f"unknown field(s) {unknown} for rule {self.name!r} "
                f"({self.config_cls.__name__}); known fields: {sorted(known)}"
            )
        return self.config_cls(**overrides)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


class Registry(Generic[F]):
    """A named dict of rules of one category; duplicate names are an error."""

    def __init__(self, category: str) -> None:
        self.category = category
        self._rules: dict[str, RegisteredRule[F]] = {}

    def register(self, name: str, *, config: type) -> Callable[[F], F]:
        """Decorator registering ``fn`` under ``name`` with its config dataclass."""
        if not dataclasses.is_dataclass(config):
            raise TypeError(f"config for {self.category} rule {name!r} must be a dataclass")

        def decorator(fn: F) -> F:
            if name in self._rules:
                existing = self._rules[name].fn
                raise ValueError(
                    f"{self.category} rule {name!r} is already registered "
                    f"(by {existing.__module__}.{existing.__qualname__})"
                )
            self._rules[name] = RegisteredRule(name=name, fn=fn, config_cls=config)
            return fn

        return decorator

    def get(self, name: str) -> RegisteredRule[F]:
        try:
            return self._rules[name]
        except KeyError:
            raise KeyError(
                f"unknown {self.category} rule {name!r}; known: {sorted(self._rules)}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._rules)

    def __contains__(self, name: object) -> bool:
        return name in self._rules

    def items(self) -> Mapping[str, RegisteredRule[F]]:
        return dict(self._rules)


advantage_estimators: Registry[AdvantageEstimator] = Registry("advantage_estimators")
step_advantage_estimators: Registry[StepAdvantageEstimator] = Registry(
    "step_advantage_estimators"
)
token_weightings: Registry[TokenWeighting] = Registry("token_weightings")
group_filters: Registry[GroupFilter] = Registry("group_filters")
policy_losses: Registry[PolicyLoss] = Registry("policy_losses")


def load_rule_modules(module_names: Iterable[str]) -> None:
    """Imports modules whose import registers rules (e.g. an experiment's own rules)."""
    for module_name in module_names:
        try:
            importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            raise ModuleNotFoundError(
                f"rule module {module_name!r} could not be imported: {err}"
            ) from err
