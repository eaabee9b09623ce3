"""SPADE's tool-use track on Qwen3-30B-A3B-Instruct-2507 with the published recipe's tool
settings (``cmd/tool_use/_train_spade_blend.sh`` with TOOL_MODEL_SIZE=30b).

    python -m spade_jax.train --experiment=spade_tool_use_30b_a3b \
        --hf_checkpoint=/ckpt/Qwen3-30B-A3B-Instruct-2507 \
        --corpus=gs://BUCKET/tool_corpus/*.jsonl --workdir=gs://BUCKET/runs/spade_tool_30b

The games experiment (``qwen3_30b_a3b``) with what the tool launch changes: the designer
writes ``class ToolEnvironment`` programs (``spade.contract="tool"``) for the recipe's six
tool skills (3 per window, as the games track rotates them); the agent calls tools
natively (``<tool_call>{json}</tool_call>``, results back as ``tool`` turns, the tool list
rendered by the checkpoint's chat template); new environments every 8 steps and designer
samples trained 8 steps after they were written; hints up to 2048 tokens; corpus
documents cut to 4000 words; KL 0.005 to the initial policy (low_var_kl = k3). Not
reproduced: the recipe's LLM solvability auditor (``--spade-use-env-validator``); our
validator runs the program's own tools instead (docs/environments.md).
"""

import dataclasses

from spade_jax.experiment import CorpusSpec, ExperimentConfig, load_experiment
from spade_jax.rl.train_step import RoleConfig, TrainConfig
from spade_jax.spade.prompts import TOOL_AGENT_SYSTEM_PROMPT


def get_config() -> ExperimentConfig:
    base = load_experiment("qwen3_30b_a3b")
    return dataclasses.replace(
        base,
        name="spade_tool_use_30b_a3b",
        agent=tool_agent(base),
        spade=dataclasses.replace(
            base.spade, contract="tool", skills="tool", regeneration_interval=8,
            designer_delay=8, hint_max_tokens=2048, max_doc_words=4000),
        corpus=CorpusSpec(domain="tool", stand_in=False),
        train=with_kl(base.train, 0.005),
    )


def tool_agent(base: ExperimentConfig):
    """The games agent turned tool agent: native tool calls and ``tool`` turns, a system
    prompt that frames the tools (the games' first-turn frame asks for boxed answers)."""
    return dataclasses.replace(
        base.agent, system_prompt=TOOL_AGENT_SYSTEM_PROMPT, action_format="tool_call",
        observation_role="tool", first_turn_template="{observation}")


def with_kl(train: TrainConfig, kl_coef: float) -> TrainConfig:
    """Both roles' policy losses with KL ``kl_coef`` to the initial policy; as for the 8B
    games run (experiments/qwen3_8b.py), the KL term makes slime divide a short batch's
    summed loss by the global batch (``pooled_min_denominator``)."""
    def role(r: RoleConfig) -> RoleConfig:
        return dataclasses.replace(r, loss=dataclasses.replace(r.loss, kl_coef=kl_coef))

    return dataclasses.replace(train, pooled_min_denominator=192, agent=role(train.agent),
                               designer=role(train.designer))
