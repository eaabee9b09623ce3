"""The SPADE round logic with a scripted policy: regeneration windows, the delayed designer
update on the window's statistics, rejection sampling, self-written hints, memory, resume
mid-window, and one scripted round per ablation. The sampler and trainer are injected, so
these run without a model; returns are a pure function of each episode's seed, so a
resumed run must reproduce an uninterrupted one exactly."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from byte_tokenizer import ByteTokenizer

from spade_jax.envs import EnvPool, SandboxConfig
from spade_jax.experiment import load_experiment
from spade_jax.overrides import diff
from spade_jax.planted_faults import planted
from spade_jax.rl.batch import TrainSequence
from spade_jax.rl.rules.grpo import GroupNormAdvantageConfig
from spade_jax.rl.update_rule import RoleConfig
from spade_jax.rollout.records import EpisodeRecord
from spade_jax.spade import seed_programs
from spade_jax.spade.config import SpadeConfig
from spade_jax.spade.corpus import CorpusSampler, CorpusSamplerConfig, Document, InMemoryCorpus
from spade_jax.spade.game_source import FixedEnv, FixedPool
from spade_jax.spade.loop import HintedEnv, SpadeLoop, reward_attribution
from spade_jax.spade.memory import EnvironmentMemory, EnvironmentRecord, MemoryConfig
from spade_jax.spade.prompts import HINT_WRITER_SYSTEM_PROMPT, format_designer_output
from spade_jax.spade.reward import make_designer_reward
from spade_jax.spade.window import DesignerSample

VALID = seed_programs.SEED_PROGRAMS[0]
OTHER = seed_programs.SEED_PROGRAMS[2]
BROKEN_PROGRAM = "class Environment:\n    def reset(self, seed=None):\n        return 1/0, {}\n"
HINT_TEXT = "Reduce modulo m first."


def scripted_return(seed: int, hinted: bool, loss: float = -1.0) -> float:
    """A pure function of the episode seed (returns in [loss, 1], the hint arm better;
    the recipe's games may score a loss -1, the paper contract's returns lie in [0, 1])."""
    table = (1.0, 1.0, 0.5, 0.0) if hinted else (1.0, 0.0, 0.5, loss, 0.0)
    return table[seed % len(table)]


class ScriptedPolicy:
    """Designer replies cycle through ``texts`` (per attempt, by prompt position); the
    hint writer answers HINT_TEXT; episode returns come from ``scripted_return``."""

    def __init__(self, texts, hint=HINT_TEXT, loss=-1.0):
        self.texts, self.hint, self.loss = texts, hint, loss
        self.design_calls, self.hint_calls, self.episode_log, self.updates = [], [], [], []
        self.episode_seeds = []

    def generate(self, prompts, *, seed, purpose):
        tok = ByteTokenizer()
        if purpose == "hint":
            self.hint_calls.append(([tok.decode(p) for p in prompts], seed))
            outs = [self.hint] * len(prompts)
        else:
            attempt = len(self.design_calls)
            self.design_calls.append(([list(p) for p in prompts], seed))
            outs = [self.texts[(attempt + i) % len(self.texts)] for i in range(len(prompts))]
        tokens = [tok.encode(t) for t in outs]
        return tokens, [[-1.0] * len(t) for t in tokens]

    def run_episodes(self, specs, *, seed):
        self.episode_seeds.append(seed)
        records, step_log = [], []
        for spec in specs:
            hinted = isinstance(spec.env, HintedEnv)
            obs, _ = spec.env.reset(seed=spec.seed)
            ret = scripted_return(spec.seed, hinted, self.loss)
            step_log.append({"env_id": spec.env_id, "hinted": hinted, "return": ret, "obs": obs,
                             "program": getattr(spec.env.unwrapped, "source", None)})
            rec = EpisodeRecord(env_id=spec.env_id, seed=spec.seed, observations=[obs])
            rec.append([1, 2, 3], policy=False)
            rec.append([4, spec.seed % 50 + 5], policy=True, logprobs=[-0.5, -0.7])
            rec.return_, rec.step_rewards = ret, [ret]
            records.append(rec)
        self.episode_log.append(step_log)
        return records

    def update(self, seqs):
        self.updates.append(seqs)
        return {"loss": 0.0, "sequences": float(len(seqs))}


class NumpyBlend:
    """The recipe's blend designer reward, re-derived here in NumPy (independent of
    spade.reward): regret at window offset 0, plateau on the window's mean return."""

    def __init__(self):
        self.calls = []

    def score(self, hint_returns, no_hint_returns_by_step, *, skill):
        self.calls.append((list(hint_returns), [list(s) for s in no_hint_returns_by_step], skill))
        return _Scored(expected_blend(hint_returns, no_hint_returns_by_step))

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


@dataclasses.dataclass
class _Scored:
    total: float

    def as_metrics(self):
        return {"total": self.total}


def expected_blend(hint, by_step):
    mean = lambda xs: float(np.mean(xs)) if len(xs) else 0.0  # noqa: E731
    regret = mean(hint) - mean(by_step[0])
    regret_norm = min(1.0, max(0.0, regret / 0.15))
    win = mean([r for s in by_step for r in s])
    distance = max(0.4 - win, win - 0.6, 0.0)
    plateau = max(0.0, 1.0 - distance / 0.25)
    return 0.4 * regret_norm + 0.6 * plateau


@pytest.fixture(scope="module")
def pool():
    with EnvPool(SandboxConfig(call_deadline_s=2.0)) as p:
        yield p


def _corpus(n=200):
    return InMemoryCorpus([Document(f"doc{i}", f"text of document {i}", "test") for i in range(n)],
                          "test")


def _loop(pool, policy, config: SpadeConfig, corpus=True, seed=0, rule=None, memory=None,
          rules=None):
    sampler = (CorpusSampler(_corpus(), CorpusSamplerConfig(seed=seed, documents_per_round=1))
               if corpus else None)
    return SpadeLoop(
        config, tokenizer=ByteTokenizer(), pool=pool, generate=policy.generate,
        run_episodes=policy.run_episodes, update=policy.update, corpus_sampler=sampler,
        memory=memory or EnvironmentMemory(MemoryConfig(seed=seed)),
        reward_rule=rule or NumpyBlend(), seed=seed, rules=rules)


def _text(program, hint="designer hint"):
    return format_designer_output(program, hint)


ALL_VALID = [_text(VALID.source), _text(OTHER.source)]
WINDOW = SpadeConfig(rounds=8, envs_per_round=4, regeneration_interval=4, plays_per_game=3,
                     hint_plays=2, designer_delay=4, contract="paper", docs_per_prompt=1,
                     memory_examples=1, eval_every=0, skills_per_window=3)


def _designer(seqs):
    return [s for s in seqs if s.role == "designer"]


def _agent(seqs):
    return [s for s in seqs if s.role == "agent"]


@pytest.mark.parametrize("rule", ["numpy", "blend"])
def test_designer_sample_of_step_k_is_trained_at_k_plus_delay_on_the_window(pool, rule):
    """With this test's NumPy re-derivation of the blend rule and with the registered
    ``blend`` rule: the same independently computed advantages."""
    policy = ScriptedPolicy(ALL_VALID)
    loop = _loop(pool, policy, WINDOW,
                 rule=NumpyBlend() if rule == "numpy" else make_designer_reward("blend"))
    for step in range(WINDOW.rounds):
        loop.run_step(step)
    # Windows at 0 and 4; designer samples of round 0 trained at round 4 (delay), those of
    # round 4 at round 7 (the last round flushes what is left).
    counts = [len(_designer(u)) for u in policy.updates]
    assert counts == [0, 0, 0, 0, 4, 0, 0, 4]
    assert len(policy.design_calls) == 2  # one attempt per regeneration: all valid
    # The window's returns, re-collected from the policy's own log of episodes.
    for produced, trained, last_offset in ((0, 4, 3), (4, 7, 3)):
        games = sorted({e["env_id"] for e in policy.episode_log[produced]})
        hint = {g: [e["return"] for e in policy.episode_log[produced]
                    if e["env_id"] == g and e["hinted"]] for g in games}
        by_step = {g: [[e["return"] for e in policy.episode_log[produced + k]
                        if e["env_id"] == g and not e["hinted"]] for k in range(last_offset + 1)]
                   for g in games}
        totals = {g: expected_blend(hint[g], by_step[g]) for g in games}
        skills = dict(zip(games, _skills_of(policy, produced), strict=True))
        num_agent = len(_agent(policy.updates[trained]))
        scale = min(num_agent / len(games) * WINDOW.regeneration_interval, 50.0)
        expected = {}
        for g in games:
            same = [totals[h] for h in games if skills[h] == skills[g]]
            expected[g] = (totals[g] - np.mean(same)) * scale
        got = [s.advantage for s in _designer(policy.updates[trained])]
        np.testing.assert_allclose(got, [expected[g] for g in games], rtol=1e-5, atol=1e-6)
        assert all(len(h) == WINDOW.hint_plays for h in hint.values())
    # 3 skills per window, consecutive blocks: window 0 = skills 0-2, window 1 = 3-5.
    assert _skills_of(policy, 0) == ["Mathematical Reasoning", "Logical Deduction",
                                     "Spatial Reasoning", "Mathematical Reasoning"]
    assert set(_skills_of(policy, 4)) == {"Pattern Recognition", "Optimization",
                                          "Causal Inference"}


def _skills_of(policy, step):
    """Skill named in each designer prompt of the regeneration at ``step``."""
    call = 0 if step == 0 else 1
    texts = [ByteTokenizer().decode(p) for p in policy.design_calls[call][0]]
    return [t.split("skill '")[1].split("'")[0] for t in texts]


def test_agent_groups_are_the_plays_of_one_game_in_one_round(pool):
    policy = ScriptedPolicy(ALL_VALID)
    loop = _loop(pool, policy, dataclasses.replace(WINDOW, rounds=2))
    loop.run_step(0)
    loop.run_step(1)
    for step, seqs in enumerate(policy.updates):
        log = [e for e in policy.episode_log[step] if not e["hinted"]]
        agent = _agent(seqs)
        assert len(agent) == len(log) == 4 * WINDOW.plays_per_game  # hint plays never trained
        for g in {e["env_id"] for e in log}:
            idx = [i for i, e in enumerate(log) if e["env_id"] == g]
            r = np.array([log[i]["return"] for i in idx])
            want = (r - r.mean()) / (r.std() + 1e-8)  # the recipe's GRPO z-score
            np.testing.assert_allclose([agent[i].advantage for i in idx], want, rtol=1e-4,
                                       atol=1e-5)


def test_self_hints_are_written_untrained_and_shown_only_in_the_hint_arm(pool):
    policy = ScriptedPolicy(ALL_VALID)
    loop = _loop(pool, policy, dataclasses.replace(WINDOW, rounds=2))
    loop.run_step(0)
    loop.run_step(1)
    (prompts, _), = policy.hint_calls  # one call, at the regeneration round
    assert len(prompts) == 4 and all(HINT_WRITER_SYSTEM_PROMPT[:40] in p for p in prompts)
    assert VALID.source in prompts[0] and OTHER.source in prompts[1]
    hinted = [e for e in policy.episode_log[0] if e["hinted"]]
    assert len(hinted) == 4 * WINDOW.hint_plays
    assert all(e["obs"].endswith(f"\n\nHINT: {HINT_TEXT}") for e in hinted)
    assert not any("HINT" in e["obs"] for e in policy.episode_log[0] if not e["hinted"])
    assert not any(e["hinted"] for e in policy.episode_log[1])  # hint plays: once a window
    trained = [ByteTokenizer().decode(s.token_ids) for u in policy.updates for s in u]
    assert not any(HINT_WRITER_SYSTEM_PROMPT[:40] in t for t in trained)


def test_rejection_sampling_trains_only_valid_attempts(pool):
    texts = [_text(VALID.source), "no program here", _text(BROKEN_PROGRAM), _text(OTHER.source)]
    policy = ScriptedPolicy(texts)
    config = dataclasses.replace(WINDOW, rounds=1, designer_delay=0, max_design_attempts=5)
    loop = _loop(pool, policy, config)
    metrics = loop.run_step(0)
    # attempt 0: slots get texts 0-3 -> 2 valid; attempt 1: the 2 invalid slots retry.
    assert len(policy.design_calls) >= 2 and len(policy.design_calls[1][0]) == 2
    assert metrics["valid_envs"] == 4 and metrics["invalid/parse_error/no_program_block"] >= 1
    assert any(k.startswith("invalid/invalid/") for k in metrics)
    programs = {e["program"] for step in policy.episode_log for e in step}
    assert BROKEN_PROGRAM not in programs  # invalid programs never reach the agent
    designer = _designer(policy.updates[0])
    assert len(designer) == 4  # the valid attempts only
    texts_trained = {ByteTokenizer().decode(s.token_ids[-len(s.token_ids) // 2:])
                     for s in designer}
    assert not any("no program here" in t for t in texts_trained)
    # designs.jsonl's records: every attempt, in order, with its verdict and reply text.
    records = loop.pop_design_records()
    assert len(records) == sum(len(prompts) for prompts, *_ in policy.design_calls)
    assert sum(r["verdict"] == "valid" for r in records) == 4
    broken = [r for r in records if r["verdict"].startswith("invalid/")]
    assert broken and all(r["detail"] and BROKEN_PROGRAM.strip()[:20] in r["reply"]
                          for r in broken)
    assert any(r["verdict"] == "parse_error/no_program_block"
               and r["reply"].startswith("no program here") for r in records)
    assert all(r["prompt_tokens"] > 0 and r["reply_tokens"] > 0 for r in records)
    # a valid attempt's record carries the hint its game was played with; others none
    games = {g.slot: g for g in loop.windows[0].games}
    assert all(r["hint"] == (games[r["slot"]].hint if r["verdict"] == "valid" else None)
               for r in records)
    assert any(r["hint"] for r in records)
    assert loop.pop_design_records() == []  # popped: one step's attempts are logged once


def test_paper_text_variant_trains_invalid_samples_with_the_penalty(pool):
    texts = [_text(VALID.source), "no program here"]
    policy = ScriptedPolicy(texts)
    config = dataclasses.replace(
        WINDOW, rounds=2, regeneration_interval=1, designer_delay=0, hint_mode="designer",
        max_design_attempts=1, invalid_penalty=-1.0, designer_groups="prompt",
        designer_group_size=2)
    loop = _loop(pool, policy, config, rules=(RoleConfig(), RoleConfig()))  # designer GRPO
    loop.run_step(0)
    designer = _designer(policy.updates[0])
    assert len(designer) == 4  # 2 prompts x 2 samples, valid and invalid alike
    # Per prompt group: one valid (blend >= 0) and one invalid (-1): z-scores +1 / -1.
    np.testing.assert_allclose(sorted(s.advantage for s in designer), [-1, -1, 1, 1], atol=1e-4)
    hinted = [e for e in policy.episode_log[0] if e["hinted"]]
    assert hinted and all(e["obs"].endswith("\n\nHINT: designer hint") for e in hinted)
    assert not policy.hint_calls  # the designer's own hint, no hint writer
    loop.run_step(1)  # a new window every round
    assert len(policy.design_calls) == 2


def test_skill_groups_train_invalid_attempts_under_a_penalty(pool):
    """The recipe drops negative *scores* from a skill group; a penalty the config asks for
    is not a score, so the invalid attempts join their skill's group and are pushed down."""
    policy = ScriptedPolicy([_text(VALID.source), "no program here"])
    config = dataclasses.replace(WINDOW, rounds=1, regeneration_interval=1, designer_delay=0,
                                 max_design_attempts=1, invalid_penalty=-1.0,
                                 skills_per_window=1)
    assert config.designer_groups == "skill"
    loop = _loop(pool, policy, config)
    metrics = loop.run_step(0)
    designer = _designer(policy.updates[0])
    invalid = [s for s in designer if "no program here" in ByteTokenizer().decode(s.token_ids)]
    valid = [s for s in designer if s not in invalid]
    assert metrics["valid_envs"] == 2 and len(invalid) == 2 and len(valid) == 2
    # one skill group, mean-centred: the -1s sit below every valid program's (blend >= 0)
    assert max(s.advantage for s in invalid) < 0 < min(s.advantage for s in valid)
    np.testing.assert_allclose(sum(s.advantage for s in designer), 0.0, atol=1e-5)
    np.testing.assert_allclose(invalid[0].advantage, invalid[1].advantage, atol=1e-6)


def _straight_and_resumed(pool, config, cut, corpus=True):
    straight = ScriptedPolicy(ALL_VALID + [_text(BROKEN_PROGRAM)])
    loop = _loop(pool, straight, config, corpus=corpus)
    metrics = [loop.run_step(s) for s in range(config.rounds)]
    first = ScriptedPolicy(ALL_VALID + [_text(BROKEN_PROGRAM)])
    loop_a = _loop(pool, first, config, corpus=corpus)
    for s in range(cut):
        loop_a.run_step(s)
    state = json.loads(json.dumps(loop_a.state_dict()))  # what a checkpoint stores
    resumed = ScriptedPolicy(ALL_VALID + [_text(BROKEN_PROGRAM)])
    resumed.design_calls = [None] * len(first.design_calls)  # the script's own cursor
    loop_b = _loop(pool, resumed, config, corpus=corpus)
    loop_b.load_state_dict(state)
    metrics_b = [loop_b.run_step(s) for s in range(cut, config.rounds)]
    return straight, resumed, metrics, metrics_b, loop, loop_b


def _batch(seqs):
    return [(s.role, list(s.token_ids), float(s.advantage).hex()) for s in seqs]


@pytest.mark.parametrize("cut", [2, pytest.param(5, marks=pytest.mark.slow)])
def test_resume_mid_window_equals_an_uninterrupted_run(pool, cut):
    config = dataclasses.replace(WINDOW, rounds=8, designer_delay=2, memory_train_envs=1)
    straight, resumed, metrics, metrics_b, loop, loop_b = _straight_and_resumed(pool, config, cut)
    assert [_batch(u) for u in resumed.updates] == [_batch(u) for u in straight.updates[cut:]]
    assert resumed.episode_log == straight.episode_log[cut:]

    def clean(m):
        return {k: v for k, v in m.items() if not k.startswith("time/")}

    for a, b in zip(metrics[cut:], metrics_b, strict=True):
        assert json.dumps(clean(a), sort_keys=True) == json.dumps(clean(b), sort_keys=True)
    assert loop_b.state_dict() == loop.state_dict()


def test_memory_fills_under_any_rule_and_replays_refresh_statistics(pool):
    """16.4 / 16.7: memory entries come from the loop's own statistics whatever the rule
    (a rule object with no regret attribute at all), and a replayed environment's record
    gets the new round's returns (on the old code ``EnvironmentMemory.update`` was never
    called)."""
    memory = EnvironmentMemory(MemoryConfig(seed=0))
    memory.add(EnvironmentRecord(
        env_id="old", program_source=VALID.source, hint="h", skill="Logical Deduction",
        round_index=0, regime="frontier", regret=0.5, win_rate_hint=1.0, win_rate_no_hint=0.0,
        mean_return_hint=1.0, mean_return_no_hint=0.0, designer_reward=0.0))
    policy = ScriptedPolicy(ALL_VALID)
    config = dataclasses.replace(WINDOW, rounds=2, designer_delay=1, memory_train_envs=1)
    loop = _loop(pool, policy, config, memory=memory)
    loop.run_step(0)
    replay = [e["return"] for e in policy.episode_log[0] if e["env_id"] == "mem_old"]
    assert len(replay) == config.plays_per_game
    record = memory["old"]
    assert record.last_evaluated_round == 0
    assert record.mean_return_no_hint == pytest.approx(np.mean(replay))
    assert record.win_rate_no_hint == pytest.approx(np.mean(np.array(replay) > 0))
    loop.run_step(1)  # window 0's games are scored (delay 1) and enter memory
    assert len(memory) == 1 + 4
    # Reward levels of each program, probed in the sandbox at the regeneration round
    # (16.5): re-probed here with the same seeds, independently of the loop.
    from spade_jax.spade.env_stats import ProbeConfig, probe_program_levels

    probe = ProbeConfig(episodes=config.probe_episodes, max_turns=25,
                        time_budget_s=config.probe_time_budget_s)
    for index, program in enumerate([VALID.source, OTHER.source, VALID.source, OTHER.source]):
        want = probe_program_levels(program, seed=0, step=0, index=index, pool=pool,
                                    contract="paper", config=probe)
        assert memory[f"r0_s{index}_m0"].reward_levels == int(want.reward_levels) >= 1
    for env_id in (g for g in memory._records if g != "old"):
        rec = memory[env_id]
        log = [e for step in policy.episode_log[:2] for e in step if e["env_id"] == env_id]
        hint = [e["return"] for e in log if e["hinted"]]
        offset0 = [e["return"] for e in policy.episode_log[0]
                   if e["env_id"] == env_id and not e["hinted"]]
        assert rec.regret == pytest.approx(np.mean(hint) - np.mean(offset0))


def test_corpus_documents_never_reused(pool):
    policy = ScriptedPolicy(ALL_VALID)
    config = dataclasses.replace(WINDOW, rounds=3, regeneration_interval=1, designer_delay=0)
    loop = _loop(pool, policy, config)
    for r in range(3):
        loop.run_step(r)
    assert len(loop.designer.used_doc_ids) == 3 * config.num_slots * config.docs_per_prompt


def test_no_memory_and_no_corpus_prompts(pool):
    policy = ScriptedPolicy(ALL_VALID)
    config = dataclasses.replace(WINDOW, rounds=3, regeneration_interval=1, designer_delay=0,
                                 use_memory=False, use_corpus=False)
    loop = _loop(pool, policy, config, corpus=False)
    for r in range(3):
        loop.run_step(r)
    assert not loop.memory.records
    text = ByteTokenizer().decode(policy.design_calls[-1][0][0])
    assert "text of document" not in text and "Agent win rate" not in text


ABLATIONS = {  # experiment -> the fields it changes and their new values
    "spade_no_memory": {"spade.use_memory": False},
    "spade_no_corpus": {"spade.use_corpus": False},
    "spade_self_generation": {"spade.train_designer": False, "spade.use_memory": False},
    "spade_fixed_designer": {"spade.designer_mode": "fixed_pool", "spade.hint_mode": "none",
                             "spade.regeneration_interval": 1, "spade.designer_delay": 0,
                             "spade.use_memory": False},
    "spade_ema_reward": {"spade.designer_reward": "learning_potential"},
    "spade_solve_rate": {"spade.designer_reward": "solve_rate"},
    "spade_two_skill": {"spade.skills": "two_skill"},
    "spade_paper_text": {
        "spade.regeneration_interval": 1, "spade.designer_delay": 0,
        "spade.hint_mode": "designer", "spade.designer_reward": "hint_regret",
        "spade.invalid_penalty": -1.0, "spade.designer_groups": "prompt",
        "train.designer.advantage_estimator": "grpo",
        "train.designer.advantage": GroupNormAdvantageConfig(),
        "spade.designer_group_size": 4, "spade.max_design_attempts": 1,
        "spade.plays_per_game": 16, "spade.hint_plays": 16, "spade.contract": "paper",
        "spade.global_batch": 0, "spade.regenerate_missing_games": False,
        "spade.program_extraction": "last_block"},
    "baseline_fixed_env_grpo": {"spade.baseline": "fixed_env_grpo"},
    "baseline_fixed_env_rlve": {"spade.baseline": "fixed_env_rlve"},
}


@pytest.mark.parametrize("name", sorted(ABLATIONS))
@pytest.mark.parametrize("base", ["qwen3_30b_a3b", "tiny"])
def test_each_ablation_changes_exactly_what_it_names(name, base):
    reference = load_experiment(base)
    variant = load_experiment(f"{name}:{base}")
    changed = diff(reference, variant)
    changed.pop("name")
    def value(config, path):
        for part in path.split("."):
            config = getattr(config, part)
        return config

    want = {k: v for k, v in ABLATIONS[name].items()
            if value(reference, k) != v}  # a base may already have the value
    assert {k: new for k, (_, new) in changed.items()} == want


@pytest.mark.parametrize("name", sorted(ABLATIONS))
def test_one_scripted_round_per_ablation_and_baseline(pool, name):
    """16.8: each ablation's tiny config runs scripted rounds that produce a real batch."""
    experiment = load_experiment(f"{name}:tiny")
    spade = dataclasses.replace(experiment.spade, contract="paper", rounds=2, eval_every=0)
    policy = ScriptedPolicy(ALL_VALID, loss=-1.0 if spade.contract == "reference" else 0.0)
    rule = make_designer_reward(spade.designer_reward, spade.designer_reward_config)
    loop = _loop(pool, policy, spade, corpus=spade.use_corpus, rule=rule,
                 rules=(experiment.train.agent, experiment.train.designer))
    if spade.game_source == "fixed_pool":
        loop.source = FixedPool([(p.source, p.hint, p.skill)
                                 for p in seed_programs.SEED_PROGRAMS[:3]])
    if spade.game_source == "fixed_env":  # the experiment's own baseline (reasoning-gym tasks)
        from spade_jax.spade.baselines import make_baseline

        baseline = make_baseline(load_experiment(f"{name}:tiny"))
        loop.source = FixedEnv(baseline)
        fed = []
        feedback = baseline.feedback
        baseline.feedback = lambda returns: (fed.append(returns), feedback(returns))
    metrics = [loop.run_step(s) for s in range(2)]
    assert all(m["batch/agent"] > 0 for m in metrics)
    assert all(math.isfinite(m["return_no_hint_mean"]) for m in metrics)
    if spade.baseline == "none":
        assert metrics[0]["validity_rate"] > 0 and math.isfinite(metrics[0]["regret_raw_mean"])
        trained = sum(m["batch/designer"] for m in metrics)
        assert (trained > 0) == (spade.train_designer and spade.designer_mode == "self")
    else:
        assert len(fed) == 2 and all(len(r) == 4 for r in fed)  # 4 tasks a round (tiny)
        assert all(len(v) == spade.plays_per_game for r in fed for v in r.values())


def test_an_untrained_agent_plays_and_scores_but_only_the_designer_trains(pool):
    """spade.train_agent=False (toy:check): the agent's plays still score the designer, but
    only designer samples reach the update."""
    experiment = load_experiment("tiny")
    spade = dataclasses.replace(experiment.spade, contract="paper", rounds=2, eval_every=0,
                                regeneration_interval=1, designer_delay=0, train_agent=False)
    policy = ScriptedPolicy(ALL_VALID, loss=0.0)
    loop = _loop(pool, policy, spade, rules=(experiment.train.agent, experiment.train.designer))
    updates = []
    update = loop.update
    loop.update = lambda seqs: (updates.append([s.role for s in seqs]), update(seqs))[1]
    metrics = [loop.run_step(s) for s in range(2)]
    assert all(m["episodes/no_hint"] > 0 and math.isfinite(m["return_no_hint_mean"])
               for m in metrics)
    assert all(m["batch/agent"] == 0 and m["batch/designer"] > 0 for m in metrics)
    assert len(updates) == 2 and all(roles and set(roles) == {"designer"} for roles in updates)
    with pytest.raises(ValueError, match="train_agent=False trains the designer alone"):
        dataclasses.replace(spade, train_designer=False)


class _TextEnv:
    """A minimal text env: a fixed opening observation."""

    def reset(self, *, seed=None, **kwargs):
        return "Guess a number.", {}

    def step(self, action):
        return "", 0.0, True, False, {}

    def close(self):
        pass


def test_one_hint_presentation_for_loop_evaluation_and_hint_filter():
    """The loop's hint arm, evaluation's hinted episodes and the hint filter show a hint
    the same way: appended as "\\n\\nHINT: ..." (evaluation and the filter used to put a
    "Hint: ..." before the observation)."""
    import gymnasium

    from spade_jax.evaluation.episodes import _open
    from spade_jax.hint_filter.runner import _hinted_prompt
    from spade_jax.hint_filter.tasks import FilterTask

    class GymText(gymnasium.Env):
        def reset(self, *, seed=None, options=None):
            return "Guess a number.", {}

    want = "Guess a number.\n\nHINT: halve the range"
    assert HintedEnv(GymText(), "halve the range").reset(seed=1)[0] == want
    assert _open(_TextEnv, None, "halve the range").reset(seed=1)[0] == want
    assert _open(_TextEnv, "Task 7.", "halve the range").reset(seed=1)[0] == (
        "Task 7.\n\nGuess a number.\n\nHINT: halve the range")
    task = FilterTask(id="t", line=1, hint="halve the range", prompt="Guess a number.")
    assert _hinted_prompt(task) == want


def test_every_sampler_call_is_seeded_from_seed_round_phase_and_index(pool):
    """16.3 (loop side): each round's episodes, designer attempts and hint calls draw from
    their own (experiment seed, round, phase, index) stream, never a repeated one."""
    from spade_jax.seeding import Phase, derive_seed

    texts = [_text(VALID.source), "no program here"]
    policy = ScriptedPolicy(texts)
    config = dataclasses.replace(WINDOW, rounds=3, regeneration_interval=2, designer_delay=1)
    loop = _loop(pool, policy, config, seed=7)
    for step in range(3):
        loop.run_step(step)
    assert policy.episode_seeds == [derive_seed(7, s, Phase.AGENT) for s in range(3)]
    design_seeds = [seed for _, seed in policy.design_calls]
    assert design_seeds[:2] == [derive_seed(7, 0, Phase.DESIGN, 0), derive_seed(7, 0, Phase.DESIGN, 1)]
    assert derive_seed(7, 2, Phase.DESIGN, 0) in design_seeds[2:]
    assert [seed for _, seed in policy.hint_calls] == [derive_seed(7, 0, Phase.HINT_WRITE, 0),
                                                      derive_seed(7, 2, Phase.HINT_WRITE, 0)]


def test_config_errors_name_the_problem():
    with pytest.raises(ValueError, match="hint_mode='designer' needs spade.contract='paper'"):
        SpadeConfig(hint_mode="designer", contract="reference")
    with pytest.raises(ValueError, match="multiple of spade.designer_group_size"):
        SpadeConfig(envs_per_round=6, designer_group_size=4)
    with pytest.raises(ValueError, match="spade.regeneration_interval must be >= 1"):
        SpadeConfig(regeneration_interval=0)
    with pytest.raises(ValueError, match="spade.skills must be one of"):
        SpadeConfig(skills="nine")
    assert SpadeConfig(designer_delay=0).designer_delay == 0  # 0 = no delay


def test_adaptive_baseline_resumes_with_its_win_rates(pool):
    """The RLVE baseline's per-task win rates travel in the loop's state: a resumed run
    draws the same tasks as an uninterrupted one (they were lost on a resume before)."""
    from spade_jax.spade.baselines import make_baseline

    experiment = load_experiment("baseline_fixed_env_rlve:tiny")
    spade = dataclasses.replace(experiment.spade, rounds=3, eval_every=0)

    def run(steps, state=None):
        policy = ScriptedPolicy(ALL_VALID, loss=0.0)
        loop = _loop(pool, policy, spade, corpus=False)
        loop.source = FixedEnv(make_baseline(experiment))
        if state is not None:
            loop.load_state_dict(json.loads(json.dumps(state)))
        for step in steps:
            loop.run_step(step)
        return loop, [[e["env_id"] for e in log] for log in policy.episode_log]

    straight, tasks = run(range(3))
    first, _ = run(range(2))
    resumed, resumed_tasks = run([2], first.state_dict())
    assert resumed_tasks == tasks[2:]
    assert straight.source.baseline.win_rate != make_baseline(experiment).win_rate  # adapted
    assert resumed.source.baseline.win_rate == straight.source.baseline.win_rate


@pytest.mark.parametrize("name", ["qwen3_30b_a3b", "qwen3_8b", "qwen3_4b"])
def test_paper_scale_experiments_set_the_recipes_numbers(name):
    from spade_jax.spade.prompts import REFERENCE_AGENT_FIRST_TURN_TEMPLATE

    config = load_experiment(name)
    s, agent = config.spade, config.agent
    assert (s.rounds, s.envs_per_round, s.regeneration_interval, s.plays_per_game,
            s.hint_plays, s.designer_delay, s.max_design_attempts) == (400, 24, 4, 8, 16, 4, 5)
    assert s.envs_per_round * s.plays_per_game == 192  # the recipe's global batch
    assert (s.skills, s.skills_per_window, s.hint_mode, s.hint_temperature,
            s.hint_max_tokens) == ("main", 3, "self", 0.3, 4096)
    assert (s.designer_reward, s.designer_groups, s.invalid_penalty, s.contract,
            s.memory_capacity) == ("blend", "skill", None, "reference", 200)
    agent_rule, designer_rule = config.train.agent, config.train.designer
    assert (agent_rule.advantage_estimator, agent_rule.advantage.eps) == ("grpo", 1e-8)
    assert designer_rule.advantage_estimator == "dr_grpo"  # per-skill centring, no std
    for sampler in (config.designer_sampler, agent.sampler):
        assert (sampler.temperature, sampler.top_p, sampler.top_k) == (0.6, 0.95, 20)
    assert (agent.max_turns, agent.max_turn_tokens, agent.max_episode_tokens) == (25, 8192, 32768)
    assert agent.sampler.max_prefill_tokens == 8 * 32768  # docs/scale_out.md: decode layout
    assert (agent.action_format, agent.first_turn_template, agent.system_prompt,
            agent.enable_thinking) == ("boxed", REFERENCE_AGENT_FIRST_TURN_TEMPLATE, None, False)
    # The second audit (issue 30, docs/reference_parity.md): the authors' code paths.
    assert (s.global_batch, s.memory_at, s.regenerate_missing_games, s.play_env_seconds,
            s.drop_failed_plays, s.fresh_prompt_per_attempt, s.corpus_draws, s.flush_at_end,
            s.hint_top_p, s.program_extraction) == (
        192, "regeneration", True, 300.0, True, True, "uniform", False, 0.9, "recipe")
    assert config.train.router_replay is False and config.corpus.stand_in is False
    assert config.checkpoint_every == 16 and agent.end_on_cut_reply is True
    assert (config.sandbox.lenient_play_steps, config.sandbox.play_call_deadline_s,
            config.sandbox.play_call_cpu_budget_s) == (True, 30.0, 30.0)
    # A short batch's loss / 192 only where slime does not rescale it (the 8B's KL).
    assert config.train.pooled_min_denominator == (192 if name == "qwen3_8b" else 0)
    designer_tokens, thinking = (20_000, True) if name == "qwen3_8b" else (16384, False)
    assert (config.designer_sampler.max_new_tokens, s.designer_thinking) == (designer_tokens,
                                                                            thinking)


def _attribution_case(programs, seed=0):
    """Designer samples writing ``programs`` (ids; equal ids = identical programs), their
    scores and the sequences a mean-centred rule trains, in shuffled order."""
    rng = np.random.default_rng(seed)
    samples = [DesignerSample(slot=i, skill="s", prompt_ids=[7, 8], output_ids=[9, 20 + p],
                              output_logprobs=[0.0, 0.0], env_id=f"e{i}")
               for i, p in enumerate(programs)]
    totals = rng.random(len(programs))
    return samples, totals


def _trained(samples, advantages, order=None):
    order = range(len(samples)) if order is None else order
    return [TrainSequence(list(samples[i].prompt_ids) + list(samples[i].output_ids),
                          [0, 0, 1, 1], [0.0] * 4, float(advantages[i]), "designer", group=0)
            for i in order]


def test_reward_attribution_matches_a_numpy_rederivation():
    programs = [0, 0, 1, 2, 2, 2, 3, 4, 5, 5]
    samples, totals = _attribution_case(programs)
    centred = totals - totals.mean()
    reversed_order = list(range(len(programs)))[::-1]  # matched by tokens, not position
    assert reward_attribution(samples, totals, _trained(samples, centred, reversed_order)
                              ) == pytest.approx(1.0)
    # scores handed to the wrong programs: by hand, identical programs as one point (their
    # mean advantage against their mean score)
    shuffled = np.roll(centred, 3)
    ids = sorted(set(programs))
    adv = [np.mean([shuffled[i] for i, p in enumerate(programs) if p == k]) for k in ids]
    own = [np.mean([centred[i] for i, p in enumerate(programs) if p == k]) for k in ids]
    expected = np.corrcoef(adv, own)[0, 1]
    assert reward_attribution(samples, totals, _trained(samples, shuffled)
                              ) == pytest.approx(expected)
    assert expected < 0.9
    # per-token advantages read as their mean over the trained tokens
    per_token = [dataclasses.replace(s, advantage=np.array([5.0, 5.0, a, a]))
                 for s, a in zip(_trained(samples, centred), centred, strict=True)]
    assert reward_attribution(samples, totals, per_token) == pytest.approx(1.0)
    # fewer than 3 distinct programs, or nothing trained: no reading
    two = [0, 0, 1, 1, 1]
    samples2, totals2 = _attribution_case(two)
    assert math.isnan(reward_attribution(samples2, totals2,
                                         _trained(samples2, totals2 - totals2.mean())))
    assert math.isnan(reward_attribution(samples, totals, []))


def test_the_loop_logs_reward_attribution_and_a_permutation_lowers_it(pool):
    """The loop's own designer_sequences (skill groups, the recipe's): every program gets
    its own score; under the planted permutation fault the same samples read low."""
    loop = _loop(pool, ScriptedPolicy(ALL_VALID), dataclasses.replace(
        WINDOW, rounds=1, regeneration_interval=1, designer_delay=0))
    samples, totals = _attribution_case([0, 1, 2, 3, 4, 5])
    pairs = [(0, s) for s in samples]
    clean = loop.designer_sequences(pairs, list(totals), num_agent=8, step=3)
    assert reward_attribution(samples, totals, clean) == pytest.approx(1.0)
    with planted("designer_reward_permutation"):
        moved = loop.designer_sequences(pairs, list(totals), num_agent=8, step=3)
    assert reward_attribution(samples, totals, moved) < 0.9
    metrics = loop.run_step(0)  # a scored round logs it (2 distinct scripted programs: none)
    assert "designer/reward_attribution" not in metrics or math.isfinite(
        metrics["designer/reward_attribution"])


def test_supervised_replay_adds_seeded_supervised_rows_to_every_update(pool):
    """``spade.supervised_replay`` rows join every update (agent-only ones too), drawn from
    the loop's examples with seed (seed, step, SUPERVISED_REPLAY): the same step draws the
    same rows in another loop, and they are marked for the NLL term, not a role's rule."""
    examples = [TrainSequence([1, 2, 3 + i], [0, 1, 1], [0.0] * 3, 0.0, role="designer")
                for i in range(5)]
    config = dataclasses.replace(WINDOW, rounds=3, supervised_replay=3)
    runs = []
    for _ in range(2):
        policy = ScriptedPolicy(ALL_VALID)
        loop = _loop(pool, policy, config)
        loop.supervised_examples = examples
        for step in range(3):
            loop.run_step(step)
        runs.append([[s.token_ids for s in u if s.role == "supervised"] for u in policy.updates])
    assert runs[0] == runs[1] and len(runs[0]) == 3
    assert all(len(rows) == 3 for rows in runs[0])
    assert len({tuple(map(tuple, rows)) for rows in runs[0]}) > 1  # a new draw each step
    loop.supervised_examples = []
    with pytest.raises(ValueError, match="no supervised examples"):
        loop.run_step(3)
