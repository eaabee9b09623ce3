"""Experiment files and command-line overrides: every experiment's docstring command runs
with --dry_run, every documented --set parses, switching a rule by name works on every
experiment, the run length sets the schedule, the tokenizer follows the checkpoint."""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
import types
from pathlib import Path

import pytest

from spade_jax import rl
from spade_jax.experiment import (
    EXPERIMENTS_DIR,
    config_hash,
    load_experiment,
    train_config_for_run,
)
from spade_jax.models import ModelConfig
from spade_jax.overrides import OverrideError, diff
from spade_jax.rl.optim import OptimizerConfig, learning_rate_schedule
from spade_jax.spade.prompts import TOOL_AGENT_SYSTEM_PROMPT

REPO = Path(__file__).resolve().parents[1]
EXPERIMENTS = sorted(p.stem for p in EXPERIMENTS_DIR.glob("*.py") if not p.stem.startswith("_"))


def docstring_commands(path: Path) -> list[list[str]]:
    """The ``python -m spade_jax.train ...`` commands of a file's docstring, as argv lists
    (backslash continuations joined, trailing ``# comments`` dropped)."""
    text = ast.get_docstring(ast.parse(path.read_text())) or ""
    text = re.sub(r"\\\n\s*", " ", text)
    commands = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("python -m spade_jax.train "):
            commands.append(shlex.split(line.split(" # ")[0])[3:])
    return commands


DRIVER = """
import contextlib, io, json, sys
from absl import flags
from spade_jax import train
results = []
for argv in json.loads(sys.argv[1]):
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["train", *argv])
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = train.main(["train"])
    results.append({"rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue()})
print(json.dumps(results))
"""


@pytest.mark.slow  # JAX subprocess
def test_every_experiment_docstring_command_dry_runs():
    """The commands reference checkpoints (/ckpt/...) and buckets that do not exist here:
    --dry_run resolves and prints the config without opening either, so the test runs the
    documented command unchanged (plus --dry_run) and checks what it would train with."""
    commands = {name: docstring_commands(EXPERIMENTS_DIR / f"{name}.py") for name in EXPERIMENTS}
    missing = [name for name, found in commands.items() if not found]
    assert not missing, f"experiments without a `python -m spade_jax.train` command: {missing}"
    argvs = [[*argv, "--dry_run"] for found in commands.values() for argv in found]
    proc = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(argvs)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for argv, result in zip(argvs, results, strict=True):
        assert result["rc"] == 0, (argv, result["stderr"])
        config = json.loads(result["stdout"])
        experiment = next(a.split("=", 1)[1] for a in argv if a.startswith("--experiment="))
        assert config["name"] == experiment.partition(":")[0]
        checkpoint = next((a.split("=", 1)[1] for a in argv if a.startswith("--hf_checkpoint=")),
                          None)
        if checkpoint:  # a real checkpoint trains with its own tokenizer
            assert config["model"]["hf_checkpoint"] == checkpoint
            assert config["tokenizer"]["path"] == checkpoint


def documented_sets() -> list[tuple[str, list[str]]]:
    """(file, [key=value, ...]) for every line with ``--set key=value`` in README.md,
    docs/*.md and the package's and experiments' Python sources (docstrings and help
    texts): the sets of one line apply together, in order (a rule file, then its rule). A
    line that names ``--experiment=NAME`` has NAME first in its list."""
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
             *sorted((REPO / "spade_jax").rglob("*.py")), *sorted(EXPERIMENTS_DIR.glob("*.py"))]
    pattern = re.compile(r"--set[=\s]+(?:'([^']*)'|\"([^\"]*)\"|([^\s`]+))")
    experiment = re.compile(r"--experiment[=\s]+([\w:]+)")
    found = []
    for path in files:
        for line in path.read_text().splitlines():
            named = experiment.search(line)
            items = [] if named is None else [named.group(1)]
            for match in pattern.finditer(line):
                item = next(g for g in match.groups() if g is not None)
                item = item.rstrip(".,;:)")
                if "=" in item and not item.endswith("=value") and "DIR" not in item:
                    items.append(item)
            if len(items) > (named is not None):
                found.append((str(path.relative_to(REPO)), items))
    return found


def test_every_documented_set_parses():
    saved = {name: dict(reg._rules) for name, reg in (
        ("advantage_estimators", rl.advantage_estimators),)}
    loaded = set(sys.modules)
    try:
        _check_documented_sets()
    finally:  # the docs load an example rule file: leave no registration behind
        rl.advantage_estimators._rules.clear()
        rl.advantage_estimators._rules.update(saved["advantage_estimators"])
        for name in set(sys.modules) - loaded:
            if name.startswith("spade_rule_file_"):
                del sys.modules[name]


def _check_documented_sets():
    found = documented_sets()
    sources = {source for source, _ in found}
    assert len(found) >= 10 and "README.md" in sources and "spade_jax/experiment.py" in sources
    failures = []
    for source, items in found:
        # A line that names its experiment is parsed against it (its overrides may be valid
        # only there); the others against tiny.
        name, items = (items[0], items[1:]) if "=" not in items[0] else ("tiny", items)
        try:
            load_experiment(name, items)
        except (OverrideError, ValueError, TypeError) as e:
            failures.append(f"{source}: --set {' --set '.join(items)}: {e}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_switching_the_policy_loss_by_name_works_on_every_experiment(name):
    base = load_experiment(name)
    for rule in rl.policy_losses.names():
        config = load_experiment(name, [f"train.agent.policy_loss={rule}",
                                        f"train.designer.policy_loss={rule}"])
        defaults = rl.policy_losses.get(rule).make_config()
        for role, before in zip(config.train.roles, base.train.roles, strict=True):
            assert role.policy_loss == rule
            # A new rule starts from its defaults; re-setting the same rule keeps its settings.
            want = before.loss if before.policy_loss == rule else defaults
            assert role.loss == want
    # A setting of the new rule given after the switch applies on top of its defaults.
    config = load_experiment(name, ["train.agent.policy_loss=gspo",
                                    "train.agent.loss.clip_eps_high=0.001"])
    assert config.train.agent.loss.clip_eps_high == 0.001


def test_recipe_experiments_set_the_recipes_update():
    for name, kl in (("qwen3_30b_a3b", 0.0), ("qwen3_4b", 0.0), ("qwen3_8b", 0.005)):
        train = load_experiment(name).train
        opt = train.optimizer
        assert (opt.learning_rate, opt.schedule, opt.warmup_steps) == (1e-6, "constant", 0)
        assert (opt.weight_decay, opt.b1, opt.b2, opt.clip_norm) == (0.1, 0.9, 0.98, 1.0)
        assert train.loss_aggregation == "pooled"
        for role in train.roles:
            assert role.policy_loss == "grpo" and role.importance_correction == "tis"
            assert role.importance.clamp == 2.0 and role.importance.clamp_low == 0.0
            cfg = role.loss
            assert (cfg.clip_eps, cfg.clip_eps_high, cfg.kl_coef) == (0.2, 0.28, kl)


def test_recipe_samplers_prefill_within_the_engines_budget():
    """The big recipes bound `sample`'s prefill (designer, agent) by the engine's budget of
    8 x 32768 tokens (docs/scale_out.md); tiny prefills in one call."""
    for name in ("qwen3_30b_a3b", "qwen3_4b", "qwen3_8b"):
        config = load_experiment(name)
        budgets = (config.designer_sampler.max_prefill_tokens,
                   config.agent.sampler.max_prefill_tokens)
        assert budgets == (8 * 32768,) * 2
    # One place for the agent's budget (its sampler's): the loop has no field of its own.
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        load_experiment("qwen3_30b_a3b", ["agent.max_prefill_tokens=4096"])
    tiny = load_experiment("tiny", ["designer_sampler.max_prefill_tokens=4096"])
    assert load_experiment("tiny").designer_sampler.max_prefill_tokens == 0
    assert tiny.designer_sampler.max_prefill_tokens == 4096
    assert tiny.agent.sampler.max_prefill_tokens == 0


@pytest.mark.parametrize("name, changes", [
    ("qwen3_4b", {"model.preset": "qwen3_4b_instruct_2507", "mesh.expert": 1,
                  "train.microbatches": 8}),
    ("qwen3_8b", {"model.preset": "qwen3_8b", "mesh.expert": 1, "train.microbatches": 8,
                  "designer_sampler.max_new_tokens": 20_000, "spade.designer_thinking": True,
                  "train.agent.loss.kl_coef": 0.005, "train.designer.loss.kl_coef": 0.005,
                  "train.pooled_min_denominator": 192}),
])
def test_the_4b_and_8b_experiments_are_small_variants_of_the_30b(name, changes):
    """Everything else (the recipe's rounds, sampling, update) comes from the 30B file."""
    changed = diff(load_experiment("qwen3_30b_a3b"), load_experiment(name))
    assert changed.pop("name") == ("qwen3_30b_a3b", name)
    assert {k: new for k, (_, new) in changed.items()} == changes


_TOOL_AGENT = {"agent.system_prompt": TOOL_AGENT_SYSTEM_PROMPT, "agent.action_format": "tool_call",
               "agent.observation_role": "tool"}


@pytest.mark.parametrize("name, base, changes", [
    # cmd/tool_use/_train_spade_blend.sh (30b): regeneration and delay 8, hints up to 2048
    # tokens, documents cut to 4000, KL 0.005; the tool contract, skills and agent.
    ("spade_tool_use_30b_a3b", "qwen3_30b_a3b", {
        **_TOOL_AGENT, "agent.first_turn_template": "{observation}",
        "train.agent.loss.kl_coef": 0.005, "train.designer.loss.kl_coef": 0.005,
        "train.pooled_min_denominator": 192, "spade.regeneration_interval": 8,
        "spade.designer_delay": 8, "spade.hint_max_tokens": 2048, "spade.skills": "tool",
        "spade.contract": "tool", "spade.max_doc_words": 4000, "corpus.domain": "tool"}),
    # cmd/tool_use/train_spade_4b.sh: 500 steps, 16 environments x 16 plays, regeneration
    # and delay 32, regret_based, 4 hint plays of hints up to 512 tokens.
    ("spade_tool_use_4b", "spade_tool_use_30b_a3b", {
        "model.preset": "qwen3_4b_instruct_2507", "mesh.expert": 1, "train.microbatches": 8,
        "train.pooled_min_denominator": 256, "spade.rounds": 500, "spade.envs_per_round": 16,
        "spade.regeneration_interval": 32, "spade.plays_per_game": 16, "spade.hint_plays": 4,
        "spade.designer_delay": 32, "spade.hint_max_tokens": 512,
        "spade.designer_reward": "regret", "spade.global_batch": 256}),
    ("tiny_tool_use", "tiny", {
        **_TOOL_AGENT, "designer_sampler.max_new_tokens": 800, "agent.max_turns": 3,
        "agent.max_turn_tokens": 80, "agent.max_episode_tokens": 1536,
        "agent.sampler.max_new_tokens": 80, "spade.skills": "tool", "spade.contract": "tool",
        "spade.eval_every": 0, "warm_start.programs": (), "warm_start.agent_demos": 1,
        "warm_start.steps": 300}),
])
def test_the_tool_experiments_are_small_variants_of_their_games_experiments(name, base, changes):
    changed = diff(load_experiment(base), load_experiment(name))
    assert changed.pop("name") == (base, name)
    assert {k: new for k, (_, new) in changed.items()} == changes


def test_total_steps_follows_the_run_length():
    assert OptimizerConfig().total_steps is None
    config = load_experiment("tiny", ["train.optimizer.schedule=cosine", "spade.rounds=7"])
    optimizer = train_config_for_run(config).optimizer
    assert optimizer.total_steps == 7
    lr = learning_rate_schedule(optimizer)
    assert float(lr(7)) == pytest.approx(optimizer.learning_rate * optimizer.end_lr_ratio)
    assert float(lr(3)) > float(lr(6))
    explicit = load_experiment("tiny", ["train.optimizer.schedule=cosine", "spade.rounds=7",
                                        "train.optimizer.total_steps=20"])
    assert train_config_for_run(explicit).optimizer.total_steps == 20
    with pytest.raises(ValueError, match="cosine schedule needs total_steps"):
        learning_rate_schedule(OptimizerConfig(schedule="cosine"))


def test_a_kl_reference_is_allowed_with_or_without_a_warm_start():
    kl = ["train.agent.loss.kl_coef=0.01"]
    assert train_config_for_run(load_experiment("tiny", kl)).agent.loss.kl_coef == 0.01
    train = train_config_for_run(load_experiment("tiny", [*kl, "warm_start.steps=0"]))
    assert train.agent.loss.kl_coef == 0.01
    train_config_for_run(load_experiment("qwen3_8b"))  # no warm start: the checkpoint is it


def test_tokenizer_defaults_to_the_checkpoints_own():
    config = load_experiment("qwen3_8b", ["model.hf_checkpoint='/ckpt/Qwen3-8B'"])
    assert config.tokenizer.path == "/ckpt/Qwen3-8B"
    explicit = load_experiment("qwen3_8b", ["model.hf_checkpoint='/ckpt/Qwen3-8B'",
                                            "tokenizer.path='/tok/other'"])
    assert explicit.tokenizer.path == "/tok/other"
    assert load_experiment("tiny").tokenizer.path == ""  # random init: the project tokenizer


def fake_tokenizer(vocab_size: int, eos: int):
    return types.SimpleNamespace(vocab_size=vocab_size, eos_ids=frozenset({eos}), pad_id=eos)


def test_a_checkpoint_refuses_a_tokenizer_that_is_not_its_own(tmp_path):
    from spade_jax.experiment import ModelSpec
    from spade_jax.run import build_model, check_tokenizer_matches

    qwen = ModelConfig(vocab_size=151936, bos_token_id=151643, eos_token_id=151645)
    check_tokenizer_matches(fake_tokenizer(151669, 151645), qwen, "qwen")  # Qwen3's own
    with pytest.raises(ValueError, match="embedding has 151936 rows but the tokenizer only 2000"):
        check_tokenizer_matches(fake_tokenizer(2000, 1), qwen, "/ckpt/Qwen3-8B")
    with pytest.raises(ValueError, match=r"bos/eos ids \[151643, 151645\] are not in the"):
        check_tokenizer_matches(fake_tokenizer(150000, 1), qwen, "/ckpt/Qwen3-8B")

    tiny_hf = pytest.importorskip("tiny_hf")
    tiny_hf.make_hf_model("dense", tmp_path / "hf")
    spec = ModelSpec(hf_checkpoint=str(tmp_path / "hf"), dtype="float32")
    with pytest.raises(ValueError, match="tokenizer does not match the checkpoint"):
        build_model(spec, fake_tokenizer(2000, 1), seed=0, mesh=None)
    model = build_model(spec, fake_tokenizer(tiny_hf.VOCAB, 1), seed=0, mesh=None)
    assert model.config.vocab_size == tiny_hf.VOCAB


def _sets_sorted(value):
    """A config dict with every set as a sorted list (the re-derivation's canonical form)."""
    if isinstance(value, dict):
        return {k: _sets_sorted(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_sets_sorted(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    return value


def test_config_hash_sorts_sets():
    """The hash is of the config with its sets sorted (a frozenset's str follows the
    process's string hashing), re-derived here without the package's helper."""
    config = load_experiment("tiny")
    assert isinstance(config.sandbox.allowed_imports, frozenset)  # what made it unstable
    canonical = json.dumps(_sets_sorted(dataclasses.asdict(config)), sort_keys=True,
                           default=str)
    assert config_hash(config) == hashlib.sha256(canonical.encode()).hexdigest()[:16]
    reordered = dataclasses.replace(config, sandbox=dataclasses.replace(
        config.sandbox, allowed_imports=frozenset(sorted(config.sandbox.allowed_imports,
                                                         reverse=True))))
    assert config_hash(reordered) == config_hash(config)
    fewer = dataclasses.replace(config, sandbox=dataclasses.replace(
        config.sandbox, allowed_imports=config.sandbox.allowed_imports - {"math"}))
    assert config_hash(fewer) != config_hash(config)


@pytest.mark.slow  # two Python subprocesses importing the package
def test_config_hash_is_the_same_under_any_pythonhashseed():
    script = ("from spade_jax.experiment import config_hash, load_experiment\n"
              "c = load_experiment('tiny')\n"
              "print(config_hash(c), str(c.sandbox.allowed_imports))\n")
    outputs = []
    for seed in ("1", "2"):
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             timeout=300, cwd=REPO,
                             env={**os.environ, "PYTHONHASHSEED": seed, "JAX_PLATFORMS": "cpu"})
        assert run.returncode == 0, run.stderr[-2000:]
        outputs.append(run.stdout.split(" ", 1))
    (hash_1, set_1), (hash_2, set_2) = outputs
    assert set_1 != set_2  # the seeds do reorder the set, so the test can tell
    assert hash_1 == hash_2 == config_hash(load_experiment("tiny"))


def test_a_warm_start_of_another_contract_than_the_run_is_refused_before_the_run():
    """The warm start answers the designer's own prompt (`Designer.messages`) with the seed
    programs, so they must follow the run's contract (the tiny run pins the paper's)."""
    from spade_jax.experiment import check_warm_start

    check_warm_start(load_experiment("tiny"))
    reference = load_experiment("tiny", ["spade.contract='reference'"])
    with pytest.raises(ValueError, match=r"warm_start.programs \[.*\] follow another contract"):
        check_warm_start(reference)
    check_warm_start(load_experiment("tiny", ["spade.contract='reference'", "warm_start.steps=0"]))
    with pytest.raises(ValueError, match=r"\['nope'\] names no seed program"):
        check_warm_start(load_experiment("tiny", ["warm_start.programs=('nope',)"]))
    # Without names, the run's contract picks the seeds; the recipe's contract has none.
    with pytest.raises(ValueError, match="no seed program follows spade.contract='reference'"):
        check_warm_start(load_experiment("tiny", ["spade.contract='reference'",
                                                  "warm_start.programs=()"]))
    with pytest.raises(ValueError, match=r"\['modular_product', 'sort_numbers'\] follow another"):
        check_warm_start(load_experiment("tiny", ["spade.contract='tool'"]))
    check_warm_start(load_experiment("tiny", ["spade.contract='tool'", "warm_start.programs=()"]))


def test_overrides_that_are_valid_only_together_apply_in_either_order():
    """A field whose check reads another (twelve levels need twelve designer weights) can
    be set on the command line: an override the configs' validation rejects waits, and the
    whole config must validate after the last one. An override invalid on its own, or a
    set that is still invalid at the end, names itself."""
    weights = "toy.designer_level_weights=" + ",".join(["1"] * 12)
    for order in (["toy.chain_max_level=12", weights], [weights, "toy.chain_max_level=12"]):
        config = load_experiment("toy", order)
        assert config.toy.chain_max_level == 12 and config.toy.designer_level_weights == (1,) * 12
        assert config == load_experiment("toy", order[::-1])
    with pytest.raises(OverrideError, match=r"override 'toy.chain_max_level=12' is invalid: "
                                            r"toy.designer_level_weights must be 12 weights"):
        load_experiment("toy", ["toy.chain_max_level=12"])
    with pytest.raises(OverrideError, match=r"override 'toy.chain_base=11' is invalid: "
                                            r"toy.chain_base must be in 3..10"):
        load_experiment("toy", [weights, "toy.chain_max_level=12", "toy.chain_base=11"])
    eleven = "toy.designer_level_weights=" + ",".join(["1"] * 11)
    with pytest.raises(OverrideError, match=f"override '{eleven}' is invalid: "
                                            r"toy.designer_level_weights must be 12 weights"):
        load_experiment("toy", ["toy.chain_max_level=12", eleven])
    with pytest.raises(OverrideError, match="unknown config field 'nope'"):
        load_experiment("toy", ["toy.chain_max_level=12", "toy.nope=1"])


def test_replay_settings_are_set_together():
    """The replay's count, its NLL weight and its level mask: one without the others is
    refused before a run starts, naming the settings."""
    from spade_jax.experiment import check_supervised_replay

    both = ["spade.supervised_replay=4", "train.supervised_coef=1.0"]
    check_supervised_replay(load_experiment("toy", both))
    check_supervised_replay(load_experiment("toy", [*both, "spade.supervised_replay_masks_level=True"]))
    for alone in (both[:1], both[1:], ["spade.supervised_replay_masks_level=True"]):
        with pytest.raises(ValueError, match="spade.supervised_replay"):
            check_supervised_replay(load_experiment("toy", alone))
