"""Fixed designer: an offline, corpus-grounded pool of programs, no memory (paper, 30B: 53.0).

The pool is spade.pool_dir (*.py + NAME.hint.txt); empty = the project's seed programs.

    python -m spade_jax.train --experiment=spade_fixed_designer --workdir=DIR          # on qwen3_30b_a3b
    python -m spade_jax.train --experiment=spade_fixed_designer:tiny --workdir=DIR     # CPU mechanics run
"""

from spade_jax.experiment import ExperimentConfig, ablation


def get_config(base: str = "qwen3_30b_a3b") -> ExperimentConfig:
    return ablation(base, "spade_fixed_designer", spade__designer_mode="fixed_pool", spade__use_memory=False)
