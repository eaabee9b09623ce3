"""The fixed-environment baselines: a scripted policy that always answers correctly scores 1
on every episode of a baseline round (one env per episode), and the training tasks never
overlap the held-out evaluation suites."""

from __future__ import annotations

import pytest

reasoning_gym = pytest.importorskip("reasoning_gym")

from spade_jax.envs.reasoning_gym_envs import RG_SUITES  # noqa: E402
from spade_jax.experiment import load_experiment  # noqa: E402
from spade_jax.rollout.agent_loop import EpisodeSpec  # noqa: E402
from spade_jax.spade.baselines import (  # noqa: E402
    ReasoningGymBaseline,
    check_disjoint_from_evaluation,
    make_baseline,
    train_tasks,
)

TASKS = ("course_schedule", "family_relationships", "largest_island", "shortest_path")
INDEX_SPACE = 1_000_000  # the env's reset(seed) picks item seed % 10^6 of these tasks


def oracle(specs: list[EpisodeSpec]) -> dict[str, str]:
    """question -> correct answer, from datasets built here, independently of the envs."""
    answers = {}
    for spec in specs:
        entry = reasoning_gym.create_dataset(spec.env_id, seed=0, size=INDEX_SPACE)[
            spec.seed % INDEX_SPACE]
        answers[entry["question"]] = entry["answer"]
    return answers


def run_scripted(specs: list[EpisodeSpec], answers: dict[str, str]) -> list[float]:
    """The batched agent loop's order: reset every episode, then step each with the policy's
    reply to its own first observation. Returns each episode's summed reward."""
    observations = [spec.env.reset(seed=spec.seed)[0] for spec in specs]
    returns = []
    for spec, observation in zip(specs, observations, strict=True):
        _, reward, terminated, _, _ = spec.env.step(answers[observation])
        assert terminated
        returns.append(reward)
    return returns


def test_a_correct_policy_scores_1_on_every_episode_of_a_round():
    baseline = ReasoningGymBaseline(TASKS, envs_per_round=3, adaptive=False, seed=7)
    for round_index in range(2):
        specs = baseline.episodes(round_index, plays_per_task=4)
        assert len(specs) == 12 and len({s.env_id for s in specs}) == 3
        assert len({id(s.env) for s in specs}) == 12  # one env per episode
        assert len({(s.env_id, s.seed) for s in specs}) == 12
        assert run_scripted(specs, oracle(specs)) == [1.0] * 12


def test_one_shared_env_per_task_would_grade_against_the_wrong_question():
    """The scripted round detects the old defect: all plays of a task on one env object."""
    baseline = ReasoningGymBaseline(TASKS, envs_per_round=2, adaptive=False, seed=7)
    specs = baseline.episodes(0, plays_per_task=4)
    shared = {}
    specs = [EpisodeSpec(env=shared.setdefault(s.env_id, s.env), env_id=s.env_id, seed=s.seed)
             for s in specs]
    answers = oracle(specs)
    observations = [s.env.reset(seed=s.seed)[0] for s in specs]
    returns = [s.env.step(answers[o])[1] for s, o in zip(specs, observations, strict=True)]
    assert returns != [1.0] * len(specs)


def test_episode_seeds_depend_on_seed_and_round():
    def seeds(seed, round_index):
        specs = ReasoningGymBaseline(TASKS, 2, False, seed).episodes(round_index, 3)
        return [(s.env_id, s.seed) for s in specs]

    assert seeds(1, 0) == seeds(1, 0)
    assert seeds(1, 0) != seeds(1, 1)
    assert seeds(1, 0) != seeds(2, 0)


def test_training_tasks_are_disjoint_from_the_evaluation_suites():
    evaluated = {t for suite in RG_SUITES for t in RG_SUITES[suite]}
    default = train_tasks()
    assert len(default) >= 10 and not set(default) & evaluated
    assert set(train_tasks(("graphs",))) == set(TASKS) | {"path_star", "quantum_lock"}
    # The baseline experiments train on the default: nothing the evaluation suites hold.
    for name in ("baseline_fixed_env_grpo:tiny", "baseline_fixed_env_rlve:tiny"):
        baseline = make_baseline(load_experiment(name))
        assert baseline.tasks == sorted(default)
    overlapping = load_experiment("baseline_fixed_env_grpo:tiny",
                                  ["baseline.train_categories=('graphs', 'logic')"])
    with pytest.raises(ValueError, match=r"RG-Logic: \[.*'knights_knaves'"):
        make_baseline(overlapping)


def test_overlap_and_unknown_names_are_refused_by_name():
    with pytest.raises(ValueError, match=r"RG-Math: \['basic_arithmetic'\]"):
        train_tasks(tasks=("basic_arithmetic", "maze"))
    with pytest.raises(ValueError, match=r"RG-Math: \['basic_arithmetic'\]"):
        ReasoningGymBaseline(["maze", "basic_arithmetic"], 2, False, 0)
    with pytest.raises(ValueError, match="unknown reasoning-gym categories \\['gamez'\\]"):
        train_tasks(("gamez",))
    with pytest.raises(ValueError, match="unknown reasoning-gym tasks \\['mazee'\\]"):
        train_tasks(tasks=("mazee",))
    check_disjoint_from_evaluation(["maze", "sudoku"])  # no error
