"""What step-level rules see: episodes as arrays, and the one interface to the rollout side.

A step-credit rule (``rl.step_credits``) gets

  * an :class:`EpisodeBatch`: the sampled episodes (any object with the :class:`Episode`
    attributes; :class:`spade_jax.rollout.records.EpisodeRecord` is one) plus their structure
    as arrays, ``step_rewards [B, S]``, ``step_mask [B, S]`` and ``token_step [B, T]`` (the
    turn whose action token t belongs to, -1 for prompt / observation / padding tokens);
  * a :class:`StepContext`: the seed parts of this update and, when the caller can provide
    one, a :class:`RolloutService`, through which a rule asks for more samples: forked
    continuations of an episode from one of its turns (:class:`Fork`), plain policy
    completions (a policy judge), or new plays of this step's environments (a group
    filter's refill, :class:`GroupRequest`). A rule never reaches into the loop for them.

Shape legend: B episodes, S steps (turns), T tokens (the longest episode's length).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from spade_jax import seeding
from spade_jax.rollout.records import EpisodeRecord


class Episode(Protocol):
    """The fields of a sampled episode a rule may read (``EpisodeRecord`` has them all).

    ``turn_spans[k]`` is the [start, end) slice of ``token_ids`` holding turn k's policy
    tokens; ``actions[k]`` the action it sent, ``step_rewards[k]`` the reward it got;
    ``observations`` the reset observation then one per step; ``seed`` the env's reset
    seed (with ``actions`` it replays the episode); ``env_id`` which program ran.
    """

    env_id: str
    seed: int
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    turn_spans: list[tuple[int, int]]
    actions: list[str]
    observations: list[str]
    step_rewards: list[float]
    return_: float


@dataclasses.dataclass(frozen=True)
class EpisodeBatch:
    """Episodes of one role's update and their structure as arrays (see module docstring).

    ``rewards_b`` is each episode's outcome reward (what its advantage was computed from),
    ``group_b`` its group's index.
    """

    episodes: tuple[Any, ...]
    rewards_b: np.ndarray
    group_b: np.ndarray
    step_rewards_bs: np.ndarray
    step_mask_bs: np.ndarray
    token_step_bt: np.ndarray

    @property
    def lengths_b(self) -> np.ndarray:
        return np.array([len(ep.token_ids) for ep in self.episodes], np.int64)


def episode_batch(
    episodes: Sequence[Any], rewards: Sequence[float], groups: Sequence[int]
) -> EpisodeBatch:
    """Builds the arrays of an :class:`EpisodeBatch` from the episodes' turn spans."""
    b = len(episodes)
    steps = max([len(ep.turn_spans) for ep in episodes] + [1])
    tokens = max([len(ep.token_ids) for ep in episodes] + [1])
    step_rewards_bs = np.zeros((b, steps), np.float64)
    step_mask_bs = np.zeros((b, steps), np.float64)
    token_step_bt = np.full((b, tokens), -1, np.int64)
    for i, ep in enumerate(episodes):
        for k, (start, end) in enumerate(ep.turn_spans):
            if not 0 <= start <= end <= len(ep.token_ids):
                raise ValueError(f"episode {i}: turn span {k} = {(start, end)} lies outside "
                                 f"its {len(ep.token_ids)} tokens")
            token_step_bt[i, start:end] = k
            step_mask_bs[i, k] = 1.0
            if k < len(ep.step_rewards):  # the last turn may end the episode unstepped
                step_rewards_bs[i, k] = ep.step_rewards[k]
        policy = np.asarray(ep.loss_mask[: tokens], bool)
        token_step_bt[i, : len(policy)][~policy] = -1
    return EpisodeBatch(tuple(episodes), np.asarray(rewards, np.float64),
                        np.asarray(groups, np.int64), step_rewards_bs, step_mask_bs,
                        token_step_bt)


def step_to_token_advantages(step_adv_bs: np.ndarray, token_step_bt: np.ndarray) -> np.ndarray:
    """``[B, S]`` per-step advantages -> ``[B, T]``: each policy token gets its step's, 0 else."""
    gathered = np.take_along_axis(step_adv_bs, np.maximum(token_step_bt, 0), axis=1)
    return np.where(token_step_bt >= 0, gathered, 0.0)


@dataclasses.dataclass(frozen=True)
class Fork:
    """One forked continuation: the episode's environment at the state before ``turn``
    (reset with ``episode.seed``, then ``episode.actions[:turn]`` replayed), the turn played
    with ``action`` (None: the policy samples a fresh one), then the policy to the end.
    ``seed`` seeds the policy's draws of this continuation."""

    episode: Any
    turn: int
    action: str | None
    seed: int


@dataclasses.dataclass(frozen=True)
class ForkResult:
    """A continuation's return from ``turn`` on (the sum of its rewards) and its cost."""

    return_to_go: float
    turns: int
    tokens_generated: int = 0


@dataclasses.dataclass(frozen=True)
class GroupRequest:
    """A replacement group for a group filter's refill: ``len(seeds)`` new plays of the
    environment ``env_id`` (one this step already played), play j reset with ``seeds[j]``."""

    env_id: str
    seeds: tuple[int, ...]


class RolloutService(Protocol):
    """The rollout side as a rule may use it (the caller provides it)."""

    def continue_forks(self, forks: Sequence[Fork]) -> list[ForkResult]:
        """Runs every fork to the end (batched as the service likes), results in order."""
        ...

    def complete(self, prompts: Sequence[str], *, seed: int) -> list[str]:
        """The policy's reply to each single-turn prompt (e.g. a policy judge's question)."""
        ...

    def play_groups(self, requests: Sequence[GroupRequest], *, seed: int) -> list[list[Any]]:
        """New no-hint plays by the current policy, one list of :class:`Episode` records per
        request (in order, one per seed), all in one batch whose sampler draws are seeded
        from ``seed``."""
        ...


@dataclasses.dataclass(frozen=True)
class StepContext:
    """What a step-credit rule gets besides the episodes.

    rollouts: the caller's :class:`RolloutService`, or None where there is none (rules
      that need one raise a clear error).
    seed_parts: (experiment seed, step, phase, ...) of this update; a rule draws with
      ``seeding.rng(*seed_parts, index)``.
    role: "agent" or "designer".
    refill_seed_parts: (experiment seed, step, ``Phase.REFILL``, role) of a group filter's
      replacement plays; None: ``seed_parts`` followed by ``Phase.REFILL``.
    """

    rollouts: RolloutService | None = None
    seed_parts: tuple[int, ...] = (0,)
    role: str = "agent"
    refill_seed_parts: tuple[int, ...] | None = None

    def require_rollouts(self, rule: str, part: str = "step credit") -> RolloutService:
        if self.rollouts is None:
            raise ValueError(f"{part} {rule!r} needs a RolloutService (forked rollouts, policy "
                             f"completions or new plays), and the caller gave none for the "
                             f"{self.role} role")
        return self.rollouts

    def rng(self, *index: int) -> np.random.Generator:
        return seeding.rng(*self.seed_parts, *index)

    def seed(self, *index: int) -> int:
        return seeding.derive_seed(*self.seed_parts, *index)

    def refill_seed(self, *index: int) -> int:
        """A seed of the refill's draws: ``derive_seed(*refill_seed_parts, *index)``."""
        parts = self.refill_seed_parts
        if parts is None:
            parts = (*self.seed_parts, int(seeding.Phase.REFILL))
        return seeding.derive_seed(*parts, *index)


def scripted_action_tokens(action: str) -> list[int]:
    """The one token a :class:`ScriptedRollouts` play writes for ``action`` (ids 3..10)."""
    return [3 + sum(map(ord, action)) % 8]


@dataclasses.dataclass
class ScriptedRollouts:
    """A :class:`RolloutService` over plain Python: ``make_env(env_id)`` gives a fresh
    gymnasium-style text env, ``policy(observations, actions, rng) -> action`` plays it
    (a scripted policy, e.g. for tests with closed-form credit), ``judge_reply(prompt)``
    answers completions. A new play (``play_groups``) is an ``EpisodeRecord`` whose
    observations are token 1 and whose actions are ``action_tokens(action)`` (log-prob -1
    each). Counts what it ran in ``forks_run`` / ``turns_run`` / ``plays_run``."""

    make_env: Any
    policy: Any
    judge_reply: Any = None
    max_turns: int = 64
    action_tokens: Any = scripted_action_tokens
    forks_run: int = 0
    turns_run: int = 0
    plays_run: int = 0

    def continue_forks(self, forks: Sequence[Fork]) -> list[ForkResult]:
        return [self._one(fork) for fork in forks]

    def _one(self, fork: Fork) -> ForkResult:
        env, rng = self.make_env(fork.episode.env_id), np.random.default_rng(fork.seed)
        observation, _ = env.reset(seed=fork.episode.seed)
        observations, actions = [observation], list(fork.episode.actions[: fork.turn])
        for action in actions:
            observation, _, terminated, truncated, _ = env.step(action)
            observations.append(observation)
            if terminated or truncated:
                raise ValueError(f"fork at turn {fork.turn}: the replayed episode ended early")
        rewards = self._play_on(env, observations, actions, rng, fork.action)
        self.forks_run += 1
        return ForkResult(float(sum(rewards)), len(rewards))

    def _play_on(self, env: Any, observations: list[str], actions: list[str],
                 rng: np.random.Generator, action: str | None = None) -> list[float]:
        """The policy plays ``env`` to its end (``action`` first, when given), appending to
        ``observations`` / ``actions``; returns the rewards of the turns it played."""
        rewards: list[float] = []
        while len(rewards) < self.max_turns:
            action = action if action is not None else self.policy(observations, actions, rng)
            observation, reward, terminated, truncated, _ = env.step(action)
            rewards.append(float(reward))
            observations.append(observation)
            actions.append(action)
            action = None
            if terminated or truncated:
                break
        self.turns_run += len(rewards)
        return rewards

    def complete(self, prompts: Sequence[str], *, seed: int) -> list[str]:
        if self.judge_reply is None:
            raise ValueError("this ScriptedRollouts has no judge_reply for completions")
        return [self.judge_reply(prompt) for prompt in prompts]

    def play_groups(self, requests: Sequence[GroupRequest], *, seed: int) -> list[list[Any]]:
        return [[self._play(request.env_id, env_seed, seeding.rng(seed, r, j))
                 for j, env_seed in enumerate(request.seeds)]
                for r, request in enumerate(requests)]

    def _play(self, env_id: str, env_seed: int, rng: np.random.Generator) -> Any:
        env, record = self.make_env(env_id), EpisodeRecord(env_id=env_id, seed=env_seed)
        observation, _ = env.reset(seed=env_seed)
        record.observations.append(observation)
        record.step_rewards = self._play_on(env, record.observations, record.actions, rng)
        record.append([1], policy=False)
        for action in record.actions:
            tokens = list(self.action_tokens(action))
            record.turn_spans.append((len(record.token_ids), len(record.token_ids) + len(tokens)))
            record.append(tokens, policy=True, logprobs=[-1.0] * len(tokens))
            record.append([1], policy=False)
        record.return_ = float(sum(record.step_rewards))
        self.plays_run += 1
        return record
