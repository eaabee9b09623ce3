"""One round of a fixed-environment baseline (no designer): the agent plays the baseline's
environments ``plays_per_game`` times each and trains on them, GRPO group = one
environment's plays this round."""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

from spade_jax.seeding import Phase, derive_seed
from spade_jax.spade import agreement
from spade_jax.spade.step_metrics import PhaseTimer


def run_baseline_round(loop: Any, baseline: Any, step: int) -> dict[str, float]:
    """One step of ``baseline`` (a `game_source.FixedEnvBaseline`); ``loop`` is the
    SpadeLoop (its run_episodes, update, agent_sequences, learnable tracker)."""
    cfg = loop.config
    timer = PhaseTimer()
    with timer("rollout"):
        specs = baseline.episodes(step, cfg.plays_per_game)  # seeded by the baseline
        try:
            records = loop.run_episodes(specs, seed=derive_seed(loop.seed, step, Phase.BASELINE))
        finally:
            for spec in specs:
                spec.env.close()
        for rec, ret in zip(records, agreement.agree_returns([float(r.return_) for r in records]),
                            strict=True):
            rec.return_, rec.hinted = ret, False
    with timer("update"):
        seqs = loop.agent_sequences(records, step)
        update_metrics = loop.update(seqs) if seqs else {"skipped_no_data": 1.0}
    by_env: dict[str, list[float]] = collections.defaultdict(list)
    for rec in records:
        by_env[rec.env_id].append(rec.return_)
    baseline.feedback(by_env)
    share = loop.learnable.record_step([float(np.mean(v)) for v in by_env.values()])
    return {
        "return_no_hint_mean": float(np.mean([r.return_ for r in records])) if records else 0.0,
        "learnable_share": share,
        "batch/agent": float(len(seqs)),
        **loop.pop_rule_metrics(),
        **{f"train/{k}": v for k, v in update_metrics.items()},
        **{f"time/{k}": v for k, v in timer.times.items()},
    }
