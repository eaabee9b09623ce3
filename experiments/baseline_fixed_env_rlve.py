"""Baseline: RLVE-style adaptive selection over fixed reasoning-gym environments (paper, 30B: 53.0).

    python -m spade_jax.train --experiment=baseline_fixed_env_rlve --workdir=DIR          # on qwen3_30b_a3b
    python -m spade_jax.train --experiment=baseline_fixed_env_rlve:tiny --workdir=DIR     # CPU mechanics run
"""

from spade_jax.experiment import ExperimentConfig, ablation


def get_config(base: str = "qwen3_30b_a3b") -> ExperimentConfig:
    return ablation(base, "baseline_fixed_env_rlve", spade__baseline="fixed_env_rlve")
