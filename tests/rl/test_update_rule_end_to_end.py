"""Every built-in rule part, selected per role with ``--set`` on the tiny experiment,
trains: one process runs a few short updates that together use every registered name of
every part for both roles (host-side parts on scripted episodes, then the real jitted step
on a tiny model), and the same selections drive scripted SPADE rounds (the loop's groups,
forks through its rollout service, a policy judge through its sampler). And a rule from a
file outside the package trains the tiny run through the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from xla_test_flags import jax_flags

from spade_jax.experiment import load_experiment
from spade_jax.models import ModelConfig, ModelOptions, Qwen3
from spade_jax.rl.batch import PackConfig, pack_sequences
from spade_jax.rl.episodes import ScriptedRollouts, StepContext
from spade_jax.rl.train_step import init_train_state, make_train_step
from spade_jax.rl.update_rule import PARTS, Group, apply_rule
from spade_jax.rollout.records import EpisodeRecord

REPO = Path(__file__).resolve().parents[2]


def _loop_takes_rules() -> bool:
    import inspect

    from spade_jax.spade.loop import SpadeLoop

    return "rules" in inspect.signature(SpadeLoop).parameters


# The loop half of the rule work needs the window loop that hands groups to the role's rule.
needs_rule_loop = pytest.mark.skipif(not _loop_takes_rules(),
                                     reason="the SPADE loop here does not take role rules yet")
BUILT_IN = {name: reg.names() for name, _, reg in PARTS}


class CountEnv:
    """T turns; action "a" pays 1/T, anything else 0."""

    def __init__(self, turns: int):
        self.turns, self.t = turns, 0

    def reset(self, seed=None):
        self.t = 0
        return "start", {}

    def step(self, action):
        self.t += 1
        return f"t{self.t}", (1.0 / self.turns if action == "a" else 0.0), self.t >= self.turns, \
            False, {}


def episode(actions, seed) -> EpisodeRecord:
    env, rec = CountEnv(len(actions)), EpisodeRecord(env_id=f"count{len(actions)}", seed=seed)
    rec.observations.append(env.reset(seed)[0])
    rec.append([1, 2], policy=False)
    for k, action in enumerate(actions):
        start = len(rec.token_ids)
        rec.append([3 + k, 5 + (action == "a")], policy=True, logprobs=[-1.2, -0.8])
        rec.turn_spans.append((start, len(rec.token_ids)))
        rec.actions.append(action)
        observation, reward, *_ = env.step(action)
        rec.step_rewards.append(reward)
        rec.observations.append(observation)
        rec.append([2], policy=False)
    rec.return_ = float(sum(rec.step_rewards))
    return rec


GROUPS = [Group([episode(["a", "b"], 0), episode(["b", "b"], 1), episode(["a", "a"], 2)]),
          Group([episode(["a", "a"], 3), episode(["a", "a"], 4), episode(["a", "a"], 5)]),
          Group([episode(["b", "a"], 6), episode(["a", "b"], 7), episode(["b", "b"], 8)])]


def rollouts() -> ScriptedRollouts:
    def policy(observations, actions, rng):
        return "a" if rng.random() < 0.5 else "b"

    return ScriptedRollouts(lambda env_id: CountEnv(int(env_id[5:])), policy,
                            judge_reply=lambda prompt: "Step 1")


def role_sets(run: int) -> list[str]:
    """--set items giving the agent the run-th name of every part, the designer the next."""
    sets = []
    for offset, role in enumerate(("agent", "designer")):
        for part, names in BUILT_IN.items():
            sets.append(f"train.{role}.{part}={names[(run + offset) % len(names)]}")
    return sets


@pytest.mark.slow
def test_every_built_in_part_trains_per_role_when_set_on_the_tiny_experiment():
    runs = max(len(names) for names in BUILT_IN.values())
    used = {(role, part): set() for role in ("agent", "designer") for part in BUILT_IN}
    model = Qwen3(ModelConfig(architecture="Qwen3MoeForCausalLM", vocab_size=16, hidden_size=16,
                              num_layers=1, num_heads=2, num_kv_heads=2, head_dim=8,
                              intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=8), ModelOptions(), rngs=nnx.Rngs(0))
    for run in range(runs):
        # The scripted episodes carry no recorded routes: the tiny run's router replay off.
        train = load_experiment("tiny", role_sets(run) + ["train.router_replay=false"]).train
        sequences, kept = [], {}
        for role_name, role in (("agent", train.agent), ("designer", train.designer)):
            for part, _, _ in PARTS:
                used[(role_name, part)].add(getattr(role, part))
            out = apply_rule(role, GROUPS, role_name=role_name,
                             context=StepContext(rollouts(), seed_parts=(0, run), role=role_name))
            assert out.dropped_groups == ([1] if role.group_filter != "keep_all" else [])
            kept[role_name] = len(out.sequences)
            sequences += out.sequences
        graphdef, state = init_train_state(model, train)
        params0 = jax.tree.map(np.asarray, state.params)
        batch = pack_sequences(sequences, PackConfig(buckets=(16,)))
        state, metrics = make_train_step(graphdef, train)(state, batch)
        assert int(metrics["skipped"]) == 0 and np.isfinite(float(metrics["loss"]))
        for role_name in ("agent", "designer"):
            assert float(metrics[f"{role_name}/sequences"]) == kept[role_name]
        moved = jax.tree.map(lambda a, b: np.abs(np.asarray(a) - b).max(), state.params, params0)
        assert max(jax.tree.leaves(moved)) > 0, f"run {run}: no parameter changed"
        for role_name, role in (("agent", train.agent), ("designer", train.designer)):
            if role.importance_correction == "tis":
                assert 0 < float(metrics[f"{role_name}/tis/weight_mean"]) <= 2.0
            if role.importance_correction == "gmc":
                assert 0 < float(metrics[f"{role_name}/gmc/shrink_mean"]) <= 1.0
    for (role_name, part), names in used.items():
        assert names == set(BUILT_IN[part]), (role_name, part, names)


PAIRWISE_SETS = ["--set", "train.agent.advantage_estimator=pairwise",
                 "--set", "train.agent.advantage.scale=2.0"]
# One round on the project's seed programs (the fixed-pool designer: no warm start needed
# for valid games), so the agent's groups exist and reach the rule.
SHRINK = ["--set", "warm_start.steps=0", "--set", "spade.rounds=1",
          "--set", "spade.eval_every=100", "--set", "spade.designer_mode=fixed_pool",
          "--set", "spade.hint_mode=none", "--set", "agent.max_turn_tokens=8",
          "--set", "checkpoint_every=100"]


@pytest.mark.slow
@needs_rule_loop
def test_rule_from_a_file_outside_the_package_trains(tmp_path):
    """The docs' worked example, written to a file outside the package (< 60 lines), picked
    with --set, trains the tiny run (shortened)."""
    doc = (REPO / "docs" / "update_rules.md").read_text()
    code = doc.split("```python\n# examples/rules/pairwise.py\n", 1)[1].split("```", 1)[0]
    rule_file = tmp_path / "outside" / "pairwise.py"
    rule_file.parent.mkdir()
    rule_file.write_text(code)
    assert len(code.splitlines()) < 60
    # One device at LLVM -O0: a run without a warm start is mostly compiling
    # (tests/support/xla_test_flags.py).
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": jax_flags()}
    workdir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "spade_jax.train", "--experiment=tiny", f"--workdir={workdir}",
         *SHRINK, "--set", f"rule_modules=[{str(rule_file)!r}]", *PAIRWISE_SETS],
        capture_output=True, text=True, env=env, timeout=1200, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    config = json.loads((workdir / "config.json").read_text())
    assert config["train"]["agent"]["advantage_estimator"] == "pairwise"
    assert config["train"]["agent"]["advantage"] == {"scale": 2.0}
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0]
    # The rule ran on the agent's groups (its own metric) and the update trained on them.
    row = rows[0]
    assert 0.0 <= row["rule/agent/advantage/tie_frac"] <= 1.0
    assert row["rule/agent/group_filter/kept_groups"] == row["valid_envs"] >= 1
    assert row["train/agent/sequences"] == row["batch/agent"] >= 2
    assert row["train/skipped"] == 0 and np.isfinite(row["train/loss"])


@pytest.mark.slow  # 12-16 s: five pairs of scripted rounds in the sandbox
@needs_rule_loop
def test_every_built_in_part_runs_in_scripted_spade_rounds():
    """The loop hands each role's groups to that role's rule: every part's name, set with
    --set on the tiny experiment, runs in two scripted rounds (no model)."""
    import dataclasses

    from spade.test_loop import ALL_VALID, ScriptedPolicy, _loop  # tests/spade/test_loop.py

    from spade_jax.envs import EnvPool, SandboxConfig

    class TurnPolicy(ScriptedPolicy):
        """ScriptedPolicy whose episodes keep their turn span and action (one turn)."""

        def run_episodes(self, specs, *, seed):
            records = super().run_episodes(specs, seed=seed)
            for rec in records:
                rec.turn_spans, rec.actions = [(3, 5)], ["x"]
            return records

    runs = max(len(names) for names in BUILT_IN.values())
    with EnvPool(SandboxConfig(call_deadline_s=2.0)) as pool:
        for run in range(runs):
            experiment = load_experiment("tiny", role_sets(run))
            spade = dataclasses.replace(experiment.spade, contract="paper", rounds=2,
                                        eval_every=0)
            policy = TurnPolicy(ALL_VALID)
            loop = _loop(pool, policy, spade,
                         rules=(experiment.train.agent, experiment.train.designer))
            metrics = [loop.run_step(0), loop.run_step(1)]
            trained = [s for update in policy.updates for s in update]
            roles = {s.role for s in trained}
            assert "agent" in roles
            # The designer trains unless its group filter (DAPO) dropped every group: the
            # scripted designer rewards can be all-equal within a group.
            kept = sum(m.get("rule/designer/group_filter/kept_groups", 0) for m in metrics)
            assert ("designer" in roles) == (kept > 0), (run, kept)
            if experiment.train.designer.group_filter == "keep_all":
                assert "designer" in roles, run
            for role_name, role in (("agent", experiment.train.agent),
                                    ("designer", experiment.train.designer)):
                keys = {k for m in metrics for k in m if k.startswith(f"rule/{role_name}/")}
                assert f"rule/{role_name}/group_filter/kept_groups" in keys
                if role.step_credit == "crr" and role_name == "agent":
                    forks = sum(m.get("rule/agent/step_credit/forks", 0) for m in metrics)
                    assert forks > 0  # forked through the loop's rollout service
                if role.step_credit != "none" and role_name in roles:
                    assert any(isinstance(s.advantage, np.ndarray) for s in trained
                               if s.role == role_name)
