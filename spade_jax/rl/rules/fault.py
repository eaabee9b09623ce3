"""FAULT-style conservation redistribution (from the feed: Alibaba's FAULT, "structured
self-diagnosis + outcome pricing + conservation redistribution"): the outcome credit of
an episode is moved between its steps, never created or destroyed.

Each step s of episode i has a diagnostic score d_is (here the environment's own partial
reward of that step). The outcome's sign prices the diagnosis: a success credits its
best-scored steps most, a failure blames its worst-scored steps most::

    w_is  = softmax_s( sign(A_i) * d_is / temperature )     over the episode's S_i steps
    A_is  = S_i * w_is * A_i            so  sum_s A_is = S_i * A_i   (conservation)
    A_it  = A_{i, step(t)} on policy tokens, 0 elsewhere

``temperature -> inf`` is plain GRPO (every step A_i); ``mix`` blends the two,
``A_is = (1 - mix) A_i + mix S_i w_is A_i``, which conserves the total as well.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from spade_jax.rl.episodes import EpisodeBatch, StepContext, step_to_token_advantages
from spade_jax.rl.registry import Metrics, step_credits


@dataclasses.dataclass(frozen=True)
class FaultConfig:
    """temperature: of the step softmax (> 0; small = credit on the extreme step);
    mix: share of the outcome credit that is redistributed (in [0, 1])."""

    temperature: float = 1.0
    mix: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 <= self.mix <= 1:
            raise ValueError(f"mix must be in [0, 1], got {self.mix}")


def conserved_step_advantages(
    outcome_b: np.ndarray, scores_bs: np.ndarray, step_mask_bs: np.ndarray, cfg: FaultConfig
) -> np.ndarray:
    """``[B, S]`` per-step advantages whose sum over each episode's steps is S_i A_i."""
    mask_bs = np.asarray(step_mask_bs, np.float64)
    sign_b1 = np.sign(np.asarray(outcome_b, np.float64))[:, None]
    logits_bs = np.where(mask_bs > 0, sign_b1 * scores_bs / cfg.temperature, -np.inf)
    logits_bs = logits_bs - np.max(np.where(mask_bs > 0, logits_bs, -1e300), axis=1,
                                   keepdims=True)
    exp_bs = np.where(mask_bs > 0, np.exp(logits_bs), 0.0)
    weights_bs = exp_bs / np.maximum(exp_bs.sum(axis=1, keepdims=True), 1e-300)
    steps_b1 = mask_bs.sum(axis=1, keepdims=True)
    outcome_b1 = np.asarray(outcome_b, np.float64)[:, None]
    redistributed_bs = steps_b1 * weights_bs * outcome_b1
    return mask_bs * ((1 - cfg.mix) * outcome_b1 + cfg.mix * redistributed_bs)


@step_credits.register("fault", config=FaultConfig)
def fault_credit(
    episodes: EpisodeBatch, outcome_advantages: np.ndarray, cfg: FaultConfig,
    context: StepContext,
) -> tuple[np.ndarray, Metrics]:
    """Outcome advantage redistributed over steps by sign-priced step scores."""
    del context
    step_adv_bs = conserved_step_advantages(outcome_advantages, episodes.step_rewards_bs,
                                            episodes.step_mask_bs, cfg)
    steps_b = episodes.step_mask_bs.sum(axis=1)
    spread_b = np.where(steps_b > 0, step_adv_bs.max(axis=1) - np.where(
        episodes.step_mask_bs > 0, step_adv_bs, np.inf).min(axis=1), 0.0)
    return step_to_token_advantages(step_adv_bs, episodes.token_step_bt), {
        "step_credit_spread": float(np.mean(spread_b)),
    }
