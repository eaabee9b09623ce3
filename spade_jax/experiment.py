"""An experiment = one frozen config tree, returned by ``experiments/<name>.py:get_config()``.

Each component keeps its own small dataclass (sampler, agent loop, sandbox, trainer,
SPADE); this module only composes them and finds experiment files by name. Any leaf is
overridable from the command line, e.g.
``--set spade.rounds=5 --set train.optimizer.learning_rate=1e-5``.

Defaults resolved when an experiment is loaded (so ``--dry_run`` prints them):
``tokenizer.path`` empty with ``model.hf_checkpoint`` set -> the checkpoint's directory
(its ``tokenizer.json``): a real checkpoint never trains with a stand-in tokenizer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import re
from pathlib import Path
from typing import Any

from spade_jax.envs.config import SandboxConfig
from spade_jax.models.config import ModelConfig
from spade_jax.models.qwen3 import ModelOptions
from spade_jax.overrides import apply_overrides
from spade_jax.rl.registry import load_rule_modules
from spade_jax.rl.train_step import TrainConfig
from spade_jax.rollout.agent_loop import AgentLoopConfig
from spade_jax.rollout.sampler import SamplerConfig
from spade_jax.sharding import MeshConfig
from spade_jax.spade.config import GameSourceKind, SpadeConfig
from spade_jax.spade.warm_start import LOSS_MEANS
from spade_jax.toy.world import ToyConfig

EXPERIMENTS_DIR = Path(__file__).resolve().parent.parent / "experiments"


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Which weights the policy starts from.

    Attributes:
      hf_checkpoint: Hugging Face directory (config.json + safetensors) to load.
      orbax_checkpoint: Orbax model directory (``python -m spade_jax.convert`` output).
      preset: named architecture (``spade_jax.models.PRESETS``) initialised at random.
      architecture: an explicit architecture initialised at random (tiny CPU runs).
      dtype: parameter / activation dtype of the policy ("float32" or "bfloat16").
      moe_impl: MoE dispatch, a key of ``spade_jax.models.moe.DISPATCH``, or "auto" (the
        backend's fastest, chosen when the model is built: ``ModelOptions.moe_impl``).
      remat: backward-pass recompute policy per decoder layer: False/"none", True/"full",
        "dots" or "dots_no_batch" (``spade_jax.models.qwen3.REMAT_POLICIES``).
      scan_layers: stacked layers run by ``jax.lax.scan`` (compile time independent of
        depth); needs every layer of one kind.
      attention_chunk: queries per attention-softmax block (0 = all at once).
      batch_invariant: fixed-order numerics (``ModelOptions.batch_invariant``): the
        sampler's and the trainer's log-probs agree bit for bit. Slower (no GEMMs);
        ``python -m spade_jax.train`` then also turns FMA off on XLA:CPU (exactness needs it).
    The first of hf_checkpoint, orbax_checkpoint, preset, architecture that is set wins.
    """

    hf_checkpoint: str = ""
    orbax_checkpoint: str = ""
    preset: str = ""
    architecture: ModelConfig | None = None
    dtype: str = "bfloat16"
    moe_impl: str = "auto"
    remat: bool | str = False
    scan_layers: bool = False
    attention_chunk: int = 0
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        self.options()  # a bad dtype / dispatch / remat / attention_chunk fails at load time

    def options(self) -> ModelOptions:
        """How the policy runs: compute in ``dtype``, fp32 master parameters."""
        return ModelOptions(dtype=self.dtype, param_dtype="float32", moe_impl=self.moe_impl,
                            remat=self.remat, scan_layers=self.scan_layers,
                            attention_chunk=self.attention_chunk,
                            batch_invariant=self.batch_invariant)


@dataclasses.dataclass(frozen=True)
class TokenizerSpec:
    """Tokenizer: a directory/file (tokenizer.json or sentencepiece .model), or, when empty,
    the HF checkpoint's own tokenizer if ``model.hf_checkpoint`` is set, else a sentencepiece
    model of ``vocab_size`` trained on the project's own text (random-init tiny runs)."""

    path: str = ""
    vocab_size: int = 2000
    # What a trained sentencepiece model learns from: "project" (the spade_jax package's own
    # .py/.md/.txt files and seed programs: the same in a checkout and an installed wheel,
    # whatever docs/ or tests/ hold) or "toy" (the toy world's programs and observations
    # only: small, and the same whatever else the checkout holds).
    text: str = "project"

    def __post_init__(self) -> None:
        if self.text not in ("project", "toy"):
            raise ValueError(f"tokenizer.text must be 'project' or 'toy', got {self.text!r}")


@dataclasses.dataclass(frozen=True)
class WarmStartConfig:
    """Supervised pass on the project's example environment programs before self-play, so
    a small policy's designer role emits programs that validate (0 steps = off)."""

    steps: int = 0
    batch_size: int = 8
    learning_rate: float = 3e-3
    programs: tuple[str, ...] = ()  # seed program names to use; empty = all
    prompts_per_program: int = 3  # prompt variants: one without documents, the rest with
    vary_skills: bool = False  # variants cycle through every skill, not the program's own
    # Tool contract: demonstrated episodes per tool seed program (its scripted solution,
    # played in the sandbox; `spade.tool_demos`) taught to the agent role (0 = none).
    agent_demos: int = 0
    # "token": the loss is the mean over a batch's target tokens (long programs dominate);
    # "sequence": the mean over its examples (a 6-token answer weighs as a 220-token program).
    loss_mean: str = "token"
    # Length groups of the examples (spade/warm_start.py `warm_start`): 1 pads every batch
    # to the longest example; with 2, a step's batch comes from one group (short agent
    # answers, or long programs and hint prompts), padded to that group's length.
    length_buckets: int = 1
    # A local directory that keeps warm-started weights by a hash of everything the pass
    # reads (spade/warm_start_cache.py): the runs of a sweep at one seed (an experiment and
    # its ablations, planted faults) train the warm start once. "" = no cache.
    cache_dir: str = ""

    def __post_init__(self) -> None:
        if self.loss_mean not in LOSS_MEANS:
            raise ValueError(f"warm_start.loss_mean must be one of {LOSS_MEANS}, got "
                             f"{self.loss_mean!r}")
        if self.length_buckets < 1:
            raise ValueError(f"warm_start.length_buckets must be >= 1, got "
                             f"{self.length_buckets}")
        if "://" in self.cache_dir:
            raise ValueError(f"warm_start.cache_dir must be a local directory, got "
                             f"{self.cache_dir!r}")


@dataclasses.dataclass(frozen=True)
class CorpusSpec:
    """Grounding corpus: JSONL / parquet shards (``text`` field) or the offline default.

    Attributes:
      paths: shard paths or globs (local or gs://); empty = the offline default corpus.
      domain: default-corpus domain, "game" or "tool".
      stand_in: with no ``paths``, run on the offline default corpus (a stand-in built
        from installed packages' docs). False (the recipe experiments, whose launch
        requires the corpus file): a run without ``paths`` refuses to start
        (:func:`require_corpus`).
    """

    paths: tuple[str, ...] = ()
    domain: str = "game"
    stand_in: bool = True


class CorpusMissing(ValueError):
    """The experiment needs a corpus (``corpus.stand_in=False``) and none was given, or a
    given corpus path names no file."""


def require_corpus(config: ExperimentConfig, check_paths: bool = True) -> None:
    """Refuses a run that would silently fall back to the stand-in corpus when the
    experiment asks for a real one (the recipe's launch requires its corpus file), and,
    with ``check_paths``, a run whose corpus paths or globs name no file (this lists them:
    a gs:// glob reads the bucket), before anything starts."""
    spade = config.spade
    uses_corpus = spade.use_corpus and spade.game_source == GameSourceKind.SELF_DESIGN
    if uses_corpus and check_paths and config.corpus.paths:
        from spade_jax.spade.corpus import expand_paths

        try:
            expand_paths(list(config.corpus.paths))
        except FileNotFoundError as err:
            raise CorpusMissing(f"--corpus / corpus.paths: {err}") from err
    if uses_corpus and not config.corpus.paths and not config.corpus.stand_in:
        raise CorpusMissing(
            f"experiment {config.name!r} needs its grounding corpus: pass "
            "--corpus=gs://BUCKET/corpus/*.parquet (corpus.paths: JSONL or parquet shards "
            "with a 'text' field), or --set corpus.stand_in=True to run on the offline "
            "stand-in corpus instead (not the recipe)")


@dataclasses.dataclass(frozen=True)
class EvalSpec:
    """Held-out evaluation inside training (every ``spade.eval_every`` rounds), on the
    reasoning-gym suites generated offline with a fixed seed.

    Attributes:
      suites: suite names (RG-Math, RG-Algo, RG-Cog, RG-Logic).
      tasks_per_suite: first k tasks of each suite in sorted order (0 = all).
      problems_per_task: items per task.
      samples_per_problem: n for pass@1.
      max_new_tokens: answer budget.
    """

    suites: tuple[str, ...] = ("RG-Math", "RG-Algo", "RG-Cog", "RG-Logic")
    tasks_per_suite: int = 0
    problems_per_task: int = 10
    samples_per_problem: int = 4
    max_new_tokens: int = 1024


@dataclasses.dataclass(frozen=True)
class BaselineSpec:
    """Training tasks of the fixed-environment baselines (``spade.baseline``).

    The baselines train on reasoning-gym tasks, and the held-out evaluation runs
    reasoning-gym suites (RG-Math, RG-Algo, RG-Cog, RG-Logic), so the two must not share a
    task. Empty ``train_categories`` and ``train_tasks`` = every reasoning-gym category that
    no evaluation suite uses (disjoint by construction); a set that overlaps an evaluation
    suite is refused with the overlapping tasks named (``spade.baselines``).

    Attributes:
      train_categories: reasoning-gym categories (subpackages: "games", "graphs", ...).
      train_tasks: individual reasoning-gym task names, added to the categories' tasks.
    """

    train_categories: tuple[str, ...] = ()
    train_tasks: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    """Everything one run needs."""

    name: str
    seed: int = 0
    model: ModelSpec = dataclasses.field(default_factory=ModelSpec)
    tokenizer: TokenizerSpec = dataclasses.field(default_factory=TokenizerSpec)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    designer_sampler: SamplerConfig = dataclasses.field(
        default_factory=lambda: SamplerConfig(max_new_tokens=2048, temperature=1.0))
    agent: AgentLoopConfig = dataclasses.field(default_factory=AgentLoopConfig)
    sandbox: SandboxConfig = dataclasses.field(default_factory=SandboxConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    spade: SpadeConfig = dataclasses.field(default_factory=SpadeConfig)
    warm_start: WarmStartConfig = dataclasses.field(default_factory=WarmStartConfig)
    corpus: CorpusSpec = dataclasses.field(default_factory=CorpusSpec)
    eval: EvalSpec = dataclasses.field(default_factory=EvalSpec)
    baseline: BaselineSpec = dataclasses.field(default_factory=BaselineSpec)
    toy: ToyConfig = dataclasses.field(default_factory=ToyConfig)
    checkpoint_every: int = 10
    keep_checkpoints: int = 3
    # Kept besides the newest keep_checkpoints: the step with the best value of this logged
    # metric (the held-out eval's mean over suites; "" = keep the newest only).
    best_checkpoint_metric: str = "eval/mean/pass@1"
    best_checkpoint_mode: str = "max"  # "max" or "min"
    # Record MoE routing and log the replay telemetry (replay/<role>/...) even with
    # train.router_replay off: the replay-off control of docs/trainer.md. router_replay=True
    # always records (it needs the routes).
    record_routing: bool = False
    rule_modules: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # Rules defined outside the package register on import; done here so that the
        # role configs set after rule_modules (on the command line too) can name them.
        load_rule_modules(self.rule_modules)


def check_warm_start(config: ExperimentConfig) -> None:
    """Refuses a warm start that would teach the designer programs of another contract
    than the one its prompt asks for (the seed programs follow the paper's or the tool
    contract; a run with ``spade.contract='reference'`` has none, so it needs
    ``warm_start.steps=0``), and a chain-games run whose ``spade.hint_pattern`` rejects
    the hint of its own base (``check_chain_hint_pattern``)."""
    ws, spade = config.warm_start, config.spade
    if config.toy.enabled:
        check_chain_hint_pattern(config)
        return
    if ws.steps == 0 or spade.game_source != GameSourceKind.SELF_DESIGN:
        return
    warm_start_programs(config)


def check_supervised_replay(config: ExperimentConfig) -> None:
    """``spade.supervised_replay`` (examples replayed a step) and ``train.supervised_coef``
    (their NLL term's weight) work together: one without the other would replay rows
    that train nothing, or weigh a term that has no rows. So does
    ``spade.supervised_replay_masks_level`` with the replay."""
    replay, coef = config.spade.supervised_replay, config.train.supervised_coef
    if bool(replay) != bool(coef > 0):
        raise ValueError(
            f"spade.supervised_replay={replay} and train.supervised_coef={coef}: set both "
            "(examples replayed per update and their NLL term's weight) or neither")
    if config.spade.supervised_replay_masks_level and not replay:
        raise ValueError("spade.supervised_replay_masks_level=True masks the level of replayed "
                         "rows, but spade.supervised_replay=0 replays none: set both or neither")


def _own_chain_hint(config: ExperimentConfig) -> str | None:
    """The hint of a chain-games run's own games, the one its policy's hint writer should
    produce (what ``check_chain_hint_pattern`` / ``check_chain_hint_fits`` test); None when
    the run has no such writer (not chain games, or the policy writes no hints)."""
    toy = config.toy
    if not toy.enabled or toy.family != "chain" or not config.spade.policy_writes_hints:
        return None
    from spade_jax.toy import chain

    return chain.hint_for(toy.chain_base, toy.chain_hint_form)


def check_chain_hint_pattern(config: ExperimentConfig) -> None:
    """A chain-games run whose policy writes the hints keeps only hints matching
    ``spade.hint_pattern``; ``chain:hint`` and ``toy`` set it for base 5. Run with another
    ``toy.chain_base`` and that pattern, every hint of the base's table is rejected and no
    game has a hint arm, silently (hints_written 0, regret minus the no-hint return): a
    ValueError instead, naming the pattern the base needs."""
    from spade_jax.toy import chain

    toy, spade, hint = config.toy, config.spade, _own_chain_hint(config)
    if hint is None or not spade.hint_pattern:
        return
    if re.fullmatch(spade.hint_pattern, hint) is None:
        wanted = (f"spade.hint_pattern=r'{chain.pairs_hint_pattern(toy.chain_base)}' "
                  "(quoted, in --set)" if toy.chain_hint_form == "pairs"
                  else "a pattern that matches it")
        raise ValueError(
            f"spade.hint_pattern {spade.hint_pattern!r} rejects the hint of the run's own "
            f"games (toy.chain_base={toy.chain_base}, toy.chain_hint_form="
            f"{toy.chain_hint_form!r}: {hint!r}), so no game would get a hint arm; "
            f"set {wanted}")


class ConfigProblemAtStart(ValueError):
    """A config problem found only once a run has built something it needs (the
    tokenizer): ``python -m spade_jax.train`` prints it as one error line, exit 2."""


def check_chain_hint_fits(config: ExperimentConfig, tokenizer: Any) -> None:
    """The other half of ``check_chain_hint_pattern``, once the run's tokenizer exists: the
    hint of the run's own games, with the token that ends the reply, must fit the hint
    writer's ``spade.hint_max_tokens``, or every hint is cut short and rejected (base 5's
    table is 13 tokens under the toy tokenizer, base 7's 17: ``chain:hint`` sets 16).
    ConfigProblemAtStart naming the budget needed."""
    spade, hint = config.spade, _own_chain_hint(config)
    if hint is None:
        return
    needed = len(tokenizer.encode(hint)) + 1  # the turn's end token
    if needed > spade.hint_max_tokens:
        raise ConfigProblemAtStart(
            f"spade.hint_max_tokens={spade.hint_max_tokens} is shorter than the hint of the "
            f"run's own games with its end token ({needed} tokens for {hint!r}, "
            f"toy.chain_base={config.toy.chain_base}): every hint would be cut short and none "
            f"used; set spade.hint_max_tokens={needed} or more")


def check_chain_answer_fits(config: ExperimentConfig, tokenizer: Any) -> None:
    """A chain-games run's agent must be able to write the longest answer of its family
    (``toy.chain_max_level`` digits, with the turn's end token) within
    ``agent.sampler.max_new_tokens``, or every game at the top levels is cut short and
    scores as a wrong answer (base 5 under the toy tokenizer: 22 tokens at level 9 and 28 at
    12 spaced, 17 at 12 unspaced as ``toy`` writes them; ``chain:hint`` sets 24).
    ConfigProblemAtStart naming the budget needed."""
    from spade_jax.toy import chain

    toy = config.toy
    if not toy.enabled or toy.family != "chain":
        return
    answer = chain.answer_text(chain.target(toy.chain_base - 1, toy.chain_max_level,
                                            toy.chain_base), toy.chain_separator)
    needed = len(tokenizer.encode(answer)) + 1  # the turn's end token
    budget = config.agent.sampler.max_new_tokens
    if needed > budget:
        raise ConfigProblemAtStart(
            f"agent.sampler.max_new_tokens={budget} is shorter than the longest answer of the "
            f"run's games with its end token ({needed} tokens for {answer!r}, "
            f"toy.chain_max_level={toy.chain_max_level}): those answers would be cut short "
            f"and score as wrong; set agent.sampler.max_new_tokens={needed} or more")


def warm_start_programs(config: ExperimentConfig) -> list[Any]:
    """The seed programs the warm start teaches (`spade.seed_programs`): those named in
    ``warm_start.programs``, or every seed program of the run's contract; each must follow
    that contract (ValueError naming the programs otherwise)."""
    from spade_jax.spade import seed_programs

    ws, contract = config.warm_start, config.spade.contract
    every = seed_programs.SEED_PROGRAMS + seed_programs.TOOL_SEED_PROGRAMS
    if ws.programs:
        programs = [p for p in every if p.name in ws.programs]
        unknown = sorted(set(ws.programs) - {p.name for p in programs})
        if unknown:
            raise ValueError(f"warm_start.programs {unknown} names no seed program; "
                             f"known: {[p.name for p in every]}")
    else:
        programs = [p for p in every if p.contract == contract]
        if not programs:
            raise ValueError(f"no seed program follows spade.contract={contract.value!r}: "
                             f"set warm_start.steps=0 (the warm start teaches the designer "
                             f"to answer the run's own prompt with seed programs)")
    wrong = [p.name for p in programs if p.contract != contract]
    if wrong:
        raise ValueError(
            f"warm_start.programs {wrong} follow another contract than spade.contract="
            f"{contract.value!r}: the warm start teaches the designer to answer the "
            f"run's own prompt with them (set warm_start.steps=0, or choose programs of "
            f"that contract)")
    return programs


def experiment_path(name: str) -> Path:
    path = Path(name)
    if path.suffix == ".py" and path.exists():
        return path
    path = EXPERIMENTS_DIR / f"{name}.py"
    if not path.exists():
        known = sorted(p.stem for p in EXPERIMENTS_DIR.glob("*.py") if not p.stem.startswith("_"))
        raise FileNotFoundError(f"unknown experiment {name!r}; known: {known}")
    return path


def load_experiment(name: str, overrides: tuple[str, ...] | list[str] = ()) -> ExperimentConfig:
    """Imports ``experiments/<name>.py`` (or a path), calls ``get_config()``, applies overrides.

    ``name:arg`` passes ``arg`` to ``get_config`` (big_vision style), e.g.
    ``spade_no_memory:tiny`` is the no-memory ablation of the tiny experiment.
    """
    name, _, arg = name.partition(":")
    path = experiment_path(name)
    spec = importlib.util.spec_from_file_location(f"spade_experiment_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise AttributeError(f"{path} defines no get_config()")
    config = module.get_config(arg) if arg else module.get_config()
    if not isinstance(config, ExperimentConfig):
        raise TypeError(f"{path}: get_config() returned {type(config).__name__}, not ExperimentConfig")
    return with_resolved_defaults(apply_overrides(config, list(overrides)))


def with_resolved_defaults(config: ExperimentConfig) -> ExperimentConfig:
    """Fills the defaults that depend on other fields (module docstring)."""
    if not config.tokenizer.path and config.model.hf_checkpoint:
        tokenizer = dataclasses.replace(config.tokenizer, path=config.model.hf_checkpoint)
        config = dataclasses.replace(config, tokenizer=tokenizer)
    return config


def train_config_for_run(config: ExperimentConfig) -> TrainConfig:
    """``config.train`` as the run builds it: ``optimizer.total_steps`` left None becomes
    the run's number of updates (one per SPADE round, ``spade.rounds``).

    A KL term with a warm start is allowed: its reference is the warm-started policy (the
    policy RL starts from), which the run's checkpoints then carry
    (``Trainer.anchor_reference``)."""
    optimizer = config.train.optimizer.for_run(config.spade.rounds)
    return dataclasses.replace(config.train, optimizer=optimizer)


def ablation(base: str, name: str, **changes: object) -> ExperimentConfig:
    """``base`` experiment with dotted-path ``changes`` (e.g. ``spade__use_memory=False``)."""
    config = load_experiment(base)
    items = [f"{k.replace('__', '.')}={v!r}" for k, v in changes.items()]
    return dataclasses.replace(with_resolved_defaults(apply_overrides(config, items)), name=name)


def json_value(obj: object) -> object:
    """``json.dumps``'s ``default`` for configs: sets as sorted lists (a set's iteration
    order, and so its ``str``, changes with ``PYTHONHASHSEED``), anything else as ``str``."""
    if isinstance(obj, (set, frozenset)):
        return sorted(obj, key=lambda item: json.dumps(item, sort_keys=True, default=json_value))
    return str(obj)


def config_hash(config: ExperimentConfig) -> str:
    """Short stable digest of a resolved config (checkpoints warn when it changes); the
    same in every process, whatever its ``PYTHONHASHSEED``."""
    blob = json.dumps(dataclasses.asdict(config), sort_keys=True, default=json_value)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
