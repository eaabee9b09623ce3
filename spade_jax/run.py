"""The run builder: builds every component of a run from an ExperimentConfig and drives
the steps.

It composes every layer (experiment configs, models, the trainer, the SPADE loop, the
export spec), so it sits with the entry points, not in ``spade/``. Kept apart from
``spade/loop.py`` (the step logic) so that the loop can be tested with a scripted policy,
and apart from ``train.py`` (flags) so a notebook can call ``run_experiment(config,
workdir)`` directly. Checkpoints hold the TrainState's arrays by name
(``checkpoint.named_arrays``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from spade_jax import distributed, sharding, storage
from spade_jax.checkpoint import CheckpointConfig, CheckpointManager
from spade_jax.envs import EnvPool
from spade_jax.envs.preflight import require_isolation
from spade_jax.experiment import (
    ExperimentConfig,
    ModelSpec,
    TokenizerSpec,
    check_chain_answer_fits,
    check_chain_hint_fits,
    check_supervised_replay,
    check_warm_start,
    config_hash,
    json_value,
    require_corpus,
    train_config_for_run,
    warm_start_programs,
)
from spade_jax.metrics import MetricsWriter, Progress, read_metrics
from spade_jax.models import Qwen3, abstract_model, load_hf, preset
from spade_jax.models.orbax_io import load_orbax
from spade_jax.preemption import Preempted, PreemptionGuard
from spade_jax.rl.batch import PackConfig
from spade_jax.rl.train_step import TrainState
from spade_jax.rl.trainer import Trainer
from spade_jax.rollout.agent_loop import EpisodeSpec, run_episodes
from spade_jax.rollout.routing import compact_routing
from spade_jax.rollout.sampler import SamplerConfig, sample
from spade_jax.seeding import Phase, derive_seed
from spade_jax.spade import seed_programs
from spade_jax.spade.config import Contract, GameSourceKind
from spade_jax.spade.corpus import CorpusSampler, CorpusSamplerConfig, JsonlCorpus, ParquetCorpus
from spade_jax.spade.default_corpus import DefaultCorpusConfig, default_corpus
from spade_jax.spade.env_stats import stated_level_span
from spade_jax.spade.game_source import FixedEnv, FixedPool, GameSource, SelfDesign
from spade_jax.spade.loop import SpadeLoop
from spade_jax.spade.memory import EnvironmentMemory, MemoryConfig
from spade_jax.spade.prompts import (
    DESIGNER_SYSTEM_PROMPT,
    format_designer_output,
    format_program_reply,
)
from spade_jax.spade.reward import make_designer_reward
from spade_jax.spade.skills import get_skill_set
from spade_jax.spade.warm_start import supervised_pairs, warm_start, without_target_chars

log = logging.getLogger(__name__)


# ---- components ------------------------------------------------------------------------
def build_tokenizer(spec: TokenizerSpec, workdir: storage.PathLike, toy: Any = None):
    """``spec.path`` when given (on every host); otherwise the sentencepiece model in
    ``workdir/tokenizer``, trained there on the first run (``spec.text="toy"``: on the toy
    world's text for the family ``toy``, the run's ``ToyConfig``, selects).

    Multi-host: the trained model depends on each host's local files (installed package
    versions), so process 0 trains or loads it and sends the model file's bytes; the other
    hosts load that copy from a local temporary directory and write nothing to ``workdir``.
    """
    from spade_jax.tokenizers import load_tokenizer

    if spec.path:
        return load_tokenizer(spec.path)
    if jax.process_count() == 1:
        return _train_or_load_tokenizer(spec, workdir, toy)
    tokenizer = _train_or_load_tokenizer(spec, workdir, toy) if distributed.is_primary() else None
    data = distributed.agree_bytes(tokenizer.model_file.read_bytes() if tokenizer else b"")
    if tokenizer is not None:
        return tokenizer
    local = Path(tempfile.mkdtemp(prefix=f"spade_tokenizer_p{jax.process_index()}_"))
    local = local / "spm.model"
    local.write_bytes(data)
    return load_tokenizer(local)


def _train_or_load_tokenizer(spec: TokenizerSpec, workdir: storage.PathLike, toy: Any = None):
    from spade_jax.tokenizers import load_tokenizer, project_text_files, train_sentencepiece

    directory = storage.as_path(workdir) / "tokenizer"
    if (directory / "spm.model").exists():
        return load_tokenizer(directory / "spm.model")
    # sentencepiece writes local files: train in a local mirror, then upload (gs:// workdir)
    mirror = storage.MirroredDir(directory)
    symbols: tuple[str, ...] = ()
    if spec.text == "toy":
        from spade_jax.toy.world import tokenizer_symbols, tokenizer_text

        toy_text = mirror.local / "toy_world.txt"
        toy_text.write_text(tokenizer_text(toy) + "\n" + _loop_prompt_text(toy))
        files = [toy_text]
        symbols = tokenizer_symbols(toy)
    else:
        # The package's own text only, not the checkout's docs/ and tests/: the same command
        # then trains the same tokenizer (and so makes the same run) from a source checkout
        # or an installed wheel, and editing a doc or a test does not change a run.
        package = Path(__file__).resolve().parent
        files = project_text_files(package) + [_seed_program_text(mirror.local)]
    log.info("training a %d-piece sentencepiece tokenizer on %d %s text files", spec.vocab_size,
             len(files), spec.text)
    tokenizer = train_sentencepiece(files, str(mirror.local / "spm"), vocab_size=spec.vocab_size,
                                    extra_symbols=symbols)
    mirror.sync()
    return tokenizer


def _loop_prompt_text(toy: Any = None) -> str:
    """The fixed prompt texts of the loop's roles (designer, hint writer, agent), the
    designer's on the toy family's skill (``toy``: the run's ``ToyConfig``)."""
    from spade_jax.spade.prompts import (
        COMPACT_REFERENCE_DESIGNER_SYSTEM_PROMPT,
        HINT_WRITER_SYSTEM_PROMPT,
        reference_designer_user_prompt,
    )
    from spade_jax.toy import chain
    from spade_jax.toy.family import SKILL

    skill = chain.SKILL if toy is not None and toy.family == "chain" else SKILL
    return "\n".join([COMPACT_REFERENCE_DESIGNER_SYSTEM_PROMPT, HINT_WRITER_SYSTEM_PROMPT,
                      reference_designer_user_prompt(skill, [], max_doc_chars=64)])


def _seed_program_text(directory: Path) -> Path:
    """The seed programs and prompts as one text file, so the tokenizer knows them well."""
    path = directory / "seed_programs.txt"
    text = "\n\n".join(format_designer_output(p.source, p.hint) for p in seed_programs.SEED_PROGRAMS)
    path.write_text(text + "\n" + DESIGNER_SYSTEM_PROMPT)
    return path


def build_model(spec: ModelSpec, tokenizer, seed: int, mesh) -> Qwen3:
    options = spec.options()  # computes in spec.dtype; master weights stay fp32
    if spec.hf_checkpoint:
        model, _ = load_hf(spec.hf_checkpoint, jnp.float32, mesh=mesh, options=options)
    elif spec.orbax_checkpoint:
        model, _ = load_orbax(spec.orbax_checkpoint, jnp.float32, mesh=mesh, options=options)
    else:
        arch = preset(spec.preset) if spec.preset else spec.architecture
        if arch is None:
            raise ValueError("model: set one of hf_checkpoint, orbax_checkpoint, preset, architecture")
        if arch.vocab_size < tokenizer.vocab_size:
            arch = arch.replace(vocab_size=tokenizer.vocab_size)
        arch = arch.replace(eos_token_id=sorted(tokenizer.eos_ids), pad_token_id=tokenizer.pad_id)
        model = Qwen3(arch, options, rngs=nnx.Rngs(seed))
    if spec.hf_checkpoint or spec.orbax_checkpoint:  # pretrained: its own tokenizer only
        check_tokenizer_matches(tokenizer, model.config,
                                spec.hf_checkpoint or spec.orbax_checkpoint)
        # The loaders build every module with fp32 options; each module keeps the dtype it
        # was built with, so re-merge the loaded (fp32 master) weights into a structure
        # built with the run's options: every layer then computes in spec.dtype.
        graphdef = nnx.graphdef(abstract_model(model.config, options))
        model = nnx.merge(graphdef, nnx.state(model))
    return model


# Rows a checkpoint's embedding may have beyond its tokenizer's ids: alignment padding
# (Qwen3: 151,936 rows for 151,669 ids; Megatron pads to 128 x tensor-parallel ways).
MAX_EMBEDDING_PADDING = 4096


def check_tokenizer_matches(tokenizer, arch, source: str) -> None:
    """Refuses a pretrained model whose tokenizer is not its own: ids the embedding lacks,
    special ids the tokenizer lacks, or far more embedding rows than tokens (e.g. the
    2,000-piece project tokenizer on a Qwen3 checkpoint)."""
    model_ids = [i for i in (arch.bos_token_id, *_as_tuple(arch.eos_token_id)) if i is not None]
    problems = []
    if tokenizer.vocab_size > arch.vocab_size:
        problems.append(f"the tokenizer has {tokenizer.vocab_size} ids but the embedding only "
                        f"{arch.vocab_size} rows")
    elif arch.vocab_size - tokenizer.vocab_size > MAX_EMBEDDING_PADDING:
        problems.append(f"the embedding has {arch.vocab_size} rows but the tokenizer only "
                        f"{tokenizer.vocab_size} ids")
    missing = [i for i in model_ids if i >= tokenizer.vocab_size]
    if missing:
        problems.append(f"the model's bos/eos ids {missing} are not in the tokenizer")
    if problems:
        raise ValueError(
            f"tokenizer does not match the checkpoint {source}: {'; '.join(problems)}. Leave "
            "tokenizer.path empty to use the checkpoint's own tokenizer.json, or point it at "
            "the tokenizer the model was trained with")


def _as_tuple(ids) -> tuple:
    return ids if isinstance(ids, tuple) else (ids,)


def build_pool(config: ExperimentConfig) -> EnvPool:
    """This host's sandbox pool, seeded per host (episode seeds stay shared: they are
    drawn by the loop from the experiment seed)."""
    return EnvPool(config.sandbox, seed=distributed.host_seed(config.seed))


def build_corpus(config: ExperimentConfig):
    paths = list(config.corpus.paths)
    if paths and all(".parquet" in p for p in paths):
        return ParquetCorpus(paths, "user_corpus")
    if paths:
        return JsonlCorpus(paths, "user_corpus")
    return default_corpus(DefaultCorpusConfig(domain=config.corpus.domain))


def build_corpus_sampler(config: ExperimentConfig, seed_offset: int = 0) -> CorpusSampler | None:
    # Built for a baseline too (designer_mode keeps its "self" default there): its cursor is
    # part of that run's state, though no document is read.
    if not config.spade.use_corpus or config.spade.game_source == GameSourceKind.FIXED_POOL:
        return None
    return CorpusSampler(build_corpus(config), CorpusSamplerConfig(
        seed=config.seed + seed_offset, documents_per_round=config.spade.docs_per_prompt,
        draws=config.spade.corpus_draws))


# ---- checkpoint helpers -----------------------------------------------------------------
def _abstract(blob_like: dict[str, Any]) -> dict[str, Any]:
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=getattr(v, "sharding", None))
            for k, v in blob_like.items()}


# ---- the loop -----------------------------------------------------------------------------
def records_routing(config: ExperimentConfig) -> bool:
    """Whether the run's samplers record MoE routing (router replay, or its telemetry)."""
    return config.train.router_replay or config.record_routing


def loop_sampling(config: ExperimentConfig, policy: Callable[[], Qwen3], tokenizer: Any,
                  mesh: Any) -> tuple[Callable, Callable]:
    """The loop's two sampling callables over the current policy: ``generate(prompts, *,
    seed, purpose)`` with the whole sampler config of the purpose (buckets, chunking,
    compaction, ``max_rows``), the loop's per-call seed and the tokenizer's end-of-turn ids
    as stop tokens (as the agent's turns), and ``run_episodes(specs, *, seed)``."""
    samplers = _loop_samplers(config)
    record = records_routing(config)  # router replay / its telemetry: samplers record
    agent = dataclasses.replace(config.agent, sampler=dataclasses.replace(
        config.agent.sampler, return_router="experts")) if record else config.agent

    def generate_fn(prompts, *, seed, purpose):
        model = policy()
        # One stop rule for both roles: the tokenizer's end-of-turn ids, as the agent loop
        # uses, not the model config's eos_token_id (a base checkpoint's <|endoftext|>,
        # past which a reply would run on after <|im_end|>).
        out = sample(model, prompts, dataclasses.replace(samplers[purpose], seed=seed,
                     return_router="experts" if record and purpose == "design" else False),
                     stop_tokens=sorted(tokenizer.eos_ids), mesh=mesh)
        routes = [None] * len(prompts)
        if out.selected_experts is not None:
            routes = [compact_routing(r, model.config.num_experts)
                      for r in out.selected_experts]
        return out.tokens, out.logprobs, routes

    def episodes_fn(specs, *, seed):
        return run_episodes(policy(), tokenizer, specs, agent, mesh=mesh, seed=seed)

    return generate_fn, episodes_fn


def build_loop(config: ExperimentConfig, *, tokenizer: Any, pool: EnvPool,
               policy: Callable[[], Qwen3], update: Callable, mesh: Any) -> SpadeLoop:
    """The SPADE loop of an experiment over the current policy and the train step."""
    spade = config.spade
    corpus_sampler = build_corpus_sampler(config)
    _check_corpus_agrees(corpus_sampler)
    generate_fn, episodes_fn = loop_sampling(config, policy, tokenizer, mesh)
    return SpadeLoop(
        spade, tokenizer=tokenizer, pool=pool, generate=generate_fn, run_episodes=episodes_fn,
        update=update, corpus_sampler=corpus_sampler,
        memory=EnvironmentMemory(MemoryConfig(capacity=spade.memory_capacity, seed=config.seed,
                                             selection=spade.memory_selection)),
        reward_rule=make_designer_reward(spade.designer_reward, spade.designer_reward_config),
        source=build_game_source(config), seed=config.seed,
        max_turns=config.agent.max_turns, rules=(config.train.agent, config.train.designer))


# ---- the run -----------------------------------------------------------------------------
def run_experiment(config: ExperimentConfig, workdir: storage.PathLike) -> None:
    """Runs (or resumes) ``config`` in ``workdir``: a local directory or ``gs://...``."""
    workdir = storage.absolute(workdir)
    require_corpus(config)  # before anything starts: the recipe refuses the stand-in
    check_warm_start(config)
    check_supervised_replay(config)
    if distributed.is_primary():  # multi-host: only process 0 writes the run's files
        (workdir / "config.json").write_text(
            json.dumps(dataclasses.asdict(config), indent=2, default=json_value))
    # SIGTERM (a preemption notice) from here on is a save request, not an exit.
    guard = PreemptionGuard.install()
    pool = build_pool(config)
    log.info("sandbox isolation: %s", pool.isolation_report().as_dict())
    if config.spade.game_source != GameSourceKind.FIXED_ENV:  # baselines run no designer-written programs
        try:
            require_isolation(pool.isolation_report(),
                              allow_weak=config.sandbox.allow_weak_isolation)
        except Exception:
            pool.close()
            raise
    tokenizer = build_tokenizer(config.tokenizer, workdir, config.toy)
    try:  # needs the tokenizer: checked here, not with the other checks above
        check_chain_hint_fits(config, tokenizer)
        check_chain_answer_fits(config, tokenizer)
    except Exception:
        pool.close()
        raise
    mesh = sharding.make_mesh(config.mesh) if jax.device_count() > 1 else None
    model = build_model(config.model, tokenizer, config.seed, mesh)
    if distributed.is_primary():  # what `python -m spade_jax.export` rebuilds the policy from
        from spade_jax.export import write_model_spec

        write_model_spec(workdir, model)
    log.info("policy: %s, %s parameters", model.config.architecture,
             f"{model.config.param_count():,}")
    trainer = Trainer(model, _with_sampler_temperatures(config), pack=_pack_config(
        config, tokenizer, model, mesh), seed=config.seed, mesh=mesh, mesh_config=config.mesh,
        routing_telemetry=records_routing(config), guard=guard)
    loop = build_loop(config, tokenizer=tokenizer, pool=pool, policy=trainer.sampling_policy,
                      update=trainer.update, mesh=trainer.sample_mesh)
    loop.supervised_examples = supervised_replay_examples(config, tokenizer, loop)

    ckpt = CheckpointManager(
        CheckpointConfig(workdir / "checkpoints", save_every_steps=config.checkpoint_every,
                         keep=config.keep_checkpoints,
                         best_metric=config.best_checkpoint_metric or None,
                         best_mode=config.best_checkpoint_mode),
        guard=guard, config_hash=config_hash(config))
    start_step = 0
    if config.warm_start.steps:  # its KL reference is the warm-started policy (below)
        trainer.expect_saved_reference()
    restored = ckpt.restore_latest(_abstract(trainer.named_arrays()))
    if restored is not None:
        trainer.restore(restored.state)
        loop.load_state_dict(restored.run_state["loop"])
        # "round": the key of checkpoints written before steps were called steps.
        done = restored.run_state.get("step", restored.run_state.get("round"))
        start_step = done + 1
        log.info("resumed from step %d", done)  # -1: the warm start
    elif config.warm_start.steps:
        trainer.state = _warm_start(config, tokenizer, trainer.graphdef, trainer.state, loop)
        # KL runs: the reference is the policy RL starts from, not the random init.
        trainer.anchor_reference()

    try:
        # Nothing to save before the first step of a fresh run without a warm start.
        saved = restored is not None or not config.warm_start.steps
        _train_steps(config, loop, ckpt, trainer, start_step, workdir,
                      evaluate=(lambda r: _toy_eval(config, loop, pool, r)) if config.toy.enabled
                      else (lambda r: _held_out_eval(config, trainer.policy(), tokenizer, r)),
                      saved=saved)
    finally:
        pool.close()
    if distributed.is_primary():  # metrics.jsonl exists on process 0 only
        from spade_jax.spade.report import write_report

        lead = ()
        if config.toy.enabled:  # the toy world's report leads with its claims' curves
            from spade_jax.toy.check import report_lead

            lead = report_lead(read_metrics(workdir), storage.as_path(workdir) / "plots")
        write_report(workdir, title=f"SPADE run: {config.name}", lead=lead)


def _pack_config(config: ExperimentConfig, tokenizer: Any, model: Qwen3, mesh: Any
                 ) -> PackConfig:
    """How a step's sequences are packed: rows a multiple of the microbatches times the
    mesh's data-parallel ways, routing kept for the MoE layers."""
    data_ways = 1 if mesh is None else int(np.prod([mesh.shape[a] for a in
                                                    ("data", "fsdp", "expert")]))
    arch = model.config
    return PackConfig(pad_id=tokenizer.pad_id,
                      batch_multiple=config.train.microbatches * data_ways,
                      moe_layers=tuple(i for i in range(arch.num_layers) if arch.is_moe_layer(i)),
                      num_layers=arch.num_layers, row_buckets=config.train.row_buckets)


def _train_steps(config: ExperimentConfig, loop: SpadeLoop, ckpt: CheckpointManager,
                 trainer: Trainer, start_step: int, workdir: Any,
                  evaluate: Callable[[int], dict[str, float]], saved: bool) -> None:
    """The steps from ``start_step`` (one update each; ``spade.rounds`` of them): held-out
    evaluation every ``eval_every``, metrics, and checkpoints (every ``checkpoint_every``,
    the last, a new best, and on preemption). ``saved``: the state before ``start_step``
    needs no save (it is in a checkpoint, or is a fresh run's initial state).

    A preemption requested inside a step, before its update, drops the step
    (``spade_jax.preemption``): the state after the previous step is saved (its loop
    state was kept as JSON when the step began) and the run stops; the resume redoes the
    step from the same seeds."""
    writer = MetricsWriter(workdir)
    progress = Progress(config.spade.rounds, start_step=start_step, every_seconds=0.0,
                        print_fn=lambda _: None)
    try:
        for step in range(start_step, config.spade.rounds):
            resume_point = None if saved else json.dumps(
                {"step": step - 1, "loop": loop.state_dict()})
            log.info("step %d started", step)
            t0 = time.perf_counter()
            try:
                with _interruptible(ckpt):
                    metrics = loop.run_step(step)
            except Preempted:
                _save_dropped_step(ckpt, step, trainer, resume_point)
                break
            if config.spade.eval_every and (step + 1) % config.spade.eval_every == 0:
                try:
                    with _interruptible(ckpt):
                        metrics.update(evaluate(step))
                except Preempted:  # the step is complete: saved below, without its eval
                    log.warning("preempted: held-out evaluation of step %d skipped", step)
            metrics["time/step"] = time.perf_counter() - t0
            writer.write_designs(step, loop.pop_design_records())  # uploaded with the metrics
            writer.write(step, metrics)
            line = progress.update(step + 1, {k: metrics[k] for k in
                                                     ("validity_rate", "regret_raw_mean") if k in metrics})
            if line:
                log.info(line)
            last = step + 1 == config.spade.rounds
            # The held-out score when evaluated this step, else None; process 0's on every
            # host, since whether to save (a collective) depends on it.
            score = distributed.agree_json(ckpt.score(metrics))
            saved = ckpt.should_save(step + 1) or last or ckpt.is_new_best(score)
            if saved:
                ckpt.save(step + 1, trainer.named_arrays(),
                          {"step": step, "loop": loop.state_dict()}, score=score)
            if ckpt.preempted:
                log.warning("preempted: checkpoint saved after step %d, exiting", step)
                break
    finally:
        ckpt.wait()
        writer.close()


def _interruptible(ckpt: CheckpointManager):
    return ckpt.guard.interruptible() if ckpt.guard is not None else contextlib.nullcontext()


def _save_dropped_step(ckpt: CheckpointManager, step: int, trainer: Trainer,
                       resume_point: str | None) -> None:
    """A preemption dropped ``step`` before its update: saves the state after the previous
    step as checkpoint ``step`` (unless it is saved already)."""
    ckpt.preempted = True
    if resume_point is None:
        log.warning("preempted during step %d: the step is dropped; nothing new to save "
                    "since the last checkpoint (or the start), exiting", step)
        return
    ckpt.save(step, trainer.named_arrays(), json.loads(resume_point))
    log.warning("preempted during step %d: the step is dropped; saved the state after "
                "step %d as checkpoint %d, exiting", step, step - 1, step)


def _check_corpus_agrees(sampler: CorpusSampler | None) -> None:
    """Multi-host: warns when this host's corpus differs from process 0's (e.g. the default
    corpus, extracted from locally installed package versions). The run stays correct, as
    the loop uses process 0's documents on every host, but the difference is worth knowing."""
    if sampler is None or jax.process_count() == 1:
        return
    primary = distributed.agree(sampler.fingerprint)
    if primary != sampler.fingerprint:
        log.warning("host %d's corpus (fingerprint %s) differs from process 0's (%s); "
                    "process 0's documents are used on every host", jax.process_index(),
                    sampler.fingerprint, primary)


def _loop_samplers(config: ExperimentConfig) -> dict[str, SamplerConfig]:
    """The loop's sampler per purpose: the designer's, and the hint writer's (the designer
    sampler at the hint temperature, token budget and, when set, top-p)."""
    designer, spade = config.designer_sampler, config.spade
    return {"design": designer,
            "hint": dataclasses.replace(designer, temperature=spade.hint_temperature,
                                        max_new_tokens=spade.hint_max_tokens,
                                        top_p=spade.hint_top_p or designer.top_p)}


def _with_sampler_temperatures(config: ExperimentConfig):
    """Each role's log-probs in training use the temperature that role sampled at, so the
    sampler's old_logp and the trainer's logp are of the same distribution. The sampler
    config is the one place for it: a role temperature set to anything else is an error."""
    def temp(sampler):
        return sampler.temperature if sampler.temperature > 0 else 1.0  # greedy: T = 1

    train = train_config_for_run(config)  # optimizer.total_steps from the run length
    roles = {"agent": (train.agent, config.agent.sampler, "agent.sampler.temperature"),
             "designer": (train.designer, config.designer_sampler,
                          "designer_sampler.temperature")}
    for name, (role, sampler, where) in roles.items():
        if role.temperature is not None and role.temperature != temp(sampler):
            raise ValueError(
                f"train.{name}.temperature={role.temperature} differs from the temperature "
                f"that role samples at ({where}={sampler.temperature}); the trainer scores "
                f"each role at its sampler's temperature: set {where} instead")
    return dataclasses.replace(
        train,
        agent=dataclasses.replace(train.agent, temperature=temp(config.agent.sampler)),
        designer=dataclasses.replace(train.designer, temperature=temp(config.designer_sampler)))


def _warm_start(config, tokenizer, graphdef, state: TrainState, loop: SpadeLoop) -> TrainState:
    """Supervised pass on (designer prompt -> seed program + hint) pairs. The prompts are
    the loop's own (`Designer.messages`: the run's contract, prompt style and skill text),
    with real corpus documents (from a sampler of its own, so the run's corpus cursor is
    untouched) or none, and no memory examples. When the policy writes the hints
    (``hint_mode="self"``), also (hint-writer prompt -> the seed program's hint) pairs, one
    per program: an untaught tiny policy often answers the hint prompt with nothing, and a
    game without a hint has no hint arm."""
    spade_cfg, ws = config.spade, config.warm_start
    if config.toy.enabled:
        seqs = _toy_warm_start_sequences(config, tokenizer, loop)
        log.info("toy warm start: %d steps on %d examples", ws.steps, len(seqs))
        return _supervised_pass(config, tokenizer, graphdef, state, seqs)
    programs = warm_start_programs(config)  # they exist and follow the run's contract
    pairs = _designer_warm_start_pairs(config, loop, programs)
    designer_pairs = len(pairs)
    if spade_cfg.policy_writes_hints:
        pairs += [(loop.designer.hint_messages(prog.source), prog.hint) for prog in programs]
    if jax.process_count() > 1:
        # The warm-start batch is global, so every host needs the same pairs, but each drew
        # its documents from its own corpus: process 0's pairs everywhere (one broadcast).
        pairs = [(messages, target) for messages, target in distributed.agree_json(pairs)]
    seqs = supervised_pairs(tokenizer, pairs)
    demos = (_tool_agent_sequences(config, tokenizer, loop.designer.pool, programs)
             if spade_cfg.contract == Contract.TOOL and ws.agent_demos else [])
    log.info("warm start: %d steps on %d designer, %d hint-writer and %d agent examples",
             ws.steps, designer_pairs, len(seqs) - designer_pairs, len(demos))
    return _supervised_pass(config, tokenizer, graphdef, state, seqs + demos)


def _designer_warm_start_pairs(config, loop: SpadeLoop, programs) -> list:
    """The warm start's (designer prompt, program reply) pairs from the seed programs:
    ``warm_start.prompts_per_program`` prompts each, the first without documents."""
    spade_cfg, ws = config.spade, config.warm_start
    # A tool designer replies with the program alone (its prompt asks for no hint).
    target = (format_program_reply if spade_cfg.contract == Contract.TOOL
              else format_designer_output)
    docs_sampler = build_corpus_sampler(config, seed_offset=7919)
    skills = [s.name for s in get_skill_set(spade_cfg.skills)]
    pairs = []
    for prog in programs:
        for variant in range(ws.prompts_per_program):
            docs = ([d.text for d in docs_sampler.sample(spade_cfg.docs_per_prompt)]
                    if docs_sampler is not None and variant > 0 else [])
            skill = skills[variant % len(skills)] if ws.vary_skills else prog.skill
            pairs.append((loop.designer.messages(skill, docs, []),
                          target(prog.source, prog.hint)))
    return pairs


def supervised_replay_examples(config: ExperimentConfig, tokenizer: Any,
                               loop: SpadeLoop) -> list:
    """What ``spade.supervised_replay`` replays: the warm start's designer examples (the toy
    world's programs across its levels, or the seed programs' pairs), as the warm start
    builds them; [] when the run replays none."""
    if not config.spade.supervised_replay:
        return []
    if config.toy.enabled:
        from spade_jax.toy import world

        pairs = world.designer_pairs(config.toy, loop.designer.messages, config.seed)
    else:
        pairs = _designer_warm_start_pairs(config, loop, warm_start_programs(config))
    if jax.process_count() > 1:  # the corpus documents are drawn per host (see _warm_start)
        pairs = [(messages, target) for messages, target in distributed.agree_json(pairs)]
    rows = supervised_pairs(tokenizer, pairs)
    if config.spade.supervised_replay_masks_level:
        rows = [_level_untrained(tokenizer, row, target)
                for row, (_, target) in zip(rows, pairs, strict=True)]
    return rows


def _level_untrained(tokenizer: Any, row: Any, target: str) -> Any:
    """A replayed row whose stated level's tokens are not trained (a target stating none
    is kept whole)."""
    span = stated_level_span(target)
    if span is None:
        return row
    # Every digit changed, so each token that spells one differs between the two texts.
    stand_in = "".join(str((int(d) + 1) % 10) for d in target[span[0]:span[1]])
    return without_target_chars(tokenizer, row, target, *span, stand_in)


def _tool_agent_sequences(config, tokenizer, pool, programs) -> list:
    """``warm_start.agent_demos`` demonstrated episodes of each tool seed program with a
    scripted solution (`spade.tool_demos`), played in the sandbox with seeds (seed, 0,
    WARM_START, program, episode) and laid out as the agent loop lays out an episode (its
    ``ChatTurns`` with the env's tools): one example per reply, its prefix the episode so
    far."""
    from spade_jax.envs import make_env
    from spade_jax.rollout.agent_loop import ChatTurns
    from spade_jax.spade.tool_demos import SOLVERS, demo_turns
    from spade_jax.spade.warm_start import supervised_sequence, turn_end_id

    agent = config.agent
    turns = ChatTurns(tokenizer, agent.system_prompt, agent.enable_thinking,
                      agent.first_turn_template, agent.observation_role)
    end = turn_end_id(tokenizer)
    out = []
    for index, prog in enumerate(p for p in programs if p.name in SOLVERS):
        for episode in range(config.warm_start.agent_demos):
            env = make_env(prog.source, pool, contract="tool", max_turns=agent.max_turns)
            try:
                tools = env.tools
                first, played = demo_turns(
                    env, SOLVERS[prog.name],
                    derive_seed(config.seed, 0, Phase.WARM_START, index, episode), agent.max_turns)
            finally:
                env.close()
            ids = turns.first_prompt(first, tools)
            for reply, observation in played:
                answer = list(tokenizer.encode(reply)) + [end]
                out.append(supervised_sequence(ids, answer))
                ids = ids + answer + turns.after_policy(observation, True)
    return out


def _toy_warm_start_sequences(config, tokenizer, loop: SpadeLoop) -> list:
    """The toy world's warm-start examples (``spade_jax.toy.world``): designer programs
    across the levels, hints, and the agent's answer format."""
    from spade_jax.toy import world

    toy = config.toy
    pairs = (world.designer_pairs(toy, loop.designer.messages, config.seed)
             + world.hint_pairs(toy, config.seed))
    return (supervised_pairs(tokenizer, pairs)
            + world.agent_sequences(toy, config.seed, tokenizer, config.agent))


def _supervised_pass(config, tokenizer, graphdef, state: TrainState, seqs) -> TrainState:
    """``warm_start.steps`` of masked NLL on ``seqs``; the state with the new params."""
    from spade_jax.spade import warm_start_cache

    ws = config.warm_start
    settings = dict(steps=ws.steps, batch_size=ws.batch_size, learning_rate=ws.learning_rate,
                    seed=config.seed, pad_id=tokenizer.pad_id, loss_mean=ws.loss_mean)
    if ws.length_buckets != 1:  # (absent at 1, so the cache entries made before it still hit)
        settings["length_buckets"] = ws.length_buckets
    key = None
    if ws.cache_dir and jax.process_count() == 1:
        key = warm_start_cache.cache_key(
            seqs, state.params, {**settings, "model": dataclasses.asdict(config.model)})
        hit = warm_start_cache.load(ws.cache_dir, key, state.params)
        if hit is not None:
            log.info("warm start loaded from the cache (%s, %s.npz): loss %.3f -> %.3f when "
                     "trained", ws.cache_dir, key[:12], hit.first_loss, hit.last_loss)
            return dataclasses.replace(
                state, params=warm_start_cache.restore_like(hit.arrays, state.params))
    elif ws.cache_dir:
        log.warning("warm_start.cache_dir is ignored by a multi-process run")
    params, losses = warm_start(graphdef, state.params, seqs, **settings)
    # Means over the first and last tenth of the steps: with length groups one step's loss
    # is of one group (a short answer's or a program's), not of the mix.
    tenth = max(1, len(losses) // 10)
    log.info("warm start loss %.3f -> %.3f (means of the first and last %d steps)",
             float(np.mean(losses[:tenth])), float(np.mean(losses[-tenth:])), tenth)
    if key is not None:
        path = warm_start_cache.save(ws.cache_dir, key, params, losses)
        log.info("warm start cached as %s", path)
    return dataclasses.replace(state, params=params)


def _toy_eval(config, loop: SpadeLoop, pool, step: int) -> dict[str, float]:
    """The toy world's held-out grid (``eval/toy/...``): fixed levels and seeds, played
    with the loop's own episode runner, never trained on."""
    from spade_jax.envs import ProgramLoadError, make_env
    from spade_jax.toy import world
    from spade_jax.toy.family import render_program

    if jax.process_count() > 1:  # every host would open every copy (the loop splits them)
        raise ValueError("the toy world's held-out grid runs in one process; run toy "
                         "experiments single-host")
    grid = world.heldout_grid(config.toy, config.seed)
    played, specs, refused = [], [], {}
    for level, rule, seed in grid:
        # A grid program can be blocklisted by the pool: the designer may write the same
        # text, and a play of it past a limit (a call timing out on an overloaded host)
        # blocklists every copy. Those episodes are left out, logged and counted; the run
        # goes on.
        try:
            env = make_env(render_program(level, rule), pool, contract="reference",
                           max_turns=config.agent.max_turns)
        except ProgramLoadError as err:
            refused[f"level {level} ({rule})"] = str(err)
            continue
        played.append((level, rule, seed))
        specs.append(EpisodeSpec(env=env, env_id=f"heldout_L{level}_{rule}", seed=seed))
    try:
        records = (loop.run_episodes(specs, seed=derive_seed(config.seed, step, Phase.EVAL))
                   if specs else [])
    finally:
        for spec in specs:
            spec.env.close()
    metrics = world.heldout_metrics(played, [float(r.return_) for r in records]) if played else {}
    if refused:
        log.warning("held-out grid at step %d: %d of %d episodes not played, their programs "
                    "refused: %s", step, len(grid) - len(played), len(grid),
                    "; ".join(f"{k}: {v}" for k, v in sorted(refused.items())))
        metrics["eval/toy/episodes_not_played"] = float(len(grid) - len(played))
    return metrics


def _held_out_eval(config, model, tokenizer, step) -> dict[str, float]:
    """The reasoning-gym suites through the same sampler as training."""
    from spade_jax.evaluation import SamplerPolicy, run_suites
    from spade_jax.evaluation.suites import EvalConfig, SuiteConfig

    spec = config.eval
    suites = [SuiteConfig(name, "reasoning_gym", max_tasks=spec.tasks_per_suite or None,
                          problems_per_task=spec.problems_per_task) for name in spec.suites]
    results = run_suites(SamplerPolicy(model, tokenizer), suites,
                         EvalConfig(samples_per_problem=spec.samples_per_problem, seed=config.seed,
                                    max_new_tokens=spec.max_new_tokens))
    return {f"eval/{k}": float(v) for k, v in results.items()}


def build_game_source(config: ExperimentConfig) -> GameSource:
    """Where the run's games come from (``spade.game_source``, from ``spade.baseline`` and
    ``spade.designer_mode``): a fixed-environment baseline, a fixed pool (``spade.pool_dir``,
    the toy world's pool, else the seed programs), or the policy's own designs."""
    spade = config.spade
    if spade.game_source == GameSourceKind.FIXED_ENV:
        from spade_jax.spade.baselines import make_baseline

        return FixedEnv(make_baseline(config))
    if spade.game_source == GameSourceKind.FIXED_POOL:
        if config.toy.enabled and not spade.pool_dir:  # the toy world's fixed pool
            from spade_jax.toy.world import fixed_pool as toy_pool

            return FixedPool(toy_pool(config.toy))
        programs = (seed_programs.load_program_pool(spade.pool_dir) if spade.pool_dir
                    else seed_programs.TOOL_SEED_PROGRAMS if spade.contract == Contract.TOOL
                    else seed_programs.SEED_PROGRAMS)
        return FixedPool([(p.source, p.hint, p.skill) for p in programs])
    return SelfDesign()
