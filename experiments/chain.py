"""The toy world on the chain family (spade_jax/toy/chain.py; docs/toy_world.md).

    python -m spade_jax.train --experiment=chain:check --workdir=runs/chain_check  # ~5 min
    python -m spade_jax.train --experiment=chain --workdir=runs/chain              # with designer

The agent sees ``Start: 3. Length: 4.`` and answers ``\\boxed{3 4 0 1}`` (count up from the
start modulo ``toy.chain_base``; the score is the share of right leading digits, 0 for an
answer of the wrong length: ``toy.chain_length_rule="exact_length"``, set here; the
family's default is ``"partial"``, which keeps credit for a short answer). The same
policy, model and warm-start recipe as ``toy``; the warm start teaches the answer format
and level-1 copying, no successor information.

``check``: the agent-path question for this family: a fixed pool of the chain games at
levels 2 and 3 (``toy.pool_levels``), no designer, no hints, 96 rounds (one update each;
24 do not show the table being learned: docs/toy_world.md), the held-out grid (levels 2,
3, 4, 6; 20 episodes each, every start equally often) every 4 rounds. Does the agent find
the successor table by RL on this CPU?
"""

import dataclasses

from spade_jax.experiment import ExperimentConfig, load_experiment


def get_config(variant: str = "") -> ExperimentConfig:
    if variant not in ("", "check"):
        raise ValueError(f"chain variants: '' or 'check', got {variant!r}")
    config = load_experiment("toy")
    # One try; a level-9 answer is 22 tokens (\, boxed, {, 9 digits, 8 spaces, }, turn end).
    agent = dataclasses.replace(
        config.agent, max_turns=1, max_turn_tokens=24,
        sampler=dataclasses.replace(config.agent.sampler, max_new_tokens=24))
    config = dataclasses.replace(
        config, name="chain", agent=agent,
        # exact_length: an answer of the wrong length scores 0, so the length is part of
        # the skill (under partial credit the answers shrank to 2 digits whatever the
        # level; docs/toy_world.md, "Chain games").
        toy=dataclasses.replace(config.toy, family="chain", chain_base=5,
                                chain_length_rule="exact_length"),
        # The designer's skill text describes chain games (spade/skills.py CHAIN).
        spade=dataclasses.replace(config.spade, skills="toy_chain"))
    if variant == "check":
        config = dataclasses.replace(
            config,  # the name stays "chain": a variant is named by its experiment
            toy=dataclasses.replace(config.toy, pool_levels=(2, 3),
                                    heldout_levels=(2, 3, 4, 6), heldout_episodes=20),
            spade=dataclasses.replace(
                config.spade, rounds=96, designer_mode="fixed_pool", hint_mode="none",
                regeneration_interval=1, designer_delay=0, use_memory=False, eval_every=4))
    return config
