"""Name -> rule registries for the update rule: a dict and a decorator per category.

An update rule is a pure function of arrays plus its own small frozen config dataclass.
Registering it under a name makes it selectable from an experiment file::

    @policy_losses.register("grpo", config=GRPOLossConfig)
    def grpo_loss(logp, old_logp, ref_logp, advantages, loss_mask, cfg): ...

    rule = policy_losses.get("grpo")          # RegisteredRule(fn, config_cls, name)
    cfg = rule.make_config(clip_eps=0.1)      # validated GRPOLossConfig
    loss, metrics = rule.fn(logp, old_logp, ref_logp, adv, mask, cfg)

Categories (one typed Protocol each), in the order a role's rule applies them; the first
three run on the host over the sampled episodes (:mod:`spade_jax.rl.update_rule`), the last
three inside the jitted train step:
  group_filters           grouped rewards [G, N] -> keep-mask [G] (dynamic sampling)
  advantage_estimators    outcome rewards [B] grouped by ``group_size`` -> advantages [B]
  step_credits            episodes' structure + outcome advantages -> per-token advantages
  token_weightings        (advantages, entropy, mask) -> reweighted advantages [B, T]
  importance_corrections  (logp, sampler logp, advantages, mask, groups) -> the ratio's
                          reference and reweighted advantages (TIS, GMC)
  policy_losses           (logp, old_logp, ref_logp, advantages, mask) -> (loss, metrics)

One more category holds the SPADE designer's reward rules, so that every rule of a run is
named and configured the same way:
  designer_rewards        classes, not functions: ``cls(config)`` is a (possibly stateful)
                          rule with ``score(...)``, ``state_dict()``, ``load_state_dict()``;
                          the classes and their protocol live in
                          :mod:`spade_jax.spade.rewards` (``spade`` imports ``rl``, never the
                          reverse, so only the category object lives here)

Every category resolves a rule's config with :meth:`RegisteredRule.resolve_config` (None, a
dict of overrides, the config dataclass, or a base dataclass it extends).

Built-in rules live one per file in :mod:`spade_jax.rl.rules`, which imports every module
it contains; a new rule is one new file there, or any module or ``.py`` file listed in the
experiment's ``rule_modules`` (loaded with :func:`load_rule_modules`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, Protocol, TypeVar

import jax
import numpy as np

if TYPE_CHECKING:
    from spade_jax.rl.episodes import EpisodeBatch, StepContext

Array = jax.Array
Metrics = dict[str, Array]


class AdvantageEstimator(Protocol):
    """``(rewards [B], group_size, cfg) -> (advantages [B], metrics)``.

    ``rewards`` is flat with the ``group_size`` samples of one prompt contiguous, so
    ``rewards.reshape(-1, group_size)`` is ``[G, N]``.
    """

    def __call__(self, rewards: Array, group_size: int, cfg: Any) -> tuple[Array, Metrics]: ...


class StepCredit(Protocol):
    """``(episodes, outcome_advantages [B], cfg, context) -> (advantages [B, T], metrics)``.

    ``episodes`` (:class:`spade_jax.rl.episodes.EpisodeBatch`) carries the episode structure
    as arrays (``step_rewards [B, S]``, ``step_mask [B, S]``, ``token_step [B, T]``: the
    step each token's action belongs to, -1 for tokens the policy did not generate) and the
    records themselves (env ids, seeds, actions, observations). ``context``
    (:class:`spade_jax.rl.episodes.StepContext`) is the one way to ask the rollout side for
    more (forked continuations, policy completions) and carries the seed parts. Runs on the
    host (NumPy); the result is each token's final advantage.
    """

    def __call__(
        self, episodes: EpisodeBatch, outcome_advantages: np.ndarray, cfg: Any,
        context: StepContext,
    ) -> tuple[np.ndarray, Metrics]: ...


class TokenWeighting(Protocol):
    """``(advantages [B] or [B, T], entropy [B, T], loss_mask [B, T], cfg) -> ([B, T], metrics)``."""

    def __call__(
        self, advantages: Array, entropy: Array, loss_mask: Array, cfg: Any
    ) -> tuple[Array, Metrics]: ...


class GroupFilter(Protocol):
    """``(rewards [G, N], cfg) -> (keep [G] bool, metrics)``."""

    def __call__(self, rewards_gn: Array, cfg: Any) -> tuple[Array, Metrics]: ...


class Corrected(NamedTuple):
    """What an importance correction hands the policy loss: the ``[B, T]`` log-probs the
    loss's ratio is taken against, and the ``[B, T]`` advantages it weighs tokens with."""

    old_logp: Array
    advantages: Array


class ImportanceCorrection(Protocol):
    """``(logp, sampler_logp, advantages, loss_mask, group_id, cfg) -> (Corrected, metrics)``.

    ``logp`` (with gradient) and ``sampler_logp`` are ``[B, T]``; ``advantages`` ``[B, T]``;
    ``group_id`` ``[B]`` int (rows of one prompt's group share an id; -1 = a group of its
    own). The loss then sees ``logp - Corrected.old_logp`` as its log-ratio.
    """

    def __call__(
        self, logp: Array, sampler_logp: Array, advantages: Array, loss_mask: Array,
        group_id: Array, cfg: Any,
    ) -> tuple[Corrected, Metrics]: ...


class PolicyLoss(Protocol):
    """``(logp, old_logp, ref_logp, advantages, loss_mask, cfg) -> (scalar loss, metrics)``.

    ``logp``/``old_logp``/``ref_logp``/``loss_mask`` are ``[B, T]``; ``ref_logp`` may be
    None when the rule's KL coefficient is 0; ``advantages`` is ``[B]`` or ``[B, T]``.

    Importance corrections (TIS, GMC) reach every loss through its inputs: ``old_logp`` and
    the advantages are the correction's (:class:`Corrected`).
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


class ConfigTypeError(TypeError, ValueError):
    """A rule's config given as something other than None, a dict or a dataclass it accepts.

    Both a TypeError (the update rules' ``RoleConfig`` always raised one) and a ValueError
    (the designer rewards always raised one, and callers catch bad settings as such), so
    one resolver serves both without changing what either kind of caller catches.
    """


@dataclasses.dataclass(frozen=True)
class RegisteredRule(Generic[F]):
    """A registered rule (a function, or for designer rewards a class) together with the
    config dataclass it expects."""

    name: str
    fn: F
    config_cls: type
    category: str = ""

    def resolve_config(self, given: Any = None, *, field: str | None = None) -> Any:
        """The rule's validated config from what an experiment gave (the one resolver).

        * None -> the config's defaults;
        * a mapping -> the defaults plus those overrides (unknown fields: ValueError
          naming them and the known ones);
        * an instance of the config dataclass -> as is;
        * an instance of a dataclass the config extends (e.g. the paper text's
          ``DesignerRewardConfig`` for ``hint_regret``'s ``HintRegretConfig``) -> upgraded
          field by field, the added fields at their defaults;
        * anything else -> :class:`ConfigTypeError` (``field``, when given, names where the
          value came from).

        The config's own ``__post_init__`` validates the values.
        """
        cls = self.config_cls
        if given is None:
            given = {}
        if isinstance(given, Mapping):
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(given) - known)
            if unknown:
                raise ValueError(
                    f"unknown field(s) {unknown} for {self._label()} ({cls.__name__}); "
                    f"known fields: {sorted(known)}"
                )
            return cls(**given)
        if isinstance(given, cls):
            return given
        if dataclasses.is_dataclass(given) and issubclass(cls, type(given)):
            return cls(**{f.name: getattr(given, f.name) for f in dataclasses.fields(given)})
        where = f"{field}: " if field else ""
        raise ConfigTypeError(
            f"{where}{self._label()} takes None, a dict of overrides or a {cls.__name__} "
            f"(or a dataclass it extends), got {type(given).__name__}"
        )

    def make_config(self, **overrides: Any) -> Any:
        """Builds the rule's config from its defaults plus ``overrides`` (validated)."""
        return self.resolve_config(overrides)

    def _label(self) -> str:
        return f"{self.category} rule {self.name!r}" if self.category else f"rule {self.name!r}"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


class Registry(Generic[F]):
    """A named dict of rules of one category; duplicate names are an error."""

    def __init__(self, category: str) -> None:
        self.category = category
        self._rules: dict[str, RegisteredRule[F]] = {}

    def register(self, name: str, *, config: type) -> Callable[[F], F]:
        """Decorator registering ``fn`` (a function, or a class) under ``name`` with its
        config dataclass. A name already taken is the first error reported."""
        self._check_free(name)
        if not dataclasses.is_dataclass(config):
            raise TypeError(f"config for {self.category} rule {name!r} must be a dataclass")

        def decorator(fn: F) -> F:
            self._check_free(name)
            self._rules[name] = RegisteredRule(
                name=name, fn=fn, config_cls=config, category=self.category
            )
            return fn

        return decorator

    def _check_free(self, name: str) -> None:
        if name in self._rules:
            existing = self._rules[name].fn
            raise ValueError(
                f"{self.category} rule {name!r} is already registered "
                f"(by {existing.__module__}.{existing.__qualname__})"
            )

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
step_credits: Registry[StepCredit] = Registry("step_credits")
token_weightings: Registry[TokenWeighting] = Registry("token_weightings")
importance_corrections: Registry[ImportanceCorrection] = Registry("importance_corrections")
group_filters: Registry[GroupFilter] = Registry("group_filters")
policy_losses: Registry[PolicyLoss] = Registry("policy_losses")
# Designer reward rule classes (spade_jax.spade.rewards registers them; see the module doc).
designer_rewards: Registry[type] = Registry("designer_rewards")


def load_rule_modules(module_names: Iterable[str]) -> None:
    """Imports modules whose import registers rules (e.g. an experiment's own rules): dotted
    module names, or paths of ``.py`` files (a rule file anywhere, outside the package).
    Loading the same module or file again is a no-op."""
    for module_name in module_names:
        if not isinstance(module_name, str):
            raise TypeError(f"rule_modules entries must be module names or .py paths (str), "
                            f"got {module_name!r}")
        if module_name.endswith(".py"):
            _load_rule_file(Path(module_name))
            continue
        try:
            importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            raise ModuleNotFoundError(
                f"rule module {module_name!r} could not be imported: {err}"
            ) from err


def _load_rule_file(path: Path) -> None:
    path = path.resolve()
    if not path.is_file():
        raise FileNotFoundError(f"rule file {str(path)!r} does not exist")
    digest = hashlib.blake2b(str(path).encode(), digest_size=6).hexdigest()
    name = f"spade_rule_file_{path.stem}_{digest}"
    if name in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
