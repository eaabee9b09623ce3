"""Fixed-environment baselines on reasoning-gym tasks (no designer).

  fixed_env_grpo   tasks drawn uniformly from the training tasks every round (plain GRPO).
  fixed_env_rlve   RLVE-style adaptive selection: each task keeps a moving win rate and
                   tasks are drawn in proportion to how close it sits to the learnable band
                   (win rate in [0.2, 0.8]), so training follows the agent's frontier.
                   reasoning-gym exposes difficulty per task through different knobs, so
                   adaptivity here is over *which* task, not a per-task difficulty dial.

Training tasks never overlap the held-out reasoning-gym suites (``evaluation``): by default
they are the reasoning-gym categories no suite uses (``experiment.BaselineSpec``), and an
explicit choice that overlaps a suite is refused with the shared tasks named.

Each episode gets its own environment: a reasoning-gym env holds the question of its last
``reset`` and the episode's best score, and the agent loop resets every episode of a batch
before stepping any, so a shared env would grade every answer against the last question.
The procedural dataset behind the envs (item i = a pure function of (dataset seed, i)) is
built once per task and shared; the per-episode state is each env's own.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import numpy as np

from spade_jax.envs.reasoning_gym_envs import (
    RG_SUITES,
    SUITE_CATEGORIES,
    ReasoningGymEnv,
    make_reasoning_gym_env,
    rg_tasks_by_category,
)
from spade_jax.rollout.agent_loop import EpisodeSpec
from spade_jax.seeding import Phase, rng
from spade_jax.spade.config import Baseline

# reasoning-gym categories that are not task families (one task mixing all the others).
NON_FAMILY_CATEGORIES = ("composite",)
# Tasks left out of the default set because their generator builds every item up front:
# acre takes minutes for the env's 10^6-item index space. Name one in train_tasks to use it.
EAGER_TASKS = ("acre",)


def default_train_categories() -> tuple[str, ...]:
    """reasoning-gym categories that no evaluation suite draws from."""
    evaluated = {c for categories in SUITE_CATEGORIES.values() for c in categories}
    return tuple(c for c in rg_tasks_by_category()
                 if c not in evaluated and c not in NON_FAMILY_CATEGORIES)


def train_tasks(categories: Sequence[str] = (), tasks: Sequence[str] = ()) -> tuple[str, ...]:
    """The baselines' training tasks: the categories' tasks plus ``tasks`` (sorted), or the
    default categories' tasks (less ``EAGER_TASKS``) when both are empty. Raises ValueError naming unknown
    categories / tasks, and any task an evaluation suite also holds."""
    by_category = rg_tasks_by_category()
    known_tasks = {t for names in by_category.values() for t in names}
    default = not categories and not tasks
    if default:
        categories = default_train_categories()
    unknown = sorted(set(categories) - set(by_category))
    if unknown:
        raise ValueError(f"unknown reasoning-gym categories {unknown}; known: {sorted(by_category)}")
    unknown = sorted(set(tasks) - known_tasks)
    if unknown:
        raise ValueError(f"unknown reasoning-gym tasks {unknown}")
    chosen = sorted({t for c in categories for t in by_category[c]} | set(tasks))
    if default:
        chosen = [t for t in chosen if t not in EAGER_TASKS]
    if not chosen:
        raise ValueError(f"no reasoning-gym tasks in categories {list(categories)}")
    check_disjoint_from_evaluation(chosen)
    return tuple(chosen)


def check_disjoint_from_evaluation(tasks: Sequence[str]) -> None:
    """Raises ValueError naming every training task that an evaluation suite holds."""
    overlap = {suite: sorted(set(tasks) & set(RG_SUITES[suite])) for suite in RG_SUITES}
    overlap = {suite: shared for suite, shared in overlap.items() if shared}
    if overlap:
        listed = "; ".join(f"{suite}: {shared}" for suite, shared in overlap.items())
        raise ValueError(f"baseline training tasks overlap the held-out evaluation suites "
                         f"({listed}); train on other reasoning-gym categories")


class ReasoningGymBaseline:
    """Picks the round's tasks and builds one fresh env per episode (module docstring)."""

    def __init__(self, tasks: Sequence[str], envs_per_round: int, adaptive: bool, seed: int,
                 decay: float = 0.8):
        self.tasks = sorted(tasks)
        if not self.tasks:
            raise ValueError("a fixed-environment baseline needs at least one task")
        check_disjoint_from_evaluation(self.tasks)
        if envs_per_round < 1:
            raise ValueError(f"envs_per_round must be >= 1, got {envs_per_round}")
        self.envs_per_round, self.adaptive, self.seed = envs_per_round, adaptive, seed
        self.decay = decay
        self.win_rate = {t: 0.5 for t in self.tasks}
        self._templates: dict[str, ReasoningGymEnv] = {}

    def _weights(self) -> np.ndarray:
        if not self.adaptive:
            return np.full(len(self.tasks), 1.0 / len(self.tasks))
        # 1 inside the learnable band, falling linearly to 0.05 at win rates 0 and 1.
        w = np.array([max(0.05, 1.0 - max(0.0, abs(self.win_rate[t] - 0.5) - 0.3) / 0.2)
                      for t in self.tasks])
        return w / w.sum()

    def round_tasks(self, round_index: int) -> list[str]:
        """This round's tasks, without replacement (weighted when adaptive)."""
        picks = rng(self.seed, round_index, Phase.BASELINE, 0).choice(
            len(self.tasks), size=min(self.envs_per_round, len(self.tasks)), replace=False,
            p=self._weights())
        return [self.tasks[int(i)] for i in picks]

    def new_env(self, task: str) -> ReasoningGymEnv:
        """A fresh env of ``task``: its own episode state, the task's shared dataset."""
        if task not in self._templates:
            self._templates[task] = make_reasoning_gym_env(task)
        return copy.copy(self._templates[task])

    def episodes(self, round_index: int, plays_per_task: int) -> list[EpisodeSpec]:
        """``plays_per_task`` episodes of each of the round's tasks, one env each, seeded
        from (experiment seed, round, BASELINE, task slot, play)."""
        specs = []
        for slot, task in enumerate(self.round_tasks(round_index)):
            seeds = rng(self.seed, round_index, Phase.BASELINE, 1 + slot).integers(
                0, 2**31 - 1, size=plays_per_task)
            specs += [EpisodeSpec(env=self.new_env(task), env_id=task, seed=int(s))
                      for s in seeds]
        return specs

    def feedback(self, returns_by_env: dict[str, list[float]]) -> None:
        for task, returns in returns_by_env.items():
            won = float(np.mean(np.asarray(returns) >= 1.0))
            self.win_rate[task] = self.decay * self.win_rate[task] + (1 - self.decay) * won

    def state_dict(self) -> dict[str, Any]:
        """The adaptive win rates (checkpointed with the loop, so a resume draws alike)."""
        return {"win_rate": dict(self.win_rate)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unknown = sorted(set(state["win_rate"]) - set(self.tasks))
        if unknown:
            raise ValueError(f"baseline state names tasks this baseline does not have: {unknown}")
        self.win_rate.update({k: float(v) for k, v in state["win_rate"].items()})


def make_baseline(config) -> ReasoningGymBaseline:
    """The baseline ``config.spade.baseline`` names, on ``config.baseline``'s tasks."""
    tasks = train_tasks(config.baseline.train_categories, config.baseline.train_tasks)
    return ReasoningGymBaseline(tasks, config.spade.envs_per_round,
                                adaptive=config.spade.baseline == Baseline.FIXED_ENV_RLVE,
                                seed=config.seed)
