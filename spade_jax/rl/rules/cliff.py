"""Cliff (AWS + UIUC, "Learning Process Rewards from the First Mistake"): a judge locates
the first mistaken step ("pitfall step") of each failed episode; the correct prefix is
credited positively, the mistake and everything after it negatively. Nothing after the
first error says what was right, so the suffix keeps the failure's advantage::

    m_i   = judge(episode_i)            (only when A_i < 0 with only_failures; None = none)
    A_it  = +prefix_scale * |A_i|   if step(t) < m_i
          =  A_i                    if step(t) >= m_i, or no mistake was located
          =  0                      on non-policy tokens

The judge is a callable ``(episodes, context) -> [first mistaken step (0-based) or
None]``, named in the config by a plain value: "policy" (the policy itself reads a
numbered transcript and answers with the step number, through the rollout service's
``complete``), "reward_drop" (the environment's partial rewards, as ``first_mistake``),
or "package.module:function" for a user-supplied one.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from spade_jax.rl.episodes import EpisodeBatch, StepContext
from spade_jax.rl.registry import Metrics, step_credits
from spade_jax.rl.rules.first_mistake import reward_drop_steps, split_at_mistake

Judge = Callable[[Sequence[Any], StepContext], list[int | None]]
JUDGE_QUESTION = (
    "Below is an attempt at a task, step by step. Find the first step that is a mistake. "
    "Answer with that step's number only, or 0 if no step is a mistake.\n\n")


@dataclasses.dataclass(frozen=True)
class CliffConfig:
    """Settings of the Cliff credit.

    Attributes:
      judge: "policy", "reward_drop" or "module:function" (see the module docstring).
      prefix_scale: the prefix's credit, as a multiple of the failure's |A_i| (> 0).
      only_failures: ask the judge only about episodes with a negative outcome advantage.
      max_chars: characters of each observation / action shown to a policy judge.
    """

    judge: str = "policy"
    prefix_scale: float = 1.0
    only_failures: bool = True
    max_chars: int = 400

    def __post_init__(self) -> None:
        if not self.prefix_scale > 0:
            raise ValueError(f"prefix_scale must be > 0, got {self.prefix_scale}")
        if self.judge not in ("policy", "reward_drop") and ":" not in self.judge:
            raise ValueError(f"judge must be 'policy', 'reward_drop' or 'module:function', "
                             f"got {self.judge!r}")


def policy_judge_prompt(episode: Any, max_chars: int) -> str:
    """The numbered transcript a policy judge reads (observation, then action, per step)."""
    lines = [JUDGE_QUESTION]
    for k, action in enumerate(episode.actions):
        observation = episode.observations[k] if k < len(episode.observations) else ""
        lines.append(f"Step {k + 1}. Observation: {observation[:max_chars]}\n"
                     f"Step {k + 1}. Action: {action[:max_chars]}\n")
    return "".join(lines)


def parse_step_answer(reply: str, num_steps: int) -> int | None:
    """The judge's 1-based step number -> 0-based index; 0, out of range or none -> None."""
    found = re.search(r"\d+", reply)
    if not found or not 1 <= int(found.group()) <= num_steps:
        return None
    return int(found.group()) - 1


def resolve_judge(cfg: CliffConfig) -> Judge:
    if cfg.judge == "policy":
        def policy_judge(episodes: Sequence[Any], context: StepContext) -> list[int | None]:
            prompts = [policy_judge_prompt(ep, cfg.max_chars) for ep in episodes]
            replies = context.require_rollouts("cliff").complete(prompts, seed=context.seed(0))
            return [parse_step_answer(r, len(ep.actions))
                    for r, ep in zip(replies, episodes, strict=True)]
        return policy_judge
    if cfg.judge == "reward_drop":
        def drop_judge(episodes: Sequence[Any], context: StepContext) -> list[int | None]:
            out = []
            for ep in episodes:
                rewards = np.asarray([ep.step_rewards], np.float64)
                m = int(reward_drop_steps(rewards, np.ones_like(rewards), 0.0, 0.0)[0])
                out.append(m if m < rewards.shape[1] else None)
            return out
        return drop_judge
    module_name, _, attr = cfg.judge.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"cliff judge {cfg.judge!r} could not be loaded: {err}") from err


@step_credits.register("cliff", config=CliffConfig)
def cliff_credit(
    episodes: EpisodeBatch, outcome_advantages: np.ndarray, cfg: CliffConfig,
    context: StepContext,
) -> tuple[np.ndarray, Metrics]:
    """Per-token advantages split at the judge's first mistake (module docstring)."""
    outcome_b = np.asarray(outcome_advantages, np.float64)
    asked = [i for i in range(len(outcome_b)) if outcome_b[i] < 0 or not cfg.only_failures]
    verdicts = resolve_judge(cfg)([episodes.episodes[i] for i in asked], context) if asked else []
    if len(verdicts) != len(asked):
        raise ValueError(f"cliff judge returned {len(verdicts)} verdicts for {len(asked)} episodes")
    num_steps = episodes.step_mask_bs.shape[1]
    mistake_b = np.full(len(outcome_b), num_steps + 1)  # beyond every step: no split
    for i, verdict in zip(asked, verdicts, strict=True):
        if verdict is not None:
            mistake_b[i] = int(verdict)
    located_b = mistake_b <= num_steps
    outcome_b1 = outcome_b[:, None]
    prefix_b1 = np.where(located_b[:, None], cfg.prefix_scale * np.abs(outcome_b1), outcome_b1)
    advantages_bt = split_at_mistake(mistake_b, episodes.token_step_bt, prefix_b1, outcome_b1)
    return advantages_bt, {
        "judged": float(len(asked)),
        "located_frac": float(np.sum(located_b) / max(len(asked), 1)),
        "mistake_step": float(np.sum(np.where(located_b, mistake_b, 0))
                              / max(int(np.sum(located_b)), 1)),
    }
