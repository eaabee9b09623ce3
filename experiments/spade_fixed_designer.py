"""Fixed designer: an offline, corpus-grounded pool of programs, no memory (paper, 30B: 53.0).

The pool is spade.pool_dir (the recipe's games/game_*.py, or *.py + NAME.hint.txt); empty =
the project's seed programs. As in the recipe's fixed-pool run: new games every step, drawn
without replacement across the run, no hints, no designer update, no memory.

    python -m spade_jax.train --experiment=spade_fixed_designer --workdir=DIR          # on qwen3_30b_a3b
    python -m spade_jax.train --experiment=spade_fixed_designer:tiny --workdir=DIR     # CPU mechanics run
"""

from spade_jax.experiment import ExperimentConfig, ablation


def get_config(base: str = "qwen3_30b_a3b") -> ExperimentConfig:
    return ablation(base, "spade_fixed_designer", spade__designer_mode="fixed_pool", spade__hint_mode="none",
                    spade__regeneration_interval=1, spade__designer_delay=0,
                    spade__use_memory=False)
