"""The first toy world, key-digit games (docs/toy_world.md; named ``toy`` until 2026-12-05).

    python -m spade_jax.train --experiment=key_digit --workdir=runs/key_digit
    python -m spade_jax.train --experiment=key_digit:check --workdir=...  # the CI learning check's run

Its loop never showed the agent learning the family (docs/toy_world.md, "What is not shown
yet"); ``toy`` is now the chain family (experiments/toy.py), built on this experiment's
policy, tokenizer and warm-start recipe through experiments/chain.py.

One small Qwen3-MoE policy, trained from scratch, plays both roles on the key-digit family
(spade_jax/toy/family.py): the designer writes the family's game at a level it chooses,
the agent plays it. The warm start teaches the designer the program (every level, easy ones
more often) and the agent level 1 only; what the agent learns above level 1 and where the
designer moves are RL's doing. A toy world, not the paper's claims: the curves show the
loop's mechanics working together (the agent improving, the designer following it), on a
task a ~1M-parameter model can learn in minutes.
"""

import dataclasses

from spade_jax.envs.config import SandboxConfig
from spade_jax.experiment import (
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
from spade_jax.toy.world import ToyConfig


def get_config(variant: str = "") -> ExperimentConfig:
    """``variant`` "check": the agent-path learning check of CI
    (tests/toy/test_learning_check.py, ~2 min): the same policy, warm start and agent loop
    on the family's constant-key games (the key is always 7), from a fixed pool with no
    designer, 16 rounds. Its return rises within a dozen updates unless the agent's
    signal path is broken (scripts/planted_faults.py)."""
    if variant not in ("", "check"):
        raise ValueError(f"key_digit variants: '' or 'check', got {variant!r}")
    config = _key_digit()
    if variant == "check":
        config = dataclasses.replace(
            config,
            # No designer and no hints here, so their warm-start examples are one each (the
            # config needs one), and two length groups keep the agent's short examples from
            # being padded to a program's length: the warm start took 73 s with 96 of each
            # and one length, a few seconds now (docs/toy_world.md, "The learning checks").
            warm_start=dataclasses.replace(config.warm_start, steps=150, length_buckets=2),
            toy=dataclasses.replace(config.toy, pool="constant_key", designer_examples=1,
                                    hint_examples=1),
            spade=dataclasses.replace(
                config.spade, rounds=16, designer_mode="fixed_pool", hint_mode="none",
                regeneration_interval=1, designer_delay=0, use_memory=False, eval_every=0))
    return config


def _key_digit() -> ExperimentConfig:
    return ExperimentConfig(
        name="key_digit",
        seed=0,
        model=ModelSpec(
            architecture=ModelConfig(
                architecture="Qwen3MoeForCausalLM", vocab_size=1024, hidden_size=128,
                num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=256,
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                norm_topk_prob=True, max_position_embeddings=2048,
            ),
            dtype="float32",
            moe_impl="blocked",
        ),
        tokenizer=TokenizerSpec(vocab_size=1024, text="toy"),
        designer_sampler=SamplerConfig(max_new_tokens=320, temperature=0.8),
        # Two turns: a first answer, and after "Wrong. The key digit is the <rule>." a
        # second one; replies are one box.
        agent=AgentLoopConfig(
            max_turns=2, max_turn_tokens=8, max_episode_tokens=256, action_format="boxed",
            sampler=SamplerConfig(max_new_tokens=8, temperature=1.0), env_threads=2,
        ),
        sandbox=SandboxConfig(call_deadline_s=2.0, spare_workers=2),
        # Rows padded to a few batch sizes: the sequence count varies by round (designer
        # samples join every other round), and each new shape is a compile.
        train=TrainConfig(optimizer=OptimizerConfig(learning_rate=3e-4, warmup_steps=1),
                          row_buckets=(24, 48, 72, 96)),
        spade=SpadeConfig(
            rounds=48, envs_per_round=8, regeneration_interval=2, plays_per_game=8,
            hint_plays=4, designer_delay=1, max_design_attempts=2,
            hint_mode="self", hint_max_tokens=16, hint_temperature=0.3,
            # Each role's loss is its own mean (per-role aggregation), so the recipe's
            # scale-up of designer advantages (x16 here) would only blow up the
            # designer's gradient: its programs stopped validating within 20 rounds.
            designer_reward="blend", max_env_reward_scale=1.0,
            contract="reference", prompt_style="compact",
            # A memory example is shown by its first lines: its LEVEL and RULE.
            skills="toy", use_corpus=False, docs_per_prompt=0, memory_examples=1,
            max_program_chars=28,
            learnable_window=4, eval_every=4, probe_episodes=0,
        ),
        warm_start=WarmStartConfig(steps=200, batch_size=8, learning_rate=3e-3),
        toy=ToyConfig(enabled=True),
        checkpoint_every=1000,
        keep_checkpoints=2,
        best_checkpoint_metric="",
    )
