"""SPADE on Qwen3-4B-Instruct-2507 with the published recipe: the 30B experiment with the
4B model (thinking off, as for 30B).

    python -m spade_jax.train --experiment=qwen3_4b --hf_checkpoint=/ckpt/Qwen3-4B-Instruct-2507 \
        --corpus=gs://BUCKET/corpus/*.parquet --workdir=gs://BUCKET/runs/spade_qwen3_4b

Dense model: parameters and optimizer state sharded FSDP over every chip.
"""

import dataclasses

from spade_jax.experiment import ExperimentConfig, load_experiment
from spade_jax.sharding import MeshConfig


def get_config() -> ExperimentConfig:
    base = load_experiment("qwen3_30b_a3b")
    return dataclasses.replace(
        base,
        name="qwen3_4b",
        model=dataclasses.replace(base.model, preset="qwen3_4b_instruct_2507"),
        mesh=MeshConfig(data=1, fsdp=-1, tensor=1, expert=1),
        # The recipe's update, as the 30B's (cmd/games/train_spade_4b.sh: same flags).
        train=dataclasses.replace(base.train, microbatches=8),
    )
