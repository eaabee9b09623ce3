"""CRR (counterfactual step credit from forked environment state; from the feed: CRR,
"the return difference of continuations run to the end, executed for real in a forkable
sandbox"). SPADE environments are programs with a deterministic (seed, actions) replay, so
the state before any turn can be forked and played on.

For a chosen turn k of episode i, with s_k the state before it and a_k the action taken::

    G^act_ik  = sum_{s >= k} r_is           (the episode's own return-to-go), or with
                paired=True the mean return of M forks that replay a_k, then the policy
    G^alt_ik  = mean_{m < M} G(fork from s_k: play a'_m, then the policy to the end)
                a'_m = the policy's fresh sample (alternative=None: then G^alt estimates
                V(s_k) and the credit estimates the advantage Q(s_k, a_k) - V(s_k)),
                or a fixed alternative action
    c_ik      = clip(G^act_ik - G^alt_ik, -clip, clip)
    A_it      = A_i + scale * c_{i, step(t)}   on the chosen turns' tokens, A_i elsewhere

Variance controls: ``forks`` (M, the baseline's average; Var ~ 1/M), ``paired`` (the
actual action's continuation averaged too, removing the realized episode's own noise),
``clip``, ``scale``. Budget per update: at most ``turns_per_episode`` turns of an episode
("first" turns or "random" ones, seeded) and ``max_forks`` forks in all, episodes taken in
a seeded random order. Costs (forks, turns and tokens played, seconds) are logged. The
forks come from the caller's :class:`spade_jax.rl.episodes.RolloutService`.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from spade_jax.rl.episodes import EpisodeBatch, Fork, StepContext, step_to_token_advantages
from spade_jax.rl.registry import Metrics, step_credits

TURN_CHOICES = ("first", "random")


@dataclasses.dataclass(frozen=True)
class CRRConfig:
    """Settings of counterfactual step credit (see the module docstring for each symbol).

    Attributes:
      forks: M continuations per chosen turn and arm (>= 1).
      turns_per_episode: turns of one episode that get counterfactual credit at most.
      turn_choice: "first" (turns 0, 1, ...) or "random" (a seeded draw).
      max_forks: forks per update in all (the budget; forks = turns x M x arms).
      alternative: None (the policy resamples the turn) or a fixed action to play instead.
      paired: estimate the actual action's return with M forks too (2 arms per turn).
      scale: weight of the counterfactual credit added to the outcome advantage.
      clip: bound on |c| (> 0).
    """

    forks: int = 2
    turns_per_episode: int = 2
    turn_choice: str = "first"
    max_forks: int = 64
    alternative: str | None = None
    paired: bool = False
    scale: float = 1.0
    clip: float = 1.0

    def __post_init__(self) -> None:
        for name in ("forks", "turns_per_episode", "max_forks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.turn_choice not in TURN_CHOICES:
            raise ValueError(f"turn_choice must be one of {TURN_CHOICES}, got "
                             f"{self.turn_choice!r}")
        if not self.clip > 0:
            raise ValueError(f"clip must be > 0, got {self.clip}")


def chosen_turns(num_turns: int, cfg: CRRConfig, rng: np.random.Generator) -> list[int]:
    """Which turns of an episode with ``num_turns`` stepped turns get forked."""
    count = min(num_turns, cfg.turns_per_episode)
    if cfg.turn_choice == "first":
        return list(range(count))
    return sorted(int(k) for k in rng.choice(num_turns, size=count, replace=False))


def plan_forks(episodes: EpisodeBatch, cfg: CRRConfig, context: StepContext):
    """[(episode index, turn)] within the budget, and the forks to run for them."""
    arms = 2 if cfg.paired else 1
    order = context.rng(0).permutation(len(episodes.episodes))
    plan, forks = [], []
    for i in order:
        episode = episodes.episodes[int(i)]
        for k in chosen_turns(len(episode.step_rewards), cfg, context.rng(1, int(i))):
            if len(forks) + arms * cfg.forks > cfg.max_forks:
                return plan, forks
            plan.append((int(i), k))
            for m in range(cfg.forks):
                forks.append(Fork(episode, k, cfg.alternative, context.seed(2, int(i), k, m)))
                if cfg.paired:
                    forks.append(Fork(episode, k, episode.actions[k],
                                      context.seed(3, int(i), k, m)))
    return plan, forks


@step_credits.register("crr", config=CRRConfig)
def counterfactual_credit(
    episodes: EpisodeBatch, outcome_advantages: np.ndarray, cfg: CRRConfig,
    context: StepContext,
) -> tuple[np.ndarray, Metrics]:
    """Outcome advantage plus the clipped return difference of forked continuations."""
    rollouts = context.require_rollouts("crr")
    plan, forks = plan_forks(episodes, cfg, context)
    start = time.perf_counter()
    results = rollouts.continue_forks(forks) if forks else []
    seconds = time.perf_counter() - start
    if len(results) != len(forks):
        raise ValueError(f"the rollout service returned {len(results)} results for "
                         f"{len(forks)} forks")
    arms = 2 if cfg.paired else 1
    returns = np.array([r.return_to_go for r in results], np.float64).reshape(
        len(plan), cfg.forks, arms) if plan else np.zeros((0, cfg.forks, arms))
    credit_bs = np.zeros_like(episodes.step_rewards_bs)
    for (i, k), returns_ma in zip(plan, returns, strict=True):
        actual = (returns_ma[:, 1].mean() if cfg.paired
                  else float(np.sum(episodes.episodes[i].step_rewards[k:])))
        credit_bs[i, k] = np.clip(actual - returns_ma[:, 0].mean(), -cfg.clip, cfg.clip)
    outcome_bt = np.asarray(outcome_advantages, np.float64)[:, None]
    credit_bt = step_to_token_advantages(cfg.scale * credit_bs, episodes.token_step_bt)
    advantages_bt = np.where(episodes.token_step_bt >= 0, outcome_bt + credit_bt, 0.0)
    chosen = np.array([credit_bs[i, k] for i, k in plan]) if plan else np.zeros(1)
    return advantages_bt, {
        "forks": float(len(forks)),
        "fork_turns": float(sum(r.turns for r in results)),
        "fork_tokens": float(sum(r.tokens_generated for r in results)),
        "fork_seconds": seconds,
        "credited_turns": float(len(plan)),
        "credit_mean": float(np.mean(chosen)),
        "credit_abs_mean": float(np.mean(np.abs(chosen))),
    }
