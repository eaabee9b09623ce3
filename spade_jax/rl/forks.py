"""Forked continuations for step-level rules: a :class:`spade_jax.rl.episodes.RolloutService`
backed by the policy's own batched agent loop.

    service = PolicyRollouts(run_episodes=lambda specs, seed: run_episodes(model, tok, specs,
                                                                           cfg, seed=seed),
                             make_env=lambda env_id: make_env(programs[env_id], pool=pool))
    results = service.continue_forks([Fork(record, turn=2, action=None, seed=s), ...])

A fork's environment (:class:`ForkedEnv`) is a fresh instance of the episode's program,
reset with the episode's seed and stepped through ``actions[:turn]`` (SPADE environments
are deterministic in (seed, actions), the same replay ``EnvPool.fork`` verifies by
digest); a fixed alternative action is played next. The policy then continues in a new
conversation whose first observation is the transcript so far (earlier observations and
actions, then the current observation), so every fork of one batch is an ordinary episode
of ``run_episodes``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from spade_jax import seeding
from spade_jax.rl.episodes import Fork, ForkResult, GroupRequest
from spade_jax.rollout.agent_loop import EpisodeSpec
from spade_jax.rollout.records import EpisodeRecord

RunEpisodes = Callable[[list[EpisodeSpec], int], list[EpisodeRecord]]


class ForkedEnv:
    """A gymnasium-style text env at a fork's state (see the module docstring).

    ``prefix_reward`` is what the replayed fixed action earned (it belongs to the fork's
    return-to-go); ``done_at_fork`` is True when that action ended the episode."""

    def __init__(self, make_env: Callable[[str], Any], fork: Fork) -> None:
        self.fork, self.env = fork, make_env(fork.episode.env_id)
        self.prefix_reward, self.done_at_fork = 0.0, False
        self.first_observation = self._replay()

    def _replay(self) -> str:
        episode, fork = self.fork.episode, self.fork
        observation, _ = self.env.reset(seed=episode.seed)
        transcript = [f"Observation: {observation}"]
        played = list(episode.actions[: fork.turn])
        if fork.action is not None:
            played.append(fork.action)
        for k, action in enumerate(played):
            observation, reward, terminated, truncated, _ = self.env.step(action)
            transcript += [f"Action: {action}", f"Observation: {observation}"]
            if k >= fork.turn:  # the fixed alternative: its reward counts for the fork
                self.prefix_reward += float(reward)
            if terminated or truncated:
                if k < fork.turn:
                    raise ValueError(f"fork of {episode.env_id!r} at turn {fork.turn}: the "
                                     f"replayed episode ended at turn {k}")
                self.done_at_fork = True
        return "\n".join(transcript)

    @property
    def unwrapped(self) -> Any:
        return getattr(self.env, "unwrapped", self.env)

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[str, dict]:
        del seed, options  # the fork's state is fixed by the episode's seed and actions
        return self.first_observation, {}

    def step(self, action: str):
        return self.env.step(action)

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        if close is not None:
            close()


@dataclasses.dataclass
class PolicyRollouts:
    """A RolloutService over the policy's agent loop.

    run_episodes: ``(specs, seed) -> records`` (the agent loop with the policy's model,
      tokenizer and sampler, every sampler call of the batch seeded from ``seed``).
    make_env: ``env_id -> a fresh env`` of the program that episode ran.
    complete_fn: ``(prompts, seed) -> replies``, the policy's single-turn completions, or
      None (a rule that asks for them then fails with a clear error).
    play_groups_fn: ``(requests, seed) -> [[record] per request]``, new plays of this
      step's environments (a group filter's refill), or None (the same).
    """

    run_episodes: RunEpisodes
    make_env: Callable[[str], Any]
    complete_fn: Callable[[Sequence[str], int], list[str]] | None = None
    play_groups_fn: Callable[[Sequence[GroupRequest], int], list[list[Any]]] | None = None

    def continue_forks(self, forks: Sequence[Fork]) -> list[ForkResult]:
        envs = [ForkedEnv(self.make_env, fork) for fork in forks]
        try:
            live = [i for i, env in enumerate(envs) if not env.done_at_fork]
            specs = [EpisodeSpec(env=envs[i], env_id=forks[i].episode.env_id,
                                 seed=forks[i].episode.seed) for i in live]
            seed = seeding.derive_seed(*(fork.seed for fork in forks)) if forks else 0
            records = self.run_episodes(specs, seed) if specs else []
        finally:
            for env in envs:
                env.close()
        by_index = dict(zip(live, records, strict=True))
        results = []
        for i, env in enumerate(envs):
            record = by_index.get(i)
            forced = 0 if forks[i].action is None else 1
            if record is None:
                results.append(ForkResult(env.prefix_reward, forced))
            else:
                results.append(ForkResult(env.prefix_reward + float(record.return_),
                                          forced + record.cost.turns,
                                          record.cost.tokens_generated))
        return results

    def complete(self, prompts: Sequence[str], *, seed: int) -> list[str]:
        if self.complete_fn is None:
            raise ValueError("this PolicyRollouts was built without a completion function "
                             "(complete_fn), so no policy judge can be asked")
        return self.complete_fn(prompts, seed)

    def play_groups(self, requests: Sequence[GroupRequest], *, seed: int) -> list[list[Any]]:
        if self.play_groups_fn is None:
            raise ValueError("this PolicyRollouts cannot play new groups (no play_groups_fn): "
                             "a group filter's refill needs environments to play")
        return self.play_groups_fn(requests, seed)
