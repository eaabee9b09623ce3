"""No corpus grounding (paper, 30B: 53.5).

    python -m spade_jax.train --experiment=spade_no_corpus --workdir=DIR          # on qwen3_30b_a3b
    python -m spade_jax.train --experiment=spade_no_corpus:tiny --workdir=DIR     # CPU mechanics run
"""

from spade_jax.experiment import ExperimentConfig, ablation


def get_config(base: str = "qwen3_30b_a3b") -> ExperimentConfig:
    return ablation(base, "spade_no_corpus", spade__use_corpus=False)
