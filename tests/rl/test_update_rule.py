"""``apply_rule`` (``rl/update_rule.py``), a role's host-side rule parts in order: the
group filter, the advantage estimator (times the advantage scale), the step credit and
the group indices; equal totals give zero advantages; policy tokens outside every turn
span keep the outcome advantage.

And DAPO dynamic sampling with refill (``_refill``): groups whose rewards all agree are
dropped and replaced by new plays of the step's environments (fresh seeds
``derive_seed(seed, step, Phase.REFILL, role, round, 1 + j, play)``), through the rollout
side's ``play_groups``, up to ``max_refill_rounds``. The environments here pay a known
function of the reset seed, so which groups are all-equal, and which replacements are, is
computed independently below. The same in SPADE rounds (the loop plays the replacements)
and set from the command line."""

from __future__ import annotations

import numpy as np
import pytest
from rule_references import played

from spade_jax.rl.batch import pack_sequences
from spade_jax.rl.episodes import GroupRequest, ScriptedRollouts, StepContext
from spade_jax.rl.update_rule import Group, RoleConfig, apply_rule
from spade_jax.seeding import Phase, derive_seed

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


# ---- DAPO dynamic sampling: refill -------------------------------------------------------

PLAYS = 4
SEED, STEP, ROLE = 5, 3, 0


class SeedBitEnv:
    """One turn; pays the reset seed's last bit, so a group is all-equal exactly when all
    its seeds share a parity."""

    def reset(self, seed=None):
        self.seed = seed
        return f"seed {seed}", {}

    def step(self, action):
        return "done", float(self.seed % 2), True, False, {}


class SolvedEnv(SeedBitEnv):
    """Always pays 1: every group of it is all-equal, whatever the seeds."""

    def step(self, action):
        return "done", 1.0, True, False, {}


def pays(env_id: str, seed: int) -> float:
    return 1.0 if env_id.startswith("solved") else float(seed % 2)


def service() -> ScriptedRollouts:
    return ScriptedRollouts(lambda env_id: SolvedEnv() if env_id.startswith("solved")
                            else SeedBitEnv(), lambda observations, actions, rng: "go")


def sampled(rollouts: ScriptedRollouts, seeds_by_env: dict[str, tuple[int, ...]]) -> list[Group]:
    """The step's regular groups, played by the same service with chosen seeds."""
    played = rollouts.play_groups([GroupRequest(e, s) for e, s in seeds_by_env.items()], seed=0)
    rollouts.plays_run = rollouts.turns_run = 0
    return [Group(episodes) for episodes in played]


def context(rollouts, seed=SEED) -> StepContext:
    return StepContext(rollouts, seed_parts=(seed, STEP, Phase.CREDIT, ROLE), role="agent",
                       refill_seed_parts=(seed, STEP, Phase.REFILL, ROLE))


def expected_refill(dropped_envs, rounds, seed=SEED, step=STEP, plays=PLAYS, pays=pays):
    """Re-derives "dropped"-mode refill: [(env id, seeds)] requested, the env ids still
    all-equal after at most ``rounds`` rounds, and the rounds run."""
    requested, missing, run = [], list(dropped_envs), 0
    for r in range(rounds):
        if not missing:
            break
        run += 1
        still = []
        for j, env_id in enumerate(missing):
            seeds = [derive_seed(seed, step, Phase.REFILL, ROLE, r, 1 + j, p)
                     for p in range(plays)]
            requested.append((env_id, seeds))
            if len({pays(env_id, s) for s in seeds}) == 1:
                still.append(env_id)
        missing = still
    return requested, missing, run


def dapo(**filter_cfg) -> RoleConfig:
    return RoleConfig(group_filter="dapo_dynamic_sampling", filter=filter_cfg)


# bit_a is informative (mixed parities); bit_b and bit_c are all-equal (one parity each).
BITS = {"bit_a": (0, 1, 2, 3), "bit_b": (2, 4, 6, 8), "bit_c": (1, 3, 5, 7)}


def test_refill_fills_the_batch_with_informative_groups_of_fresh_seeds():
    rollouts = service()
    groups = sampled(rollouts, BITS)
    out = apply_rule(dapo(max_refill_rounds=8), groups, context=context(rollouts))
    want, still, rounds = expected_refill(["bit_b", "bit_c"], 8)
    assert still == [] and rounds >= 1  # with these seeds the budget suffices
    # The replacements are exactly the derived seeds' plays of the dropped environments.
    assert [(g.episodes[0].env_id, [ep.seed for ep in g.episodes])
            for g in out.refill_groups] == want
    assert [ep.return_ for g in out.refill_groups for ep in g.episodes] == [
        pays(e, s) for e, seeds in want for s in seeds]
    # The trained batch: as many informative groups as were sampled, PLAYS sequences each.
    m = out.metrics
    assert m["group_filter/kept_groups"] == len(BITS) == len({s.group for s in out.sequences})
    assert len(out.sequences) == len(BITS) * PLAYS
    assert m["group_filter/refill_kept_groups"] == 2
    assert m["group_filter/refill_missing_groups"] == 0
    assert m["group_filter/refill_unplayed_groups"] == 0
    assert m["group_filter/refill_groups"] == len(want) == len(out.refill_groups)
    assert m["group_filter/refill_rounds"] == rounds
    assert m["group_filter/refill_episodes"] == len(want) * PLAYS == rollouts.plays_run
    assert m["group_filter/refill_turns"] == len(want) * PLAYS  # one turn each
    assert m["group_filter/refill_tokens"] == len(want) * PLAYS  # one action token each
    assert m["group_filter/dropped_groups"] == 2 + len(want) - 2
    all_groups = groups + out.refill_groups
    assert out.dropped_groups == [g for g, group in enumerate(all_groups)
                                  if len(set(group.reward_values())) == 1]
    # Every trained group is informative, with GRPO's z-scores on its own rewards.
    for g in {s.group for s in out.sequences}:
        rewards = all_groups[g].reward_values()
        assert rewards.max() > rewards.min()
        got = np.array([s.advantage for s in out.sequences if s.group == g])
        np.testing.assert_allclose(got, (rewards - rewards.mean()) / (rewards.std() + 1e-6),
                                   rtol=1e-5)


@pytest.mark.parametrize("budget", [0, 1, 3])
def test_refill_stops_at_its_budget(budget):
    """A solved environment stays all-equal whatever the seeds: refill runs every round
    of the budget and the batch stays one group short."""
    rollouts = service()
    groups = sampled(rollouts, {"bit_a": BITS["bit_a"], "solved_d": (0, 1, 2, 3)})
    out = apply_rule(dapo(max_refill_rounds=budget), groups, context=context(rollouts))
    want, still, _ = expected_refill(["solved_d"], budget)
    assert still == ["solved_d"] and len(want) == budget
    assert rollouts.plays_run == budget * PLAYS
    assert [g.episodes[0].env_id for g in out.refill_groups] == ["solved_d"] * budget
    assert len(out.sequences) == PLAYS and {s.group for s in out.sequences} == {0}
    m = out.metrics
    assert m["group_filter/kept_groups"] == 1
    assert m["group_filter/dropped_groups"] == 1 + budget
    if budget:
        assert m["group_filter/refill_rounds"] == budget
        assert m["group_filter/refill_missing_groups"] == 1
        assert m["group_filter/refill_episodes"] == budget * PLAYS
    else:  # no refill configured: no refill metrics, nothing played
        assert not any("refill" in k for k in m)


def test_refill_from_all_replaces_from_every_environment_of_the_step():
    """With refill_from="all" a solved game's slot is filled by plays of the step's other
    games, which "dropped" cannot do."""
    rollouts = service()
    groups = sampled(rollouts, {"bit_a": BITS["bit_a"], "solved_d": (0, 1, 2, 3)})
    out = apply_rule(dapo(max_refill_rounds=6, refill_from="all"), groups,
                     context=context(rollouts))
    assert out.metrics["group_filter/kept_groups"] == 2
    assert len(out.sequences) == 2 * PLAYS
    kept_refill = [g for g in out.refill_groups if len(set(g.reward_values())) > 1]
    assert [g.episodes[0].env_id for g in kept_refill] == ["bit_a"]
    assert {g.episodes[0].env_id for g in out.refill_groups} <= {"bit_a", "solved_d"}


def test_same_seed_same_refill_and_another_seed_other_plays():
    def run(seed):
        rollouts = service()
        out = apply_rule(dapo(max_refill_rounds=8), sampled(rollouts, BITS),
                         context=context(rollouts, seed))
        return ([(s.group, s.token_ids, float(s.advantage)) for s in out.sequences],
                [[ep.seed for ep in g.episodes] for g in out.refill_groups])

    first, again, other = run(SEED), run(SEED), run(SEED + 1)
    assert first == again
    assert first[1] != other[1]


def test_refill_needs_a_rollout_service_and_a_valid_config():
    groups = sampled(service(), BITS)
    with pytest.raises(ValueError, match="group filter \\(refill\\) 'dapo_dynamic_sampling' "
                                         "needs a RolloutService"):
        apply_rule(dapo(max_refill_rounds=1), groups, context=StepContext())
    # Without a refill budget no service is needed: the dropped groups just do not train.
    out = apply_rule(dapo(), groups, context=StepContext())
    assert out.dropped_groups == [1, 2] and out.refill_groups == []
    with pytest.raises(ValueError, match="max_refill_rounds must be >= 0"):
        dapo(max_refill_rounds=-1)
    with pytest.raises(ValueError, match="refill_from must be one of"):
        dapo(refill_from="prompts")


# ---- in SPADE rounds: the loop plays the replacements ---------------------------------------


@pytest.fixture(scope="module")
def pool():
    from spade_jax.envs import EnvPool, SandboxConfig

    with EnvPool(SandboxConfig(call_deadline_s=2.0)) as p:
        yield p


def spade_rounds(pool, rounds=2, budget=6):
    """Two scripted rounds whose agent plays pay their reset seed's last bit; returns the
    loop, its policy and each round's metrics."""
    import dataclasses

    from spade.test_loop import ALL_VALID, WINDOW, ScriptedPolicy, _loop  # tests/spade/

    from spade_jax.rl.update_rule import DEFAULT_DESIGNER_RULE

    class SeedBitPolicy(ScriptedPolicy):
        def run_episodes(self, specs, *, seed):
            records = super().run_episodes(specs, seed=seed)
            for rec, entry in zip(records, self.episode_log[-1], strict=True):
                rec.return_ = rec.step_rewards[0] = entry["return"] = float(rec.seed % 2)
            return records

    policy = SeedBitPolicy(ALL_VALID)
    config = dataclasses.replace(WINDOW, rounds=rounds, hint_mode="none", hint_plays=0)
    loop = _loop(pool, policy, config, rules=(dapo(max_refill_rounds=budget),
                                              DEFAULT_DESIGNER_RULE))
    return loop, policy, [loop.run_step(step) for step in range(rounds)]


def test_spade_rounds_refill_the_agents_dropped_games_with_new_plays(pool):
    loop, policy, metrics = spade_rounds(pool)
    plays = loop.config.plays_per_game
    calls = iter(zip(policy.episode_seeds, policy.episode_log, strict=True))
    for step, row in enumerate(metrics):
        seed, regular = next(calls)
        assert seed == derive_seed(0, step, Phase.AGENT)
        groups: dict[str, list] = {}
        for entry in regular:
            groups.setdefault(entry["env_id"], []).append(entry["return"])
        dropped = [env_id for env_id, returns in groups.items() if len(set(returns)) == 1]
        want, still, rounds = expected_refill(dropped, 6, seed=0, step=step, plays=plays,
                                              pays=lambda env_id, s: float(s % 2))
        # The loop's replacement batches: one per refill round, sampler seeded per round.
        got = []
        for r in range(rounds):
            seed, log = next(calls)
            assert seed == derive_seed(0, step, Phase.REFILL, ROLE, r)
            got += [(e["env_id"], e["return"]) for e in log]
        assert got == [(env_id, float(s % 2)) for env_id, seeds in want for s in seeds]
        assert row.get("rule/agent/group_filter/refill_groups", 0) == len(want)
        assert row["rule/agent/group_filter/kept_groups"] == len(groups) - len(still)
        # The update trains every game's informative group, plays_per_game sequences each.
        agent = [s for s in policy.updates[step] if s.role == "agent"]
        assert len(agent) == (len(groups) - len(still)) * plays
        assert all(s.advantage != 0 for s in agent)
        # Refill plays train only: the window's statistics hold the regular plays.
        for game in loop.windows[0].games:
            assert len(game.returns_by_offset[step]) == plays
    assert any(row.get("rule/agent/group_filter/refill_groups", 0) > 0 for row in metrics)


def test_spade_rounds_with_refill_are_reproducible(pool):
    def run():
        _, policy, metrics = spade_rounds(pool)
        trained = [[(s.role, s.token_ids, s.advantage) for s in update]
                   for update in policy.updates]
        return trained, [{k: v for k, v in row.items() if "seconds" not in k and
                          not k.startswith("time")} for row in metrics]

    assert run() == run()


def test_designer_refill_is_refused(pool):
    from spade.test_loop import ALL_VALID, WINDOW, ScriptedPolicy, _loop

    with pytest.raises(ValueError, match="designer.filter.max_refill_rounds must be 0"):
        _loop(pool, ScriptedPolicy(ALL_VALID), WINDOW,
              rules=(RoleConfig(), dapo(max_refill_rounds=1)))


def test_refill_is_set_from_the_command_line():
    from spade_jax.experiment import load_experiment

    train = load_experiment("tiny", ["train.agent.group_filter=dapo_dynamic_sampling",
                                     "train.agent.filter.max_refill_rounds=3",
                                     "train.agent.filter.refill_from=all"]).train
    assert (train.agent.filter.max_refill_rounds, train.agent.filter.refill_from) == (3, "all")
    with pytest.raises(ValueError, match="refill_from must be one of"):
        load_experiment("tiny", ["train.agent.group_filter=dapo_dynamic_sampling",
                                 "train.agent.filter.refill_from=everything"])


class BitTaskBaseline:
    """A fixed-environment baseline with tasks "t0".."t2" of SeedBitEnv; plays seeded
    2, 4, 6 (all even: every group all-equal) so every group is refilled."""

    tasks = ("t0", "t1", "t2")

    def episodes(self, round_index, plays_per_task):
        from spade_jax.rollout.agent_loop import EpisodeSpec

        return [EpisodeSpec(env=self.new_env(t), env_id=t, seed=2 * (p + 1))
                for t in self.tasks for p in range(plays_per_task)]

    def new_env(self, task):
        env = SeedBitEnv()
        env.unwrapped = env
        env.close = lambda: None
        return env

    def feedback(self, returns_by_env):
        pass

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def test_baseline_rounds_refill_from_the_baselines_tasks(pool):
    import dataclasses

    from spade.test_loop import ALL_VALID, WINDOW, ScriptedPolicy, _loop

    from spade_jax.rl.update_rule import DEFAULT_DESIGNER_RULE
    from spade_jax.spade.game_source import FixedEnv

    class SeedBitPolicy(ScriptedPolicy):
        def run_episodes(self, specs, *, seed):
            records = super().run_episodes(specs, seed=seed)
            for rec in records:
                rec.return_ = rec.step_rewards[0] = float(rec.seed % 2)
            return records

    policy = SeedBitPolicy(ALL_VALID)
    loop = _loop(pool, policy, dataclasses.replace(WINDOW, baseline="fixed_env_grpo"),
                 rules=(dapo(max_refill_rounds=5), DEFAULT_DESIGNER_RULE))
    loop.source = FixedEnv(BitTaskBaseline())
    row = loop.run_step(0)
    plays = WINDOW.plays_per_game
    want, still, rounds = expected_refill(list(BitTaskBaseline.tasks), 5, seed=0, step=0,
                                          plays=plays, pays=lambda env_id, s: float(s % 2))
    assert row["rule/agent/group_filter/refill_groups"] == len(want)
    assert row["rule/agent/group_filter/kept_groups"] == 3 - len(still)
    assert policy.episode_seeds[1:] == [derive_seed(0, 0, Phase.REFILL, ROLE, r)
                                        for r in range(rounds)]
    assert [s.advantage != 0 for s in policy.updates[0]] == [True] * (3 - len(still)) * plays


def test_requests_the_service_cannot_play_are_counted_and_skipped():
    class NoSolvedPlays(ScriptedRollouts):
        def play_groups(self, requests, *, seed):
            played = super().play_groups(requests, seed=seed)
            return [[] if r.env_id.startswith("solved") else g
                    for r, g in zip(requests, played, strict=True)]

    groups = sampled(service(), {**BITS, "solved_d": (0, 1, 2, 3)})
    rollouts = NoSolvedPlays(service().make_env, service().policy)
    out = apply_rule(dapo(max_refill_rounds=8), groups, context=context(rollouts))
    m = out.metrics
    # solved_d's one request is unplayable; "dropped" then has nothing left to replace it.
    assert m["group_filter/refill_unplayed_groups"] == 1
    assert "solved_d" not in {g.episodes[0].env_id for g in out.refill_groups}
    assert m["group_filter/kept_groups"] == 3 and m["group_filter/refill_missing_groups"] == 1
    want, _, rounds = expected_refill(["bit_b", "bit_c"], 8)  # rounds stop when they fill
    assert m["group_filter/refill_rounds"] == max(rounds, 1)
    assert m["group_filter/refill_groups"] == len(want) >= 2
