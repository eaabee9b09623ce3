"""The paper text's round instead of the published recipe's windows: every round the
designer writes games with their hints (4 samples per prompt, one attempt, -1 for an invalid
program), both hint arms are played (16 with the hint, 16 without), the hint-regret reward
scores them at once, and designer groups get GRPO advantages.

    python -m spade_jax.train --experiment=spade_paper_text --workdir=DIR          # on qwen3_30b_a3b
    python -m spade_jax.train --experiment=spade_paper_text:tiny --workdir=DIR     # CPU mechanics run
"""

from spade_jax.experiment import ExperimentConfig, ablation


def get_config(base: str = "qwen3_30b_a3b") -> ExperimentConfig:
    return ablation(
        base, "spade_paper_text", spade__contract="paper", spade__regeneration_interval=1,
        spade__designer_delay=0,
        spade__hint_mode="designer", spade__designer_reward="hint_regret",
        spade__invalid_penalty=-1.0, spade__designer_groups="prompt",
        train__designer__advantage_estimator="grpo",
        spade__designer_group_size=4, spade__max_design_attempts=1, spade__plays_per_game=16,
        spade__hint_plays=16,
        # The recipe's batch cut and missing-game rewrites belong to its windows: the
        # paper text trains every sample of its round (16 plays a game, 4 designs a prompt).
        spade__global_batch=0, spade__regenerate_missing_games=False,
        # The paper's designer writes its hint beside the program: this project's parser.
        spade__program_extraction="last_block")
