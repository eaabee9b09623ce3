"""What a finished episode hands to the trainer: one flat token stream with a loss mask.

The stream is exactly what the policy saw and produced, token for token (no re-rendering
of the conversation), so a trainer forward pass over ``token_ids`` recomputes every
sampled log-probability, and router replay / snapshot replay line up with it.
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np


class EndReason(enum.StrEnum):
    """Why an episode ended: the one list of `EpisodeRecord.end_reason` values (a StrEnum,
    so a value compares equal to its string and is written to JSON as one)."""

    TERMINATED = "terminated"  # the env ended it (won or lost)
    TRUNCATED = "truncated"  # the env cut it (its own turn limit)
    MAX_TURNS = "max_turns"  # AgentLoopConfig.max_turns policy turns were taken
    MAX_TOKENS = "max_tokens"  # the episode's token budget ran out
    CUT_REPLY = "cut_reply"  # a reply cut at the turn's token cap (end_on_cut_reply)
    ENV_ERROR = "env_error"  # an env call raised
    # The sandboxed program broke a run-time limit (per-call CPU budget or deadline,
    # memory, a replay that did not reproduce it) and is blocklisted: `EnvPool.blocked`.
    # The sandbox names it by this string (`envs.SandboxError.end_reason`).
    ENV_LIMIT = "env_limit"
    # The game's step() raised or answered badly and the sandbox's play wrapper answered
    # for it, reward -1 (``SandboxConfig.lenient_play_steps``).
    PROGRAM_ERROR = "program_error"


@dataclasses.dataclass
class EpisodeCost:
    """Per-episode cost accounting.

    tokens_generated: policy tokens sampled (sum over turns).
    context_tokens: length of the final token stream (prompt + observations + policy).
    turns: policy turns taken.
    env_seconds: wall time inside env.reset / env.step for this episode.
    parse_failures: turns whose text the action parser could not read.
    """

    tokens_generated: int = 0
    context_tokens: int = 0
    turns: int = 0
    env_seconds: float = 0.0
    parse_failures: int = 0


@dataclasses.dataclass
class EpisodeRecord:
    """One multi-turn episode, ready for a GRPO update.

    token_ids: the whole conversation as the policy saw it (chat-template tokens).
    loss_mask: 1 on tokens the policy sampled, 0 on prompt / observation / template tokens.
    logprobs: the sampler's log pi(token) (untruncated, temperature-scaled) on policy
      tokens, 0.0 elsewhere.
    turn_spans: per turn, the [start, end) slice of ``token_ids`` holding its policy tokens.
    actions: per turn, the parsed action passed to ``env.step`` (a turn that ended the
      episode unplayed, "cut_reply" or "max_tokens", keeps its action, never sent).
    observations: the reset observation, then one per step.
    step_rewards: per ``env.step`` reward; ``return_`` is their sum, but 0 for a
      "cut_reply" episode (the recipe scores it 0 whatever earlier steps paid).
    seed: the ``env.reset(seed=...)`` seed; with ``actions`` it replays the episode.
    env_id: which environment program ran.
    end_reason: an `EndReason` ("" while the episode runs).
    turn_done_reasons: the sampler's done reason per turn ("eos", "stop_string", "max_tokens").
    sampler_seeds: the generate() seed of each turn's call (with the row order, reproduces it).
    routing: with ``SamplerConfig.return_router``, the experts each fed token was routed to
      (``[T_fed, L, X]`` compact ints, post router-hook; :mod:`spade_jax.rollout.routing`),
      else None.
    """

    env_id: str
    seed: int
    token_ids: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    turn_spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    actions: list[str] = dataclasses.field(default_factory=list)
    observations: list[str] = dataclasses.field(default_factory=list)
    step_rewards: list[float] = dataclasses.field(default_factory=list)
    return_: float = 0.0
    terminated: bool = False
    truncated: bool = False
    end_reason: EndReason | str = ""
    turn_done_reasons: list[str] = dataclasses.field(default_factory=list)
    sampler_seeds: list[int] = dataclasses.field(default_factory=list)
    cost: EpisodeCost = dataclasses.field(default_factory=EpisodeCost)
    routing: np.ndarray | None = None

    def append(self, ids: list[int], policy: bool, logprobs: list[float] | None = None) -> None:
        """Extends the stream; policy tokens carry their sampled log-probs."""
        if policy and (logprobs is None or len(logprobs) != len(ids)):
            raise ValueError("policy tokens need one log-prob each")
        self.token_ids.extend(ids)
        self.loss_mask.extend([1 if policy else 0] * len(ids))
        self.logprobs.extend(logprobs if policy else [0.0] * len(ids))

    def arrays(self) -> dict[str, np.ndarray]:
        """The stream as NumPy arrays (int32 ids and mask, fp32 log-probs)."""
        return {
            "token_ids": np.asarray(self.token_ids, np.int32),
            "loss_mask": np.asarray(self.loss_mask, np.int32),
            "logprobs": np.asarray(self.logprobs, np.float32),
        }
