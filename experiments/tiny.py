"""CPU-sized SPADE run: the whole loop on a tiny Qwen3-MoE, in minutes, on a fresh machine.

    python -m spade_jax.train --experiment=tiny --workdir=runs/tiny

A mechanics run, not a result: a ~1M-parameter policy with a sentencepiece tokenizer
trained on the project's own text, warm-started on the project's example environment
programs (and their hints) so the designer role writes programs that validate and the
hint writer writes hints. Every phase, metric,
checkpoint and the report are real; the numbers say nothing about SPADE's claims.
"""

from spade_jax.envs.config import SandboxConfig
from spade_jax.experiment import (
    EvalSpec,
    ExperimentConfig,
    ModelSpec,
    TokenizerSpec,
    WarmStartConfig,
)
from spade_jax.models import ModelConfig
from spade_jax.rl.optim import OptimizerConfig
from spade_jax.rl.train_step import TrainConfig
from spade_jax.rollout.agent_loop import AgentLoopConfig
from spade_jax.rollout.sampler import SamplerConfig
from spade_jax.spade.config import SpadeConfig
from spade_jax.spade.prompts import AGENT_SYSTEM_PROMPT


def get_config() -> ExperimentConfig:
    return ExperimentConfig(
        name="tiny",
        seed=0,
        model=ModelSpec(
            architecture=ModelConfig(
                architecture="Qwen3MoeForCausalLM", vocab_size=4000, hidden_size=96,
                num_layers=2, num_heads=4, num_kv_heads=2, head_dim=24, intermediate_size=192,
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96,
                norm_topk_prob=True, max_position_embeddings=4096,
            ),
            dtype="float32",
            moe_impl="blocked",  # XLA:CPU runs ragged_dot as a loop of full matmuls
        ),
        tokenizer=TokenizerSpec(vocab_size=4000),
        designer_sampler=SamplerConfig(max_new_tokens=448, temperature=0.2, top_p=0.95),
        agent=AgentLoopConfig(
            max_turns=2, max_turn_tokens=24, max_episode_tokens=1024,
            system_prompt=AGENT_SYSTEM_PROMPT,
            sampler=SamplerConfig(max_new_tokens=24, temperature=1.0),
            env_threads=2,
        ),
        sandbox=SandboxConfig(call_deadline_s=2.0, spare_workers=2),
        # Router replay: the samplers record routing (2 MoE layers x top-2: 4 bytes a
        # token) and the trainer replays it; replay/<role>/... telemetry every step.
        train=TrainConfig(optimizer=OptimizerConfig(learning_rate=1e-4, warmup_steps=1),
                          router_replay=True),
        # Two windows of two steps: a regeneration (design, self-written hints, hint
        # plays) then a plain step; designer samples trained one step later with the
        # blend reward (the last step flushes the second window's).
        spade=SpadeConfig(
            rounds=4, envs_per_round=4, regeneration_interval=2, plays_per_game=2,
            hint_plays=2, designer_delay=1, designer_group_size=1, max_design_attempts=2,
            hint_mode="self", hint_max_tokens=24, designer_reward="blend",
            contract="paper",  # the warm-start seed programs use the paper's contract
            docs_per_prompt=1, max_doc_chars=64, memory_examples=1, memory_train_envs=1,
            eval_every=2, prompt_style="compact", probe_episodes=2,
        ),
        # Two short seed programs under prompts of every skill and with corpus documents:
        # a 1M-parameter policy learns to emit one of them whatever the prompt says.
        warm_start=WarmStartConfig(steps=160, batch_size=4, learning_rate=3e-3,
                                   programs=("modular_product", "sort_numbers"),
                                   prompts_per_program=6, vary_skills=True),
        eval=EvalSpec(suites=("RG-Math", "RG-Logic"), tasks_per_suite=2, problems_per_task=2,
                      samples_per_problem=1, max_new_tokens=16),
        checkpoint_every=2,
        keep_checkpoints=2,
    )
