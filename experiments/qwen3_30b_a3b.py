"""SPADE on Qwen3-30B-A3B-Instruct-2507, the paper's main setting (400 rounds x 24 envs, GRPO).

    python -m spade_jax.convert --hf_dir=/ckpt/Qwen3-30B-A3B-Instruct-2507 --out_dir=/ckpt/q30b
    python -m spade_jax.train --experiment=qwen3_30b_a3b --hf_checkpoint=/ckpt/Qwen3-30B-A3B-Instruct-2507 \
        --workdir=gs://BUCKET/runs/spade_30b

Sharding: 128 experts over the expert axis (expert parallelism), the rest FSDP.
"""

from spade_jax.experiment import CorpusSpec, ExperimentConfig, ModelSpec, TokenizerSpec
from spade_jax.rl.optim import OptimizerConfig
from spade_jax.rl.train_step import RoleConfig, TrainConfig
from spade_jax.rollout.agent_loop import AgentLoopConfig
from spade_jax.rollout.sampler import SamplerConfig
from spade_jax.sharding import MeshConfig
from spade_jax.spade.config import SpadeConfig
from spade_jax.spade.prompts import AGENT_SYSTEM_PROMPT


def get_config() -> ExperimentConfig:
    return ExperimentConfig(
        name="qwen3_30b_a3b",
        # Memory levers chosen from `python -m spade_jax.aot` (README table): stacked layers
        # under lax.scan, full per-layer remat, attention scores 512 queries at a time.
        model=ModelSpec(preset="qwen3_30b_a3b_instruct_2507", dtype="bfloat16",
                        moe_impl="expert_parallel", remat="full", scan_layers=True,
                        attention_chunk=512),
        tokenizer=TokenizerSpec(path=""),  # set to the checkpoint dir (tokenizer.json)
        mesh=MeshConfig(data=1, fsdp=-1, tensor=1, expert=8),
        designer_sampler=SamplerConfig(max_new_tokens=2048, temperature=1.0, top_p=1.0,
                                       cache_dtype="bfloat16"),
        agent=AgentLoopConfig(max_turns=8, max_turn_tokens=1024, max_episode_tokens=8192,
                              system_prompt=AGENT_SYSTEM_PROMPT,
                              # 256 rows per batch: the KV cache of 8k-token episodes
                              # stays < 12 GiB per chip on 32 chips (README AOT table).
                              sampler=SamplerConfig(max_new_tokens=1024, temperature=1.0,
                                                    cache_dtype="bfloat16", max_rows=256)),
        # The recipe's update (slime flags of cmd/games/train_spade_30b.sh): Adam lr 1e-6
        # constant, weight decay 0.1, betas 0.9/0.98, clip 1.0; PPO clip 0.2/0.28, KL 0,
        # TIS clamp 2; designer and agent samples in one per-sample mean.
        train=TrainConfig(
            optimizer=OptimizerConfig(learning_rate=1e-6, warmup_steps=0, schedule="constant",
                                      weight_decay=0.1, b1=0.9, b2=0.98, clip_norm=1.0),
            agent=RoleConfig(importance_correction="tis", importance=dict(clamp=2.0),
                             policy_loss="grpo", loss=dict(
                clip_eps=0.2, clip_eps_high=0.28, kl_coef=0.0)),
            designer=RoleConfig(importance_correction="tis", importance=dict(clamp=2.0),
                                policy_loss="grpo", loss=dict(
                clip_eps=0.2, clip_eps_high=0.28, kl_coef=0.0)),
            loss_aggregation="pooled",
            microbatches=16, compute_dtype="bfloat16", router_replay=False,
            logit_chunk=1024,  # [tokens, 151k vocab] logits 1024 positions at a time
        ),
        spade=SpadeConfig(rounds=400, envs_per_round=24, designer_group_size=4, n_hint=16,
                          designer_delay=1, eval_every=20),
        corpus=CorpusSpec(domain="game"),
        checkpoint_every=10,
    )
