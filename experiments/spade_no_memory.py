"""No environment memory (paper, 30B: 53.2 vs 58.3 for full SPADE).

    python -m spade_jax.train --experiment=spade_no_memory --workdir=DIR          # on qwen3_30b_a3b
    python -m spade_jax.train --experiment=spade_no_memory:tiny --workdir=DIR     # CPU mechanics run
"""

from spade_jax.experiment import ExperimentConfig, ablation


def get_config(base: str = "qwen3_30b_a3b") -> ExperimentConfig:
    return ablation(base, "spade_no_memory", spade__use_memory=False)
