"""reasoning-gym tasks as gymnasium text environments, and the RG evaluation suites.

These are fixed, trusted environments (the package's own generators and verifiers), so
they run in-process, not in the sandbox. Two modes:
  single-turn: reset() gives the question; one step() answers it; reward = the package's
    score of the answer in [0, 1]; the episode ends.
  multi-turn: up to `max_attempts` answers with feedback ("scored 0.40, 2 attempts
    left"); each step pays the improvement over the best score so far, so the return is
    the best score reached, in [0, 1].
An answer wrapped in <answer>...</answer> is scored on the last such span.

Suites follow the package's own categories (the subpackage a task's dataset class lives
in): RG-Math = algebra + arithmetic + geometry + probability, RG-Algo = algorithmic,
RG-Cog = cognition, RG-Logic = logic.
"""

from __future__ import annotations

import collections
import functools
import math
import re
from typing import Any

import gymnasium
from gymnasium import spaces

from spade_jax.envs.gym_env import PRINTABLE, sanitize_observation

SUITE_CATEGORIES: dict[str, tuple[str, ...]] = {
    "RG-Math": ("algebra", "arithmetic", "geometry", "probability"),
    "RG-Algo": ("algorithmic",),
    "RG-Cog": ("cognition",),
    "RG-Logic": ("logic",),
}
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# Index space of the procedural datasets: reset(seed) picks item seed % size.
_DATASET_SIZE = 1_000_000


@functools.cache
def rg_tasks_by_category() -> dict[str, tuple[str, ...]]:
    """reasoning-gym category -> sorted task names, from the dataset classes' modules."""
    from reasoning_gym.factory import DATASETS

    categories: dict[str, list[str]] = collections.defaultdict(list)
    for name, (dataset_cls, _) in DATASETS.items():
        categories[dataset_cls.__module__.split(".")[1]].append(name)
    return {category: tuple(sorted(names)) for category, names in sorted(categories.items())}


class _Suites(collections.abc.Mapping):
    """RG_SUITES: suite name -> task names, computed from the installed package on access."""

    def _table(self) -> dict[str, tuple[str, ...]]:
        by_category = rg_tasks_by_category()
        return {
            suite: tuple(sorted(t for c in cats for t in by_category.get(c, ())))
            for suite, cats in SUITE_CATEGORIES.items()
        }

    def __getitem__(self, suite: str) -> tuple[str, ...]:
        return self._table()[suite]

    def __iter__(self):
        return iter(SUITE_CATEGORIES)

    def __len__(self) -> int:
        return len(SUITE_CATEGORIES)


RG_SUITES: collections.abc.Mapping[str, tuple[str, ...]] = _Suites()


def _extract(action: str) -> str:
    spans = _ANSWER_TAG.findall(action)
    return spans[-1].strip() if spans else action.strip()


class ReasoningGymEnv(gymnasium.Env):
    """One reasoning-gym task as a text env (see the module docstring for the modes)."""

    metadata = {"render_modes": []}

    def __init__(
        self,
        task: str,
        *,
        multi_turn: bool = False,
        max_attempts: int = 3,
        dataset_seed: int = 0,
        max_observation_chars: int = 65_536,
        max_action_chars: int = 16_384,
        **task_config: Any,
    ) -> None:
        import reasoning_gym
        from reasoning_gym.factory import DATASETS

        if task not in DATASETS:
            raise ValueError(f"unknown reasoning-gym task {task!r}; see rg_tasks_by_category()")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.task = task
        self.multi_turn = multi_turn
        self.max_attempts = max_attempts if multi_turn else 1
        # Some generators cap their dataset size (word_ladder): take the largest accepted.
        for size in (_DATASET_SIZE, 10_000, 500):
            try:
                self.dataset = reasoning_gym.create_dataset(
                    task, seed=dataset_seed, size=size, **task_config
                )
                break
            except ValueError:
                if size == 500:
                    raise
        self.size = size
        charset = "".join(sorted(PRINTABLE))
        self.observation_space = spaces.Text(max_observation_chars, min_length=0, charset=charset)
        self.action_space = spaces.Text(max_action_chars, min_length=0, charset=charset)
        self.entry: dict[str, Any] | None = None
        self._attempts = 0
        self._best = 0.0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        index = int(self.np_random.integers(0, self.size)) if seed is None else seed % self.size
        self.entry = self.dataset[index]
        self._attempts, self._best = 0, 0.0
        prompt = self.entry["question"]
        if self.multi_turn:
            prompt += f"\n\n(You have {self.max_attempts} attempts; you get feedback after each.)"
        return sanitize_observation(prompt, {"task": self.task, "index": index})

    def score(self, answer: str) -> float:
        """The package's own verifier, clipped to [0, 1]; a verifier crash scores 0."""
        try:
            value = float(self.dataset.score_answer(_extract(answer), self.entry))
        except Exception:  # noqa: BLE001 - garbage answers must not crash an episode
            return 0.0
        return min(1.0, max(0.0, value)) if math.isfinite(value) else 0.0

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.entry is None:
            raise RuntimeError("call reset() before step()")
        if not isinstance(action, str):
            raise TypeError(f"action must be str, got {type(action).__name__}")
        self._attempts += 1
        score = self.score(action)
        reward = max(0.0, score - self._best)
        self._best = max(self._best, score)
        solved = score >= 1.0
        out_of_attempts = self._attempts >= self.max_attempts
        terminated = solved or out_of_attempts
        if solved:
            feedback = "Correct."
        elif out_of_attempts:
            feedback = f"Incorrect (score {score:.2f}). No attempts left."
        else:
            left = self.max_attempts - self._attempts
            feedback = f"Incorrect (score {score:.2f}). {left} attempt(s) left. Try again."
        info = {"score": score, "best_score": self._best, "attempts": self._attempts}
        observation, info = sanitize_observation(feedback, info)
        return observation, reward, terminated, False, info


def make_reasoning_gym_env(
    task: str, *, multi_turn: bool = False, **kwargs: Any
) -> ReasoningGymEnv:
    """A reasoning-gym task as a gymnasium text env (single-turn unless multi_turn)."""
    return ReasoningGymEnv(task, multi_turn=multi_turn, **kwargs)
