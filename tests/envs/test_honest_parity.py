"""Honest programs behave identically inside and outside the sandbox.

Each honest game below is played twice with the same seeds and actions: in this process
(the independent reference: the program exec'd with the recipe's import-free names bound
by hand, its own rewards) and in a sandbox worker (the pool, static gate on). Every
observation, raw reward and flag must be equal. The games lean on what the sandbox used
to break: math_verify answers that need sympy's lazy imports (the golden ratio, sqrt(2),
pi decimals, sets, intervals, matrices, integrals), numpy submodules that were not
imported at warm-up (polynomial, fft, ma, linalg), and the standard library's allowed
modules. A second test imports every public module of the allowed packages inside a
worker and compares with what imports here.
"""

from __future__ import annotations

import collections
import copy
import functools
import heapq
import importlib
import itertools
import json
import math
import operator
import pkgutil
import random
import re
import statistics
import string
import typing

import numpy as np
import pytest

from spade_jax.envs import EnvPool, SandboxConfig
from spade_jax.envs.contract import DEFAULT_ALLOWED_IMPORTS

# A quiz checked with math_verify: one question per turn, the observation says whether the
# answer was accepted, the last step pays the share of accepted answers.
MATH_QUIZ = r"""
from math_verify import parse, verify

QUESTIONS = [
    ("the golden ratio", r"\frac{1+\sqrt{5}}{2}"),
    ("the square root of two", r"\sqrt{2}"),
    ("pi", r"\pi"),
    ("(x+1)^2 expanded", r"(x+1)^2"),
    ("the set of 1, 2 and 3", r"\{1,2,3\}"),
    ("the interval from 0 (closed) to 1 (open)", r"[0,1)"),
    ("the matrix with rows 1 2 and 3 4", r"\begin{pmatrix}1&2\\3&4\end{pmatrix}"),
    ("the integral of x from 0 to 1", r"\int_0^1 x\,dx"),
    ("5 choose 2", r"\binom{5}{2}"),
    ("sin(pi/6)", r"\sin(\pi/6)"),
    ("three quarters", r"\frac{3}{4}"),
    ("the solution of x - 2 = 0", r"x=2"),
]

class QuizEnv:
    def __init__(self, max_turns=25):
        self.max_turns = max_turns

    def reset(self, seed=None):
        self.order = list(range(len(QUESTIONS)))
        random.Random(seed).shuffle(self.order)
        self.turn = self.right = 0
        return f"Give {QUESTIONS[self.order[0]][0]} as \\boxed{{...}}.", {}

    def step(self, action):
        m = re.search(r"\\boxed\{(.*)\}", action)
        given = m.group(1) if m else ""
        name, expected = QUESTIONS[self.order[self.turn]]
        ok = bool(given) and verify(parse("$" + expected + "$"), parse("$" + given + "$"))
        self.right += ok
        self.turn += 1
        verdict = f"{name}: {'accepted' if ok else 'rejected'} ({given})"
        if self.turn == len(QUESTIONS):
            return verdict, self.right / len(QUESTIONS), True, False, {}
        return verdict + f". Next: {QUESTIONS[self.order[self.turn]][0]}", 0.0, False, False, {}
"""

# Answers per question name (accepted outside the sandbox by math_verify 0.9).
ANSWERS = {
    "the golden ratio": (r"\frac{1+\sqrt{5}}{2}", "(1+\\sqrt{5})/2", "1.618033988749895"),
    "the square root of two": (r"\sqrt{2}", "2^{1/2}", "1.41421356237"),
    "pi": ("3.14159265358979", r"\pi", "3.14159265358979"),
    "(x+1)^2 expanded": ("x^2+2x+1", "x^2+2x+1", "x^2+1"),
    "the set of 1, 2 and 3": (r"\{3,2,1\}", r"\{1,2,3\}", r"\{3,2,1\}"),
    "the interval from 0 (closed) to 1 (open)": ("[0,1)", "[0,1)", "(0,1]"),
    "the matrix with rows 1 2 and 3 4": (r"\begin{pmatrix}1&2\\3&4\end{pmatrix}",) * 3,
    "the integral of x from 0 to 1": (r"\frac{1}{2}", "0.5", r"\frac12"),
    "5 choose 2": ("10", "10", "11"),
    "sin(pi/6)": (r"\frac12", "0.5", r"\frac{1}{2}"),
    "three quarters": ("0.75", r"75\%", r"\frac{3}{4}"),
    "the solution of x - 2 = 0": ("2", "x = 2", "2"),
}

# numpy submodules: data from the seed, results printed to 6 decimals every turn.
NUMPY_LAB = r"""
class LabEnv:
    def __init__(self, max_turns=25):
        self.max_turns = max_turns

    def reset(self, seed=None):
        rng = np.random.default_rng(seed)
        self.x = np.arange(8.0)
        self.y = 2.5 * self.x - 1.0 + rng.normal(0.0, 0.1, 8)
        self.turn = 0
        return "points: " + " ".join(f"{v:.4f}" for v in self.y), {}

    def step(self, action):
        self.turn += 1
        slope = np.polynomial.polynomial.polyfit(self.x, self.y, 1)[1]
        fitted = np.polynomial.Polynomial.fit(self.x, self.y, 2).convert().coef
        spectrum = np.abs(np.fft.rfft(self.y))[:3]
        masked = np.ma.masked_less(self.y, 3.0).mean()
        det = np.linalg.det(np.vander(self.x[:3]))
        obs = (f"slope {slope:.6f} quad {' '.join(f'{c:.6f}' for c in fitted)} "
               f"fft {' '.join(f'{v:.6f}' for v in spectrum)} masked {masked:.6f} det {det:.6f}")
        m = re.search(r"\\boxed\{(.*)\}", action)
        won = bool(m) and m.group(1).strip() == f"{slope:.2f}"
        return obs, (1.0 if won else 0.0), won or self.turn >= 3, False, {}
"""

# The paper contract's allowed standard library, used the way a game would.
STDLIB_PUZZLE = r"""
import bisect, cmath, dataclasses, decimal, enum, fractions, random, statistics, textwrap
import unicodedata
from collections import Counter

class Suit(enum.Enum):
    CLUBS = 1
    HEARTS = 2

@dataclasses.dataclass(frozen=True)
class Card:
    rank: int
    suit: Suit

class Environment:
    def reset(self, seed=None):
        rng = random.Random(seed)
        self.cards = [Card(rng.randint(1, 13), rng.choice(list(Suit))) for _ in range(6)]
        self.t = 0
        return textwrap.fill(" ".join(f"{c.rank}{c.suit.name[0]}" for c in self.cards), 20), {}

    def step(self, action):
        self.t += 1
        ranks = sorted(c.rank for c in self.cards)
        mean = fractions.Fraction(sum(ranks), len(ranks))
        money = decimal.Decimal(sum(ranks)) / decimal.Decimal(7)
        root = cmath.sqrt(-ranks[0])
        facts = [
            f"mean {mean}", f"median {statistics.median(ranks)}",
            f"stdev {statistics.pstdev(ranks):.6f}", f"money {money:.5f}",
            f"root {root.imag:.6f}", f"slot {bisect.bisect(ranks, 7)}",
            f"common {Counter(c.suit.name for c in self.cards).most_common(1)[0][0]}",
            f"name {unicodedata.name(action[:1]) if action else 'EMPTY'}",
            f"norm {unicodedata.normalize('NFKD', action)[:20]!r}",
        ]
        won = action.strip() == str(mean)
        reward = 0.25 if won else 0.0
        return "; ".join(facts), reward, won or self.t >= 4, False, {}
"""

GAMES = {
    "math_quiz": (MATH_QUIZ, "QuizEnv"),
    "numpy_lab": (NUMPY_LAB, "LabEnv"),
    "stdlib_puzzle": (STDLIB_PUZZLE, "Environment"),
}


def _actions(name: str, seed: int, variant: int) -> list[str]:
    if name == "math_quiz":
        from math_verify import parse  # noqa: F401 - the test needs math_verify here too

        order = list(range(12))
        random.Random(seed).shuffle(order)
        names = list(ANSWERS)
        return [f"\\boxed{{{ANSWERS[names[q]][variant]}}}" for q in order]
    if name == "numpy_lab":
        return ["\\boxed{2.50}", "no box", "\\boxed{2.49}"][variant:] + ["\\boxed{x}"] * 3
    return ["", "7", "ünï ✓", "13/2", "\\boxed{1}"][variant:] + ["9"] * 4


def _namespace() -> dict:
    """The recipe's import-free names, bound by hand in this process."""
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


def _outside(source: str, cls: str, seed: int, actions: list[str]) -> list[tuple]:
    namespace = _namespace() if cls != "Environment" else {}
    exec(compile(source, "<honest game>", "exec"), namespace)  # noqa: S102 - our own code
    env = namespace[cls]() if cls == "Environment" else namespace[cls](max_turns=25)
    first = env.reset(seed=seed)
    transcript = [("reset", first[0])]
    for action in actions:
        obs, reward, terminated, truncated, _ = env.step(action)
        transcript.append((obs, float(reward), bool(terminated), bool(truncated)))
        if terminated or truncated:
            break
    return transcript


def _inside(pool: EnvPool, source: str, seed: int, actions: list[str]) -> list[tuple]:
    handle = pool.open(source)
    assert handle.ok, handle.error
    first = handle.reset(seed)
    assert first.ok, first.error
    transcript = [("reset", first.observation)]
    for action in actions:
        result = handle.step(action)
        assert result.ok, result.error
        raw = result.info.get("raw_reward", result.reward)
        transcript.append((result.observation, raw, result.terminated, result.truncated))
        if result.terminated or result.truncated:
            break
    handle.close()
    return transcript


@pytest.fixture(scope="module")
def pool():
    with EnvPool(SandboxConfig(call_deadline_s=20.0, load_deadline_s=20.0, spare_workers=1,
                               replay_audit_rate=0.0)) as p:
        if p.isolation_report().missing:
            pytest.skip(f"sandbox layers missing here: {p.isolation_report().missing}")
        yield p


@pytest.mark.parametrize("name", sorted(GAMES))
def test_honest_games_play_the_same_inside_and_outside(name, pool):
    source, cls = GAMES[name]
    for seed, variant in ((3, 0), (11, 1), (5, 2)):
        actions = _actions(name, seed, variant)
        outside = _outside(source, cls, seed, actions)
        inside = _inside(pool, source, seed, actions)
        assert inside == outside, (name, seed)
    if name == "math_quiz":  # the reference accepted what it should: the test has teeth
        assert outside[-1][1] == 1.0 - 3 / 12  # variant 2 has three wrong answers
        first_run = _outside(source, cls, 3, _actions(name, 3, 0))
        assert first_run[-1][1] == 1.0 and "rejected" not in str(first_run)


# Public modules of the allowed packages that must import inside a worker exactly when they
# import here (tests, compilers and build tooling left out; the static gate refuses them).
_SKIP = re.compile(r"(^|\.)(tests?|testing|conftest|f2py|distutils|_pyinstaller|setup|"
                   r"benchmarks|__main__)(\.|$)")


def _public_modules() -> list[str]:
    names = sorted(DEFAULT_ALLOWED_IMPORTS - {"__future__"}) + ["collections.abc",
                                                                "json.decoder"]
    numpy_packages = [m.name for m in pkgutil.iter_modules(np.__path__, "numpy.")
                      if not m.name.split(".")[-1].startswith("_")]
    import math_verify
    import sympy

    verify_modules = [m.name for m in pkgutil.walk_packages(math_verify.__path__,
                                                            "math_verify.")]
    sympy_packages = [m.name for m in pkgutil.iter_modules(sympy.__path__, "sympy.") if m.ispkg]
    names += numpy_packages + verify_modules + sympy_packages
    return [n for n in names if not _SKIP.search(n)]


IMPORT_ALL = """
import importlib, json, sys
class ImportsEnv:
    def reset(self, seed=None):
        failed = []
        for name in @names@:
            try:
                importlib.import_module(name)
            except BaseException as err:
                failed.append(name + ': ' + type(err).__name__)
        return json.dumps(failed), {}
    def step(self, action):
        return 'x', 0.0, True, False, {}
"""


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # numpy.matlib says so
def test_every_public_module_of_the_allowed_packages_imports_inside():
    names = _public_modules()
    outside = []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - recorded, compared with the sandbox
            outside.append(f"{name}: {type(err).__name__}")
    config = SandboxConfig(call_deadline_s=60.0, static_gate=False, spare_workers=0,
                           memory_limit_mb=2048, worker_memory_mb=1024)
    with EnvPool(config) as pool:
        if pool.isolation_report().missing:
            pytest.skip(f"sandbox layers missing here: {pool.isolation_report().missing}")
        handle = pool.open(IMPORT_ALL.replace("@names@", repr(names)), contract="reference")
        result = handle.reset(0)
        handle.close()
    assert result.ok, result.error
    assert len(names) > 60 and "numpy.polynomial" in names and "numpy.fft" in names
    assert json.loads(result.observation) == outside
