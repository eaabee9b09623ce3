"""The toy world on the chain family (spade_jax/toy/chain.py; docs/toy_world.md).

    python -m spade_jax.train --experiment=chain:check --workdir=runs/chain_check  # ~5 min
    python -m spade_jax.train --experiment=chain --workdir=runs/chain              # with designer
    python -m spade_jax.train --experiment=chain:hint --workdir=runs/chain_hint    # + a usable hint

The agent sees ``Start: 3. Length: 4.`` and answers ``\\boxed{3 4 0 1}`` (count up from the
start modulo ``toy.chain_base``; the score is the share of right leading digits, 0 for an
answer of the wrong length: ``toy.chain_length_rule="exact_length"``, set here; the
family's default is ``"partial"``, which keeps credit for a short answer). The same
policy, model and warm-start recipe as ``key_digit``; the warm start teaches the answer format
and level-1 copying, no successor information.

The designer run (no variant) is the ``key_digit`` loop on this family with two changes that
keep the designer's programs valid (docs/toy_world.md, "Keeping the designer's programs
valid"): no memory examples in its prompts, and a KL term (0.5) to the warm-started
policy on the designer's tokens.

``hint``: the designer run with a hint the warm-started policy can follow (pairs form,
unspaced answers, hint-following warm start; the comment below).

``check``: the agent-path question for this family: a fixed pool of the chain games at
levels 2 and 3 (``toy.pool_levels``), no designer, no hints, 96 rounds (one update each;
24 do not show the table being learned: docs/toy_world.md), the held-out grid (levels 2,
3, 4, 6; 20 episodes each, every start equally often) every 4 rounds. Does the agent find
the successor table by RL on this CPU?
"""

import dataclasses

from spade_jax.experiment import ExperimentConfig, load_experiment
from spade_jax.rl.train_step import TrainConfig
from spade_jax.toy import chain as chain_family


def get_config(variant: str = "") -> ExperimentConfig:
    if variant not in ("", "check", "hint"):
        raise ValueError(f"chain variants: '', 'check' or 'hint', got {variant!r}")
    config = load_experiment("key_digit")
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
        # The designer's skill text describes chain games (spade/skills.py CHAIN). No memory
        # examples in its prompts: with them a third to a half of the programs failed
        # from the second regeneration on, before any designer update had a non-zero
        # advantage; without them 8-9 of 9 validated (docs/toy_world.md, "Keeping the
        # designer's programs valid").
        spade=dataclasses.replace(config.spade, skills="toy_chain", use_memory=False),
        # A k3 KL to the warm-started policy on the designer's tokens: without it the
        # programs stopped validating within 4 designer updates that had a signal (the
        # turn-end token after the closing fence lost its probability); with it they held
        # through 96 rounds in 2 of 3 seeds (the third fell below 0.5 in 10 of 48
        # regenerations; 2.0 holds them but freezes the designer's levels: same section).
        train=_with_designer_kl(config.train, 0.5))
    if variant == "hint":
        # A hint the warm-started policy follows: the successor table as one `d>e` token
        # per digit (`Next: 0>1 1>2 2>3 3>4 4>0.`), answers without spaces (the digit just
        # written is the token that looks up the next one), and 2,000 warm-start examples
        # that follow such a hint on other tables (never the games' own), over 1,000
        # steps. The warm-started policy then solves levels 1-6 with the games' hint and
        # only level 1 without it; the cycle hint (`Cycle: 0 1 2 3 4 0.`) was never
        # followed. In the loop the policy's own hints were malformed tables, with 24
        # hint-writer examples (repeated pieces) and with the 200 set here (program text
        # run in), so the hint arm did not help (docs/toy_world.md, "A hint the agent can
        # follow"); hence the form check below.
        config = dataclasses.replace(
            config,
            toy=dataclasses.replace(config.toy, chain_hint_form="pairs", chain_separator="",
                                    chain_hint_following=2000, hint_examples=200),
            warm_start=dataclasses.replace(config.warm_start, steps=1000,
                                           loss_mean="sequence"),
            # A written hint is used only in the table's form (every digit once, in order:
            # `Next: 0>d 1>d 2>d 3>d 4>d.`); others are tried again (hint_attempts). What
            # each digit is sent to is still the policy's.
            spade=dataclasses.replace(config.spade, hint_pattern=(
                chain_family.pairs_hint_pattern(config.toy.chain_base))))
    if variant == "check":
        config = dataclasses.replace(
            config,  # the name stays "chain": a variant is named by its experiment
            # no designer samples, so no KL term (it would only cost a reference pass)
            train=_with_designer_kl(config.train, 0.0),
            toy=dataclasses.replace(config.toy, pool_levels=(2, 3),
                                    heldout_levels=(2, 3, 4, 6), heldout_episodes=20),
            spade=dataclasses.replace(
                config.spade, rounds=96, designer_mode="fixed_pool", hint_mode="none",
                regeneration_interval=1, designer_delay=0, use_memory=False, eval_every=4))
    return config


def _with_designer_kl(train: TrainConfig, kl_coef: float) -> TrainConfig:
    """``train`` with the designer's policy loss at ``kl_coef``."""
    designer = train.designer
    return dataclasses.replace(train, designer=dataclasses.replace(
        designer, loss=dataclasses.replace(designer.loss, kl_coef=kl_coef)))
