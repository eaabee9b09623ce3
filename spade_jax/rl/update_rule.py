"""A role's update rule, in one place: :class:`RoleConfig` names every part, and
:func:`apply_rule` runs the host-side parts on sampled episodes.

    RoleConfig(advantage_estimator="rloo", group_filter="dapo_dynamic_sampling",
               step_credit="crr", credit={"forks": 2}, token_weighting="eapo",
               importance_correction="tis", importance={"clamp": 2.0},
               policy_loss="gspo", loss={"clip_eps_high": 4e-4})

or from the command line, one part at a time with plain values::

    --set train.agent.policy_loss=gspo --set train.agent.loss.clip_eps_high=4e-4

The parts, in the order they act (each a name in its registry, :mod:`spade_jax.rl.registry`,
plus that rule's own small config):

  on the host, per update, over groups of episodes (:func:`apply_rule`)
    group_filter / filter            which groups train (DAPO dynamic sampling)
    advantage_estimator / advantage  outcome rewards of a group -> A_i (GRPO, RLOO, ...)
    step_credit / credit             episodes' steps + A_i -> per-token advantages
                                     (first mistake, Cliff, FAULT, CRR)
  in the jitted train step (:mod:`spade_jax.rl.train_step`)
    token_weighting / weighting      A_it reweighted by token entropy (EAPO)
    importance_correction / importance  the ratio's reference and token weights (TIS, GMC)
    policy_loss / loss               the surrogate (GRPO, GSPO, DAPO, Dr.GRPO, CISPO)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from spade_jax.rl import registry
from spade_jax.rl import rules as _rules  # noqa: F401  (import registers the built-ins)
from spade_jax.rl.batch import TrainSequence
from spade_jax.rl.episodes import EpisodeBatch, StepContext, episode_batch

# (name field, config field, registry) of every part, in the order the parts act.
PARTS: tuple[tuple[str, str, registry.Registry], ...] = (
    ("group_filter", "filter", registry.group_filters),
    ("advantage_estimator", "advantage", registry.advantage_estimators),
    ("step_credit", "credit", registry.step_credits),
    ("token_weighting", "weighting", registry.token_weightings),
    ("importance_correction", "importance", registry.importance_corrections),
    ("policy_loss", "loss", registry.policy_losses),
)


def resolve_config(rule: registry.RegisteredRule, given: Any, field: str) -> Any:
    """None -> the rule's defaults; a dict -> defaults plus overrides; the rule's own config
    dataclass as is. Anything else is a TypeError naming ``field``."""
    if given is None:
        return rule.make_config()
    if isinstance(given, dict):
        return rule.make_config(**given)
    if isinstance(given, rule.config_cls):
        return given
    raise TypeError(
        f"{field} must be None, a dict of overrides or a {rule.config_cls.__name__} (the "
        f"config of rule {rule.name!r}), got {type(given).__name__}"
    )


@dataclasses.dataclass(frozen=True)
class RoleConfig:
    """How one role's samples are trained: its whole update rule (both roles update the
    same weights). Each part is a registered rule's name plus that rule's config (None =
    its defaults, a dict of overrides, or the config dataclass itself).

    Attributes:
      group_filter, filter: which groups of samples train ("keep_all",
        "dapo_dynamic_sampling": drop groups whose rewards all agree).
      advantage_estimator, advantage: a group's outcome rewards -> advantages ("grpo",
        "dr_grpo": mean-centred, the recipe's per-skill centring with skill groups, "rloo").
      step_credit, credit: per-token advantages from the episodes' steps ("none": the
        outcome advantage on every token; "first_mistake", "cliff", "fault", "crr").
      token_weighting, weighting: "none" or "eapo".
      importance_correction, importance: "none" (the ratio against the sampler's
        log-probs), "tis" (truncated importance sampling, the recipe with clamp 2.0),
        "gmc" (GMC-GRPO group-wise shrinkage of the ratios).
      policy_loss, loss: "grpo", "dr_grpo", "dapo", "gspo", "cispo", ...
      weight: w_r, this role's weight in the summed loss (0 trains the role not at all).
      temperature: this role's sampling temperature when it differs from
        ``TrainConfig.temperature`` (None): log-probs are of softmax(logits / T_role).

    Changing a part's name with ``--set`` resets that part's config to the new rule's
    defaults (``OVERRIDE_RESETS``: one rule's settings mean nothing to another); set
    ``train.<role>.<config>.<field>`` after it to change them.
    """

    OVERRIDE_RESETS: ClassVar[dict[str, tuple[str, ...]]] = {
        name: (config,) for name, config, _ in PARTS
    }

    group_filter: str = "keep_all"
    filter: Any = None
    advantage_estimator: str = "grpo"
    advantage: Any = None
    step_credit: str = "none"
    credit: Any = None
    token_weighting: str = "none"
    weighting: Any = None
    importance_correction: str = "none"
    importance: Any = None
    policy_loss: str = "grpo"
    loss: Any = None
    weight: float = 1.0
    temperature: float | None = None

    def __post_init__(self) -> None:
        for name_field, config_field, reg in PARTS:
            rule = reg.get(getattr(self, name_field))
            config = resolve_config(rule, getattr(self, config_field), config_field)
            object.__setattr__(self, config_field, config)
        if not self.weight >= 0:
            raise ValueError(f"role weight must be >= 0, got {self.weight}")
        if self.temperature is not None and not self.temperature > 0:
            raise ValueError(f"role temperature must be > 0 or None, got {self.temperature}")

    def part(self, name_field: str) -> tuple[Any, Any]:
        """(the registered function, its resolved config) of one part, by its name field."""
        for part_name, config_field, reg in PARTS:
            if part_name == name_field:
                return reg.get(getattr(self, part_name)).fn, getattr(self, config_field)
        raise KeyError(f"no rule part {name_field!r}; parts: {[p for p, _, _ in PARTS]}")


# The designer's default rule: mean-centred advantages (with the loop's skill groups and
# reward scale, the recipe's per-skill centring).
DEFAULT_DESIGNER_RULE = RoleConfig(advantage_estimator="dr_grpo")


@dataclasses.dataclass(frozen=True)
class Group:
    """Samples of one prompt / one game that share an advantage baseline.

    episodes: :class:`spade_jax.rl.episodes.Episode`-like records (``EpisodeRecord``; a
      designer sample is a one-turn episode).
    rewards: each sample's outcome reward; None = each episode's ``return_``.
    """

    episodes: Sequence[Any]
    rewards: Sequence[float] | None = None

    def reward_values(self) -> np.ndarray:
        values = [ep.return_ for ep in self.episodes] if self.rewards is None else self.rewards
        if len(values) != len(self.episodes):
            raise ValueError(f"group has {len(self.episodes)} episodes but {len(values)} rewards")
        return np.asarray(values, np.float64)


@dataclasses.dataclass
class RuleOutput:
    """Training sequences of one role, the host-side parts' metrics (prefixed by part), and
    the indices of the groups the filter dropped (the caller may refill them)."""

    sequences: list[TrainSequence]
    metrics: dict[str, float]
    dropped_groups: list[int]


def _prefixed(prefix: str, metrics: dict[str, Any]) -> dict[str, float]:
    return {f"{prefix}/{k}": float(np.asarray(v)) for k, v in metrics.items()}


def _policy_tokens(episodes: Sequence[Any], length: int) -> np.ndarray:
    mask = np.zeros((len(episodes), length), bool)
    for i, ep in enumerate(episodes):
        mask[i, : len(ep.loss_mask)] = np.asarray(ep.loss_mask, bool)
    return mask


def _group_advantages(role: RoleConfig, groups: Sequence[Group]):
    """Filter then estimate per group: (kept group indices, advantages per kept group,
    metrics averaged over groups)."""
    keep_fn, keep_cfg = role.part("group_filter")
    estimate_fn, estimate_cfg = role.part("advantage_estimator")
    kept, advantages, metric_sums = [], [], {}
    for g, group in enumerate(groups):
        rewards_n = group.reward_values()
        keep_1, filter_metrics = keep_fn(rewards_n[None, :].astype(np.float32), keep_cfg)
        for key, value in _prefixed("group_filter", filter_metrics).items():
            metric_sums[key] = metric_sums.get(key, 0.0) + value
        if not bool(np.asarray(keep_1)[0]):
            continue
        adv_n, adv_metrics = estimate_fn(rewards_n.astype(np.float32), len(rewards_n),
                                         estimate_cfg)
        for key, value in _prefixed("advantage", adv_metrics).items():
            metric_sums[key] = metric_sums.get(key, 0.0) + value
        kept.append(g)
        advantages.append(np.asarray(adv_n, np.float64))
    metrics = {k: v / max(len(groups), 1) for k, v in metric_sums.items()}
    metrics["group_filter/kept_groups"] = float(len(kept))
    metrics["group_filter/dropped_groups"] = float(len(groups) - len(kept))
    return kept, advantages, metrics


def apply_rule(
    role: RoleConfig,
    groups: Sequence[Group],
    *,
    role_name: str = "agent",
    context: StepContext | None = None,
    advantage_scale: float = 1.0,
) -> RuleOutput:
    """The host-side parts of ``role``'s rule on ``groups``: filter, advantages (times
    ``advantage_scale``, e.g. the recipe's designer reward scale), step credit. Each kept
    sample becomes a :class:`TrainSequence` with its advantage ([T] when the step credit
    gives per-token ones) and its group index (for group-wise importance corrections)."""
    context = context or StepContext(role=role_name)
    kept, advantages, metrics = _group_advantages(role, groups)
    dropped = sorted(set(range(len(groups))) - set(kept))
    episodes = [ep for g in kept for ep in groups[g].episodes]
    if not episodes:
        return RuleOutput([], metrics, dropped)
    group_b = [g for g in kept for _ in groups[g].episodes]
    rewards_b = np.concatenate([groups[g].reward_values() for g in kept])
    outcome_b = np.concatenate(advantages) * advantage_scale
    batch: EpisodeBatch = episode_batch(episodes, rewards_b, group_b)
    credit_fn, credit_cfg = role.part("step_credit")
    adv, credit_metrics = credit_fn(batch, outcome_b, credit_cfg, context)
    adv = np.asarray(adv, np.float64)
    if adv.ndim == 2:  # policy tokens outside every turn span keep the outcome advantage
        unspanned = (batch.token_step_bt < 0) & _policy_tokens(episodes, adv.shape[1])
        adv = np.where(unspanned, outcome_b[:, None], adv)
    metrics.update(_prefixed("step_credit", credit_metrics))
    sequences = []
    for i, (ep, g) in enumerate(zip(episodes, group_b, strict=True)):
        n = len(ep.token_ids)
        advantage = float(adv[i]) if adv.ndim == 1 else adv[i, :n].astype(np.float32)
        sequences.append(TrainSequence(ep.token_ids, ep.loss_mask, ep.logprobs, advantage,
                                       role_name, group=g))
    return RuleOutput(sequences, metrics, dropped)
