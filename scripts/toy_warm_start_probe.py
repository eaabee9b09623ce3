"""What a toy experiment's warm start leaves the policy able to do, before any RL step
(docs/toy_world.md, "Keeping the designer's programs valid").

    python scripts/toy_warm_start_probe.py --workdir /tmp/probe --experiment chain
    python scripts/toy_warm_start_probe.py --workdir /tmp/probe --experiment chain \
        --set toy.chain_hint_following=96 --set warm_start.loss_mean=sequence

Runs the experiment's warm start (its tokenizer is trained in ``--workdir`` or reused from
there), then:

- agent: plays the chain games at levels 1-6 and 8 (``--episodes`` each, the agent's
  sampler and temperature) without and with the games' hint, and prints the exact-answer
  rate and the first three answers per level;
- designer: samples one program for each of ``--prompts`` designer prompts, a third with
  no memory example, a third with one to build on, a third with one to avoid (random
  levels and scores), and prints how many validate per kind and the levels the valid
  programs written with no memory example state (the levels RL can start from).

Seeded: the same command prints the same numbers. About 2-4 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import collections
import json
import types

import numpy as np

from spade_jax import run
from spade_jax.envs import make_env
from spade_jax.experiment import load_experiment
from spade_jax.overrides import apply_overrides
from spade_jax.rollout.agent_loop import EpisodeSpec
from spade_jax.seeding import Phase, derive_seed
from spade_jax.spade.design import Attempt
from spade_jax.spade.env_stats import stated_level
from spade_jax.spade.loop import HintedEnv
from spade_jax.toy import chain, family

LEVELS = (1, 2, 3, 4, 5, 6, 8)


def episode_spec(config, pool, level: int, index: int, hinted: bool, env_id: str) -> EpisodeSpec:
    """Episode ``index`` of the chain game at ``level`` (seeded from Phase.EVAL), shown the
    games' hint when ``hinted``."""
    base, rule = config.toy.chain_base, config.toy.chain_length_rule
    env = make_env(chain.render_program(level, base, rule), pool, contract="reference",
                   max_turns=config.agent.max_turns)
    if hinted:
        env = HintedEnv(env, chain.hint_for(base, config.toy.chain_hint_form))
    return EpisodeSpec(env=env, env_id=env_id,
                       seed=derive_seed(config.seed, level, Phase.EVAL, index))


def agent_rates(config, loop, pool, episodes: int, shown: dict) -> dict[str, dict[str, float]]:
    """Exact-answer rate per level, without and with the games' hint; ``shown`` gets the
    first three actions per arm and level (what the policy writes)."""
    out = {}
    for hinted in (False, True):
        specs = [episode_spec(config, pool, level, i, hinted, f"L{level}")
                 for level in LEVELS for i in range(episodes)]
        try:
            records = loop.run_episodes(specs, seed=derive_seed(config.seed, int(hinted),
                                                                Phase.EVAL))
        finally:
            for spec in specs:
                spec.env.close()
        solved = collections.defaultdict(list)
        arm = shown.setdefault("hint" if hinted else "no_hint", {})
        for spec, record in zip(specs, records, strict=True):
            solved[spec.env_id].append(float(record.return_) == 1.0)
            samples = arm.setdefault(spec.env_id, [])
            if len(samples) < 3:
                samples.append(record.actions[0] if record.actions else "")
        out["hint" if hinted else "no_hint"] = {k: round(float(np.mean(v)), 2)
                                                for k, v in solved.items()}
    return out


def mixed_batch_rates(config, loop, pool, episodes: int) -> dict[str, dict[str, float]]:
    """The two arms played in one batch, as the loop plays a regeneration round's no-hint
    and hint plays together (prompts of different lengths in one sampler call)."""
    specs = [episode_spec(config, pool, level, i, hinted,
                          f"{'hint' if hinted else 'no_hint'}/L{level}")
             for level in LEVELS for i in range(episodes) for hinted in (False, True)]
    try:
        records = loop.run_episodes(specs, seed=derive_seed(config.seed, 2, Phase.EVAL))
    finally:
        for spec in specs:
            spec.env.close()
    solved = collections.defaultdict(list)
    for spec, record in zip(specs, records, strict=True):
        solved[spec.env_id].append(float(record.return_) == 1.0)
    return {k: round(float(np.mean(v)), 2) for k, v in sorted(solved.items())}


def written_hints(config, loop, programs: int) -> list[str]:
    """The hints the policy writes (as the loop's hint writer does, ``write_hints``) for
    programs at levels 1 .. ``programs``."""
    base, rule = config.toy.chain_base, config.toy.chain_length_rule
    games = [types.SimpleNamespace(program=family.as_loop_program(
        chain.render_program(level, base, rule)), hint=None)
             for level in range(1, programs + 1)]
    loop.designer.write_hints(games, step=0)
    return [game.hint for game in games]


def designer_validity(config, loop, tokenizer, prompts: int) -> dict[str, str]:
    designer, draw = loop.designer, np.random.default_rng(config.seed)
    base, rule = config.toy.chain_base, config.toy.chain_length_rule
    ids, kinds = [], []
    for i in range(prompts):
        kind = ("none", "build_on", "avoid")[i % 3]
        examples = [] if kind == "none" else [{
            "program": family.as_loop_program(chain.render_program(int(draw.integers(1, 10)),
                                                                base, rule)),
            "hint": "",
            "regime": "frontier" if kind == "build_on" else "mastered",
            "win_rate": float(draw.choice([0.0, 0.125, 0.5, 1.0])),
            "regret": float(draw.uniform(-0.2, 0.3)), "build_on": kind == "build_on"}]
        ids.append(list(tokenizer.apply_chat_template(
            designer.messages(chain.SKILL, [], examples), add_generation_prompt=True,
            enable_thinking=False)))
        kinds.append(kind)
    tokens, logprobs, *_ = designer.generate(
        ids, seed=derive_seed(config.seed, 0, Phase.DESIGN, 0), purpose="design")
    batch = [Attempt(i, 0, chain.SKILL, p, list(t), list(lp))
             for i, (p, t, lp) in enumerate(zip(ids, tokens, logprobs, strict=True))]
    designer.validate(batch, [f"probe{i}" for i in range(len(batch))],
                      [derive_seed(config.seed, 0, Phase.VALIDATION, i) for i in range(len(batch))])
    valid = collections.defaultdict(list)
    levels = collections.Counter()
    for kind, attempt in zip(kinds, batch, strict=True):
        valid[kind].append(attempt.verdict.ok)
        if attempt.verdict.ok and kind == "none":
            levels[stated_level(attempt.parsed.program)] += 1
    out = {kind: f"{sum(v)}/{len(v)}" for kind, v in valid.items()}
    # The stated levels of the valid programs written with no memory example (toy's
    # prompts): the levels the designer can explore at the start of RL.
    out["levels_no_example"] = {str(level): n for level, n in sorted(levels.items())}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--experiment", default="chain")
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    parser.add_argument("--episodes", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=96)
    args = parser.parse_args()
    config = apply_overrides(load_experiment(args.experiment), args.overrides)
    if not (config.toy.enabled and config.toy.family == "chain"):
        raise SystemExit("the probe plays chain games: use a chain experiment")
    tokenizer = run.build_tokenizer(config.tokenizer, args.workdir, config.toy)
    pool = run.build_pool(config)
    try:
        model = run.build_model(config.model, tokenizer, config.seed, None)
        trainer = run.Trainer(model, run._with_sampler_temperatures(config),
                              pack=run._pack_config(config, tokenizer, model, None),
                              seed=config.seed)
        loop = run.build_loop(config, tokenizer=tokenizer, pool=pool,
                              policy=trainer.sampling_policy, update=trainer.update,
                              mesh=trainer.sample_mesh)
        trainer.state = run._warm_start(config, tokenizer, trainer.graphdef, trainer.state, loop)
        shown: dict = {}
        print(json.dumps({"overrides": args.overrides,
                          "agent_exact_rate": agent_rates(config, loop, pool, args.episodes,
                                                          shown),
                          "agent_actions": shown,
                          "written_hints": written_hints(config, loop, 8),
                          "mixed_batch": mixed_batch_rates(config, loop, pool, args.episodes),
                          "designer_valid": designer_validity(config, loop, tokenizer,
                                                              args.prompts)}, indent=1))
    finally:
        pool.close()


if __name__ == "__main__":
    main()
