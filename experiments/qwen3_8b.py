"""SPADE on Qwen3-8B with the published recipe: the 30B experiment with the 8B model, the
designer thinking (20000 designer tokens), KL 0.005 (see the train block).

    python -m spade_jax.train --experiment=qwen3_8b --hf_checkpoint=/ckpt/Qwen3-8B \
        --corpus=gs://BUCKET/corpus/*.parquet --workdir=gs://BUCKET/runs/spade_qwen3_8b

Dense model: parameters and optimizer state sharded FSDP over every chip.
"""

import dataclasses

from spade_jax.experiment import ExperimentConfig, load_experiment
from spade_jax.rl.train_step import RoleConfig
from spade_jax.sharding import MeshConfig


def get_config() -> ExperimentConfig:
    base = load_experiment("qwen3_30b_a3b")
    return dataclasses.replace(
        base,
        name="qwen3_8b",
        model=dataclasses.replace(base.model, preset="qwen3_8b"),
        mesh=MeshConfig(data=1, fsdp=-1, tensor=1, expert=1),
        designer_sampler=dataclasses.replace(base.designer_sampler, max_new_tokens=20_000),
        spade=dataclasses.replace(base.spade, designer_thinking=True),
        # The recipe's update, as the 30B's but KL 0.005 to the initial policy
        # (cmd/games/train_spade_8b.sh: --kl-loss-coef 0.005, low_var_kl = k3).
        train=dataclasses.replace(
            base.train, microbatches=8,
            # slime divides a short batch's summed losses by the global batch: the 8B's KL
            # term turns off the reward rescaling the 30B launch gets (spade_rollout.py,
            # partial batches; docs/reference_parity.md).
            pooled_min_denominator=192,
            agent=_with_kl(base.train.agent, 0.005),
            designer=_with_kl(base.train.designer, 0.005)),
    )


def _with_kl(role: RoleConfig, kl_coef: float) -> RoleConfig:
    """The role's rule with its policy loss's KL coefficient set (the rest as the 30B's)."""
    return dataclasses.replace(role, loss=dataclasses.replace(role.loss, kl_coef=kl_coef))
