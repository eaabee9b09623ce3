"""SPADE on Qwen3-30B-A3B-Instruct-2507 with the published recipe's numbers (games track).

    python -m spade_jax.convert --hf_dir=/ckpt/Qwen3-30B-A3B-Instruct-2507 --out_dir=/ckpt/q30b
    python -m spade_jax.train --experiment=qwen3_30b_a3b --hf_checkpoint=/ckpt/Qwen3-30B-A3B-Instruct-2507 \
        --corpus=gs://BUCKET/corpus/*.parquet --workdir=gs://BUCKET/runs/spade_30b

The recipe (docs/spade.md, docs/reference_parity.md): 400 steps; new games every 4 steps,
24 per regeneration (3 of the 6 skills per window, 8 games each), each played 8 times per
step (global batch 24 x 8 = 192), 16 hint plays per game at the regeneration step with a
hint the policy writes itself (T = 0.3); designer samples trained 4 steps after they were
written with the blend reward, centred per skill and scaled; rejection sampling up to 5
attempts per game. Sampling T = 0.6, top-p 0.95, top-k 20; 25 turns, 8192 tokens per
turn, 32768 context, designer 16384 tokens; thinking off.
The paper text's variant is one experiment away: experiments/spade_paper_text.py.

Sharding: 128 experts over the expert axis (expert parallelism), the rest FSDP.
"""

from spade_jax.envs import SandboxConfig
from spade_jax.experiment import CorpusSpec, ExperimentConfig, ModelSpec, TokenizerSpec
from spade_jax.rl.optim import OptimizerConfig
from spade_jax.rl.train_step import RoleConfig, TrainConfig
from spade_jax.rollout.agent_loop import AgentLoopConfig
from spade_jax.rollout.sampler import SamplerConfig
from spade_jax.sharding import MeshConfig
from spade_jax.spade.config import SpadeConfig
from spade_jax.spade.prompts import REFERENCE_AGENT_FIRST_TURN_TEMPLATE

# The recipe's sampling for the designer, the agent and (hint_temperature) the hint writer.
RECIPE_SAMPLING = dict(temperature=0.6, top_p=0.95, top_k=20)


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
        # Prefill in row groups of at most 8 x 32768 tokens, the engine's budget below
        # (docs/scale_out.md, "Prefill on the decode layout": 256 whole 32k rows are refused).
        designer_sampler=SamplerConfig(max_new_tokens=16384, cache_dtype="bfloat16",
                                       max_prefill_tokens=8 * 32768, **RECIPE_SAMPLING),
        # No system prompt: the first user turn frames the game and asks for the answer in
        # \boxed{} (the last box of a reply is the action).
        agent=AgentLoopConfig(max_turns=25, max_turn_tokens=8192, max_episode_tokens=32768,
                              system_prompt=None, enable_thinking=False,
                              action_format="boxed",
                              first_turn_template=REFERENCE_AGENT_FIRST_TURN_TEMPLATE,
                              # A reply cut at 8192 tokens ends the episode, score 0.
                              end_on_cut_reply=True,
                              # 256 rows per batch bounds the KV cache per chip (README
                              # AOT table: re-run `python -m spade_jax.aot` for 32k context).
                              # Prefill budget of one call, the engine's admits included
                              # (the engine reads it here): 8 rows x 32768 tokens. docs/scale_out.md
                              # ("prefill:auto" table): on the decode layout the prefill
                              # temporaries grow ~18.8 GiB per 32k-token row per chip, and
                              # beside the 256 slots' 40960-slot cache about 8 such rows fit
                              # (~72%, arithmetic, not compiled).
                              sampler=SamplerConfig(max_new_tokens=8192, cache_dtype="bfloat16",
                                                    max_rows=256, max_prefill_tokens=8 * 32768,
                                                    **RECIPE_SAMPLING)),
        # The recipe's update (slime flags of cmd/games/train_spade_30b.sh): Adam lr 1e-6
        # constant, weight decay 0.1, betas 0.9/0.98, clip 1.0; PPO clip 0.2/0.28, KL 0,
        # TIS clamp 2; designer and agent samples in one per-sample mean.
        train=TrainConfig(
            optimizer=OptimizerConfig(learning_rate=1e-6, warmup_steps=0, schedule="constant",
                                      weight_decay=0.1, b1=0.9, b2=0.98, clip_norm=1.0),
            # Advantages: agent GRPO over a game's plays (std eps 1e-8); designer centred
            # per skill, no std (dr_grpo with spade.designer_groups="skill"), scaled.
            agent=RoleConfig(advantage_estimator="grpo", advantage=dict(eps=1e-8),
                             importance_correction="tis", importance=dict(clamp=2.0),
                             policy_loss="grpo", loss=dict(
                clip_eps=0.2, clip_eps_high=0.28, kl_coef=0.0)),
            designer=RoleConfig(advantage_estimator="dr_grpo",
                                importance_correction="tis", importance=dict(clamp=2.0),
                                policy_loss="grpo", loss=dict(
                clip_eps=0.2, clip_eps_high=0.28, kl_coef=0.0)),
            loss_aggregation="pooled",
            # Router replay (issue 22) is off, as the recipe's launch leaves it: one --set
            # away (train.router_replay=True, the trainer then runs each MoE layer on the
            # experts the sampler chose; docs/reference_parity.md).
            microbatches=16, compute_dtype="bfloat16", router_replay=False,
            logit_chunk=1024,  # [tokens, 151k vocab] logits 1024 positions at a time
        ),
        spade=SpadeConfig(
            rounds=400, envs_per_round=24, regeneration_interval=4, plays_per_game=8,
            hint_plays=16, designer_delay=4, designer_group_size=1, max_design_attempts=5,
            invalid_penalty=None, hint_mode="self", hint_temperature=0.3, hint_max_tokens=4096,
            skills="main", skills_per_window=3, designer_reward="blend",
            designer_groups="skill", max_env_reward_scale=50.0, contract="reference",
            # The recipe: one document cut to 6000 words (the character cap only bounds
            # text without spaces); memory of 200, first in first out, 2 games to build on
            # from the top 10 by regret with win rate in [0.15, 0.85] and 1 to avoid, each
            # shown as its program's first 2000 characters.
            docs_per_prompt=1, max_doc_words=6000, max_doc_chars=60_000, max_program_chars=2000,
            memory_capacity=200, memory_examples=2, memory_selection="recipe", eval_every=20,
            # The authors' code, second audit (docs/reference_parity.md, issue 30): the
            # update's samples cut to the global batch, designer samples first; a game in
            # memory at the end of the round that wrote it; missing games written later
            # with ceil(192 / games) plays each; a play over 300 s of environment time or
            # a step over the sandbox's 30 s dropped and its game blocklisted; fresh
            # document and examples per attempt, uniform corpus draws; the program read
            # as the first block with f-string braces repaired; the last window's
            # designer samples not trained; hints sampled at top-p 0.9.
            global_batch=192, memory_at="regeneration", regenerate_missing_games=True,
            play_env_seconds=300.0, drop_failed_plays=True, fresh_prompt_per_attempt=True,
            corpus_draws="uniform", flush_at_end=False, hint_top_p=0.9,
            program_extraction="recipe"),
        # The recipe's launch requires its corpus file: no silent stand-in
        # (python -m spade_jax.train --corpus=gs://B/corpus/*.parquet, or knowingly
        # --set corpus.stand_in=True).
        corpus=CorpusSpec(domain="game", stand_in=False),
        # The recipe's play wrapper: a game's error in step() is the agent's observation,
        # reward -1 (validation stays strict); a played step may take 30 s (validation
        # keeps its 1 s CPU budget), past that the play is dropped and the game blocklisted.
        sandbox=SandboxConfig(lenient_play_steps=True, play_call_deadline_s=30.0,
                              play_call_cpu_budget_s=30.0),
        checkpoint_every=16,
    )
