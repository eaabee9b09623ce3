"""The toy world: a CPU run where SPADE's mechanism is visible (docs/toy_world.md).

    python -m spade_jax.train --experiment=toy --workdir=runs/toy_s0
    python -m spade_jax.train --experiment=spade_self_generation:toy --workdir=runs/toy_selfgen_s0
    python -m spade_jax.compare runs/toy_* --out runs/compare

Add ``--set warm_start.cache_dir=runs/warm_cache`` to each: the runs of one seed then train
the warm start once (a third of a run) and load it after.

One ~755k-parameter Qwen3-MoE policy, trained from scratch, plays both roles on chain games
(spade_jax/toy/chain.py): the agent sees ``Start: 3. Length: 4.`` and writes the digits
counting up from the start through a successor table it is never told (``\\boxed{3401}``);
the designer writes the game at a level (the length) it chooses, and a hint that states the
table (``Next: 0>1 1>2 2>3 3>4 4>0.``). The warm start teaches the designer the program at
every level, the hint writer the table's form, and the agent the answer format, level 1
(a copy) and following a table written in the prompt on other tables (never the games'
own): so the agent starts able to use a hint and unable to play above level 1 without one.
What it learns without the hint, and where the designer moves, are RL's doing.

This is ``chain:hint`` (experiments/chain.py) run for 96 rounds with nucleus sampling for
the designer, 1,000 no-hint agent warm-start examples, a designer warm start uniform over
the levels, hint following taught up to level 9 and invalid programs trained at -1
(below). A toy world, not the paper's claims: the curves show the loop's parts working
together on a task a ~1M-parameter model learns in minutes. 21-37 minutes on 2 cores with other runs sharing
them (docs/toy_world.md, "The toy experiment").
"""

import dataclasses

from spade_jax.experiment import ExperimentConfig, load_experiment


def get_config(variant: str = "") -> ExperimentConfig:
    """``variant`` "check": the designer path's learning check
    (tests/toy/test_designer_check.py, in CI; the agent path's is ``key_digit:check``);
    "twelve": the family's top level at 12, beyond the hint's reach (``_twelve``);
    "replay": the warm start's designer examples replayed in every update (``_replay``)."""
    if variant not in ("", "check", "twelve", "replay"):
        raise ValueError(f"toy variants: '', 'check', 'twelve' or 'replay', got {variant!r} "
                         "(the chain family's are chain:<variant>)")
    config = _toy()
    if variant == "twelve":
        return _twelve(config)
    if variant == "replay":
        return _replay(config)
    return _check(config) if variant == "check" else config


def _toy() -> ExperimentConfig:
    config = load_experiment("chain:hint")
    return dataclasses.replace(
        config, name="toy",
        # 96 rounds: the held-out pass@1 and the designer's levels move in the second half
        # of a run (48 rounds did not show them: docs/toy_world.md, "Chain games").
        # Invalid attempts trained with a designer reward of -1 (the paper text's penalty;
        # the recipe never trains them): without it the shared weights' program writing
        # eroded as they trained, and validity fell below 0.5 in 6-9 of 48
        # regenerations in 2 of 3 seeds; with it, in 1-3 of 48 in
        # every seed, recovering at the next (docs/toy_world.md, "fifth pass").
        spade=dataclasses.replace(config.spade, rounds=96, invalid_penalty=-1.0),
        # Nucleus sampling for the designer: under chain:hint's sampling (T = 0.8, no
        # filter) the programs fell below half valid in 10-16 of 48 regenerations as the
        # agent's updates eroded the shared weights' program writing (syntax errors,
        # blocks run past the budget); the tail that the filter cuts is where those tokens
        # came from (docs/toy_world.md, "The toy experiment").
        designer_sampler=dataclasses.replace(config.designer_sampler, top_p=0.9),
        # 1,000 no-hint agent examples (chain:hint has 96, beside 2,000 hint-following
        # ones): with 96 the seed-2 warm start wrote no-hint answers of the wrong length
        # and nothing rose; with 1,000 it writes the right length at chance accuracy (the
        # digits after the start are uniform, so the answers are not in it) and learns
        # (docs/toy_world.md, "The toy experiment").
        # The designer's warm start writes every level equally often (chain:hint weights
        # levels 1-2 four times levels 7-9): with chain:hint's weights the warm-started
        # designer, sampled as toy samples it, never wrote levels 7 and 8, so RL could not
        # move it there when the agent mastered level 6; uniform, it writes levels 7-9 from
        # the start (scripts/toy_warm_start_probe.py; docs/toy_world.md, "The toy
        # experiment").
        # Hint following is taught on answers up to level 9 (chain:hint: up to 6, one wrap
        # of the table): with 6, the hint arm failed at levels 7-9, so the regret term paid
        # nothing there and the designer stayed 1.7-5 levels under an agent that had
        # mastered level 8, and the programs of level 9 (negative advantages round after
        # round) were the ones that stopped validating. The examples still follow other
        # tables than the games' own (docs/toy_world.md, "The toy experiment").
        toy=dataclasses.replace(config.toy, agent_examples=1000,
                                designer_level_weights=(1,) * 9, chain_hint_max_level=9),
        # A checkpoint every 12 rounds (key_digit: only the last): a 40-60 minute run
        # killed near its end (the kernel's OOM killer, 2026-12-07) lost everything; a
        # checkpoint changes nothing in the run (resumes are bit-exact:
        # tests/cli/test_train_cli.py).
        checkpoint_every=12)


def _twelve(config: ExperimentConfig) -> ExperimentConfig:
    """``toy`` with the family's top level at 12 (``toy.chain_max_level``; toy: 9), hint
    following still taught up to level 9. Two things ``toy`` lacks, by construction: levels
    above the hint's reach, where both arms fail until the agent learns the table without
    the hint (the intractable regime, seen in 2 of 4 ``toy`` seeds), and levels above an
    agent that has mastered 1-9 (in ``toy``'s seed 1 every level the designer could write
    was mastered from round ~79, so its reward was flat and its level drifted). The
    designer's warm start is uniform over the twelve levels, and the held-out grid adds
    levels 10 and 12 (docs/toy_world.md, "Twelve levels")."""
    toy = dataclasses.replace(config.toy, chain_max_level=12, designer_level_weights=(1,) * 12,
                              heldout_levels=(2, 3, 4, 6, 8, 10, 12))
    # Room for a spaced twelve-digit answer (28 tokens; toy's unspaced ones need 17): the
    # runs in docs/toy_world.md were made with 32.
    agent = dataclasses.replace(config.agent, sampler=dataclasses.replace(
        config.agent.sampler, max_new_tokens=32))
    return dataclasses.replace(config, name="toy_twelve", toy=toy, agent=agent)


def _replay(config: ExperimentConfig) -> ExperimentConfig:
    """``toy`` with 4 of the warm start's designer examples replayed as supervised rows in
    every update, their NLL added at weight 1.0 (PPO-ptx), the tokens of each program's
    stated level left out of it (``spade.supervised_replay_masks_level``): the replay holds
    how a program is written, which the agent's updates of the shared weights otherwise
    erode (validity dips below 0.5 in 1-3 of 48 regenerations of every ``toy`` seed), and
    leaves the choice of level to RL. About twice ``toy``'s run time: the replayed
    programs (~300 tokens) pad every update (docs/toy_world.md, "Keeping the program
    writing")."""
    spade = dataclasses.replace(config.spade, supervised_replay=4,
                                supervised_replay_masks_level=True)
    train = dataclasses.replace(config.train, supervised_coef=1.0)
    return dataclasses.replace(config, name="toy_replay", spade=spade, train=train)


def _check(config: ExperimentConfig) -> ExperimentConfig:
    """``toy`` shortened to the designer path's question: does the designer move toward the
    agent's frontier because of its reward? The agent plays every game but is not trained
    (``spade.train_agent=False``), so its frontier stays where the warm start left it
    (level 1 without the hint, levels 2-4 with it); every round writes 16 programs,
    scored and trained in the same round. The designer starts writing every level; under
    the blend reward its games should move into the agent's frontier (levels 2-4, where
    the hint helps and the no-hint win rate is near the band). With its rewards handed to
    the wrong programs it has no direction (and the advantages it trains on stop matching
    its games' scores), with the hint and no-hint returns swapped or the advantage's sign
    flipped it is pushed away (``spade_jax.toy.check.
    check_designer_path``; ``python scripts/planted_faults.py --check designer_path``)."""
    toy = dataclasses.replace(
        config.toy,
        # Hint following up to level 4 only (toy: 9): the short answers are learned in a
        # few hundred steps, and the hint arm then helps at levels 2-4, where the designer
        # should go.
        chain_hint_max_level=4, chain_hint_following=800, agent_examples=300,
        designer_examples=300, hint_examples=100)
    # 16 programs a round (toy: 8): with 8 (and the KL term below at 0.5), a run whose
    # rewards were permuted across the programs ended with 0.38-0.50 of its games at the
    # frontier against 0.66-0.97 clean; with 16, 0.40-0.41 against 0.70-0.94. No held-out
    # evaluation: the agent does not change.
    spade = dataclasses.replace(
        config.spade, rounds=5, envs_per_round=16, regeneration_interval=1, designer_delay=0,
        train_agent=False, eval_every=0)
    # The designer's KL term to its warm start at 0.1 (toy: 0.5). At 0.5 the tilt a
    # reward can give the level the designer writes is capped near exp(reward gap / 0.5),
    # a few-fold over 9 levels: the clean runs ended with 0.34-0.94 of their games at the
    # frontier and seed 4 failed. At 0.1 all five seeds are at 0.75-1.00 by the fifth
    # round and stay there to the twelfth, and every planted fault already fails by the
    # fifth (docs/toy_world.md, "The designer path's check"), so 5 rounds (7 until
    # 2026-12-07: about 24 s more alone, and the seed-1 permutation failed one claim, not two).
    designer = dataclasses.replace(config.train.designer, loss=dataclasses.replace(
        config.train.designer.loss, kl_coef=0.1))
    return dataclasses.replace(
        config, toy=toy, spade=spade,
        warm_start=dataclasses.replace(config.warm_start, steps=550, length_buckets=3),
        train=dataclasses.replace(config.train, designer=designer,
                                  optimizer=dataclasses.replace(config.train.optimizer,
                                                                learning_rate=1e-4)))
