"""Rows of docs/reference_parity.md that no other test checked: the recipe experiments'
prompt and memory settings, the temperature each role's log-probs are scored at, and the
fixed-designer pool's draws without replacement. Cheap: configs and the draw alone, no
model, no sandbox."""

from __future__ import annotations

import dataclasses

import pytest

from spade_jax.experiment import load_experiment

RECIPES = ["qwen3_30b_a3b", "qwen3_8b", "qwen3_4b"]


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_experiments_set_the_recipes_prompt_and_memory_settings(name):
    """The recipe: one corpus document per designer attempt, cut to 6000 words; memory
    picks 2 games to build on from the top 10 by regret plus 1 to avoid, each shown as the
    first 2000 characters of its program (the defaults differ: regime selection, no word
    cut, 4000 characters)."""
    s = load_experiment(name).spade
    assert (s.docs_per_prompt, s.max_doc_words) == (1, 6000)
    assert (s.memory_selection, s.memory_examples, s.max_program_chars,
            s.memory_capacity) == ("recipe", 2, 2000, 200)
    # Ours on purpose (docs/reference_parity.md): held-out evaluation every 20 rounds.
    assert s.eval_every == 20


@pytest.mark.parametrize("name", RECIPES)
def test_each_role_is_scored_at_the_temperature_it_sampled_at(name):
    """The recipe samples at 0.6 and (likely) scores log-probs at 1.0; the run scores each
    role at its own sampler's temperature; a role temperature set against it is refused."""
    from spade_jax import run

    config = load_experiment(name)
    assert (config.train.agent.temperature, config.train.designer.temperature) == (None, None)
    train = run._with_sampler_temperatures(config)
    assert (train.agent.temperature, train.designer.temperature) == (0.6, 0.6)
    clash = dataclasses.replace(config, train=dataclasses.replace(
        config.train, designer=dataclasses.replace(config.train.designer, temperature=1.0)))
    with pytest.raises(ValueError, match="designer_sampler.temperature"):
        run._with_sampler_temperatures(clash)


def test_fixed_pool_games_are_drawn_without_replacement_across_the_run():
    """The recipe's fixed-designer run draws its games without replacement over the run,
    exhausting the pool before any game comes back; no hints. Ours: a seeded permutation
    per pass over the pool (the recipe's 7,872 games are 328 steps of 24 exactly)."""
    from spade_jax.spade.loop import SpadeLoop
    from spade_jax.spade.memory import EnvironmentMemory, MemoryConfig
    from spade_jax.spade.reward import make_designer_reward
    from tests.spade.test_loop import ALL_VALID, ByteTokenizer, ScriptedPolicy

    config = dataclasses.replace(
        load_experiment("spade_fixed_designer").spade, envs_per_round=4, plays_per_game=2)
    assert (config.designer_mode, config.hint_mode, config.regeneration_interval,
            config.use_memory) == ("fixed_pool", "none", 1, False)
    policy = ScriptedPolicy(ALL_VALID)
    loop = SpadeLoop(config, tokenizer=ByteTokenizer(), pool=None, generate=policy.generate,
                     run_episodes=policy.run_episodes, update=policy.update,
                     corpus_sampler=None, memory=EnvironmentMemory(MemoryConfig(seed=0)),
                     reward_rule=make_designer_reward("blend"), seed=3)
    pool = [(f"program {i}", f"hint {i}", "Optimization") for i in range(12)]
    cursor, steps = 0, []
    for step in range(6):  # two passes over the pool, 4 games a step
        games, cursor = loop.designer.fixed_pool_games(step, pool, cursor)
        assert all(g.hint is None for g in games)  # hint_mode "none": the pool's hints unused
        steps.append([g.program for g in games])
    first, second = sum(steps[:3], []), sum(steps[3:], [])
    assert sorted(first) == sorted(p for p, _, _ in pool)  # every game once before reuse
    assert sorted(second) == sorted(first) and second != first  # a new pass, a new order
    # The same seed draws the same games (a resumed run continues from its cursor).
    again, _ = loop.designer.fixed_pool_games(4, pool, 16)
    assert [g.program for g in again] == steps[4]



@pytest.mark.parametrize("usable_from, hinted", [(2, True), (3, False)])
def test_the_hint_writer_gets_three_tries(usable_from, hinted):
    """The recipe's self-hint call is tried up to 3 times in all (its hint is not usable
    before the call numbered ``usable_from``); a game still without a hint then has no
    hint arm."""
    from spade_jax.envs import EnvPool, SandboxConfig
    from tests.spade.test_loop import ALL_VALID, WINDOW, ScriptedPolicy, _loop

    class LateHints(ScriptedPolicy):
        def generate(self, prompts, *, seed, purpose):
            self.hint = "  " if len(self.hint_calls) < usable_from else "Try the middle."
            return super().generate(prompts, seed=seed, purpose=purpose)

    assert all(load_experiment(n).spade.hint_attempts == 3 for n in RECIPES)
    policy = LateHints(ALL_VALID)
    config = dataclasses.replace(WINDOW, rounds=1, designer_delay=0, hint_attempts=3)
    with EnvPool(SandboxConfig(call_deadline_s=2.0)) as pool:
        _loop(pool, policy, config).run_step(0)
    assert len(policy.hint_calls) == min(usable_from + 1, 3)
    assert any(e["hinted"] for e in policy.episode_log[0]) == hinted


def test_a_hint_pattern_makes_a_hint_of_the_wrong_form_unusable():
    """``spade.hint_pattern``: a written hint must match it in full, else it is tried
    again like an empty one; a bad pattern is refused by name."""
    from spade_jax.envs import EnvPool, SandboxConfig
    from tests.spade.test_loop import ALL_VALID, WINDOW, ScriptedPolicy, _loop

    class FormedLate(ScriptedPolicy):
        def generate(self, prompts, *, seed, purpose):
            self.hint = "Nextright += 0>1" if len(self.hint_calls) < 1 else "Next: 0>1 1>0."
            return super().generate(prompts, seed=seed, purpose=purpose)

    for pattern, hinted, calls in ((r"Next: (\d>\d ?)+\.", True, 2), (r"Never\.", False, 3)):
        policy = FormedLate(ALL_VALID)
        config = dataclasses.replace(WINDOW, rounds=1, designer_delay=0, hint_attempts=3,
                                     hint_pattern=pattern)
        with EnvPool(SandboxConfig(call_deadline_s=2.0)) as pool:
            _loop(pool, policy, config).run_step(0)
        assert len(policy.hint_calls) == calls
        assert any(e["hinted"] for e in policy.episode_log[0]) == hinted
    with pytest.raises(ValueError, match="spade.hint_pattern"):
        dataclasses.replace(WINDOW, hint_pattern="Next: (")
