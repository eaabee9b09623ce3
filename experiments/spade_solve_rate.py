"""Designer reward = solve-rate targeting only: the plateau on the window's mean return over
[0.4, 0.6], no regret term (the recipe's `solve_rate` ablation).

    python -m spade_jax.train --experiment=spade_solve_rate --workdir=DIR          # on qwen3_30b_a3b
    python -m spade_jax.train --experiment=spade_solve_rate:tiny --workdir=DIR     # CPU mechanics run
"""

from spade_jax.experiment import ExperimentConfig, ablation


def get_config(base: str = "qwen3_30b_a3b") -> ExperimentConfig:
    return ablation(base, "spade_solve_rate", spade__designer_reward="solve_rate")
