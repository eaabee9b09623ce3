"""Every registered update rule against an independent NumPy re-derivation (float64, plain
loops over groups / sequences / tokens) on random batches, plus gradients of GRPO and GSPO
against finite differences of the NumPy losses, and the registry's error paths."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spade_jax import rl
from spade_jax.rl import terms
from spade_jax.rl.registry import Registry

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


def np_gspo_loss(batch, eps_low, eps_high):
    """Sequence-level GSPO: one ratio per sequence, loss_i = max(-A s_i, -A clip(s_i))."""
    lp, olp = batch["logp"].astype(np.float64), batch["old_logp"].astype(np.float64)
    adv, mask = batch["advantages"].astype(np.float64), batch["loss_mask"]
    losses = []
    for b in range(lp.shape[0]):
        idx = np.flatnonzero(mask[b])
        if idx.size == 0:
            continue
        s = np.exp(np.mean(lp[b, idx] - olp[b, idx]))
        a = adv[b]
        losses.append(max(-a * s, -a * min(max(s, 1 - eps_low), 1 + eps_high)))
    return np.mean(losses)


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


# ----------------------------------------------------------------------------------------
# advantage estimators and group filters
# ----------------------------------------------------------------------------------------


def grouped_rewards(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    rewards = rng.integers(0, 3, size=(5, 4)).astype(np.float32) * 0.5
    rewards[1] = 0.1  # a zero-variance group of a non-representable float
    return rewards


@pytest.mark.parametrize("ddof", [0, 1])
def test_grpo_advantages_match_numpy(ddof):
    rewards_gn = grouped_rewards(0)
    rule = rl.advantage_estimators.get("grpo")
    adv, metrics = rule.fn(jnp.asarray(rewards_gn.reshape(-1)), 4, rule.make_config(std_ddof=ddof))
    expected = []
    for group in rewards_gn.astype(np.float64):
        mean = sum(group) / len(group)
        std = np.sqrt(sum((r - mean) ** 2 for r in group) / (len(group) - ddof))
        expected += [(r - mean) / (std + 1e-6) for r in group]
    np.testing.assert_allclose(np.asarray(adv), expected, rtol=1e-5, atol=1e-4)
    assert float(metrics["zero_std_frac"]) == pytest.approx(
        np.mean([len(set(g)) == 1 for g in rewards_gn]))


def test_dr_grpo_and_rloo_advantages_match_numpy():
    rewards_gn = grouped_rewards(1).astype(np.float64)
    flat = jnp.asarray(rewards_gn.reshape(-1), dtype=jnp.float32)
    dr = rl.advantage_estimators.get("dr_grpo")
    rloo = rl.advantage_estimators.get("rloo")
    dr_adv, _ = dr.fn(flat, 4, dr.make_config())
    rloo_adv, _ = rloo.fn(flat, 4, rloo.make_config())
    dr_expected, rloo_expected = [], []
    for group in rewards_gn:
        for i, r in enumerate(group):
            dr_expected.append(r - np.mean(group))
            others = [group[j] for j in range(len(group)) if j != i]
            rloo_expected.append(r - sum(others) / len(others))
    np.testing.assert_allclose(np.asarray(dr_adv), dr_expected, atol=1e-6)
    np.testing.assert_allclose(np.asarray(rloo_adv), rloo_expected, atol=1e-6)


def test_dynamic_sampling_keeps_groups_with_differing_rewards():
    rewards_gn = grouped_rewards(2)
    rewards_gn[3] = [1.0, 1.0, 1.0, 1.0]
    rule = rl.group_filters.get("dapo_dynamic_sampling")
    keep, metrics = rule.fn(jnp.asarray(rewards_gn), rule.make_config())
    expected = [len(set(group.tolist())) > 1 for group in rewards_gn]
    assert np.asarray(keep).tolist() == expected
    assert float(metrics["kept_group_frac"]) == pytest.approx(np.mean(expected))
    keep_all = rl.group_filters.get("keep_all")
    assert np.asarray(keep_all.fn(jnp.asarray(rewards_gn), keep_all.make_config())[0]).all()


def test_advantage_estimators_reject_bad_group_size():
    rule = rl.advantage_estimators.get("grpo")
    with pytest.raises(ValueError, match="group_size 4 does not divide the batch of 6"):
        rule.fn(jnp.zeros(6), 4, rule.make_config())
    rloo = rl.advantage_estimators.get("rloo")
    with pytest.raises(ValueError, match="group_size 4 does not divide"):
        rloo.fn(jnp.zeros(6), 4, rloo.make_config())
    # A group of one has no leave-one-out baseline: advantage 0, not an error mid-run.
    alone, _ = rloo.fn(jnp.asarray([0.3, 0.9]), 1, rloo.make_config())
    np.testing.assert_array_equal(np.asarray(alone), [0.0, 0.0])


@pytest.mark.parametrize("value", [0.3, 0.7, 0.9])
@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_a_group_of_equal_returns_gets_exactly_zero_advantage(name, value):
    """Issue 37 item 3: eight equal non-dyadic returns carry no signal, so every advantage
    is exactly 0.0 (float32 rounding of the mean, divided by a ~0 std, gave up to 0.056 at
    eps 1e-6); GRPO at the recipe's eps 1e-8 too. The other group is untouched."""
    rule = rl.advantage_estimators.get(name)
    cfg = rule.make_config(eps=1e-8) if name == "grpo" else rule.make_config()
    mixed = np.array([0.0, 1.0, value, 0.0, 1.0, 0.5, value, 1.0])
    rewards = np.r_[np.full(8, value), mixed].astype(np.float32)
    adv, _ = rule.fn(jnp.asarray(rewards), 8, cfg)
    adv = np.asarray(adv)
    assert adv[:8].tolist() == [0.0] * 8
    mixed = mixed.astype(np.float32).astype(np.float64)
    centred = mixed - mixed.mean()
    want = {"grpo": centred / (mixed.std() + 1e-8), "dr_grpo": centred,
            "rloo": centred * 8 / 7}[name]
    np.testing.assert_allclose(adv[8:], want, rtol=1e-5, atol=1e-6)


def test_equal_totals_give_zero_advantages_through_the_update_rule():
    """The same through ``apply_rule`` as the loop calls it: the agent's GRPO at the
    recipe's eps over one game's plays, and the designer's per-skill centring times the
    recipe's reward scale (32): every trained sequence gets advantage 0.0."""
    from spade_jax.rl.update_rule import Group, RoleConfig, apply_rule
    from spade_jax.rollout.records import EpisodeRecord

    def episode(i: int) -> EpisodeRecord:
        rec = EpisodeRecord(env_id="g", seed=i)
        rec.append([1, 2], policy=False)
        rec.append([3 + i], policy=True, logprobs=[-1.0])
        return rec

    for role, rule, scale in (("agent", RoleConfig(advantage=dict(eps=1e-8)), 1.0),
                              ("designer", RoleConfig(advantage_estimator="dr_grpo"), 32.0)):
        for value in (0.3, 0.7, 0.9):
            out = apply_rule(rule, [Group([episode(i) for i in range(8)], [value] * 8)],
                             role_name=role, advantage_scale=scale)
            assert [s.advantage for s in out.sequences] == [0.0] * 8, (role, value)


# ----------------------------------------------------------------------------------------
# policy losses
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("token_adv", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_grpo_loss_matches_numpy(seed, token_adv):
    batch = random_batch(seed, token_adv)
    loss, metrics = run_loss("grpo", batch, clip_eps=0.2, clip_eps_high=0.3, kl_coef=0.05)
    expected, clip_frac = np_clipped_loss(batch, 0.2, 0.3, 0.05, "seq_mean")
    assert float(loss) == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert float(metrics["clip_frac"]) == pytest.approx(clip_frac, abs=1e-6)
    valid = batch["loss_mask"] > 0
    ratio = np.exp(batch["logp"] - batch["old_logp"])[valid]
    assert float(metrics["ratio"]) == pytest.approx(ratio.mean(), rel=1e-5)
    assert float(metrics["approx_kl"]) == pytest.approx(((ratio - 1) - np.log(ratio)).mean(),
                                                        rel=1e-4)
    kl = np_k3(batch["logp"], batch["ref_logp"])[valid].mean()
    assert float(metrics["kl"]) == pytest.approx(kl, rel=1e-4)


@pytest.mark.parametrize("seed", [2, 3])
def test_dapo_loss_matches_numpy(seed):
    batch = random_batch(seed)
    loss, _ = run_loss("dapo", batch)
    expected, _ = np_clipped_loss(batch, 0.2, 0.28, 0.0, "token_mean")
    assert float(loss) == pytest.approx(expected, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("norm_tokens", [None, 32])
def test_dr_grpo_loss_matches_numpy(norm_tokens):
    batch = random_batch(4, token_advantages=True)
    loss, _ = run_loss("dr_grpo", batch, kl_coef=0.1, norm_tokens=norm_tokens)
    expected, _ = np_clipped_loss(batch, 0.2, 0.2, 0.1, "sum_norm", norm_tokens)
    assert float(loss) == pytest.approx(expected, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("eps", [(3e-4, 4e-4), (0.05, 0.08)])
def test_gspo_loss_matches_numpy(eps):
    batch = random_batch(5)
    batch["old_logp"] = batch["logp"] + np.random.default_rng(9).normal(0, 0.05, (B, T)).astype(
        np.float32)
    loss, _ = run_loss("gspo", batch, clip_eps_low=eps[0], clip_eps_high=eps[1])
    assert float(loss) == pytest.approx(np_gspo_loss(batch, *eps), rel=1e-5, abs=1e-6)


def test_grpo_gradient_matches_finite_differences():
    batch = random_batch(6)
    rule = rl.policy_losses.get("grpo")
    cfg = rule.make_config(clip_eps=0.2, kl_coef=0.05)
    grad = jax.grad(lambda lp: rule.fn(lp, batch["old_logp"], batch["ref_logp"],
                                       batch["advantages"], batch["loss_mask"], cfg)[0])(
        jnp.asarray(batch["logp"]))

    def np_loss(lp: np.ndarray) -> float:
        return np_clipped_loss({**batch, "logp": lp}, 0.2, 0.2, 0.05, "seq_mean")[0]

    expected = finite_diff_grad(np_loss, batch["logp"])
    assert np.abs(expected).max() > 1e-3  # some tokens are unclipped and carry gradient
    np.testing.assert_allclose(np.asarray(grad), expected, atol=2e-5)


def test_gspo_gradient_equals_sequence_level_objective():
    """The stop-gradient token form must have the gradient of the sequence-ratio loss."""
    batch = random_batch(7, token_advantages=False)
    batch["old_logp"] = batch["logp"] + np.random.default_rng(3).normal(0, 0.1, (B, T)).astype(
        np.float32)
    rule = rl.policy_losses.get("gspo")
    cfg = rule.make_config(clip_eps_low=0.05, clip_eps_high=0.06)
    grad = jax.grad(lambda lp: rule.fn(lp, batch["old_logp"], None, batch["advantages"],
                                       batch["loss_mask"], cfg)[0])(jnp.asarray(batch["logp"]))
    expected = finite_diff_grad(lambda lp: np_gspo_loss({**batch, "logp": lp}, 0.05, 0.06),
                                batch["logp"])
    assert np.abs(expected).max() > 1e-3
    np.testing.assert_allclose(np.asarray(grad), expected, atol=2e-5)


LOSSES_WITH_KL = {"grpo": 0.005, "dr_grpo": 0.005, "dapo": 0.005, "gspo": 0.005, "cispo": None}


@pytest.mark.parametrize("masked", [(-100.0, 0.0, 0.0), (0.0, -100.0, -100.0)],
                         ids=["rare_prompt_token", "stale_sampler_logp"])
@pytest.mark.parametrize("name", sorted(LOSSES_WITH_KL))
def test_masked_positions_cannot_overflow_the_loss_or_its_gradient(name, masked):
    """Issue 37 item 2. Off the mask the batch stores 0 for the sampler's and reference's
    log-probs, while the policy's own may be -100 (a rare prompt token at T 0.6): the
    exponentials of the KL (e^(ref - logp)) and of the ratio must see a masked difference,
    else e^100 = inf, inf * 0 = NaN, and the step is skipped. One masked position at
    (logp, old_logp, ref_logp) = ``masked``: the loss and gradient are finite and equal
    those with a harmless value there (masked positions do not count)."""
    batch = random_batch(8)
    b, t = 2, 4
    batch["loss_mask"][b, t] = 0.0
    extreme = {k: v.copy() for k, v in batch.items()}
    for key, value in zip(("logp", "old_logp", "ref_logp"), masked, strict=True):
        extreme[key][b, t] = value
    rule = rl.policy_losses.get(name)
    kl = LOSSES_WITH_KL[name]
    cfg = rule.make_config() if kl is None else rule.make_config(kl_coef=kl)

    def loss_and_grad(values):
        def loss(lp):
            return rule.fn(lp, jnp.asarray(values["old_logp"]), jnp.asarray(values["ref_logp"]),
                           jnp.asarray(values["advantages"]), jnp.asarray(values["loss_mask"]),
                           cfg)[0]

        return jax.value_and_grad(loss)(jnp.asarray(values["logp"]))

    loss, grad = loss_and_grad(extreme)
    assert np.isfinite(float(loss)) and np.isfinite(np.asarray(grad)).all()
    want_loss, want_grad = loss_and_grad(batch)
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-6, abs=1e-7)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(want_grad), rtol=1e-6, atol=1e-7)
    assert float(grad[b, t]) == 0.0
    if name == "grpo":  # the registered recipe loss against the NumPy re-derivation
        assert float(loss) == pytest.approx(np_clipped_loss(extreme, 0.2, 0.2, kl, "seq_mean")[0],
                                            rel=1e-5, abs=1e-6)


def test_losses_reject_mismatched_shapes_and_missing_reference():
    batch = random_batch(0)
    with pytest.raises(ValueError, match="old_logp has shape"):
        run_loss("grpo", {**batch, "old_logp": batch["old_logp"][:, :-1]})
    with pytest.raises(ValueError, match="advantages must be"):
        run_loss("dapo", {**batch, "advantages": np.zeros(B + 1, np.float32)})
    rule = rl.policy_losses.get("grpo")
    with pytest.raises(ValueError, match="needs ref_logp"):
        rule.fn(batch["logp"], batch["old_logp"], None, batch["advantages"], batch["loss_mask"],
                rule.make_config(kl_coef=0.1))


# ----------------------------------------------------------------------------------------
# token weighting and step-level advantages
# ----------------------------------------------------------------------------------------


def np_eapo(adv, entropy, mask, beta, z_clip):
    adv = np.broadcast_to(adv[:, None], mask.shape) if adv.ndim == 1 else adv
    values = entropy[mask > 0].astype(np.float64)
    z = np.clip((entropy - values.mean()) / (values.std() + 1e-6), -z_clip, z_clip)
    out = np.zeros(mask.shape)
    for b in range(mask.shape[0]):
        for sign in (1, -1):
            tokens = [t for t in range(mask.shape[1]) if mask[b, t] and np.sign(adv[b, t]) == sign]
            if not tokens:
                continue
            raw = {t: np.exp(beta * sign * z[b, t]) for t in tokens}
            credit = sum(abs(adv[b, t]) for t in tokens)
            mean_raw = sum(abs(adv[b, t]) * raw[t] for t in tokens) / credit
            for t in tokens:
                out[b, t] = adv[b, t] * raw[t] / mean_raw
    return out


@pytest.mark.parametrize("token_adv", [False, True])
def test_eapo_matches_numpy_and_conserves_credit(token_adv):
    batch = random_batch(8, token_adv)
    entropy = np.random.default_rng(1).gamma(2.0, 0.5, (B, T)).astype(np.float32)
    rule = rl.token_weightings.get("eapo")
    out, _ = rule.fn(jnp.asarray(batch["advantages"]), jnp.asarray(entropy),
                     jnp.asarray(batch["loss_mask"]), rule.make_config(beta=0.7, z_clip=2.0))
    out = np.asarray(out)
    expected = np_eapo(batch["advantages"], entropy, batch["loss_mask"], 0.7, 2.0)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    base = np.broadcast_to(batch["advantages"][:, None], (B, T)) if not token_adv else \
        batch["advantages"]
    base = base * batch["loss_mask"]
    for sign in (1, -1):  # each sequence's positive and negative credit are unchanged
        sel = np.sign(base) == sign
        np.testing.assert_allclose((out * sel).sum(1), (base * sel).sum(1), rtol=1e-5, atol=1e-5)


def test_eapo_direction_and_identity():
    mask = np.ones((2, 4), np.float32)
    entropy = np.array([[0.1, 0.2, 3.0, 0.3]] * 2, np.float32)
    adv = np.array([1.0, -1.0], np.float32)
    rule = rl.token_weightings.get("eapo")
    out, _ = rule.fn(jnp.asarray(adv), jnp.asarray(entropy), jnp.asarray(mask), rule.make_config())
    out = np.asarray(out)
    assert out[0].argmax() == 2  # success: the high-entropy token gets the most credit
    assert np.abs(out[1]).argmin() == 2  # failure: the high-entropy token is blamed least
    identity, _ = rule.fn(jnp.asarray(adv), jnp.asarray(entropy), jnp.asarray(mask),
                          rule.make_config(beta=0.0))
    np.testing.assert_allclose(np.asarray(identity), np.broadcast_to(adv[:, None], (2, 4)),
                               rtol=1e-6)
    mask[1, 2:] = 0.0
    none = rl.token_weightings.get("none")
    out, _ = none.fn(jnp.asarray(adv), jnp.asarray(entropy), jnp.asarray(mask), none.make_config())
    np.testing.assert_array_equal(np.asarray(out), adv[:, None] * mask)


def np_first_mistake(step_rewards, step_mask, token_step, prefix, suffix, tol, initial):
    out = np.zeros(token_step.shape)
    for b in range(step_rewards.shape[0]):
        previous, mistake = initial, step_rewards.shape[1]
        for s in range(step_rewards.shape[1]):
            if step_mask[b, s] and step_rewards[b, s] < previous - tol:
                mistake = s
                break
            previous = step_rewards[b, s]
        for t, s in enumerate(token_step[b]):
            if s >= 0:
                out[b, t] = prefix if s < mistake else suffix
    return out


@pytest.mark.parametrize("tolerance", [0.0, 0.25])
def test_first_mistake_matches_numpy(tolerance):
    from spade_jax.rl.episodes import EpisodeBatch, StepContext

    rng = np.random.default_rng(11)
    num_steps = 5
    step_rewards = rng.choice([0.0, 0.2, 0.5, 1.0], size=(B, num_steps))
    step_rewards[0] = [0.2, 0.5, 0.5, 1.0, 1.0]  # never drops
    lengths = rng.integers(1, num_steps + 1, size=B)
    step_mask = (np.arange(num_steps)[None] < lengths[:, None]).astype(np.float64)
    token_step = np.sort(rng.integers(-1, num_steps, size=(B, 3 * num_steps)), axis=1)
    token_step = np.where(token_step < lengths[:, None], token_step, -1)
    outcome = rng.normal(0, 1, B)
    episodes = EpisodeBatch((None,) * B, np.zeros(B), np.arange(B), step_rewards, step_mask,
                            token_step)
    rule = rl.step_credits.get("first_mistake")
    cfg = rule.make_config(prefix_advantage=0.5, suffix_advantage=-1.0, tolerance=tolerance)
    out, metrics = rule.fn(episodes, outcome, cfg, StepContext())
    expected = np_first_mistake(step_rewards, step_mask, token_step, 0.5, -1.0, tolerance, 0.0)
    expected = np.where(token_step >= 0, expected + outcome[:, None], 0.0)
    np.testing.assert_allclose(np.asarray(out), expected)
    assert (np.asarray(out)[0][token_step[0] >= 0] == 0.5 + outcome[0]).all()


# ----------------------------------------------------------------------------------------
# registry
# ----------------------------------------------------------------------------------------


def test_registry_errors_are_clear():
    registry: Registry = Registry("policy_losses")

    @dataclasses.dataclass(frozen=True)
    class Cfg:
        scale: float = 1.0

    registry.register("mine", config=Cfg)(lambda *a: None)
    with pytest.raises(ValueError, match="'mine' is already registered"):
        registry.register("mine", config=Cfg)(lambda *a: None)
    with pytest.raises(KeyError, match=r"unknown policy_losses rule 'nope'; known: \['mine'\]"):
        registry.get("nope")
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['scal'\]"):
        registry.get("mine").make_config(scal=2.0)
    with pytest.raises(ValueError, match="clip_eps must be in"):
        rl.policy_losses.get("grpo").make_config(clip_eps=1.5)
    with pytest.raises(ModuleNotFoundError, match="rule module 'no_such_rules'"):
        rl.load_rule_modules(["no_such_rules"])


def test_worked_example_in_docs_registers_and_runs(tmp_path, monkeypatch):
    """The docs' "add a rule" example, copied verbatim into a module, matches NumPy."""
    doc = (Path(__file__).parents[2] / "docs" / "update_rules.md").read_text()
    code = re.search(r"```python\n(# examples/rules/pairwise\.py.*?)```", doc, re.S).group(1)
    assert len(code.splitlines()) < 60
    assert code == (Path(__file__).parents[2] / "examples" / "rules" / "pairwise.py").read_text()
    (tmp_path / "my_rules").mkdir()
    (tmp_path / "my_rules" / "__init__.py").write_text("")
    (tmp_path / "my_rules" / "pairwise.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    saved = dict(rl.advantage_estimators._rules)  # another test may have loaded the example
    rl.advantage_estimators._rules.pop("pairwise", None)
    rl.load_rule_modules(["my_rules.pairwise"])
    try:
        rule = rl.advantage_estimators.get("pairwise")
        rewards = np.array([0.0, 1.0, 1.0, 0.5, 0.2, 0.2, 0.9, 0.1], np.float32)
        advantages, metrics = rule.fn(rewards, 4, rule.make_config(scale=2.0))
        expected = [2.0 * np.mean([np.sign(g[i] - g[j]) for j in range(4) if j != i])
                    for g in rewards.reshape(2, 4) for i in range(4)]
        np.testing.assert_allclose(np.asarray(advantages), expected, rtol=1e-6)
        assert float(metrics["tie_frac"]) == pytest.approx(4 / 24)
    finally:
        rl.advantage_estimators._rules.clear()
        rl.advantage_estimators._rules.update(saved)
        sys.modules.pop("my_rules.pairwise", None)
        sys.modules.pop("my_rules", None)


# ----------------------------------------------------------------------------------------
# truncated importance sampling (the recipe's TIS)
# ----------------------------------------------------------------------------------------


def test_truncated_importance_weights_match_numpy():
    rng = np.random.default_rng(11)
    trainer = rng.normal(-1.5, 0.5, (B, T)).astype(np.float32)
    sampler = (trainer + rng.normal(0, 1.0, (B, T))).astype(np.float32)
    sampler[0, 0] = trainer[0, 0] + 40.0  # ratio e^-40: the lower clamp 0 leaves it alone
    sampler[0, 1] = trainer[0, 1] - 40.0  # ratio e^40: clamped to C
    tis = terms.truncated_importance_weights(trainer, sampler, 2.0)
    ratio = np.exp(trainer.astype(np.float64) - sampler)
    want = np.minimum(ratio, 2.0)
    np.testing.assert_allclose(np.asarray(tis.ratio), ratio, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(tis.weight), want, rtol=1e-5, atol=1e-30)
    np.testing.assert_array_equal(np.asarray(tis.clipped), (ratio > 2.0).astype(np.float32))
    assert 0 < float(np.mean(np.asarray(tis.clipped))) < 1
    low = terms.truncated_importance_weights(trainer, sampler, 2.0, clamp_low=0.5)
    np.testing.assert_allclose(np.asarray(low.weight), np.clip(ratio, 0.5, 2.0), rtol=1e-5)
    # The weight is data: no gradient through the trainer's log-probs.
    grad = jax.grad(lambda lp: jnp.sum(
        terms.truncated_importance_weights(lp, sampler, 2.0).weight))(jnp.asarray(trainer))
    np.testing.assert_array_equal(np.asarray(grad), 0.0)


def np_recipe_tis_loss(logp, trainer_old, rollout, ref, adv, mask, clamp, kl_coef):
    """slime's PPO loss with --use-tis, by loops: ratio against the trainer's pre-update
    log-probs, each token's clipped policy term times clip(pi_trainer / pi_rollout, 0, C),
    k3 KL unweighted, mean over tokens per sample, mean over samples (recipe clip 0.2/0.28)."""
    seq_means = []
    for b in range(logp.shape[0]):
        tokens = []
        for t in np.flatnonzero(mask[b]):
            w = min(np.exp(trainer_old[b, t] - rollout[b, t]), clamp)
            pg, _, _, _ = np_ppo_token(logp[b, t], trainer_old[b, t], adv[b], 0.2, 0.28)
            tokens.append(w * pg + kl_coef * np_k3(logp[b, t], ref[b, t]))
        if tokens:
            seq_means.append(np.mean(tokens))
    return np.mean(seq_means)


def tis_role_loss(policy_loss: str, loss_config: dict, batch: dict, clamp: float):
    from spade_jax.rl.batch import TrainBatch
    from spade_jax.rl.train_step import RoleConfig, role_loss

    role = RoleConfig(policy_loss=policy_loss, loss=loss_config, importance_correction="tis",
                      importance={"clamp": clamp})
    train_batch = TrainBatch(
        input_ids=np.zeros((B, T), np.int32), loss_mask=batch["loss_mask"],
        old_logp=batch["old_logp"], advantages=batch["advantages"],
        role_id=np.zeros((B,), np.int32), ref_logp=batch["ref_logp"])

    def loss(lp):
        value, metrics, _ = role_loss(role, 0, train_batch, lp, jnp.zeros((B, T)))
        return value, metrics

    return jax.value_and_grad(loss, has_aux=True)(jnp.asarray(batch["logp"]))


def test_tis_grpo_equals_the_recipes_loss_and_gradient():
    batch = random_batch(12)
    batch["old_logp"] = (batch["logp"] + np.random.default_rng(4).normal(0, 0.8, (B, T))
                         ).astype(np.float32)  # sampler log-probs: some ratios exceed C
    (loss, metrics), grad = tis_role_loss(
        "grpo", dict(clip_eps=0.2, clip_eps_high=0.28, kl_coef=0.05), batch, 2.0)
    logp0 = batch["logp"].astype(np.float64)

    def recipe(lp):
        return np_recipe_tis_loss(lp, logp0, batch["old_logp"], batch["ref_logp"],
                                  batch["advantages"], batch["loss_mask"], 2.0, 0.05)

    assert float(loss) == pytest.approx(recipe(logp0), rel=1e-5, abs=1e-6)
    expected = finite_diff_grad(recipe, batch["logp"])
    assert np.abs(expected).max() > 1e-3
    np.testing.assert_allclose(np.asarray(grad), expected, atol=2e-5)
    mask = batch["loss_mask"] > 0
    ratio = np.exp(batch["logp"].astype(np.float64) - batch["old_logp"])[mask]
    assert float(metrics["tis/weight_mean"]) == pytest.approx(np.minimum(ratio, 2).mean(), rel=1e-5)
    assert float(metrics["tis/clip_frac"]) == pytest.approx(np.mean(ratio > 2), rel=1e-6)
    assert 0 < float(metrics["tis/clip_frac"]) < 1
    # The rule's own ratio is 1 (against the trainer's log-probs): nothing is PPO-clipped.
    assert float(metrics["clip_frac"]) == 0.0


def test_tis_reaches_gspo_as_a_per_token_weight():
    """GSPO-token with TIS: each token's gradient is -A_i w_it / (|y_i| N) (docs/trainer.md)."""
    batch = random_batch(13)
    batch["old_logp"] = (batch["logp"] + np.random.default_rng(5).normal(0, 0.8, (B, T))
                         ).astype(np.float32)
    (_, metrics), grad = tis_role_loss("gspo", {}, batch, 1.5)
    mask = batch["loss_mask"]
    w = np.minimum(np.exp(batch["logp"].astype(np.float64) - batch["old_logp"]), 1.5)
    tokens = mask.sum(1, keepdims=True)
    scored = np.sum(tokens > 0)
    expected = -batch["advantages"][:, None] * w * mask / np.maximum(tokens, 1) / scored
    np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-4, atol=1e-7)
    assert float(metrics["tis/clip_frac"]) > 0
