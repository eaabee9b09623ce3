"""Two-skill curriculum: Mathematical Reasoning + Pattern Recognition, both every window,
instead of six skills (paper, 30B: 53.7).

    python -m spade_jax.train --experiment=spade_two_skill --workdir=DIR          # on qwen3_30b_a3b
    python -m spade_jax.train --experiment=spade_two_skill:tiny --workdir=DIR     # CPU mechanics run
"""

from spade_jax.experiment import ExperimentConfig, ablation


def get_config(base: str = "qwen3_30b_a3b") -> ExperimentConfig:
    return ablation(base, "spade_two_skill", spade__skills="two_skill")
