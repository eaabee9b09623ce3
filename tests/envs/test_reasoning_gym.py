"""reasoning-gym wrappers: suites follow the package's categories; the package's verifier
scores answers; single- and multi-turn modes; gymnasium's env_checker passes."""

from __future__ import annotations

import importlib
import pkgutil

import pytest
from gymnasium.utils.env_checker import check_env

reasoning_gym = pytest.importorskip("reasoning_gym")

from spade_jax.envs import RG_SUITES, make_reasoning_gym_env, rg_tasks_by_category  # noqa: E402


def test_suites_match_package_categories():
    """Independent derivation: walk reasoning_gym's category subpackages and collect the
    dataset names each one registers."""
    from reasoning_gym.factory import DATASETS

    by_package: dict[str, set[str]] = {}
    for module_info in pkgutil.iter_modules(reasoning_gym.__path__):
        if not module_info.ispkg:
            continue
        prefix = f"reasoning_gym.{module_info.name}."
        by_package[module_info.name] = {
            name for name, (cls, _) in DATASETS.items() if cls.__module__.startswith(prefix)
        }
    assert len(DATASETS) == 106
    in_packages = set().union(*by_package.values())
    assert set(DATASETS) - in_packages == {"composite"}  # the one top-level module
    expected = {
        "RG-Math": by_package["algebra"] | by_package["arithmetic"] | by_package["geometry"]
        | by_package["probability"],
        "RG-Algo": by_package["algorithmic"],
        "RG-Cog": by_package["cognition"],
        "RG-Logic": by_package["logic"],
    }  # fmt: skip
    assert {k: set(v) for k, v in RG_SUITES.items()} == expected
    assert all(len(v) > 0 for v in RG_SUITES.values())
    assert set(rg_tasks_by_category()) == {k for k, v in by_package.items() if v} | {"composite"}
    importlib.import_module("reasoning_gym.arithmetic")  # the categories are real packages


@pytest.mark.parametrize("task", ["basic_arithmetic", "spell_backward", "number_sorting"])
def test_single_turn_scores_with_package_verifier(task):
    env = make_reasoning_gym_env(task)
    question, info = env.reset(seed=4)
    assert question and info["task"] == task
    expected = env.dataset.score_answer(env.entry["answer"], env.entry)
    obs, reward, terminated, truncated, _ = env.step(f"<answer>{env.entry['answer']}</answer>")
    assert reward == pytest.approx(min(1.0, expected)) and reward > 0.99
    assert terminated and not truncated
    env.reset(seed=4)
    assert env.step("definitely wrong")[1] == pytest.approx(
        env.dataset.score_answer("definitely wrong", env.entry)
    )


def test_multi_turn_feedback_and_return_is_best_score():
    env = make_reasoning_gym_env("basic_arithmetic", multi_turn=True, max_attempts=3)
    env.reset(seed=9)
    total = 0.0
    obs, reward, terminated, _, info = env.step("nope")
    total += reward
    assert not terminated and "2 attempt(s) left" in obs
    obs, reward, terminated, _, info = env.step(str(env.entry["answer"]))
    total += reward
    assert terminated and obs == "Correct." and total == pytest.approx(1.0)
    env.reset(seed=9)
    outcomes = [env.step("nope") for _ in range(3)]
    assert outcomes[-1][2] and sum(o[1] for o in outcomes) == 0.0


def test_same_seed_same_question():
    a, b = make_reasoning_gym_env("basic_arithmetic"), make_reasoning_gym_env("basic_arithmetic")
    assert a.reset(seed=17)[0] == b.reset(seed=17)[0]
    assert a.reset(seed=17)[0] != a.reset(seed=18)[0]


def test_env_checker_passes():
    check_env(make_reasoning_gym_env("basic_arithmetic", multi_turn=True), skip_render_check=True)


def test_unknown_task_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown reasoning-gym task"):
        make_reasoning_gym_env("no_such_task")
