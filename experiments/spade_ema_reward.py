"""Designer reward = learning potential: |window mean return - slow per-skill EMA| (the
recipe's `learning_potential` variant; paper, 30B: 55.9).

    python -m spade_jax.train --experiment=spade_ema_reward --workdir=DIR          # on qwen3_30b_a3b
    python -m spade_jax.train --experiment=spade_ema_reward:tiny --workdir=DIR     # CPU mechanics run
"""

from spade_jax.experiment import ExperimentConfig, ablation


def get_config(base: str = "qwen3_30b_a3b") -> ExperimentConfig:
    return ablation(base, "spade_ema_reward", spade__designer_reward="learning_potential")
