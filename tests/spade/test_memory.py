"""Environment memory: capacity policy, sampling for prompts and training, resume."""

import collections
import dataclasses
import json

import numpy as np
import pytest
from memory_records import record_from_reward

from spade_jax.spade import (
    EnvironmentMemory,
    MemoryConfig,
    Regime,
    designer_reward,
)

_ARMS = {  # (hint returns, no-hint returns) landing in each regime under the default config
    Regime.FRONTIER: ([1, 1, 1, 0], [1, 0, 0, 0]),
    Regime.MASTERED: ([1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 0]),
    Regime.INTRACTABLE: ([0, 0, 0, 0.2], [0, 0, 0, 0]),
}


def _record(env_id, regime, round_index=0, skill="math"):
    reward = designer_reward(*_ARMS[regime])
    assert reward.regime is regime
    return record_from_reward(
        env_id=env_id,
        program_source=f"class Env:\n    name = {env_id!r}\n",
        hint="look at the parity",
        skill=skill,
        round_index=round_index,
        reward=reward,
        reward_levels=3,
        strict_partial_levels=1,
        corpus_doc_ids=("sympy-docs:sympy.factorint",),
    )


def _filled_memory(config=None, n_per_regime=10):
    memory = EnvironmentMemory(config or MemoryConfig(capacity=100, seed=7))
    for i in range(n_per_regime):
        for regime in Regime:
            skill = "math" if i % 2 == 0 else "logic"
            memory.add(_record(f"{regime.value}-{i}", regime, round_index=i, skill=skill))
    return memory


def test_record_from_reward_copies_statistics():
    record = _record("e0", Regime.FRONTIER)
    assert record.regret == pytest.approx(0.5)
    assert record.win_rate_no_hint == pytest.approx(0.25)
    assert record.win_rate_hint == pytest.approx(0.75)
    assert record.mean_return_hint == pytest.approx(0.75)
    assert record.designer_reward == pytest.approx(0.575)
    assert record.last_evaluated_round == 0
    with pytest.raises(ValueError, match="empty program"):
        record_from_reward("e", "  ", "h", "math", 0, designer_reward([1], [0]))


def test_capacity_evicts_intractable_then_mastered_then_oldest_frontier():
    memory = EnvironmentMemory(MemoryConfig(capacity=3))
    assert memory.add(_record("f0", Regime.FRONTIER, round_index=0)) is None
    memory.add(_record("m1", Regime.MASTERED, round_index=1))
    memory.add(_record("i2", Regime.INTRACTABLE, round_index=2))
    assert memory.add(_record("f3", Regime.FRONTIER, round_index=3)).env_id == "i2"
    assert memory.add(_record("f4", Regime.FRONTIER, round_index=4)).env_id == "m1"
    assert memory.add(_record("f5", Regime.FRONTIER, round_index=5)).env_id == "f0"
    assert [r.env_id for r in memory.records] == ["f3", "f4", "f5"]
    assert memory.evicted_total == 3
    with pytest.raises(ValueError, match="already in memory"):
        memory.add(_record("f5", Regime.FRONTIER))


def test_update_replaces_statistics_and_refreshes_eviction_age():
    memory = EnvironmentMemory(MemoryConfig(capacity=2))
    memory.add(_record("a", Regime.FRONTIER, round_index=0))
    memory.add(_record("b", Regime.FRONTIER, round_index=1))
    # A replay (no hint arm) refreshes the no-hint statistics; regret stays 0.5 (> 0.2),
    # so the record stays a frontier environment.
    memory.update("a", round_index=5, win_rate_no_hint=0.5, mean_return_no_hint=0.5)
    assert memory["a"].last_evaluated_round == 5 and memory["a"].round_index == 0
    assert (memory["a"].win_rate_no_hint, memory["a"].regret) == (0.5, pytest.approx(0.5))
    assert memory["a"].regime is Regime.FRONTIER
    assert memory.add(_record("c", Regime.FRONTIER, round_index=6)).env_id == "b"
    # Low regret with a high no-hint mean: mastered (the memory's own thresholds).
    memory.update("a", round_index=7, win_rate_no_hint=1.0, mean_return_no_hint=1.0,
                  regret=0.0)
    assert memory["a"].regime is Regime.MASTERED
    assert memory.regime_counts() == {"frontier": 1, "mastered": 1, "intractable": 0}
    with pytest.raises(KeyError, match="not in memory"):
        memory.update("zzz", 0, win_rate_no_hint=0.0, mean_return_no_hint=0.0)


def test_prompt_sample_prefers_frontier_with_negative_examples():
    memory = _filled_memory(MemoryConfig(capacity=100, negative_example_fraction=0.25))
    for _ in range(20):
        sample = memory.sample_for_prompt(8)
        regimes = collections.Counter(r.regime for r in sample)
        assert regimes[Regime.FRONTIER] == 6
        assert regimes[Regime.MASTERED] + regimes[Regime.INTRACTABLE] == 2
        assert len({r.env_id for r in sample}) == 8
    only_logic = memory.sample_for_prompt(4, skill="logic")
    assert {r.skill for r in only_logic} == {"logic"}


def test_prompt_sample_tops_up_when_a_pool_runs_short():
    memory = EnvironmentMemory(MemoryConfig(capacity=10, negative_example_fraction=0.5))
    memory.add(_record("f", Regime.FRONTIER))
    for i in range(5):
        memory.add(_record(f"m{i}", Regime.MASTERED))
    sample = memory.sample_for_prompt(4)
    assert len(sample) == 4 and sum(r.regime is Regime.FRONTIER for r in sample) == 1
    assert len(memory.sample_for_prompt(50)) == 6
    assert EnvironmentMemory().sample_for_prompt(3) == []


def test_training_sample_follows_regime_weights_and_never_intractable():
    config = MemoryConfig(
        capacity=100,
        seed=0,
        training_regime_weights={"frontier": 1.0, "mastered": 0.25, "intractable": 0.0},
    )
    memory = _filled_memory(config)
    no_repeat = memory.sample_for_training(15)
    assert len({r.env_id for r in no_repeat}) == 15
    draws = [r.regime for _ in range(200) for r in memory.sample_for_training(10, replace=True)]
    counts = collections.Counter(draws)
    assert counts[Regime.INTRACTABLE] == 0
    # 10 frontier at weight 1 vs 10 mastered at .25: expected frontier share 0.8.
    share = counts[Regime.FRONTIER] / len(draws)
    assert abs(share - 0.8) < 4 * np.sqrt(0.8 * 0.2 / len(draws))
    assert len(memory.sample_for_training(100)) == 20  # all eligible, no replacement


def test_memory_state_survives_json_round_trip_with_identical_samples():
    config = MemoryConfig(capacity=25, seed=3)
    memory = _filled_memory(config)  # 30 adds into capacity 25: evictions happened
    memory.sample_for_prompt(5)
    memory.sample_for_training(5)
    restored = EnvironmentMemory(config)
    restored.load_state_dict(json.loads(json.dumps(memory.state_dict())))
    assert restored.records == memory.records
    assert restored.evicted_total == memory.evicted_total == 5
    for _ in range(3):
        assert restored.sample_for_prompt(6) == memory.sample_for_prompt(6)
        assert restored.sample_for_training(6, replace=True) == memory.sample_for_training(
            6, replace=True
        )
    new = _record("new", Regime.FRONTIER, round_index=99)
    assert restored.add(new) == memory.add(new)


def test_bad_config_and_state_raise():
    with pytest.raises(ValueError, match="capacity"):
        MemoryConfig(capacity=0)
    with pytest.raises(ValueError, match="unknown regimes"):
        MemoryConfig(training_regime_weights={"easy": 1.0})
    with pytest.raises(ValueError, match="one > 0"):
        MemoryConfig(training_regime_weights={"frontier": 0.0})
    big = _filled_memory(MemoryConfig(capacity=30))
    with pytest.raises(ValueError, match="capacity is 5"):
        EnvironmentMemory(MemoryConfig(capacity=5)).load_state_dict(big.state_dict())
    with pytest.raises(ValueError, match="missing 'records'"):
        EnvironmentMemory().load_state_dict({"draws": 0})


def _scored(env_id, skill, regret, win_rate, round_index=0):
    """A record with exactly these statistics (the recipe selection reads only them)."""
    reward = designer_reward([1.0], [0.0])
    return dataclasses.replace(
        record_from_reward(env_id, f"class G{env_id}Env:\n    pass\n", "", skill,
                                      round_index, reward),
        regret=regret, win_rate_no_hint=win_rate)


def test_recipe_selection_is_the_top_ten_by_regret_in_the_win_rate_window_plus_one_negative():
    """Re-derived from the statistics: the games to build on come from the 10 same-skill
    records with the highest regret among those with win rate in [0.15, 0.85], every one
    of the 10 is drawn some time and no other; the game to avoid is a same-skill record
    with win rate < 0.1 or > 0.9."""
    rng = np.random.default_rng(3)
    memory = EnvironmentMemory(MemoryConfig(capacity=200, seed=5, selection="recipe"))
    stats = {}
    for i in range(60):
        skill = ("math", "logic")[i % 2]
        regret, win_rate = float(rng.uniform(-0.5, 1.0)), float(rng.choice(
            [rng.uniform(0, 1), 0.15, 0.85, 0.05, 0.95]))
        memory.add(_scored(f"e{i}", skill, regret, win_rate))
        stats[f"e{i}"] = (skill, regret, win_rate)
    window = sorted((e for e, (s, _, w) in stats.items() if s == "math" and 0.15 <= w <= 0.85),
                    key=lambda e: -stats[e][1])
    top10 = set(window[:10])
    assert len(window) > 10  # the cut matters
    outside = {e for e, (s, _, w) in stats.items() if s == "math" and (w < 0.1 or w > 0.9)}
    assert outside
    seen_good, seen_bad = set(), set()
    for _ in range(200):
        good, bad = memory.prompt_examples(2, skill="math")
        assert len(good) == 2 and len({r.env_id for r in good}) == 2 and len(bad) == 1
        seen_good |= {r.env_id for r in good}
        seen_bad |= {r.env_id for r in bad}
    assert seen_good == top10
    assert seen_bad == outside
    # the pool is max(3 * num, 10): 4 games to build on come from the top 12
    seen = set()
    for _ in range(300):
        seen |= {r.env_id for r in memory.prompt_examples(4, skill="math")[0]}
    assert seen == set(window[:12])
    # nothing is topped up from elsewhere when a pool is empty
    lonely = EnvironmentMemory(MemoryConfig(seed=0, selection="recipe"))
    lonely.add(_scored("easy", "math", 0.9, 0.99))
    assert lonely.prompt_examples(2, skill="math") == ([], [lonely["easy"]])
    assert lonely.sample_for_prompt(2, skill="logic") == []


def test_recipe_memory_evicts_first_in_first_out():
    memory = EnvironmentMemory(MemoryConfig(capacity=3, selection="recipe"))
    for i, regime in enumerate([Regime.FRONTIER, Regime.INTRACTABLE, Regime.MASTERED]):
        memory.add(_record(f"e{i}", regime, round_index=i))
    evicted = memory.add(_record("e3", Regime.INTRACTABLE, round_index=3))
    assert evicted.env_id == "e0"  # the oldest, although it is frontier
    assert [r.env_id for r in memory.records] == ["e1", "e2", "e3"]
    with pytest.raises(ValueError, match="selection must be one of"):
        MemoryConfig(selection="best")
    with pytest.raises(ValueError, match="build_on_win_rate"):
        MemoryConfig(selection="recipe", build_on_win_rate=(0.9, 0.1))


def test_designer_prompt_shows_recipe_picks_by_role_not_regime():
    """With the recipe selection, a game picked to build on is shown under "build on" even
    when the regret thresholds call it mastered, and the pick to avoid under "avoid"."""
    from spade_jax.spade.config import SpadeConfig
    from spade_jax.spade.design import slot_skills

    config = SpadeConfig(use_corpus=False, docs_per_prompt=0, memory_examples=2,
                         memory_selection="recipe", contract="reference")
    skill = slot_skills(config, 0)[0]
    memory = EnvironmentMemory(MemoryConfig(seed=1, selection="recipe"))
    build_on = _scored("keep", skill, regret=0.05, win_rate=0.6)  # small regret: not frontier
    memory.add(dataclasses.replace(build_on, regime=Regime.MASTERED))
    memory.add(dataclasses.replace(_scored("avoid", skill, regret=0.0, win_rate=1.0),
                                   regime=Regime.MASTERED))
    user = _first_designer_user_prompt(config, memory)
    good_at, bad_at = user.index("sat at the agent's frontier"), user.index("Games to avoid")
    assert good_at < user.index("class GkeepEnv") < bad_at < user.index("class GavoidEnv")
    assert "- too easy (agent win rate 1.00): class GavoidEnv" in user  # one line, no code


@pytest.mark.parametrize("contract", ["reference", "paper"])
def test_designer_prompt_cuts_memory_programs_to_max_program_chars(contract):
    """The recipe shows a memory game as its program's first 2000 characters
    (``spade.max_program_chars``, set by the recipe experiments): the prompt holds exactly
    that prefix of a longer program and nothing after it, in both prompt families."""
    from spade_jax.experiment import load_experiment
    from spade_jax.spade.config import SpadeConfig
    from spade_jax.spade.design import slot_skills

    assert load_experiment("qwen3_30b_a3b").spade.max_program_chars == 2000
    config = SpadeConfig(use_corpus=False, docs_per_prompt=0, memory_examples=1,
                         memory_selection="recipe", contract=contract, max_program_chars=60)
    skill = slot_skills(config, 0)[0]
    memory = EnvironmentMemory(MemoryConfig(seed=1, selection="recipe"))
    record = _scored("long", skill, regret=0.5, win_rate=0.5)
    program = record.program_source + "".join(f"# line {i:03d}\n" for i in range(100))
    memory.add(dataclasses.replace(record, program_source=program))
    user = _first_designer_user_prompt(config, memory)
    assert program[:60] in user and program[:61] not in user
    with pytest.raises(ValueError, match="max_program_chars must be >= 1"):
        SpadeConfig(max_program_chars=0)


def _first_designer_user_prompt(config, memory) -> str:
    """The user message of the designer's first slot prompt in round 0."""
    from spade_jax.spade.design import Designer

    chats = []

    class Tokenizer:
        def apply_chat_template(self, messages, **_):
            chats.append(messages)
            return [0]

    Designer(config, tokenizer=Tokenizer(), pool=None, generate=None, corpus_sampler=None,
             memory=memory, seed=0, max_turns=4).prompts(0)
    return chats[0][1]["content"]
