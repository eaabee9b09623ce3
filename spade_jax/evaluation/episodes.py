"""Multi-turn episodes of text environments under a `TextPolicy`: n episodes per task.

A policy that implements `EpisodePolicy` (the model-backed `SamplerPolicy`) runs them in the
training agent loop (`spade_jax.rollout.agent_loop.run_episodes`). Any other policy (the
scripted test policy) is driven turn by turn here through `complete`: the n episodes of a
task share their opening observation, so turn 0 asks for n completions of it and later
turns one completion per episode. Either way the same environment objects are stepped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from spade_jax.evaluation.checkers import visible_text
from spade_jax.evaluation.policy import EpisodePolicy, TextPolicy
from spade_jax.rollout.hints import agent_first_observation
from spade_jax.seeding import derive_seed


class _Prefixed:
    """An env whose opening observation is preceded by fixed text (a task statement) and
    followed by a hint, shown as everywhere else (``agent_first_observation``)."""

    def __init__(self, env: Any, prefix: str | None, hint: str | None) -> None:
        self.env, self.prefix, self.hint = env, prefix, hint

    def reset(self, *, seed: int | None = None, **kwargs: Any) -> tuple[str, dict]:
        observation, info = self.env.reset(seed=seed, **kwargs)
        shown = "\n\n".join(part for part in (self.prefix, observation) if part)
        return agent_first_observation(shown, self.hint), info

    def step(self, action: str) -> tuple:
        return self.env.step(action)

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        if close is not None:
            close()


class _Broken:
    """Stands in for an env that failed to open: reset raises, so the episode scores 0."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def reset(self, **kwargs: Any) -> tuple[str, dict]:
        raise RuntimeError(f"environment failed to open: {self.error}")

    def step(self, action: str) -> tuple:
        raise RuntimeError("environment failed to open")


def _open(factory: Callable[[], Any], prefix: str | None, hint: str | None) -> Any:
    try:
        env = factory()
    except Exception as err:  # noqa: BLE001 - e.g. a program the sandbox refuses
        return _Broken(err)
    return _Prefixed(env, prefix, hint) if prefix or hint else env


def run_task_episodes(
    policy: TextPolicy,
    make_env: Sequence[Callable[[], Any]],
    *,
    n: int,
    seeds: Sequence[int],
    seed: int,
    max_turns: int,
    max_new_tokens: int,
    prefix: Sequence[str] | None = None,
    hints: Sequence[str | None] | None = None,
) -> list[list[float]]:
    """Returns[task][episode]: n episodes of each task's env (fresh env per episode).

    `seeds[t]` is the reset seed of task t's episodes; `prefix[t]` (e.g. a task statement)
    is put before task t's opening observation and `hints[t]` (None: no hint) after it, as
    `spade.prompts.agent_first_observation` shows hints. An env whose reset raises scores 0.
    """
    for name, values in (("prefix", prefix), ("hints", hints)):
        if values is not None and len(values) != len(make_env):
            raise ValueError(f"make_env, seeds and {name} need one entry per task")
    if len(seeds) != len(make_env):
        raise ValueError("make_env, seeds and prefix need one entry per task")
    envs = [[_open(factory, None if prefix is None else prefix[t],
                   None if hints is None else hints[t]) for _ in range(n)]
            for t, factory in enumerate(make_env)]
    try:
        if isinstance(policy, EpisodePolicy):
            flat = [env for row in envs for env in row]
            returns = policy.play_episodes(
                flat, seeds=[s for s in seeds for _ in range(n)], max_turns=max_turns,
                max_new_tokens=max_new_tokens, seed=seed)
            return [returns[t * n : (t + 1) * n] for t in range(len(envs))]
        return _drive(policy, envs, n=n, seeds=seeds, seed=seed, max_turns=max_turns,
                      max_new_tokens=max_new_tokens)
    finally:
        for row in envs:
            for env in row:
                close = getattr(env, "close", None)
                if close is not None:
                    close()


def _drive(policy: TextPolicy, envs: list[list[Any]], *, n: int, seeds: Sequence[int],
           seed: int, max_turns: int, max_new_tokens: int) -> list[list[float]]:
    returns = [[0.0] * n for _ in envs]
    openings: list[str | None] = []
    for t, row in enumerate(envs):
        observation = None
        for env in row:
            try:
                observation, _ = env.reset(seed=seeds[t])
            except Exception:  # noqa: BLE001 - a broken env scores 0, the eval goes on
                observation = None
                break
        openings.append(observation)
    # (task, episode) -> conversation so far; only live episodes are kept.
    live: dict[tuple[int, int], list[dict[str, str]]] = {}
    tasks = [t for t, o in enumerate(openings) if o is not None]
    first = policy.complete([[{"role": "user", "content": openings[t]}] for t in tasks],
                            n=n, seed=derive_seed(seed, 0), max_new_tokens=max_new_tokens)
    replies: dict[tuple[int, int], str] = {}
    for t, texts in zip(tasks, first, strict=True):
        for j, text in enumerate(texts):
            live[(t, j)] = [{"role": "user", "content": openings[t]}]
            replies[(t, j)] = text
    for turn in range(max_turns):
        for key, text in replies.items():
            t, j = key
            conversation = live[key]
            conversation.append({"role": "assistant", "content": text})
            try:
                observation, reward, terminated, truncated, _ = envs[t][j].step(
                    visible_text(text).strip())
            except Exception:  # noqa: BLE001 - an env error ends the episode
                del live[key]
                continue
            returns[t][j] += float(reward)
            if terminated or truncated or turn + 1 == max_turns:
                del live[key]
            else:
                conversation.append({"role": "user", "content": str(observation)})
        if not live:
            break
        keys = sorted(live)
        texts = policy.complete([live[k] for k in keys], n=1, seed=derive_seed(seed, turn + 1),
                                max_new_tokens=max_new_tokens)
        replies = {k: out[0] for k, out in zip(keys, texts, strict=True)}
    return returns
