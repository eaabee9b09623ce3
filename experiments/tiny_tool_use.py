"""CPU-sized SPADE run of the tool-use track: the tiny policy designs tool environments
(``class ToolEnvironment``: tools over hidden state, a success check) and plays them with
native tool calls, in minutes, on a fresh machine.

    python -m spade_jax.train --experiment=tiny_tool_use --workdir=runs/tiny_tool_use

A mechanics run, not a result (as ``tiny``): the same ~1M-parameter policy, warm-started
on the project's tool seed programs (spade/seed_programs/tool_*.py.txt) so its designer
role writes programs that validate under the tool contract, and on demonstrated episodes
of them (spade/tool_demos.py) so its agent role writes tool calls. The agent calls tools as
``<tool_call>{json}</tool_call>`` and reads results as ``tool`` turns; the chat template
renders each environment's tool list into the first prompt. No held-out evaluation: the
tool benchmarks read files the user supplies (docs/evaluation.md).
"""

import dataclasses

from spade_jax.experiment import ExperimentConfig, WarmStartConfig, load_experiment
from spade_jax.rollout.sampler import SamplerConfig
from spade_jax.spade.prompts import TOOL_AGENT_SYSTEM_PROMPT


def get_config() -> ExperimentConfig:
    base = load_experiment("tiny")
    return dataclasses.replace(
        base,
        name="tiny_tool_use",
        # Tool programs (their schemas) are longer than the tiny games: the seeds are
        # 630-710 tokens of the tiny tokenizer.
        designer_sampler=dataclasses.replace(base.designer_sampler, max_new_tokens=800),
        agent=dataclasses.replace(
            # Two tool calls take up to ~75 tokens of the tiny tokenizer.
            base.agent, max_turns=3, max_turn_tokens=80, max_episode_tokens=1536,
            system_prompt=TOOL_AGENT_SYSTEM_PROMPT, action_format="tool_call",
            observation_role="tool",
            sampler=SamplerConfig(max_new_tokens=80, temperature=1.0)),
        # The tool contract and the recipe's six tool skills; the policy writes its own
        # hints (the tool designer writes a program alone).
        spade=dataclasses.replace(
            base.spade, contract="tool", skills="tool", hint_mode="self", eval_every=0),
        # Every tool seed program (warm_start.programs empty: the run's contract picks
        # them), under prompts of every skill and with corpus documents; one demonstrated
        # episode of each (spade/tool_demos.py) teaches the agent the tool-call format.
        # 300 steps: with the agent's 9 examples beside the designer's 18 and the hint
        # writer's 3, 160 steps left every program with a syntax error.
        warm_start=WarmStartConfig(steps=300, batch_size=4, learning_rate=3e-3,
                                   prompts_per_program=6, vary_skills=True, agent_demos=1),
    )
