"""The SPADE round logic with a scripted policy: validation gate, corpus, memory, resume,
ablation flags. The sampler and trainer are injected, so these run without a model."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from spade_jax.envs import EnvPool, SandboxConfig
from spade_jax.experiment import load_experiment
from spade_jax.overrides import diff
from spade_jax.rollout.records import EpisodeRecord
from spade_jax.spade import seed_programs
from spade_jax.spade.config import SpadeConfig
from spade_jax.spade.corpus import CorpusSampler, CorpusSamplerConfig, Document, InMemoryCorpus
from spade_jax.spade.loop import HintedEnv, SpadeLoop
from spade_jax.spade.memory import EnvironmentMemory, MemoryConfig
from spade_jax.spade.prompts import format_designer_output
from spade_jax.spade.reward import make_designer_reward

VALID = seed_programs.SEED_PROGRAMS[0]
BROKEN_PROGRAM = "class Environment:\n    def reset(self, seed=None):\n        return 1/0, {}\n"


class ByteTokenizer:
    """Characters as token ids: enough for the loop's prompt and decode calls."""

    eos_ids = frozenset({0})
    pad_id = 0

    def apply_chat_template(self, messages, add_generation_prompt=False, enable_thinking=True):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return [ord(c) % 50_000 + 1 for c in text]

    def encode(self, text):
        return [ord(c) + 1 for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i - 1) for i in ids if i > 0)


class ScriptedPolicy:
    """Designer outputs cycle through ``texts``; the agent 'solves' episodes with
    probability ``p_hint`` / ``p_no_hint`` depending on whether the hint was shown."""

    def __init__(self, texts, p_hint=0.9, p_no_hint=0.3):
        self.texts, self.p_hint, self.p_no_hint = texts, p_hint, p_no_hint
        self.prompts, self.episode_programs, self.updates = [], [], []
        self.rng = np.random.default_rng(0)

    def generate(self, prompts, round_index):
        self.prompts.append([list(p) for p in prompts])
        outs = [self.texts[(round_index * len(prompts) + i) % len(self.texts)] for i in range(len(prompts))]
        tokens = [ByteTokenizer().encode(t) for t in outs]
        return tokens, [[-1.0] * len(t) for t in tokens]

    def run_episodes(self, specs):
        records = []
        for spec in specs:
            hinted = isinstance(spec.env, HintedEnv)
            self.episode_programs.append(spec.env.unwrapped.source)
            obs, _ = spec.env.reset(seed=spec.seed)
            won = self.rng.random() < (self.p_hint if hinted else self.p_no_hint)
            rec = EpisodeRecord(env_id=spec.env_id, seed=spec.seed, observations=[obs])
            rec.append([1, 2, 3], policy=False)
            rec.append([4, 5], policy=True, logprobs=[-0.5, -0.7])
            rec.return_, rec.step_rewards = float(won), [float(won)]
            records.append(rec)
        return records

    def update(self, seqs):
        self.updates.append(seqs)
        return {"loss": 0.0, "sequences": float(len(seqs))}


@pytest.fixture(scope="module")
def pool():
    with EnvPool(SandboxConfig(call_deadline_s=2.0)) as p:
        yield p


def _corpus(n=40):
    return InMemoryCorpus([Document(f"doc{i}", f"text of document {i}", "test") for i in range(n)],
                          "test")


def _loop(pool, policy, config: SpadeConfig, corpus=True, seed=0):
    sampler = (CorpusSampler(_corpus(), CorpusSamplerConfig(seed=seed, documents_per_round=1))
               if corpus else None)
    return SpadeLoop(
        config, tokenizer=ByteTokenizer(), pool=pool, generate=policy.generate,
        run_episodes=policy.run_episodes, update=policy.update, corpus_sampler=sampler,
        memory=EnvironmentMemory(MemoryConfig(seed=seed)),
        reward_rule=make_designer_reward("hint_regret"), seed=seed)


TEXTS = [
    format_designer_output(VALID.source, VALID.hint),
    "I cannot write a program today.",
    format_designer_output(BROKEN_PROGRAM, "divide carefully"),
    format_designer_output(VALID.source, VALID.hint),
]
SMALL = SpadeConfig(rounds=3, envs_per_round=4, designer_group_size=2, n_hint=4, designer_delay=1,
                    docs_per_prompt=1, memory_examples=1, eval_every=0)


def test_invalid_programs_never_reach_the_agent(pool):
    policy = ScriptedPolicy(TEXTS)
    loop = _loop(pool, policy, SMALL)
    metrics = loop.run_round(0)
    assert metrics["candidates"] == 4
    assert 0 < metrics["validity_rate"] < 1
    assert set(policy.episode_programs) == {VALID.source}  # only the valid program ran
    assert BROKEN_PROGRAM not in policy.episode_programs
    assert any(k.startswith("invalid/parse_") for k in metrics)
    assert any(k.startswith("invalid/") and "parse" not in k for k in metrics)
    # invalid candidates get the penalty; designer sequences are trained (delay k=1)
    roles = [s.role for s in policy.updates[-1]]
    assert roles.count("designer") == 4 and roles.count("agent") >= 4
    for key in ("regret_raw_mean", "regret_clipped_mean", "learnable_share", "vendi_per_n",
                "reward_levels_mean", "formula_reveal_rate", "time/design", "time/update"):
        assert key in metrics, key


def test_designer_reward_reaches_designer_advantages(pool):
    # Valid env: regret > 0 (hint helps) -> higher designer reward than the invalid sample.
    policy = ScriptedPolicy(TEXTS, p_hint=1.0, p_no_hint=0.5)
    loop = _loop(pool, policy, SMALL)
    loop.run_round(0)
    designer = [s for s in policy.updates[-1] if s.role == "designer"]
    by_text = {ByteTokenizer().decode(s.token_ids[-len(ByteTokenizer().encode(t)):]): s.advantage
               for s, t in zip(designer, TEXTS[:2] * 2, strict=False)}
    assert by_text[TEXTS[0]] > by_text[TEXTS[1]]


def test_corpus_documents_never_reused(pool):
    policy = ScriptedPolicy(TEXTS)
    loop = _loop(pool, policy, SMALL)
    for r in range(3):
        loop.run_round(r)
    slots = SMALL.envs_per_round // SMALL.designer_group_size
    assert len(loop.used_doc_ids) == 3 * slots * SMALL.docs_per_prompt


def test_designer_delay_holds_designer_batches_back(pool):
    policy = ScriptedPolicy(TEXTS)
    loop = _loop(pool, policy, dataclasses.replace(SMALL, designer_delay=2))
    loop.run_round(0)
    assert all(s.role == "agent" for s in policy.updates[-1])
    loop.run_round(1)
    assert sum(s.role == "designer" for s in policy.updates[-1]) == 4  # round 0's group


def test_memory_and_corpus_state_survive_resume(pool):
    straight = ScriptedPolicy(TEXTS)
    loop = _loop(pool, straight, SMALL)
    for r in range(3):
        loop.run_round(r)

    first = ScriptedPolicy(TEXTS)
    loop_a = _loop(pool, first, SMALL)
    for r in range(2):
        loop_a.run_round(r)
    state = json.loads(json.dumps(loop_a.state_dict()))  # what a checkpoint stores
    resumed = ScriptedPolicy(TEXTS)
    resumed.rng = first.rng  # the scripted agent's own randomness continues
    loop_b = _loop(pool, resumed, SMALL)
    loop_b.load_state_dict(state)
    loop_b.run_round(2)
    # Round 2's designer prompts (corpus docs + memory examples) are identical.
    assert resumed.prompts[-1] == straight.prompts[-1]
    assert loop_b.memory.state_dict() == loop.memory.state_dict()
    assert loop_b.used_doc_ids == loop.used_doc_ids


def test_no_memory_and_no_corpus_prompts(pool):
    policy = ScriptedPolicy(TEXTS)
    loop = _loop(pool, policy, dataclasses.replace(SMALL, use_memory=False, use_corpus=False),
                 corpus=False)
    for r in range(2):
        loop.run_round(r)
    assert not loop.memory.records
    text = ByteTokenizer().decode(policy.prompts[-1][0])
    assert "text of document" not in text


ABLATIONS = {
    "spade_no_memory": {"spade.use_memory": (True, False)},
    "spade_no_corpus": {"spade.use_corpus": (True, False)},
    "spade_self_generation": {"spade.train_designer": (True, False),
                              "spade.use_memory": (True, False)},
    "spade_fixed_designer": {"spade.designer_mode": ("self", "fixed_pool"),
                             "spade.use_memory": (True, False)},
    "spade_ema_reward": {"spade.designer_reward": ("hint_regret", "ema_learning_potential")},
    "spade_two_skill": {"spade.skills": ("main", "two_skill")},
    "baseline_fixed_env_grpo": {"spade.baseline": ("none", "fixed_env_grpo")},
    "baseline_fixed_env_rlve": {"spade.baseline": ("none", "fixed_env_rlve")},
}


@pytest.mark.parametrize("name", sorted(ABLATIONS))
@pytest.mark.parametrize("base", ["qwen3_30b_a3b", "tiny"])
def test_each_ablation_changes_exactly_what_it_names(name, base):
    reference = load_experiment(base)
    variant = load_experiment(f"{name}:{base}")
    changed = diff(reference, variant)
    changed.pop("name")
    assert changed == ABLATIONS[name]
