"""Baseline: GRPO on fixed reasoning-gym environments, no designer (paper, 30B: 51.4).

    python -m spade_jax.train --experiment=baseline_fixed_env_grpo --workdir=DIR          # on qwen3_30b_a3b
    python -m spade_jax.train --experiment=baseline_fixed_env_grpo:tiny --workdir=DIR     # CPU mechanics run
"""

from spade_jax.experiment import ExperimentConfig, ablation


def get_config(base: str = "qwen3_30b_a3b") -> ExperimentConfig:
    return ablation(base, "baseline_fixed_env_grpo", spade__baseline="fixed_env_grpo")
