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
    group_filter / filter            which groups train (DAPO dynamic sampling; with
                                     max_refill_rounds, dropped groups are replaced)
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
import time
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from spade_jax import seeding
from spade_jax.rl import registry
from spade_jax.rl import rules as _rules  # noqa: F401  (import registers the built-ins)
from spade_jax.rl.batch import TrainSequence
from spade_jax.rl.episodes import EpisodeBatch, GroupRequest, StepContext, episode_batch

# (name field, config field, registry) of every part, in the order the parts act.
PARTS: tuple[tuple[str, str, registry.Registry], ...] = (
    ("group_filter", "filter", registry.group_filters),
    ("advantage_estimator", "advantage", registry.advantage_estimators),
    ("step_credit", "credit", registry.step_credits),
    ("token_weighting", "weighting", registry.token_weightings),
    ("importance_correction", "importance", registry.importance_corrections),
    ("policy_loss", "loss", registry.policy_losses),
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
      token_weighting, weighting: "none", "eapo" or "high_entropy".
      importance_correction, importance: "none" (the ratio against the sampler's
        log-probs), "tis" (truncated importance sampling, the recipe with clamp 2.0),
        "gmc" (GMC-GRPO group-wise shrinkage of the ratios).
      policy_loss, loss: "grpo", "dr_grpo", "dapo", "gspo", "cispo", ...
      weight: w_r, this role's weight in the summed loss (0 trains the role not at all).
      temperature: the temperature this role sampled at: log-probs are of
        softmax(logits / T_role), the sampler's distribution. A run sets it from the role's
        sampler (one place for the setting: the sampler config); None called directly
        means 1.0.

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
            config = rule.resolve_config(getattr(self, config_field), field=config_field)
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
    """Training sequences of one role, the host-side parts' metrics (prefixed by part), the
    replacement groups a refilling filter had played (``refill_groups``, indices
    ``len(groups)`` on) and the indices of the groups the filter dropped, into ``groups``
    followed by ``refill_groups``."""

    sequences: list[TrainSequence]
    metrics: dict[str, float]
    dropped_groups: list[int]
    refill_groups: list[Group] = dataclasses.field(default_factory=list)


def _prefixed(prefix: str, metrics: dict[str, Any]) -> dict[str, float]:
    return {f"{prefix}/{k}": float(np.asarray(v)) for k, v in metrics.items()}


def _accumulate(sums: dict[str, float], metrics: dict[str, float]) -> None:
    for key, value in metrics.items():
        sums[key] = sums.get(key, 0.0) + value


def _policy_tokens(episodes: Sequence[Any], length: int) -> np.ndarray:
    mask = np.zeros((len(episodes), length), bool)
    for i, ep in enumerate(episodes):
        mask[i, : len(ep.loss_mask)] = np.asarray(ep.loss_mask, bool)
    return mask


def _filter(role: RoleConfig, groups: Sequence[Group]) -> tuple[list[bool], dict[str, float]]:
    """The group filter on each group: (keep flags, the filter's metrics summed over groups)."""
    keep_fn, keep_cfg = role.part("group_filter")
    keep, sums = [], {}
    for group in groups:
        keep_1, metrics = keep_fn(group.reward_values()[None, :].astype(np.float32), keep_cfg)
        _accumulate(sums, _prefixed("group_filter", metrics))
        keep.append(bool(np.asarray(keep_1)[0]))
    return keep, sums


def _refill_requests(cfg: Any, groups: Sequence[Group], last_dropped: Sequence[Group],
                     missing: int, round_index: int, context: StepContext
                     ) -> list[GroupRequest]:
    """The replacement groups of one refill round: new plays of the dropped groups' own
    environments ("dropped"), or of the step's environments in a seeded order ("all")."""
    if getattr(cfg, "refill_from", "dropped") == "all":
        order = seeding.rng(context.refill_seed(round_index, 0, 1)).permutation(len(groups))
        templates = [groups[int(order[j % len(groups)])] for j in range(missing)]
    else:
        templates = list(last_dropped)
    return [GroupRequest(group.episodes[0].env_id,
                         tuple(context.refill_seed(round_index, 1 + j, play)
                               for play in range(len(group.episodes))))
            for j, group in enumerate(templates)]


def _refill(role: RoleConfig, groups: Sequence[Group], keep: Sequence[bool],
            context: StepContext) -> tuple[list[Group], list[bool], dict, dict[str, float]]:
    """DAPO's dynamic sampling: while fewer groups than were sampled pass the filter and
    the filter's ``max_refill_rounds`` allows, ask the rollout side for replacement groups
    (:meth:`RolloutService.play_groups`) and filter them too. Returns the replacement
    groups, their keep flags, the filter's metrics summed over them, and the refill's
    counts and costs."""
    _, cfg = role.part("group_filter")
    budget = int(getattr(cfg, "max_refill_rounds", 0))
    missing = list(keep).count(False)
    if budget <= 0 or missing == 0:
        return [], [], {}, {}
    service = context.require_rollouts(role.group_filter, "group filter (refill)")
    last_dropped = [g for g, k in zip(groups, keep, strict=True) if not k]
    refills, refill_keep, filter_sums, rounds, unplayed = [], [], {}, 0, 0
    start = time.perf_counter()
    while missing and rounds < budget:
        requests = _refill_requests(cfg, groups, last_dropped, missing, rounds, context)
        if not requests:  # "dropped": every slot left is one the service could not play
            break
        played = service.play_groups(requests, seed=context.refill_seed(rounds))
        if len(played) != len(requests):
            raise ValueError(f"the rollout service returned {len(played)} groups for "
                             f"{len(requests)} refill requests")
        new = [Group(episodes) for episodes in played if episodes]  # [] = could not play
        unplayed += len(played) - len(new)
        new_keep, sums = _filter(role, new)
        _accumulate(filter_sums, sums)
        last_dropped = [g for g, k in zip(new, new_keep, strict=True) if not k]
        refills, refill_keep = refills + new, refill_keep + new_keep
        missing, rounds = missing - sum(new_keep), rounds + 1
    episodes = [ep for group in refills for ep in group.episodes]
    return refills, refill_keep, filter_sums, {
        "group_filter/refill_rounds": float(rounds),
        "group_filter/refill_groups": float(len(refills)),
        "group_filter/refill_kept_groups": float(sum(refill_keep)),
        "group_filter/refill_missing_groups": float(missing),
        "group_filter/refill_unplayed_groups": float(unplayed),
        "group_filter/refill_episodes": float(len(episodes)),
        "group_filter/refill_turns": float(sum(len(ep.turn_spans) for ep in episodes)),
        "group_filter/refill_tokens": float(sum(sum(ep.loss_mask) for ep in episodes)),
        "group_filter/refill_seconds": time.perf_counter() - start,
    }


def _group_advantages(role: RoleConfig, groups: Sequence[Group], context: StepContext):
    """Filter (and refill) then estimate per group: (the groups, replacement groups
    appended; kept group indices; advantages per kept group; metrics: the filter's and
    the estimator's averaged over the groups they saw, the refill's counts)."""
    keep, filter_sums = _filter(role, groups)
    refills, refill_keep, refill_sums, refill_metrics = _refill(role, groups, keep, context)
    _accumulate(filter_sums, refill_sums)
    groups, keep = list(groups) + refills, keep + refill_keep
    estimate_fn, estimate_cfg = role.part("advantage_estimator")
    kept = [g for g, k in enumerate(keep) if k]
    advantages, adv_sums = [], {}
    for g in kept:
        rewards_n = groups[g].reward_values()
        adv_n, adv_metrics = estimate_fn(rewards_n.astype(np.float32), len(rewards_n),
                                         estimate_cfg)
        _accumulate(adv_sums, _prefixed("advantage", adv_metrics))
        advantages.append(np.asarray(adv_n, np.float64))
    # The filter's and estimator's metrics averaged over every group filtered.
    metrics = {k: v / max(len(groups), 1) for k, v in {**filter_sums, **adv_sums}.items()}
    metrics.update(refill_metrics)
    metrics["group_filter/kept_groups"] = float(len(kept))
    metrics["group_filter/dropped_groups"] = float(len(groups) - len(kept))
    return groups, kept, advantages, metrics


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
    gives per-token ones) and its group index (for group-wise importance corrections).
    A filter whose config sets ``max_refill_rounds`` has dropped groups replaced by new
    plays from ``context.rollouts`` (see :func:`_refill`)."""
    context = context or StepContext(role=role_name)
    sampled = len(groups)
    groups, kept, advantages, metrics = _group_advantages(role, groups, context)
    refills = groups[sampled:]
    dropped = sorted(set(range(len(groups))) - set(kept))
    episodes = [ep for g in kept for ep in groups[g].episodes]
    if not episodes:
        return RuleOutput([], metrics, dropped, refills)
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
                                       role_name, group=g, routing=ep.routing))
    return RuleOutput(sequences, metrics, dropped, refills)
