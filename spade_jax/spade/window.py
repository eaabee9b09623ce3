"""The state a regeneration window carries between rounds, as plain JSON-able dataclasses.

    Game            one validated program of a window: its hint, the cached hint-arm
                    returns (played once, at the regeneration round) and the no-hint
                    returns of every round of the window (offset 0 first)
    Window          the games written at round ``start``, played until the next regeneration
    DesignerSample  one designer output to train (a valid program, or an invalid attempt
                    under the paper text's penalty), waiting for its delayed update
    Pending         the designer samples written at round ``produced_at``: scored and trained
                    at round ``produced_at + designer_delay`` from their window's statistics
    GameStats       what the loop itself measures of a game (regret, win rate...) for memory
                    and metrics, independent of the designer reward rule

Everything resumes from ``to_json`` / ``from_json``: there is no random state to carry,
since every draw of a round is seeded from (experiment seed, round, phase, index).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import Any

import numpy as np

from spade_jax.rollout.routing import decode_routing, encode_routing
from spade_jax.spade import regret


class Outcome(enum.StrEnum):
    """What became of a designer attempt or a game: valid, or why not."""

    VALID = "valid"
    PARSE_ERROR = "parse_error"  # the reply holds no program in the expected format
    INVALID = "invalid"  # the sandbox's validation rejected the program
    LOAD_ERROR = "load_error"  # validated, but a copy failed to open for play
    BLOCKLISTED = "blocklisted"  # a play timed out or failed: never played again


@dataclasses.dataclass(frozen=True)
class Verdict:
    """An outcome and its reason code (``""`` for a valid one), e.g. (INVALID, "timeout")."""

    outcome: Outcome
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.VALID

    @property
    def label(self) -> str:
        """Metric key suffix: the outcome, plus the reason code when there is one."""
        return f"{self.outcome.value}/{self.reason}" if self.reason else self.outcome.value

    def to_json(self) -> list[str]:
        return [self.outcome.value, self.reason]

    @classmethod
    def from_json(cls, data: Sequence[str]) -> Verdict:
        return cls(Outcome(data[0]), data[1])


VALID = Verdict(Outcome.VALID)


@dataclasses.dataclass
class Game:
    """A validated program of a window and the agent's returns on it so far."""

    env_id: str
    slot: int
    skill: str
    program: str
    hint: str | None  # None: no hint arm (hint_mode "none", or the hint writer failed)
    doc_ids: tuple[str, ...]
    returns_by_offset: list[list[float]]  # no-hint returns per round of the window
    hint_returns: list[float] = dataclasses.field(default_factory=list)
    opening_observation: str = ""
    verdict: Verdict = VALID  # LOAD_ERROR once a copy failed to open: never played again
    # Reward levels of the PROGRAM, probed in the sandbox with seeded scripted play at the
    # regeneration round (NaN: not probed, or the probe could not play it).
    reward_levels: float = float("nan")
    strict_partial_levels: float = float("nan")
    # The round it was written: the window's start, or a later round of the window for a
    # game written in place of one that failed (SpadeConfig.regenerate_missing_games).
    written_at: int = -1

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["doc_ids"], data["verdict"] = list(self.doc_ids), self.verdict.to_json()
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Game:
        return cls(**{**data, "doc_ids": tuple(data["doc_ids"]),
                      "verdict": Verdict.from_json(data["verdict"])})

    def written_round(self, window_start: int) -> int:
        """The round this game was written (checkpoints before ``written_at`` existed:
        the window's start)."""
        return window_start if self.written_at < 0 else self.written_at


@dataclasses.dataclass
class Window:
    """The games written at round ``start``; played every round until the next one."""

    start: int
    games: list[Game]

    def to_json(self) -> dict[str, Any]:
        return {"start": self.start, "games": [g.to_json() for g in self.games]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Window:
        return cls(int(data["start"]), [Game.from_json(g) for g in data["games"]])


@dataclasses.dataclass
class DesignerSample:
    """A designer output to train: prompt, sampled tokens and their sampler log-probs."""

    slot: int
    skill: str
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    env_id: str | None  # the game it wrote; None for an invalid attempt (penalty only)
    verdict: Verdict = VALID
    # Router replay: the experts prompt + output tokens were routed to when sampled
    # ([P + n - 1, L, X] compact ints), or None. Serialised as base64 of its bytes.
    routing: np.ndarray | None = None

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(dataclasses.replace(self, routing=None))
        data["verdict"] = self.verdict.to_json()
        data["routing"] = encode_routing(self.routing)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DesignerSample:
        return cls(**{**data, "verdict": Verdict.from_json(data["verdict"]),
                      "routing": decode_routing(data.get("routing"))})


@dataclasses.dataclass
class Pending:
    """Designer samples written at round ``produced_at`` (a regeneration round)."""

    produced_at: int
    samples: list[DesignerSample]

    def to_json(self) -> dict[str, Any]:
        return {"produced_at": self.produced_at, "samples": [s.to_json() for s in self.samples]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Pending:
        return cls(int(data["produced_at"]), [DesignerSample.from_json(s) for s in data["samples"]])


@dataclasses.dataclass(frozen=True)
class GameStats:
    """The loop's own measurements of one game over its window (the recipe's definitions,
    from :mod:`spade_jax.spade.regret`; an empty set of returns has mean 0). They feed
    memory and metrics, never the reward.

    hint_mean: mean hint-arm return; offset0_mean: mean no-hint return of the
    regeneration round; regret = regret(hint, offset 0) = hint_mean - offset0_mean
    (matched timing); mean_return: the window's win rate, the mean of every no-hint return
    of the window so far; solve_rate: share of those returns > 0 (a win); plays: how many
    there were.
    """

    hint_mean: float
    offset0_mean: float
    regret: float
    mean_return: float
    solve_rate: float
    plays: int


def game_stats(game: Game, first: int = 0, end: int | None = None) -> GameStats:
    """``game``'s statistics over the window's rounds ``first`` (the round it was written,
    its "offset 0") to ``end`` (exclusive; default: every round so far)."""
    offsets = game.returns_by_offset[first:end]
    offset0 = offsets[0] if offsets else []
    window = regret.flatten_steps(offsets)
    return GameStats(hint_mean=regret.mean_return(game.hint_returns),
                     offset0_mean=regret.mean_return(offset0),
                     regret=regret.regret(game.hint_returns, offset0),
                     mean_return=regret.window_win_rate(offsets),
                     solve_rate=regret.mean_return(window > 0),  # a share: mean of 0/1
                     plays=int(window.size))
