"""One way to turn (experiment seed, step, phase, index, ...) into a random seed.

Every random draw of a run is seeded from a tuple of integers naming where it happens, so
the same command gives the same run and no two draws share a stream by accident (a seed
that is ``base + index`` repeats across steps; a tuple does not).

    from spade_jax.seeding import Phase, derive_seed, rng
    s = derive_seed(config.seed, step, Phase.AGENT, call_index)   # an int for a sampler
    g = rng(config.seed, step, Phase.DESIGN)                      # a numpy Generator
"""

from __future__ import annotations

import enum

import numpy as np


class Phase(enum.IntEnum):
    """Where in a step a draw happens; part of every seed tuple. Append, never renumber:
    the numbers are part of what makes a run reproducible across versions."""

    DESIGN = 1  # designer sampling (corpus draws, memory picks, the sampler)
    AGENT = 2  # no-hint agent plays
    HINT_ARM = 3  # hint-arm agent plays
    MEMORY_REPLAY = 4  # replayed memory environments
    BASELINE = 5  # fixed-environment baseline episodes
    HINT_WRITE = 6  # the policy writing a strategy hint (hint_mode="self")
    VALIDATION = 7  # validation seeds of designer programs
    EVAL = 8  # held-out evaluation
    PROBE = 9  # scripted probes of a program (reward levels, ...)
    ARM_ORDER = 10  # order in which environment copies are opened
    CREDIT = 11  # update-rule draws (forked continuations, judge replies, turn choices)
    REFILL = 12  # a group filter's replacement plays (DAPO dynamic sampling's refill)
    REPLAY_AUDIT = 13  # which finished sandbox episodes are replayed to check determinism
    WARM_START = 14  # supervised warm-start examples (the toy world's levels, digits)
    SUPERVISED_REPLAY = 15  # warm-start examples replayed in an update (spade.supervised_replay)


def _entropy(parts: tuple[int, ...]) -> list[int]:
    # The tuple's length leads: SeedSequence pads its entropy with zeros, so without it
    # (1, 2) and (1, 2, 0) would name the same stream.
    out = [len(parts)]
    for p in parts:
        p = int(p)
        if p < 0:
            raise ValueError(f"seed parts must be >= 0, got {parts}")
        out.append(p)
    return out


def rng(*parts: int) -> np.random.Generator:
    """A numpy Generator keyed by ``parts`` (SeedSequence entropy: order matters)."""
    return np.random.default_rng(np.random.SeedSequence(_entropy(parts)))


def derive_seed(*parts: int) -> int:
    """A 31-bit seed keyed by ``parts``, for APIs that take an int (the sampler's seed)."""
    state = np.random.SeedSequence(_entropy(parts)).generate_state(1, dtype=np.uint32)
    return int(state[0] & 0x7FFFFFFF)
