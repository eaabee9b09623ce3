"""Fixed-environment baselines on the reasoning-gym pool (no designer).

  fixed_env_grpo   tasks drawn uniformly from the pool every round (plain GRPO).
  fixed_env_rlve   RLVE-style adaptive selection: each task keeps a moving win rate and
                   tasks are drawn in proportion to how close it sits to the learnable band
                   (win rate in [0.2, 0.8]), so training follows the agent's frontier.
                   reasoning-gym exposes difficulty per task through different knobs, so
                   adaptivity here is over *which* task, not a per-task difficulty dial.
"""

from __future__ import annotations

import numpy as np

from spade_jax.envs import RG_SUITES, make_reasoning_gym_env


class ReasoningGymBaseline:
    def __init__(self, suites: tuple[str, ...], envs_per_round: int, adaptive: bool, seed: int,
                 decay: float = 0.8):
        self.tasks = sorted({t for s in suites for t in RG_SUITES[s]})
        if not self.tasks:
            raise ValueError(f"no reasoning-gym tasks in suites {suites}")
        self.envs_per_round, self.adaptive, self.seed, self.decay = envs_per_round, adaptive, seed, decay
        self.win_rate = {t: 0.5 for t in self.tasks}
        self._cache: dict[str, object] = {}

    def _weights(self) -> np.ndarray:
        if not self.adaptive:
            return np.full(len(self.tasks), 1.0 / len(self.tasks))
        # 1 inside the learnable band, falling linearly to 0.05 at win rates 0 and 1.
        w = np.array([max(0.05, 1.0 - max(0.0, abs(self.win_rate[t] - 0.5) - 0.3) / 0.2)
                      for t in self.tasks])
        return w / w.sum()

    def envs(self, round_index: int):
        rng = np.random.default_rng([self.seed, round_index, 5])
        picks = rng.choice(len(self.tasks), size=min(self.envs_per_round, len(self.tasks)),
                           replace=False, p=self._weights())
        out = []
        for i in picks:
            task = self.tasks[int(i)]
            if task not in self._cache:
                self._cache[task] = make_reasoning_gym_env(task)
            out.append((task, self._cache[task]))
        return out

    def feedback(self, returns_by_env: dict[str, list[float]]) -> None:
        for task, returns in returns_by_env.items():
            won = float(np.mean(np.asarray(returns) >= 1.0))
            self.win_rate[task] = self.decay * self.win_rate[task] + (1 - self.decay) * won


def make_baseline(config) -> ReasoningGymBaseline:
    return ReasoningGymBaseline(tuple(config.eval.suites), config.spade.envs_per_round,
                                adaptive=config.spade.baseline == "fixed_env_rlve", seed=config.seed)
