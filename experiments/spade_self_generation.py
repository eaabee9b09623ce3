"""No designer training and no memory: self-generation (paper, 30B: 40.5, below the base model's 50.2).

    python -m spade_jax.train --experiment=spade_self_generation --workdir=DIR          # on qwen3_30b_a3b
    python -m spade_jax.train --experiment=spade_self_generation:tiny --workdir=DIR     # CPU mechanics run
"""

from spade_jax.experiment import ExperimentConfig, ablation


def get_config(base: str = "qwen3_30b_a3b") -> ExperimentConfig:
    return ablation(base, "spade_self_generation", spade__train_designer=False, spade__use_memory=False)
