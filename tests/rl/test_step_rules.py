"""The rule parts that see episodes (FAULT, Cliff, CRR), the group-wise importance
correction (GMC-GRPO) and CISPO, each against a NumPy re-derivation or a closed form;
and ``apply_rule`` chaining a role's host-side parts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spade_jax import rl
from spade_jax.rl.batch import pack_sequences
from spade_jax.rl.episodes import EpisodeBatch, ScriptedRollouts, StepContext, episode_batch
from spade_jax.rl.update_rule import Group, RoleConfig, apply_rule
from spade_jax.rollout.records import EpisodeRecord

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


# ---- FAULT-style conservation -------------------------------------------------------------


def np_fault(outcome, step_rewards, step_mask, temperature, mix):
    out = np.zeros_like(step_rewards)
    for i in range(len(outcome)):
        steps = np.flatnonzero(step_mask[i])
        logits = np.sign(outcome[i]) * step_rewards[i, steps] / temperature
        w = np.exp(logits - logits.max())
        w /= w.sum()
        for j, s in enumerate(steps):
            out[i, s] = (1 - mix) * outcome[i] + mix * len(steps) * w[j] * outcome[i]
    return out


@pytest.mark.parametrize("temperature,mix", [(1.0, 1.0), (0.3, 0.5)])
def test_fault_matches_numpy_and_conserves_the_outcome(temperature, mix):
    rng = np.random.default_rng(3)
    episodes = [played(list(rng.choice(["a", "b"], size=n)), seed=i)
                for i, n in enumerate([1, 3, 4, 4, 2])]
    # Partial rewards that differ per step, so the softmax has something to move.
    for ep in episodes:
        ep.step_rewards = list(rng.normal(0, 1, len(ep.actions)))
    outcome = np.array([0.7, -1.2, 0.0, 2.0, -0.3])
    batch = episode_batch(episodes, outcome, range(5))
    rule = rl.step_credits.get("fault")
    cfg = rule.make_config(temperature=temperature, mix=mix)
    adv_bt, _ = rule.fn(batch, outcome, cfg, StepContext())
    want_bs = np_fault(outcome, batch.step_rewards_bs, batch.step_mask_bs, temperature, mix)
    for i, ep in enumerate(episodes):
        for k, (start, end) in enumerate(ep.turn_spans):
            np.testing.assert_allclose(adv_bt[i, start:end], want_bs[i, k], rtol=1e-12)
        policy = np.zeros(adv_bt.shape[1], bool)
        policy[: len(ep.loss_mask)] = np.asarray(ep.loss_mask, bool)
        assert np.all(adv_bt[i][~policy] == 0)
        # Conservation: the steps' credits sum to S_i * A_i.
        step_credit = [adv_bt[i, start] for start, _ in ep.turn_spans]
        assert sum(step_credit) == pytest.approx(len(ep.actions) * outcome[i])
    # A success credits its best step most, a failure blames its worst step most.
    best = int(np.argmax(episodes[3].step_rewards))
    assert adv_bt[3, episodes[3].turn_spans[best][0]] == max(
        adv_bt[3, s] for s, _ in episodes[3].turn_spans)
    worst = int(np.argmin(episodes[1].step_rewards))
    assert adv_bt[1, episodes[1].turn_spans[worst][0]] == min(
        adv_bt[1, s] for s, _ in episodes[1].turn_spans)


# ---- Cliff: first mistake located by a judge ---------------------------------------------


def first_b_judge(episodes, context):
    """A user-supplied judge: the first "b" is the mistake."""
    return [ep.actions.index("b") if "b" in ep.actions else None for ep in episodes]


def np_cliff(outcome, mistakes, episodes, length, prefix_scale):
    out = np.zeros((len(episodes), length))
    for i, ep in enumerate(episodes):
        for k, (start, end) in enumerate(ep.turn_spans):
            m = mistakes[i]
            if m is not None and k < m:
                out[i, start:end] = prefix_scale * abs(outcome[i])
            else:
                out[i, start:end] = outcome[i]
    return out


@pytest.mark.parametrize("judge", ["callable", "policy"])
def test_cliff_matches_numpy_with_a_judge(judge):
    episodes = [played(a) for a in (["a", "a", "b", "a"], ["b", "a"], ["a", "a"],
                                    ["a", "b", "b"])]
    outcome = np.array([-0.5, -1.0, -0.2, 0.8])  # the last is a success: never judged
    batch = episode_batch(episodes, outcome, range(4))
    rule = rl.step_credits.get("cliff")
    asked = []

    def reply(prompt):  # the policy as judge: answers the first "b" step, 1-based
        asked.append(prompt)
        actions = [line.split("Action: ")[1] for line in prompt.splitlines() if "Action: " in line]
        return f"Step {actions.index('b') + 1}" if "b" in actions else "0"

    if judge == "callable":
        cfg = rule.make_config(judge=f"{__name__}:first_b_judge", prefix_scale=0.5)
        context = StepContext()
    else:
        cfg = rule.make_config(judge="policy", prefix_scale=0.5)
        context = StepContext(rollouts=ScriptedRollouts(make_count_env, always("a"), reply))
    adv_bt, metrics = rule.fn(batch, outcome, cfg, context)
    mistakes = [2, 0, None, None]
    np.testing.assert_allclose(adv_bt, np_cliff(outcome, mistakes, episodes,
                                                adv_bt.shape[1], 0.5))
    assert metrics["judged"] == 3 and metrics["located_frac"] == pytest.approx(2 / 3)
    if judge == "policy":
        assert len(asked) == 3 and "Step 3. Action: b" in asked[0]
    with pytest.raises(ValueError, match="needs a RolloutService"):
        rule.fn(batch, outcome, rule.make_config(judge="policy"), StepContext())
    with pytest.raises(ValueError, match="could not be loaded"):
        rule.fn(batch, outcome, rule.make_config(judge="no_such_mod:judge"), StepContext())


# ---- CRR: counterfactual credit from forks -------------------------------------------------


def test_crr_credit_equals_the_closed_form_with_a_fixed_alternative():
    """Continuation policy always plays "a"; the alternative is "b". From turn k of T:
    G^alt = 0 + (T-k-1)/T exactly, G^act = the episode's return-to-go, so
    c_k = sum_{s>=k} r_s - (T-k-1)/T; paired: c_k = r(a_k) - 0 = 1/T if a_k == "a"."""
    actions = ["a", "b", "a", "b"]
    t = len(actions)
    episode = played(actions, seed=5)
    batch = episode_batch([episode], [episode.return_], [0])
    rule = rl.step_credits.get("crr")
    for paired in (False, True):
        rollouts = ScriptedRollouts(make_count_env, always("a"))
        cfg = rule.make_config(forks=3, turns_per_episode=t, alternative="b", paired=paired,
                               clip=10.0, scale=2.0)
        adv_bt, metrics = rule.fn(batch, np.array([0.25]), cfg,
                                  StepContext(rollouts, seed_parts=(1, 2, 3)))
        for k, (start, end) in enumerate(episode.turn_spans):
            return_to_go = sum(episode.step_rewards[k:])
            credit = ((1 / t if actions[k] == "a" else 0.0) if paired
                      else return_to_go - (t - k - 1) / t)
            np.testing.assert_allclose(adv_bt[0, start:end], 0.25 + 2.0 * credit, atol=1e-12)
        assert adv_bt[0, 0] == 0.0  # observation tokens carry nothing
        forks = t * 3 * (2 if paired else 1)
        assert metrics["forks"] == forks == rollouts.forks_run
        assert metrics["fork_turns"] == rollouts.turns_run == sum(
            (t - k) * 3 * (2 if paired else 1) for k in range(t))


def test_crr_resampled_credit_estimates_the_advantage():
    """Policy "a" with probability q: V(s_k) = (T-k) q / T, so with many forks
    c_k -> return_to_go_k - (T-k) q / T (4 sigma of the fork mean)."""
    q, t, forks = 0.3, 5, 400
    episode = played(["a", "a", "b", "a", "b"], seed=2)
    batch = episode_batch([episode], [episode.return_], [0])
    rule = rl.step_credits.get("crr")
    cfg = rule.make_config(forks=forks, turns_per_episode=t, max_forks=t * forks, clip=10.0)
    adv_bt, metrics = rule.fn(batch, np.zeros(1), cfg,
                              StepContext(ScriptedRollouts(make_count_env, coin(q)),
                                          seed_parts=(0, 1)))
    for k, (start, _) in enumerate(episode.turn_spans):
        closed_form = sum(episode.step_rewards[k:]) - (t - k) * q / t
        sigma = np.sqrt((t - k) * q * (1 - q)) / t / np.sqrt(forks)
        assert abs(adv_bt[0, start] - closed_form) < 4 * sigma
    assert metrics["credited_turns"] == t


def test_crr_budget_turn_choice_and_seeding():
    episodes = [played(["a", "b", "a", "a"], seed=i) for i in range(3)]
    batch = episode_batch(episodes, [ep.return_ for ep in episodes], [0, 0, 0])
    rule = rl.step_credits.get("crr")
    cfg = rule.make_config(forks=2, turns_per_episode=2, turn_choice="random", max_forks=9)
    runs = []
    for _ in range(2):
        rollouts = ScriptedRollouts(make_count_env, coin(0.5))
        adv_bt, metrics = rule.fn(batch, np.zeros(3), cfg,
                                  StepContext(rollouts, seed_parts=(7, 1)))
        runs.append(adv_bt)
        assert metrics["forks"] == 8 == rollouts.forks_run  # 4 turns x 2 forks fit in 9
        assert metrics["credited_turns"] == 4
    np.testing.assert_array_equal(runs[0], runs[1])  # same seed parts, same credit
    with pytest.raises(ValueError, match="step credit 'crr' needs a RolloutService"):
        rule.fn(batch, np.zeros(3), cfg, StepContext())
    with pytest.raises(ValueError, match="turn_choice"):
        rule.make_config(turn_choice="last")


# ---- GMC-GRPO: group-wise shrinkage of the importance ratios ------------------------------


def np_gmc_scale(logp, sampler, mask, group_id, radius):
    b = logp.shape[0]
    scale = np.ones(b)
    for i in range(b):
        members = [j for j in range(b)
                   if j == i or (group_id[i] >= 0 and group_id[j] == group_id[i])]
        sq = sum(((logp[j] - sampler[j]) ** 2 * mask[j]).sum() for j in members)
        count = sum(mask[j].sum() for j in members)
        rms = np.sqrt(sq / max(count, 1.0))
        scale[i] = min(1.0, radius / max(rms, 1e-12))
    return scale


def test_gmc_shrinks_each_group_and_keeps_the_gradient():
    rng = np.random.default_rng(0)
    b, t = 6, 5
    logp = rng.normal(-1.5, 0.5, (b, t)).astype(np.float32)
    drift = np.array([0.02, 0.02, 0.5, 0.5, 0.3, 0.05])[:, None]  # group 1 drifted far
    sampler = (logp + rng.normal(0, 1, (b, t)) * drift).astype(np.float32)
    mask = (rng.random((b, t)) < 0.8).astype(np.float32)
    group_id = np.array([0, 0, 1, 1, -1, -1], np.int32)
    adv = rng.normal(0, 1, (b, t)).astype(np.float32)
    rule = rl.importance_corrections.get("gmc")
    cfg = rule.make_config(radius=0.1)
    corrected, metrics = rule.fn(jnp.asarray(logp), sampler, adv, mask, group_id, cfg)
    scale = np_gmc_scale(logp.astype(np.float64), sampler, mask, group_id, 0.1)
    assert scale[0] == 1.0 and scale[2] < 0.5  # only the drifted group shrinks
    log_ratio = np.asarray(logp, np.float64) - np.asarray(corrected.old_logp, np.float64)
    np.testing.assert_allclose(log_ratio, scale[:, None] * (logp - sampler.astype(np.float64)),
                               rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(corrected.advantages), adv)
    assert float(metrics["gmc/shrunk_frac"]) == pytest.approx(np.mean(scale < 1))

    def surrogate(lp):  # sum_it A exp(logp - old'): gradient A c_g exp(c_g l)
        out, _ = rule.fn(lp, sampler, adv, mask, group_id, cfg)
        return jnp.sum(out.advantages * jnp.exp(lp - out.old_logp) * mask)

    grad = jax.grad(surrogate)(jnp.asarray(logp))
    l_bt = logp.astype(np.float64) - sampler
    expected = adv * scale[:, None] * np.exp(scale[:, None] * l_bt) * mask
    np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-4, atol=1e-6)


# ---- CISPO ---------------------------------------------------------------------------------


def test_cispo_matches_numpy_and_its_gradient_is_the_detached_weight():
    rng = np.random.default_rng(5)
    logp = rng.normal(-1.5, 0.5, (4, 6)).astype(np.float32)
    old = (logp + rng.normal(0, 1.0, (4, 6))).astype(np.float32)
    mask = (rng.random((4, 6)) < 0.8).astype(np.float32)
    adv = rng.normal(0, 1, 4).astype(np.float32)
    rule = rl.policy_losses.get("cispo")
    cfg = rule.make_config(clip_eps_low=0.5, clip_eps_high=1.0)
    (loss, metrics), grad = jax.value_and_grad(
        lambda lp: rule.fn(lp, old, None, adv, mask, cfg), has_aux=True)(jnp.asarray(logp))
    weight = np.clip(np.exp(logp.astype(np.float64) - old), 0.5, 2.0)
    valid = mask > 0
    expected = (-weight * adv[:, None] * logp)[valid].mean()
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    np.testing.assert_allclose(np.asarray(grad), -weight * adv[:, None] * mask / valid.sum(),
                               rtol=1e-4, atol=1e-7)
    assert 0 < float(metrics["clip_frac"]) < 1


# ---- apply_rule: a role's host-side parts in order -----------------------------------------


def test_apply_rule_filters_estimates_credits_and_groups():
    groups = [Group([played(["a", "b"]), played(["b", "b"]), played(["a", "a"])]),
              Group([played(["a"]), played(["a"])]),                       # all equal
              Group([played(["b", "a"]), played(["a", "a"])], rewards=[1.0, 0.0])]
    role = RoleConfig(group_filter="dapo_dynamic_sampling", advantage_estimator="rloo",
                      step_credit="first_mistake", credit={"suffix_advantage": -0.5})
    out = apply_rule(role, groups, role_name="designer", advantage_scale=2.0)
    assert out.dropped_groups == [1]
    assert out.metrics["group_filter/dropped_groups"] == 1.0
    returns = [0.5, 0.0, 1.0]
    rloo = [2.0 * (r - np.mean([x for j, x in enumerate(returns) if j != i]))
            for i, r in enumerate(returns)] + [2.0 * (1.0 - 0.0), 2.0 * (0.0 - 1.0)]
    kept = groups[0].episodes + groups[2].episodes
    for seq, ep, a in zip(out.sequences, kept, rloo, strict=True):
        drops = [k for k in range(len(ep.step_rewards))
                 if ep.step_rewards[k] < (ep.step_rewards[k - 1] if k else 0.0)]
        mistake = drops[0] if drops else len(ep.step_rewards)
        for k, (start, end) in enumerate(ep.turn_spans):
            want = a + (1.0 if k < mistake else -0.5)
            np.testing.assert_allclose(seq.advantage[start:end], want, rtol=1e-6)
        assert seq.role == "designer"
    assert [s.group for s in out.sequences] == [0, 0, 0, 2, 2]
    batch = pack_sequences(out.sequences)
    np.testing.assert_array_equal(np.asarray(batch.group_id)[:5], [1, 1, 1, 5, 5])
    # Without a step credit the advantage stays one float per sequence.
    plain = apply_rule(RoleConfig(), groups[:1])
    assert isinstance(plain.sequences[0].advantage, float)


def test_every_built_in_part_is_registered_and_documented():
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "update_rules.md").read_text()
    for name, reg in (("group_filters", rl.group_filters),
                      ("advantage_estimators", rl.advantage_estimators),
                      ("step_credits", rl.step_credits),
                      ("token_weightings", rl.token_weightings),
                      ("importance_corrections", rl.importance_corrections),
                      ("policy_losses", rl.policy_losses)):
        for rule in reg.names():
            assert f"`{rule}`" in doc, f"{name} rule {rule!r} is not in docs/update_rules.md"
    assert not hasattr(rl, "step_advantage_estimators")
    with pytest.raises(ImportError):
        from spade_jax.rl.update_rule import UpdateRuleConfig  # noqa: F401


def test_episode_batch_rejects_spans_outside_the_tokens():
    episode = played(["a"])
    episode.turn_spans[0] = (2, 99)
    with pytest.raises(ValueError, match="outside"):
        episode_batch([episode], [0.0], [0])
    assert isinstance(episode_batch([played(["a"])], [0.0], [0]), EpisodeBatch)


# ---- the policy-side RolloutService --------------------------------------------------------


def scripted_run_episodes(policy):
    """Stands in for the agent loop: plays each spec's env with ``policy`` to the end."""
    from spade_jax.rollout.records import EpisodeRecord as Record

    seen = []

    def run(specs, seed):
        records = []
        for j, spec in enumerate(specs):
            rng = np.random.default_rng([seed, j])
            observation, _ = spec.env.reset(seed=spec.seed)
            seen.append(observation)
            rec, actions = Record(env_id=spec.env_id, seed=spec.seed), []
            for _ in range(50):
                action = policy([observation], actions, rng)
                observation, reward, terminated, truncated, _ = spec.env.step(action)
                rec.step_rewards.append(reward)
                actions.append(action)
                rec.cost.turns += 1
                rec.cost.tokens_generated += 3
                if terminated or truncated:
                    break
            rec.return_ = float(sum(rec.step_rewards))
            records.append(rec)
        return records

    return run, seen


def test_policy_rollouts_replay_the_fork_and_match_the_closed_form():
    from spade_jax.rl.forks import PolicyRollouts

    run, seen = scripted_run_episodes(always("a"))
    service = PolicyRollouts(run_episodes=run, make_env=make_count_env)
    actions = ["a", "b", "a", "b"]
    episode = played(actions, seed=5)
    batch = episode_batch([episode], [episode.return_], [0])
    rule = rl.step_credits.get("crr")
    cfg = rule.make_config(forks=2, turns_per_episode=4, alternative="b", clip=10.0)
    adv_bt, metrics = rule.fn(batch, np.zeros(1), cfg, StepContext(service, seed_parts=(3,)))
    for k, (start, _) in enumerate(episode.turn_spans):
        credit = sum(episode.step_rewards[k:]) - (4 - k - 1) / 4
        assert adv_bt[0, start] == pytest.approx(credit)
    # Turn 3's alternative ends the episode: no policy continuation is run for it.
    assert len(seen) == 2 * 3 and metrics["fork_turns"] == 2 * (4 + 3 + 2 + 1)
    assert "Action: a\nObservation: turn 1\nAction: b" in seen[-1]  # the transcript so far
    assert metrics["fork_tokens"] == 3 * 2 * (3 + 2 + 1)
    with pytest.raises(ValueError, match="without a completion function"):
        service.complete(["q"], seed=0)


def test_policy_tokens_outside_turn_spans_keep_the_outcome_advantage():
    spanned = played(["a", "b"])
    bare = played(["b", "a"])
    bare.turn_spans = []  # e.g. a record from a loop that does not keep turn spans
    out = apply_rule(RoleConfig(step_credit="fault", advantage_estimator="dr_grpo"),
                     [Group([spanned, bare], rewards=[1.0, 0.0])])
    bare_adv = np.asarray(out.sequences[1].advantage)
    policy = np.asarray(bare.loss_mask, bool)
    np.testing.assert_allclose(bare_adv[policy], -0.5)
    np.testing.assert_allclose(bare_adv[~policy], 0.0)
