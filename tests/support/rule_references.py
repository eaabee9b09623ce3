"""Shared references for the update-rule tests (tests/rl/, tests/rl/rules/): random
token batches and independent NumPy re-derivations (float64, plain loops over groups /
sequences / tokens) of the clipped-ratio losses, finite differences, and a scripted
environment (``CountEnv``) whose step credit is known in closed form, with played episodes
of it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from spade_jax import rl
from spade_jax.rollout.records import EpisodeRecord

jax.config.update("jax_enable_x64", False)

B, T, N = 6, 9, 3  # sequences, tokens, group size


def random_batch(seed: int, token_advantages: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    logp = rng.normal(-1.5, 0.5, (B, T))
    mask = (rng.random((B, T)) < 0.8).astype(np.float32)
    mask[0, :] = 0.0  # a sequence with no trained token
    mask[1, :] = 1.0
    adv_shape = (B, T) if token_advantages else (B,)
    return {
        "logp": logp.astype(np.float32),
        "old_logp": (logp + rng.normal(0, 0.3, (B, T))).astype(np.float32),
        "ref_logp": (logp + rng.normal(0, 0.3, (B, T))).astype(np.float32),
        "advantages": rng.normal(0, 1, adv_shape).astype(np.float32),
        "loss_mask": mask,
    }


# ----------------------------------------------------------------------------------------
# NumPy references
# ----------------------------------------------------------------------------------------


def np_token_adv(adv: np.ndarray, b: int, t: int) -> float:
    return float(adv[b, t] if adv.ndim == 2 else adv[b])


def np_ppo_token(lp, olp, a, eps_low, eps_high) -> tuple[float, float, float, bool]:
    r = np.exp(lp - olp)
    l1 = -a * r
    l2 = -a * min(max(r, 1 - eps_low), 1 + eps_high)
    return max(l1, l2), l1, r, l2 > l1


def np_k3(lp, ref):
    return np.exp(ref - lp) - (ref - lp) - 1


def np_clipped_loss(batch, eps_low, eps_high, kl_coef, reduce, norm_tokens=None):
    """GRPO/DAPO/Dr.GRPO by loops; ``reduce`` in {"seq_mean", "token_mean", "sum_norm"}."""
    lp, olp, ref = (batch[k].astype(np.float64) for k in ("logp", "old_logp", "ref_logp"))
    adv, mask = batch["advantages"].astype(np.float64), batch["loss_mask"]
    seq_means, seq_sums, all_tokens = [], [], []
    clip_hits = []
    for b in range(lp.shape[0]):
        tokens = []
        for t in range(lp.shape[1]):
            if not mask[b, t]:
                continue
            pg, _, _, clipped = np_ppo_token(lp[b, t], olp[b, t], np_token_adv(adv, b, t),
                                             eps_low, eps_high)
            kl = np_k3(lp[b, t], ref[b, t]) if kl_coef else 0.0
            tokens.append(pg + kl_coef * kl)
            clip_hits.append(clipped)
        all_tokens += tokens
        seq_sums.append(sum(tokens))
        if tokens:
            seq_means.append(sum(tokens) / len(tokens))
    if reduce == "seq_mean":
        loss = np.mean(seq_means)
    elif reduce == "token_mean":
        loss = np.mean(all_tokens)
    else:
        loss = np.sum(seq_sums) / (len(seq_sums) * (norm_tokens or lp.shape[1]))
    return loss, np.mean(clip_hits)


def finite_diff_grad(fn, x: np.ndarray, h: float = 1e-6) -> np.ndarray:
    grad = np.zeros_like(x, dtype=np.float64)
    for idx in np.ndindex(x.shape):
        up, down = x.astype(np.float64).copy(), x.astype(np.float64).copy()
        up[idx] += h
        down[idx] -= h
        grad[idx] = (fn(up) - fn(down)) / (2 * h)
    return grad


def run_loss(name: str, batch: dict[str, np.ndarray], **cfg_overrides):
    rule = rl.policy_losses.get(name)
    cfg = rule.make_config(**cfg_overrides)
    fn = jax.jit(lambda b: rule.fn(b["logp"], b["old_logp"], b["ref_logp"], b["advantages"],
                                   b["loss_mask"], cfg))
    return fn({k: jnp.asarray(v) for k, v in batch.items()})


def grouped_rewards(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    rewards = rng.integers(0, 3, size=(5, 4)).astype(np.float32) * 0.5
    rewards[1] = 0.1  # a zero-variance group of a non-representable float
    return rewards


# ---- a scripted environment whose credit is known in closed form -------------------------


class CountEnv:
    """T turns; action "a" pays 1/T, anything else 0; ends after T steps."""

    def __init__(self, turns: int = 4):
        self.turns, self.t = turns, 0

    def reset(self, seed=None):
        self.t = 0
        return f"turn 0 seed {seed}", {}

    def step(self, action):
        self.t += 1
        reward = 1.0 / self.turns if action == "a" else 0.0
        return f"turn {self.t}", reward, self.t >= self.turns, False, {}


def make_count_env(env_id: str) -> CountEnv:
    return CountEnv(int(env_id.removeprefix("count")))


def played(actions, seed=0, obs_tokens=2, action_tokens=3) -> EpisodeRecord:
    """An EpisodeRecord of CountEnv (env id "count<T>") played with ``actions`` (each turn:
    observation tokens, then the action's policy tokens)."""
    env = CountEnv(len(actions))
    rec = EpisodeRecord(env_id=f"count{len(actions)}", seed=seed)
    observation, _ = env.reset(seed=seed)
    rec.observations.append(observation)
    rec.append([1] * obs_tokens, policy=False)
    for action in actions:
        start = len(rec.token_ids)
        rec.append([7] * action_tokens, policy=True, logprobs=[-1.0] * action_tokens)
        rec.turn_spans.append((start, len(rec.token_ids)))
        rec.actions.append(action)
        observation, reward, *_ = env.step(action)
        rec.step_rewards.append(reward)
        rec.observations.append(observation)
        rec.append([1] * obs_tokens, policy=False)
    rec.return_ = float(sum(rec.step_rewards))
    return rec


def always(action):
    return lambda observations, actions, rng: action


def coin(q):
    return lambda observations, actions, rng: "a" if rng.random() < q else "b"
