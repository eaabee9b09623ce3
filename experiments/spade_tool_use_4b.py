"""SPADE's tool-use track on Qwen3-4B-Instruct-2507 with the published 4B tool launch
(``cmd/tool_use/train_spade_4b.sh``, "the original 4B KL-anchored tool-use run").

    python -m spade_jax.train --experiment=spade_tool_use_4b \
        --hf_checkpoint=/ckpt/Qwen3-4B-Instruct-2507 \
        --corpus=gs://BUCKET/tool_corpus/*.jsonl --workdir=gs://BUCKET/runs/spade_tool_4b

The 30B tool experiment (``spade_tool_use_30b_a3b``: tool contract, tool skills, native
tool calls, KL 0.005) with what the 4B launch sets differently: 500 steps; 16 environments
per regeneration, each played 16 times per step (global batch 256); new environments every
32 steps and designer samples trained 32 steps later; the floored hint regret against the
window as the designer reward (``regret_based``); 4 hint plays per environment with hints
up to 512 tokens. Not reproduced: the launch's dynamic-sampling filter
(``check_reward_nonzero_std``) and ``--spade-use-solver-variance-reward``, which the
recipe's regret path does not read (spade/rewards/regret_rule.py).
"""

import dataclasses

from spade_jax.experiment import ExperimentConfig, load_experiment
from spade_jax.sharding import MeshConfig


def get_config() -> ExperimentConfig:
    base = load_experiment("spade_tool_use_30b_a3b")
    return dataclasses.replace(
        base,
        name="spade_tool_use_4b",
        model=dataclasses.replace(base.model, preset="qwen3_4b_instruct_2507"),
        mesh=MeshConfig(data=1, fsdp=-1, tensor=1, expert=1),
        spade=dataclasses.replace(
            base.spade, rounds=500, envs_per_round=16, plays_per_game=16, global_batch=256,
            regeneration_interval=32, designer_delay=32, designer_reward="regret",
            hint_plays=4, hint_max_tokens=512),
        train=dataclasses.replace(base.train, microbatches=8, pooled_min_denominator=256),
    )
