"""One step of a fixed-environment baseline (no designer): the agent plays the baseline's
environments ``plays_per_game`` times each and trains on them, GRPO group = one
environment's plays this step.

The step sees the loop only through `AgentStep`, the few operations the loop lends a game
source that plays steps of its own, so it cannot reach into the loop's windows, memory or
pending designer samples.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from spade_jax.seeding import Phase, derive_seed
from spade_jax.spade import agreement
from spade_jax.spade.step_metrics import PhaseTimer


@dataclasses.dataclass(frozen=True)
class AgentStep:
    """What the loop lends a source that plays a step of its own (`SpadeLoop.agent_step`).

    Attributes:
      seed: the experiment seed (episode seeds derive from it, the step and the phase).
      plays_per_game: episodes per task per step (the agent's GRPO group).
      run_episodes: ``(specs, *, seed) -> records``: plays the episodes with the policy.
      agent_sequences: ``(records, step) -> sequences``: the agent's update rule applied
        to the plays (advantages, filters).
      update: ``sequences -> metrics``: one optimizer step.
      record_learnable: ``per-task mean returns -> learnable share`` of the loop's window.
      pop_rule_metrics: the update rules' metrics gathered since the last call.
    """

    seed: int
    plays_per_game: int
    run_episodes: Callable[..., list[Any]]
    agent_sequences: Callable[[list[Any], int], list[Any]]
    update: Callable[[list[Any]], dict[str, float]]
    record_learnable: Callable[[list[float]], float]
    pop_rule_metrics: Callable[[], dict[str, float]]


def run_baseline_round(agent: AgentStep, baseline: Any, step: int) -> dict[str, float]:
    """One step of ``baseline`` (a `game_source.FixedEnvBaseline`), played and trained
    through ``agent``; returns the step's metrics."""
    timer = PhaseTimer()
    with timer("rollout"):
        specs = baseline.episodes(step, agent.plays_per_game)  # seeded by the baseline
        try:
            records = agent.run_episodes(specs, seed=derive_seed(agent.seed, step, Phase.BASELINE))
        finally:
            for spec in specs:
                spec.env.close()
        for rec, ret in zip(records, agreement.agree_returns([float(r.return_) for r in records]),
                            strict=True):
            rec.return_, rec.hinted = ret, False
    with timer("update"):
        seqs = agent.agent_sequences(records, step)
        update_metrics = agent.update(seqs) if seqs else {"skipped_no_data": 1.0}
    by_env: dict[str, list[float]] = collections.defaultdict(list)
    for rec in records:
        by_env[rec.env_id].append(rec.return_)
    baseline.feedback(by_env)
    share = agent.record_learnable([float(np.mean(v)) for v in by_env.values()])
    return {
        "return_no_hint_mean": float(np.mean([r.return_ for r in records])) if records else 0.0,
        "learnable_share": share,
        "batch/agent": float(len(seqs)),
        **agent.pop_rule_metrics(),
        **{f"train/{k}": v for k, v in update_metrics.items()},
        **{f"time/{k}": v for k, v in timer.times.items()},
    }
