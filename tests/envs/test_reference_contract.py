"""The reference (recipe) game contract: recipe-format games validate and play through
`make_env(..., contract="reference")` and are scored as the recipe scores them.

Each game below exercises one feature of the contract. The independent reference is the
game itself run in this process (our own trusted test code) with the recipe's import-free
names bound by hand, scored with the recipe's rule written out here: the last reward if
the episode terminated, clipped to [-1, 1], else 0. The sandboxed env must report step
rewards summing to that score, with the game's raw rewards in info["raw_reward"].
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import heapq
import itertools
import json
import math
import operator
import random
import re
import statistics
import string
import subprocess
import sys
import typing

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from spade_jax.envs import EnvPool, EnvProgramError, SandboxConfig, make_env, validate_program
from spade_jax.envs.contract import (
    REFERENCE_CONTRACT,
    detect_contract,
    render_reference_contract,
)
from spade_jax.rollout import SamplerConfig
from spade_jax.rollout.agent_loop import (
    ActionParser,
    AgentLoopConfig,
    ChatTurns,
    EpisodeSpec,
    last_boxed,
    run_episodes,
)
from spade_jax.spade.prompts import (
    REFERENCE_AGENT_FIRST_TURN_TEMPLATE,
    REFERENCE_DESIGNER_SYSTEM_PROMPT,
    reference_designer_system_prompt,
    reference_designer_user_prompt,
)
from spade_jax.spade.seed_programs import SEED_PROGRAMS, load_program_pool

# ----------------------------------------------------------------------------- games

# The real game comes after two decoys ending in Env: a helper without step() and a base
# class that has both methods (the recipe's search would take either).
DECOY = r"""
class BoardEnv:
    def reset(self, seed=None):
        return "decoy board", {}

class BaseGameEnv:
    def __init__(self, max_turns=25):
        self.max_turns = max_turns
    def reset(self, seed=None):
        return "decoy base", {}
    def step(self, action):
        return "decoy base step", 1.0, True, False, {}

class LadderEnv(BaseGameEnv):
    def reset(self, seed=None):
        rng = random.Random(seed)
        self.turn, self.pos, self.goal = 0, 0, rng.randint(3, 5)
        return f"Climb to rung {self.goal}. Actions: \\boxed{{up}}, \\boxed{{down}}.", {}
    def step(self, action):
        self.turn += 1
        m = re.search(r"\\boxed\{([^}]*)\}", action)
        cmd = m.group(1).strip().lower() if m else ""
        self.pos += {"up": 1, "down": -1}.get(cmd, 0)
        if self.pos < 0:
            return "You fell off.", 0.0, True, False, {}
        if self.pos == self.goal:
            return "Top!", 1.0, True, False, {}
        return f"rung {self.pos}", 0.0, False, self.turn >= self.max_turns, {}
"""

# cls(), then max_turns = min(its own 10, N): a smaller budget reaches the game, which
# truncates itself there.
KWARG = r"""
class CounterEnv:
    def __init__(self, max_turns=10, **kwargs):
        self.max_turns = max_turns
        self.reset()
    def reset(self, seed=None):
        self.turn = 0
        return f"budget {self.max_turns}", {}
    def step(self, action):
        self.turn += 1
        return f"turn {self.turn}", 0.0, False, self.turn >= self.max_turns, {}
"""

# No max_turns argument: built as cls(), its max_turns attribute set to N afterwards.
NO_KWARG = r"""
class PlainEnv:
    def __init__(self):
        self.max_turns = 99
        self.turn = 0
    def reset(self, seed=None):
        self.turn = 0
        return f"budget {self.max_turns}", {}
    def step(self, action):
        self.turn += 1
        return "again", 0.0, False, self.turn >= self.max_turns, {}
"""

# Never ends by itself and keeps no budget: the wrapper truncates at max_turns (score 0).
ENDLESS = r"""
class EndlessEnv:
    def reset(self, seed=None):
        return "forever", {}
    def step(self, action):
        return "still here", 0.5, False, False, {}
"""

# reset() returns a bare string; boxed answers are read from the action text.
BARE_RESET = r"""
class EchoEnv:
    def __init__(self, max_turns=25):
        self.max_turns = max_turns
    def reset(self, seed=None):
        self.word = random.Random(seed).choice(["apple", "pear", "plum"])
        self.turn = 0
        return f"Type the word {self.word} as \\boxed{{word}}."
    def step(self, action):
        self.turn += 1
        m = re.search(r"\\boxed\{([^}]*)\}", action)
        if not m:
            return "Use \\boxed{word}.", 0.0, False, self.turn >= self.max_turns, {}
        if m.group(1).strip() == self.word:
            return "Yes.", 1.0, True, False, {}
        return "No.", 0.0, True, False, {}
"""

# Import-free names, numpy included; a numpy scalar reward.
IMPLICIT = r"""
class StatsEnv:
    def __init__(self, max_turns=25):
        self.max_turns = max_turns
    def reset(self, seed: Optional[int] = None) -> Tuple[str, Dict[str, Any]]:
        np.random.seed(seed)
        self.values = np.random.randint(0, 50, size=6)
        q = deque(self.values.tolist(), maxlen=4)
        counts = Counter(v % 3 for v in self.values.tolist())
        groups = defaultdict(list)
        for v in self.values.tolist():
            groups[v % 2].append(v)
        heap = []
        for v in self.values.tolist():
            heappush(heap, v)
        pairs = len(list(combinations(range(4), 2))) + len(list(permutations(range(3))))
        total = reduce(operator.add, self.values.tolist())
        mean = statistics.mean(self.values.tolist())
        cached = lru_cache(maxsize=None)(lambda n: n * n)(7)
        snap = deepcopy(dict(groups))
        Point = namedtuple("Point", "x y")
        ordered = OrderedDict(sorted(counts.items()))
        self.answer = int(self.values.sum())
        parts = [list(q), dict(ordered), heappop(heap), pairs, total, round(mean, 3), cached,
                 sorted(snap), Point(1, 2).y, list(accumulate([1, 2, 3])),
                 list(chain([1], [2])), list(product([0, 1], repeat=2))[-1],
                 math.gcd(12, 18), json.dumps([1]), string.digits[:3],
                 copy.copy([1])[0], functools.reduce(max, [3, 9, 4]),
                 len(list(itertools.islice(itertools.count(), 5))), re.sub("a", "b", "aa"),
                 random.Random(seed).randint(0, 9), collections.Counter("aab")["a"],
                 heapq.nsmallest(2, [5, 1, 3])]
        return "values " + " ".join(map(str, self.values.tolist())) + " | " + repr(parts), {}
    def step(self, action: str) -> Tuple[str, float, bool, bool, Dict]:
        m = re.search(r"\\boxed\{([^}]*)\}", action)
        ok = m is not None and m.group(1).strip() == str(self.answer)
        return ("right" if ok else "wrong"), np.float64(1.0 if ok else 0.0), np.bool_(True), \
            False, {}
"""

# math_verify for the answer check: "\frac{1}{2}" is accepted for 0.5.
MATH = r"""
from math_verify import parse, verify

class HalfEnv:
    def __init__(self, max_turns=25):
        self.max_turns = max_turns
    def reset(self, seed=None):
        self.turn = 0
        return "What is 1 divided by 2? Answer as \\boxed{x}.", {}
    def step(self, action):
        self.turn += 1
        m = re.search(r"\\boxed\{(.*)\}", action)
        if not m:
            return "Box it.", 0.0, False, self.turn >= self.max_turns, {}
        if verify(parse("$0.5$"), parse("$" + m.group(1) + "$")):
            return "Correct.", 1.0, True, False, {}
        return "Wrong, try again.", 0.0, False, self.turn >= self.max_turns, {}
"""

# Intermediate (shaping) rewards that the recipe ignores; final reward +1 / -1.
SHAPED = r"""
class ShapedEnv:
    def __init__(self, max_turns=25):
        self.max_turns = max_turns
    def reset(self, seed=None):
        self.turn = 0
        return "Say \\boxed{win} or \\boxed{lose}; anything else earns 0.4.", {}
    def step(self, action):
        self.turn += 1
        if "\\boxed{win}" in action:
            return "won", 1.0, True, False, {}
        if "\\boxed{lose}" in action:
            return "lost", -1.0, True, False, {}
        return "keep going", 0.4, False, self.turn >= self.max_turns, {}
"""

# Game-side truncation with a positive reward: scored 0.
TRUNCATES = r"""
class TimeoutEnv:
    def __init__(self, max_turns=25):
        self.max_turns = max_turns
    def reset(self, seed=None):
        self.turn = 0
        return "wait", {}
    def step(self, action):
        self.turn += 1
        return "tick", 1.0, False, self.turn >= 2, {}
"""

# Terminal rewards outside [-1, 1] (inside the recipe's [-10, 10]) are clipped.
BIG_REWARD = r"""
class BigEnv:
    def __init__(self, max_turns=25):
        self.max_turns = max_turns
    def reset(self, seed=None):
        return "\\boxed{N}: you get N as the final reward", {}
    def step(self, action):
        m = re.search(r"\\boxed\{([^}]*)\}", action)
        try:
            value = float(m.group(1))
        except (AttributeError, ValueError):
            return "give a number", 0.0, False, False, {}
        return "done", max(-10.0, min(10.0, value)), True, False, {}
"""


@dataclasses.dataclass(frozen=True)
class Game:
    source: str
    cls: str  # the class the recipe contract must pick
    seed: int
    actions: tuple[str, ...]
    max_turns: int = 25


GAMES = {
    "decoy_helpers": Game(DECOY, "LadderEnv", 4, (r"\boxed{up}",) * 6),
    "decoy_helpers_fall": Game(DECOY, "LadderEnv", 4, (r"\boxed{down}",)),
    "max_turns_kwarg": Game(KWARG, "CounterEnv", 0, ("a",) * 9, max_turns=7),
    "max_turns_fallback": Game(NO_KWARG, "PlainEnv", 0, ("a",) * 9, max_turns=5),
    "wrapper_budget": Game(ENDLESS, "EndlessEnv", 0, ("a",) * 9, max_turns=4),
    "bare_reset_win": Game(BARE_RESET, "EchoEnv", 5, ("no box", r"\boxed{plum}")),
    "bare_reset_loss": Game(BARE_RESET, "EchoEnv", 1, (r"\boxed{kiwi}",)),
    "implicit_names": Game(IMPLICIT, "StatsEnv", 5, (r"\boxed{0}",)),
    "math_verify": Game(MATH, "HalfEnv", 0, (r"\boxed{1/3}", r"\boxed{\frac{1}{2}}")),
    "shaped_win": Game(SHAPED, "ShapedEnv", 0, ("x", "y", r"\boxed{win}")),
    "shaped_loss": Game(SHAPED, "ShapedEnv", 0, ("x", r"\boxed{lose}")),
    "shaped_out_of_turns": Game(SHAPED, "ShapedEnv", 0, ("x",) * 5, max_turns=3),
    "truncated_with_reward": Game(TRUNCATES, "TimeoutEnv", 0, ("a", "b")),
    "clipped_high": Game(BIG_REWARD, "BigEnv", 0, (r"\boxed{7.5}",)),
    "clipped_low": Game(BIG_REWARD, "BigEnv", 0, (r"\boxed{-3}",)),
    "in_range": Game(BIG_REWARD, "BigEnv", 0, (r"\boxed{0.25}",)),
}
# The score each case must get, worked out by hand from the game's rules.
EXPECTED_SCORE = {
    "decoy_helpers": 1.0, "decoy_helpers_fall": 0.0, "max_turns_kwarg": 0.0,
    "max_turns_fallback": 0.0, "wrapper_budget": 0.0, "bare_reset_win": 1.0,
    "bare_reset_loss": 0.0, "implicit_names": 0.0, "math_verify": 1.0, "shaped_win": 1.0,
    "shaped_loss": -1.0, "shaped_out_of_turns": 0.0, "truncated_with_reward": 0.0,
    "clipped_high": 1.0, "clipped_low": -1.0, "in_range": 0.25,
}  # fmt: skip


# ----------------------------------------------------------------------------- reference


def _recipe_namespace() -> dict:
    """The recipe's import-free names, bound by hand (independent of the sandbox's table)."""
    names = dict(random=random, re=re, math=math, json=json, collections=collections,
                 itertools=itertools, functools=functools, string=string, copy=copy,
                 heapq=heapq, operator=operator, statistics=statistics, np=np, numpy=np)
    for module, attrs in ((collections, "deque defaultdict Counter OrderedDict namedtuple"),
                          (itertools, "combinations permutations product chain accumulate"),
                          (functools, "reduce lru_cache"), (copy, "deepcopy"),
                          (heapq, "heappush heappop"),
                          (typing, "Tuple Dict List Optional Union Any Set FrozenSet Callable "
                                   "Iterable Sequence Mapping")):
        names.update({a: getattr(module, a) for a in attrs.split()})
    return names


def _recipe_episode(game: Game) -> tuple[list[str], list[float], float]:
    """Plays `game` in this process the recipe's way; returns observations, raw rewards and
    the recipe's score (last reward if terminated, clipped to [-1, 1], else 0)."""
    namespace = _recipe_namespace()
    exec(compile(game.source, "<test game>", "exec"), namespace)  # noqa: S102 - our own code
    cls = namespace[game.cls]
    try:  # the recipe: the game's own defaults first, its turn limit capped at the budget
        env = cls()
    except TypeError:
        env = cls(max_turns=game.max_turns)
    own = getattr(env, "max_turns", None)
    if isinstance(own, int) and own > 0:
        env.max_turns = min(own, game.max_turns)
    elif hasattr(env, "max_turns"):
        env.max_turns = game.max_turns
    first = env.reset(seed=game.seed)
    observations = [first if isinstance(first, str) else first[0]]
    rewards, terminated = [], False
    for turn, action in enumerate(game.actions):
        if turn == game.max_turns:
            break
        obs, reward, terminated, truncated, _ = env.step(action)
        observations.append(obs)
        rewards.append(float(reward))
        if terminated or truncated:
            break
    score = max(-1.0, min(1.0, rewards[-1])) if rewards and terminated else 0.0
    return observations, rewards, score


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def pool():
    with EnvPool(SandboxConfig(call_deadline_s=2.0, load_deadline_s=5.0)) as p:
        if p.isolation_report().missing:
            pytest.skip(f"sandbox layers missing here: {p.isolation_report().as_dict()}")
        yield p


def _play(env, game: Game) -> tuple[list[str], list[float], list[float], bool, bool]:
    obs, _ = env.reset(seed=game.seed)
    observations, reported, raw = [obs], [], []
    terminated = truncated = False
    for action in game.actions:
        obs, reward, terminated, truncated, info = env.step(action)
        assert "sandbox_error" not in info, info
        observations.append(obs)
        reported.append(reward)
        raw.append(info["raw_reward"])
        if terminated or truncated:
            break
    return observations, reported, raw, terminated, truncated


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", sorted(GAMES))
def test_recipe_game_validates_and_scores_as_the_recipe(name, pool):
    game = GAMES[name]
    assert detect_contract(game.source) == "reference"
    report = validate_program(game.source, pool=pool, contract="reference",
                              max_turns=game.max_turns)
    assert report.ok, report.reason
    assert "recipe_checks" in report.checks_passed

    want_obs, want_raw, want_score = _recipe_episode(game)
    env = make_env(game.source, pool, contract="reference", max_turns=game.max_turns)
    observations, reported, raw, terminated, truncated = _play(env, game)
    env.close()
    assert observations == want_obs
    assert raw == want_raw
    assert sum(reported) == pytest.approx(want_score, abs=1e-12)
    assert want_score == EXPECTED_SCORE[name]
    # Only the step that ends the episode may carry a reward.
    assert all(r == 0.0 for r in reported[:-1])
    assert terminated or truncated


# step() raises on its second action; a second game answers with loose types.
RAISES = r"""
class FragileEnv:
    def __init__(self, max_turns=12):
        self.max_turns = max_turns
    def reset(self, seed=None):
        self.turn = 0
        return "Say anything.", {}
    def step(self, action):
        self.turn += 1
        if self.turn == 2:
            raise KeyError("no such room")
        return "go on", 0.0, False, False, {}
"""
LOOSE = r"""
class LooseEnv:
    def __init__(self, max_turns=12):
        self.max_turns = max_turns
    def reset(self, seed=None):
        return "Say anything.", {}
    def step(self, action):
        if "four" in action:
            return "old gym", 1.0, True, {}
        if "list" in action:
            return ["a list", 1.0, True, False, {}]
        return 17, "1", 1, 0, {"program_error": True, "moves": 1}
"""


@pytest.fixture(scope="module")
def lenient_pool():
    # Every finished episode is replayed: the replay plays through the wrapper too.
    with EnvPool(SandboxConfig(call_deadline_s=2.0, load_deadline_s=5.0,
                               lenient_play_steps=True, replay_audit_rate=1.0)) as p:
        if p.isolation_report().missing:
            pytest.skip(f"sandbox layers missing here: {p.isolation_report().as_dict()}")
        yield p


def test_a_played_step_that_fails_is_scored_as_the_recipe_scores_it(pool, lenient_pool):
    """Issue 30 item 3: the recipe's play wrapper answers a game's exception with an error
    observation, reward -1 and the episode terminated; a reply that is not a 5-tuple is an
    "Invalid game response" (-1); a 5-tuple's parts are coerced. Validation stays strict,
    and without the setting a raising step still ends the episode as an env_error."""
    env = make_env(RAISES, lenient_pool, contract="reference", max_turns=12)
    env.reset(seed=0)
    assert env.step("a")[1:4] == (0.0, False, False)
    observation, reward, terminated, truncated, info = env.step("b")
    assert observation.startswith("Error: ") and "no such room" in observation
    assert (reward, terminated, truncated, info["program_error"]) == (-1.0, True, False, True)
    env.close()
    env = make_env(LOOSE, lenient_pool, contract="reference", max_turns=12)
    env.reset(seed=0)
    *coerced, info = env.step("one")
    assert coerced == ["17", 1.0, True, False]  # coerced, and the score is 1
    assert info["moves"] == 1 and "program_error" not in info  # the game's own key: dropped
    for action in ("four", "list"):  # a 4-tuple, and a list (the recipe wants a tuple)
        env.reset(seed=0)
        assert env.step(action)[:4] == ("Invalid game response", -1.0, True, False)
    env.close()
    report = validate_program(RAISES, pool=lenient_pool, contract="reference", max_turns=12)
    assert not report.ok  # validation keeps the contract
    strict = make_env(RAISES, pool, contract="reference", max_turns=12)
    strict.reset(seed=0)
    strict.step("a")
    with pytest.raises(EnvProgramError):
        strict.step("b")
    strict.close()


def test_only_the_play_wrapper_marks_a_step_as_a_program_error(pool):
    """The agent loop ends an episode as "program_error" on info["program_error"]: a game's
    own info of that name must not (the lenient worker drops it, see above; the trainer
    keeps the marker only on a lenient handle's terminating -1 step)."""
    marking = LOOSE.replace('return 17, "1", 1, 0, {', 'return "ok", -1.0, True, False, {')
    strict = make_env(marking, pool, contract="reference", max_turns=12)
    strict.reset(seed=0)
    *_, info = strict.step("one")
    assert info["moves"] == 1 and "program_error" not in info
    strict.close()


def test_class_is_found_by_name_past_decoys(pool):
    env = make_env(DECOY, pool, contract="reference")
    assert env.reset(seed=4)[0].startswith("Climb to rung")
    env.close()


def test_max_turns_reaches_the_game(pool):
    for source, turns in ((KWARG, 7), (NO_KWARG, 5)):
        env = make_env(source, pool, contract="reference", max_turns=turns)
        assert env.reset(seed=0)[0] == f"budget {turns}"
        steps = 0
        while True:
            steps += 1
            *_, terminated, truncated, _ = env.step("a")
            if terminated or truncated:
                break
        assert (steps, terminated, truncated) == (turns, False, True)
        env.close()


# A game paced by its own turn limit (the recipe's template shows 12).
PACED = r"""
class PacedEnv:
    def __init__(self, max_turns=OWN):
        self.max_turns = max_turns
    def reset(self, seed=None):
        self.turn = 0
        return f"budget {self.max_turns}", {}
    def step(self, action):
        self.turn += 1
        return f"turn {self.turn}", 0.0, False, self.turn >= self.max_turns, {}
"""


@pytest.mark.parametrize("own, budget, want", [(8, 25, 8), (40, 25, 25), (12, 5, 5)])
def test_the_game_keeps_its_own_turn_limit_capped_at_the_budget(own, budget, want, pool):
    """Issue 30 item 2: built as cls() first, then max_turns = min(its own, the budget); a
    game's own 8 turns stay 8 under the recipe's 25 (cls(max_turns=25) made them 25)."""
    env = make_env(PACED.replace("OWN", str(own)), pool, contract="reference",
                   max_turns=budget)
    assert env.reset(seed=0)[0] == f"budget {want}"
    steps, done = 0, False
    while not done:
        steps += 1
        *_, terminated, truncated, _ = env.step("a")
        done = terminated or truncated
    assert steps == want
    env.close()


def test_wrapper_truncates_a_game_that_never_ends(pool):
    env = make_env(ENDLESS, pool, contract="reference", max_turns=4)
    env.reset(seed=0)
    results = [env.step("a") for _ in range(4)]
    assert [r[3] for r in results] == [False, False, False, True]
    assert [r[1] for r in results] == [0.0] * 4  # intermediate 0.5s do not count
    with pytest.raises(EnvProgramError) as failed:
        env.step("a")
    assert failed.value.error.code == "episode_over"
    env.close()


@pytest.mark.parametrize("source", [BARE_RESET, IMPLICIT, SHAPED, ENDLESS],
                         ids=["bare_reset", "implicit", "shaped", "endless"])
def test_gymnasium_env_checker_passes_on_reference_envs(source, pool):
    env = make_env(source, pool, contract="reference", max_turns=5)
    check_env(env, skip_render_check=True)
    env.close()


def test_snapshot_fork_keeps_the_contract(pool):
    env = make_env(SHAPED, pool, contract="reference", max_turns=6)
    env.reset(seed=0)
    env.step("x")
    twin = env.fork()
    assert twin.step(r"\boxed{win}")[1] == 1.0
    assert env.step("x")[1] == 0.0
    twin.close()
    env.close()


def test_recipe_reward_bound_is_enforced(pool):
    source = BIG_REWARD.replace("max(-10.0, min(10.0, value))", "value")
    env = make_env(source, pool, contract="reference")
    env.reset(seed=0)
    with pytest.raises(EnvProgramError) as failed:
        env.step(r"\boxed{50}")
    assert failed.value.error.code == "reward_out_of_range"
    env.close()
    report = validate_program(
        source.replace('return "done", value', 'return "done", value * 1000'), pool=pool,
        contract="reference")
    assert report.code == "reward_out_of_range", report.reason


@pytest.mark.parametrize(
    ("source", "code"),
    [
        ("class Helper:\n    pass\n", "missing_contract"),
        ("class GridEnv:\n    def reset(self, seed=None):\n        return 'x', {}\n",
         "missing_contract"),
        (BARE_RESET.replace("return f\"Type", "return \"\"\n        f\"Type"), "bad_type"),
        (SHAPED.replace('return "keep going"', 'return 1 / 0, "keep going"'), "program_error"),
        (IMPLICIT.replace("np.random.seed(seed)", "np.random.seed(None)"),
         "nondeterministic_reset"),
    ],
    ids=["no_env_class", "env_class_without_step", "empty_first_observation",
         "raises_on_unboxed_input", "unseeded_numpy"],
)
def test_broken_recipe_games_are_rejected(source, code, pool):
    report = validate_program(source, pool=pool, contract="reference")
    assert report.code == code, report.reason


@pytest.mark.parametrize(
    ("top", "code"),
    [
        ("from math_verify import parse, verify", None),
        ("import numpy as n\nx = n.random.default_rng(0)", None),
        ("from collections import deque\nfrom typing import *", None),
        ("from numpy import *", "forbidden_import"),
        ("from numpy import load", "forbidden_attribute"),
        ("import numpy as n\nx = n.save", "forbidden_attribute"),
        ("x = getattr(np, 'fromfile')", "forbidden_attribute"),
        ("import numpy.lib", "forbidden_attribute"),
        ("from numpy.lib import format", "forbidden_attribute"),
        ("x = np.zeros(1).ctypes", "forbidden_attribute"),
        ("import math_verify.parser", "forbidden_attribute"),
        ("from math_verify import parser", "forbidden_attribute"),
        ("x = random._os", "forbidden_attribute"),
        ("x = statistics.sys", "forbidden_attribute"),
        ("import os", "forbidden_import"),
        ("import sympy", "forbidden_import"),
    ],
)
def test_static_gate_rules_for_reference_names(top, code):
    from spade_jax.envs.static_gate import check_source

    result = check_source(top + "\n" + SHAPED, SandboxConfig(), "reference")
    assert (result.error.code if result.error else None) == code, result.error
    if code is None:  # numpy and math_verify are reference-only imports
        paper = check_source(top + "\n" + SHAPED.replace("ShapedEnv", "Environment"),
                             SandboxConfig(), "paper")
        assert (paper.error is None) == ("numpy" not in top and "math_verify" not in top)


@pytest.mark.slow
def test_check_cli_validates_a_recipe_game(tmp_path):
    path = tmp_path / "game.py"
    path.write_text(SHAPED)
    run = subprocess.run(
        [sys.executable, "-m", "spade_jax.envs.check", str(path), "--contract", "reference",
         "--max-turns", "4"], capture_output=True, text=True, timeout=300, check=False)
    payload = json.loads(run.stdout)
    assert (run.returncode, payload["ok"], payload["code"]) == (0, True, "ok")
    assert "recipe_checks" in payload["checks_passed"]
    path.write_text(SHAPED.replace("0.4", "40.0"))
    run = subprocess.run([sys.executable, "-m", "spade_jax.envs.check", str(path)],
                         capture_output=True, text=True, timeout=300, check=False)
    assert (run.returncode, json.loads(run.stdout)["code"]) == (1, "reward_out_of_range")


def test_paper_programs_keep_the_paper_contract(pool):
    program = SEED_PROGRAMS[0].source
    assert detect_contract(program) == "paper"
    assert validate_program(program, pool=pool).ok  # auto -> paper
    assert validate_program(program, pool=pool, contract="reference").code == "missing_contract"
    assert validate_program(DECOY, pool=pool, contract="paper").code == "missing_contract"
    with pytest.raises(ValueError, match="unknown program contract"):
        validate_program(program, pool=pool, contract="recipe")


def test_pool_dir_loads_recipe_games(tmp_path):
    games = tmp_path / "games"
    games.mkdir()
    for index, name in enumerate(("decoy_helpers", "bare_reset_win", "math_verify")):
        (games / f"game_{index:03d}.py").write_text(GAMES[name].source)
    (games / "notes.py").write_text("x = 1\n")  # not game_*.py: ignored
    (tmp_path / "other.py").write_text("x = 1\n")  # the games folder wins
    pool = load_program_pool(tmp_path)
    assert [p.name for p in pool] == ["game_000", "game_001", "game_002"]
    assert all(p.hint is None and p.contract == "reference" for p in pool)
    assert pool[2].source == MATH
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.py").write_text(SEED_PROGRAMS[0].source)
    (tmp_path / "mixed" / "b.py").write_text(SHAPED)
    assert [p.contract for p in load_program_pool(tmp_path / "mixed")] == ["paper", "reference"]


# ----------------------------------------------------------------------------- agent side


@pytest.mark.parametrize(
    ("text", "content"),
    [
        (r"Use \boxed{answer}. I think \boxed{3} ... final: \boxed{4}", "4"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{{42}}", "42"),
        (r"\boxed{{a}{b}}", "{a}{b}"),
        (r"\boxed{ go north }", "go north"),
        (r"\boxed {7}", "7"),
        (r"\boxed{\boxed{1}}", r"\boxed{1}"),
        (r"\boxed{a} then \boxed{b", "a"),
        (r"\boxed{unclosed \boxed{5}", "5"),
        (r"} stray { \boxed{x}", "x"),
        ("no box at all", None),
        ("", None),
    ],
)
def test_last_boxed(text, content):
    assert last_boxed(text) == content


def test_boxed_action_parser():
    parse = ActionParser(action_format="boxed")
    assert parse(r"<think>\boxed{1}</think> so \boxed{2} and \boxed{ 3 }") == (r"\boxed{3}", True)
    assert parse(r"  answer 3  ") == ("answer 3", False)  # no box: the text, a parse failure
    assert parse(r"\boxed{}") == (r"\boxed{}", False)  # empty box: the same
    assert parse("<think>unclosed") == ("", False)
    assert ActionParser()(r"\boxed{2}") == (r"\boxed{2}", True)  # "text" keeps the reply
    with pytest.raises(ValueError, match="action_format"):
        ActionParser(action_format="json")


def test_boxed_actions_play_a_recipe_game(pool):
    parse = ActionParser(action_format="boxed")
    env = make_env(MATH, pool, contract="reference")
    env.reset(seed=0)
    replies = [r"The format is \boxed{x}. Let me think: 1/2 = 0.5 so \boxed{\frac{1}{2}}"]
    action, ok = parse(replies[0])
    assert (action, ok) == (r"\boxed{\frac{1}{2}}", True)
    _, reward, terminated, _, _ = env.step(action)
    assert (reward, terminated) == (1.0, True)
    env.close()


class _CharTokenizer:
    """ChatML rendered to code points: enough for ChatTurns."""

    eos_ids = (0,)

    def apply_chat_template(self, messages, add_generation_prompt, enable_thinking):
        text = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
        return [ord(c) for c in text + ("<|assistant|>" if add_generation_prompt else "")]


def test_first_turn_template_frames_only_the_first_turn():
    config = AgentLoopConfig(action_format="boxed",
                             first_turn_template=REFERENCE_AGENT_FIRST_TURN_TEMPLATE)
    turns = ChatTurns(_CharTokenizer(), None, False, config.first_turn_template)
    text = "".join(map(chr, turns.first_prompt("grid {1}\n\nHINT: go up")))
    body = REFERENCE_AGENT_FIRST_TURN_TEMPLATE.replace("{observation}", "grid {1}\n\nHINT: go up")
    assert text == f"<|user|>{body}\n<|assistant|>"
    assert "language game" in body and r"\boxed{}" in body and "step by step" in body
    plain = ChatTurns(_CharTokenizer(), None, False)
    assert "".join(map(chr, plain.first_prompt("obs"))) == "<|user|>obs\n<|assistant|>"
    with pytest.raises(ValueError, match="placeholder"):
        AgentLoopConfig(first_turn_template="no placeholder")
    with pytest.raises(ValueError, match="action_format"):
        AgentLoopConfig(action_format="last")


def test_reference_designer_prompt_states_the_recipe_requirements():
    """Issue 30 item 9: the recipe's requests (its ideas, our words), and none of what our
    earlier prompt asked instead."""
    prompt = reference_designer_system_prompt(12)
    lowered = " ".join(prompt.lower().split())
    for needed in ("ends in `env`", "max_turns` is then capped at 12", "boxed{",
                   "interactive game driven by commands", "hidden",  # hidden, revealed by acting
                   "revealed only by acting", "share of the goal reached",  # partial reward
                   "ends (terminated=true) only when the goal is reached",
                   "at least 3 commands",  # medium difficulty
                   "standard library only", "no numpy", "no math_verify",
                   "solution(self)", "checked by playing",  # a solution() to check the game
                   "doubled", "check the code yourself",  # escaped braces; a self-check
                   "truncated=true", "never raises", "without a box"):
        assert needed in lowered, needed
    for gone in ("np (numpy)", "from math_verify", "way to lose", "random play should lose",
                 "6 to 9 turns", "keep them 0.0", "at least two meaningfully",
                 "from numpy"):  # a numpy rule would contradict "no numpy"
        assert gone.lower() not in lowered, gone
    assert "max_turns=12, **kwargs" in prompt  # the template's own default (the recipe's)
    assert "capped at 25" in REFERENCE_DESIGNER_SYSTEM_PROMPT
    assert "at least 5 commands" in " ".join(reference_designer_system_prompt(
        25, min_steps=5).split())
    with pytest.raises(ValueError, match="max_turns"):
        reference_designer_system_prompt(0)
    # The contract the sandbox enforces still lists every name it binds.
    assert "np (numpy)" in render_reference_contract(25) and "math_verify" in \
        render_reference_contract(25)
    assert "from numpy no file input/output" in " ".join(render_reference_contract(25).split())


def test_docs_show_the_reference_contract_text():
    """docs/environments.md quotes REFERENCE_CONTRACT verbatim (it had kept the text from
    before issue 30: cls(max_turns=25), earlier rewards "kept 0.0")."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "environments.md").read_text()
    section = doc.split("### reference (the published recipe's games)", 1)[1]
    block = section.split("```\n", 1)[1].split("\n```", 1)[0]
    assert block + "\n" == REFERENCE_CONTRACT


def test_reference_designer_user_prompt():
    good = [{"program": SHAPED, "win_rate": 0.5, "regret": 0.25}]
    bad = [{"source": "class XEnv:\n    pass\n" + "#" * 50, "win_rate_no_hint": 1.0,
            "regret": -0.1},
           {"program": "import math\nclass HardEnv:\n    pass\n", "win_rate": 0.0,
            "regret": 0.0, "regime": "intractable"}]
    text = reference_designer_user_prompt("logic", ["A" * 30, "second doc"], good, bad,
                                          max_doc_chars=10, max_program_chars=40)
    assert text.startswith("Design one new game that trains the skill 'logic'")
    assert "[Document 1]\nAAAAAAAAAA\n[... truncated]" in text and "[Document 2]" in text
    assert "Agent win rate 0.50, regret +0.25" in text
    # Issue 30 item 6: a game to avoid is one line (too easy / too hard, win rate, class
    # name), never its program.
    assert "Games to avoid:\n- too easy (agent win rate 1.00): class XEnv\n" \
           "- too hard (agent win rate 0.00): class HardEnv" in text
    assert "pass" not in text.split("Games to avoid:")[1] and "import math" not in text
    assert text.index("frontier") < text.index("0.50") < text.index("Games to avoid")
    assert text.rstrip().endswith("one ```python block.")
    bare = reference_designer_user_prompt("logic", [], max_doc_chars=10)
    assert "Document" not in bare and "win rate" not in bare
    with pytest.raises(ValueError, match="lacks"):
        reference_designer_user_prompt("logic", [], [{"program": "x"}], max_doc_chars=10)


PENALTY_FIRST = """
class Environment:
    def reset(self, seed=None):
        self.t = 0
        return "keep going", {}
    def step(self, action):
        self.t += 1
        return "keep going", (-1.0 if self.t == 1 else 0.0), False, False, {}
"""


@pytest.mark.slow  # ~16 s: compiles the sampler for the chat model
def test_run_episodes_plays_a_recipe_game_the_recipe_way(chat_model, chat_tokenizer, pool):
    """The agent loop with the recipe's interface: the first turn framed by the template,
    boxed parsing by default, and a return equal to the recipe's score (the game pays 0.4
    per unboxed turn, which must not count)."""
    config = AgentLoopConfig(
        max_turns=3, max_turn_tokens=6, action_format="boxed",
        first_turn_template=REFERENCE_AGENT_FIRST_TURN_TEMPLATE,
        sampler=SamplerConfig(6, temperature=0.9, seed=2, prompt_bucket_min=128,
                              compact_batch=False),
    )  # fmt: skip
    env = make_env(SHAPED, pool, contract="reference", max_turns=3)
    # A paper-contract program whose running return is -1 when the turn budget cuts it.
    penalty = make_env(PENALTY_FIRST, pool)
    rec, cut = run_episodes(chat_model, chat_tokenizer, [EpisodeSpec(env, "shaped", 0),
                                                        EpisodeSpec(penalty, "penalty", 1)],
                            config)
    env.close()
    penalty.close()
    assert cut.end_reason == "max_turns" and cut.return_ == 0.0  # within [0, 1], not -1
    first = REFERENCE_AGENT_FIRST_TURN_TEMPLATE.replace("{observation}", rec.observations[0])
    opening = list(chat_tokenizer.apply_chat_template(
        [{"role": "user", "content": first}], add_generation_prompt=True, enable_thinking=False))
    assert rec.token_ids[:len(opening)] == opening
    parse = ActionParser(action_format="boxed")
    for (start, end), action in zip(rec.turn_spans, rec.actions, strict=True):
        text = chat_tokenizer.decode(rec.token_ids[start:end], skip_special_tokens=True)
        assert action == parse(text)[0]
    assert rec.cost.parse_failures == rec.cost.turns == 3  # a random policy writes no box
    assert rec.observations[1:] == ["keep going"] * 3
    assert rec.step_rewards == [0.0, 0.0, 0.0] and rec.return_ == 0.0
    assert rec.end_reason == "truncated"
