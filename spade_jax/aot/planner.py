"""The plan: the experiment's train step, sampler prefill and one decode step lowered with
``jax.ShapeDtypeStruct`` inputs that carry the experiment's ``NamedSharding``s, compiled by
the TPU compiler for a topology's abstract devices, and measured per chip. Nothing is
allocated. The programs come from the public lowering entries of the trainer
(``rl.train_step.TrainStep.lower``) and the sampler (``rollout.sampler.lower_prefill`` /
``lower_decode_step``): the planner compiles exactly what a run executes.

Peak bytes of a program = argument + output - aliased (donated) + temp. While the sampler
runs, the Adam moments stay resident on the chip (the sampler reads the master params), so
they are added to the sampler programs' peaks; with a decode layout the sampler (prefill and
decode) reads its own copy of the parameters, and the trainer's are resident too.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from spade_jax.aot.cost import (
    Parallelism,
    analytic_cost,
    matmul_params,
    parallelism,
    reshard_bytes,
)
from spade_jax.aot.rl_step import EpisodeShape, RlStepEstimate, estimate_rl_step
from spade_jax.aot.topology import Topology, parse_topology, topology_devices


@dataclasses.dataclass(frozen=True)
class AotConfig:
    """What to compile.

    Attributes:
      experiment: experiment name (experiments/<name>.py) or path, ``name:arg`` allowed.
      topology: slice name, e.g. "v5p-64", "v4-8", "v5e-16", "v6e-8".
      overrides: ``section.field=value`` config overrides (as ``--set`` of the trainer).
      train_batch: global train rows B (0 = microbatches x data-parallel ways, i.e. one
        sequence per data-parallel chip per microbatch).
      seq_len: train sequence length T (0 = the agent's ``max_episode_tokens``).
      sample_batch: sampler rows (0 = agent episodes of a regeneration round = envs_per_round
        x (plays_per_game + hint_plays), at most the agent sampler's ``max_rows``), rounded up
        to the batch shards of the mesh each sampler program runs on.
      prompt_len: prefill length (0 = next power of two >= max_episode_tokens -
        max_turn_tokens, the last turn's prompt).
      new_tokens: decode buffer (0 = the agent sampler's ``max_new_tokens``).
      hbm_fraction: a program fits when its peak is at most this share of HBM.
      programs: which programs to compile, from "train", "prefill", "decode".
      decode_layouts: the sampler weight layouts to compile the prefill and the decode
        step for (``MeshConfig.decode_layout`` values): "train" is the trainer's FSDP layout
        (the programs named "prefill" and "decode"), any other gives programs
        "prefill:<layout>" and "decode:<layout>" on its decode mesh reading the sampler's
        copy of the weights, the decode step with the per-step cost of resharding the
        weights to it.
      episodes: the assumed shape of a step's episodes for the RL step estimate
        (:mod:`~spade_jax.aot.rl_step`).
    """

    experiment: str
    topology: str
    overrides: tuple[str, ...] = ()
    train_batch: int = 0
    seq_len: int = 0
    sample_batch: int = 0
    prompt_len: int = 0
    new_tokens: int = 0
    hbm_fraction: float = 0.85
    programs: tuple[str, ...] = ("train", "prefill", "decode")
    decode_layouts: tuple[str, ...] = ("train", "auto")
    episodes: EpisodeShape = EpisodeShape()

    def __post_init__(self) -> None:
        parse_topology(self.topology)
        for name in ("train_batch", "seq_len", "sample_batch", "prompt_len", "new_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 = derived), got {getattr(self, name)}")
        if not 0 < self.hbm_fraction <= 1:
            raise ValueError(f"hbm_fraction must be in (0, 1], got {self.hbm_fraction}")
        unknown = set(self.programs) - {"train", "prefill", "decode"}
        if unknown or not self.programs:
            raise ValueError(f"programs must be a non-empty subset of train/prefill/decode, "
                             f"got {self.programs}")
        from spade_jax.sharding import DECODE_LAYOUTS  # (imports jax: the CLI chose by now)

        bad = set(self.decode_layouts) - set(DECODE_LAYOUTS)
        if bad or not self.decode_layouts:
            raise ValueError(f"decode_layouts must be a non-empty subset of {DECODE_LAYOUTS}, "
                             f"got {self.decode_layouts}")


@dataclasses.dataclass(frozen=True)
class ProgramCost:
    """One compiled program, per chip (XLA's memory_analysis / cost_analysis)."""

    name: str
    shape: str
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    resident_bytes: int  # other state live on the chip meanwhile (Adam moments)
    flops: float
    bytes_accessed: float
    xla_optimal_seconds: float  # XLA's own estimate; negative when it has none (loops)
    tokens: int  # tokens processed per call, whole slice
    model_flops: float  # 6 (train) or 2 (sampler) x N_active x tokens, whole slice
    compile_seconds: float
    # Analytic counts (see ``analytic_cost``): XLA's cost analysis counts the body of a loop
    # once, and the layers, microbatches and attention blocks are all loops.
    hardware_flops: float = 0.0  # whole slice, recomputation included
    hbm_traffic: float = 0.0  # bytes per chip, a lower bound
    ici_traffic: float = 0.0  # bytes per chip received over ICI (collectives), a lower bound
    # The program's own mesh when it is not the plan's (a decode layout), and the bytes per
    # chip moved over ICI once per step to reshard the trained weights onto it.
    mesh_shape: dict[str, int] | None = None
    reshard_bytes: float = 0.0  # analytic (``cost.reshard_bytes``)
    reshard_hlo_bytes: float = 0.0  # the compiled reshard's collectives (``aot.hlo``)
    # Bytes per parameter of the weights the program reads: the master dtype's itemsize, or
    # the decode copy's (``MeshConfig.decode_param_dtype``). 0: a plan written before.
    param_itemsize: float = 0.0
    # Result bytes per chip of the compiled HLO's collectives by kind (``aot.hlo``: each
    # loop body counted once): which collectives the program issues.
    collectives: dict[str, int] | None = None

    @property
    def peak_bytes(self) -> int:
        return (self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes
                + self.resident_bytes)


@dataclasses.dataclass(frozen=True)
class Plan:
    experiment: str
    topology: Topology
    mesh_shape: dict[str, int]
    params: int
    active_params: int
    hbm_fraction: float
    programs: tuple[ProgramCost, ...]
    rl_steps: tuple[RlStepEstimate, ...] = ()

    def fits(self, program: ProgramCost) -> bool:
        return program.peak_bytes <= self.hbm_fraction * self.topology.chip.hbm_bytes

    def seconds(self, program: ProgramCost) -> float:
        """Roofline step time: max(FLOPs / peak, HBM bytes / HBM bandwidth, ICI bytes / ICI
        bandwidth) per chip from the analytic counts, i.e. perfect overlap of compute, memory
        and communication: a lower bound on the step time, so MFU is an upper bound. Plans
        written before the analytic counts existed fall back to XLA's (per-loop-trip) ones."""
        chip = self.topology.chip
        if program.hardware_flops:
            return max(program.hardware_flops / self.topology.chips / chip.peak_flops,
                       program.hbm_traffic / chip.hbm_bandwidth,
                       program.ici_traffic / chip.ici_bandwidth)
        return max(program.flops / chip.peak_flops, program.bytes_accessed / chip.hbm_bandwidth)

    def bound(self, program: ProgramCost) -> str:
        """Which roofline term sets :meth:`seconds`: "compute", "HBM" or "ICI"."""
        chip = self.topology.chip
        terms = {"compute": program.hardware_flops / self.topology.chips / chip.peak_flops,
                 "HBM": program.hbm_traffic / chip.hbm_bandwidth,
                 "ICI": program.ici_traffic / chip.ici_bandwidth}
        return max(terms, key=terms.get)

    def mfu(self, program: ProgramCost) -> float:
        peak = self.topology.chips * self.topology.chip.peak_flops * self.seconds(program)
        return program.model_flops / peak if peak > 0 else float("nan")

    def reshard_seconds(self, program: ProgramCost) -> float:
        """Seconds on ICI to reshard the trained weights to the program's layout, per step."""
        return program.reshard_bytes / self.topology.chip.ici_bandwidth

    def tokens_per_second_per_chip(self, program: ProgramCost) -> float:
        seconds = self.seconds(program)
        return program.tokens / seconds / self.topology.chips if seconds > 0 else float("nan")


def _sds(abstract: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs carrying ``shardings`` (a tree whose leaves may sit at nnx Variables)."""
    import jax
    from flax import nnx

    def one(sharding, value):
        def leaf(x):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

        return jax.tree.map(leaf, value)

    return jax.tree.map(one, shardings, abstract,
                        is_leaf=lambda x: isinstance(x, nnx.Variable))


def _bytes_per_chip(tree: Any) -> int:
    """Bytes of one chip's shard of every ShapeDtypeStruct in ``tree``."""
    import jax

    total = 0
    for x in jax.tree.leaves(tree):
        shard = x.sharding.shard_shape(x.shape)
        total += int(np.prod(shard)) * np.dtype(x.dtype).itemsize
    return total


def _program(name: str, shape: str, compiled, seconds: float, *, resident: int, tokens: int,
             model_flops: float, **analytic: float) -> ProgramCost:
    from spade_jax.aot.hlo import collective_bytes

    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    return ProgramCost(
        name=name, shape=shape,
        argument_bytes=int(memory.argument_size_in_bytes),
        output_bytes=int(memory.output_size_in_bytes),
        alias_bytes=int(memory.alias_size_in_bytes),
        temp_bytes=int(memory.temp_size_in_bytes),
        resident_bytes=resident,
        flops=float(cost.get("flops", 0.0)),
        bytes_accessed=float(cost.get("bytes accessed", 0.0)),
        xla_optimal_seconds=float(cost.get("optimal_seconds", -1.0)),
        tokens=tokens, model_flops=model_flops, compile_seconds=seconds,
        collectives=collective_bytes(compiled.as_text()), **analytic,
    )


def _timed_compile(lowered, name: str) -> tuple[Any, float]:
    start = time.time()
    compiled = lowered.compile()
    seconds = time.time() - start
    print(f"[aot] compiled {name} in {seconds:.0f} s", file=sys.stderr, flush=True)
    return compiled, seconds


@dataclasses.dataclass(frozen=True)
class _Setting:
    """What every program of one plan shares: the experiment on the slice's mesh."""

    experiment: Any
    arch: Any  # ModelConfig
    options: Any  # ModelOptions
    mesh: Any
    rules: Any
    train: Any  # TrainConfig
    graphdef: Any  # the training model (remat as configured)
    sample_graphdef: Any  # the sampling model (no remat)
    state: Any  # abstract TrainState with its shardings
    moments_bytes: int  # Adam moments per chip, resident while the sampler runs
    par: Parallelism
    param_itemsize: int  # the master parameters' (the sampler reads them too)
    # The decode copy's cast (``sharding.cast_for_decode``): the compute dtype, or None
    # with ``mesh.decode_param_dtype="master"``.
    decode_dtype: Any


def _setting(config: AotConfig, devices: Sequence | None) -> _Setting:
    """Loads the experiment and builds its abstract train state on the slice's mesh."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from spade_jax import sharding
    from spade_jax.experiment import load_experiment, train_config_for_run
    from spade_jax.models import abstract_model, preset
    from spade_jax.rl.optim import MASTER_DTYPES, make_optimizer
    from spade_jax.rl.train_step import TrainState
    from spade_jax.rl.trainer import decode_cast_dtype

    topology = parse_topology(config.topology)
    experiment = load_experiment(config.experiment, list(config.overrides))
    devices = list(devices) if devices is not None else topology_devices(topology)
    mesh = sharding.make_mesh(experiment.mesh, devices)
    rules = sharding.DEFAULT_RULES  # what the run builder (spade_jax/run.py) trains with
    spec = experiment.model
    arch = preset(spec.preset) if spec.preset else spec.architecture
    if arch is None:
        raise ValueError(f"{experiment.name}: the plan needs model.preset or "
                         "model.architecture (a checkpoint's shape is not read here)")
    options = spec.options()
    graphdef, abstract_params = nnx.split(abstract_model(arch, options))
    # The sampler never differentiates, so remat changes nothing in its programs (and
    # nnx.remat around a layer that writes the KV cache does not trace).
    sample_graphdef, _ = nnx.split(abstract_model(arch, dataclasses.replace(options, remat=False)))
    train = train_config_for_run(experiment)
    master = MASTER_DTYPES[train.optimizer.master_dtype]
    optimizer = make_optimizer(train.optimizer)

    def fresh(params):
        params = jax.tree.map(lambda p: p.astype(master), params)
        return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params),
                          jax.random.PRNGKey(0))

    state_abstract = jax.eval_shape(fresh, abstract_params)
    state = _sds(state_abstract, sharding.tree_shardings(state_abstract, mesh, rules))
    return _Setting(
        experiment=experiment, arch=arch, options=options, mesh=mesh, rules=rules, train=train,
        graphdef=graphdef, sample_graphdef=sample_graphdef, state=state,
        moments_bytes=_bytes_per_chip(state.opt_state),
        par=parallelism(dict(mesh.shape), len(devices), rules),
        param_itemsize=np.dtype(master).itemsize,
        decode_dtype=decode_cast_dtype(nnx.merge(graphdef, abstract_params),
                                       experiment.mesh))


def _train_program(config: AotConfig, s: _Setting) -> ProgramCost:
    """The train step on a batch of B rows x T tokens, split over the data-parallel ways."""
    import jax
    import jax.numpy as jnp

    from spade_jax import sharding
    from spade_jax.rl.batch import TrainBatch
    from spade_jax.rl.train_step import make_train_step

    train, data_ways = s.train, s.par.batch
    b = config.train_batch or train.microbatches * data_ways
    t = config.seq_len or s.experiment.agent.max_episode_tokens
    if b % (train.microbatches * data_ways):
        raise ValueError(f"train_batch {b} must be a multiple of microbatches x data ways "
                         f"= {train.microbatches} x {data_ways}")
    rows = sharding.named_sharding(("batch",), s.mesh, s.rules)
    rows2 = sharding.named_sharding(("batch", None), s.mesh, s.rules)

    def abstract(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=rows2 if len(shape) == 2 else rows)

    batch = TrainBatch(
        input_ids=abstract((b, t), jnp.int32), loss_mask=abstract((b, t), jnp.float32),
        old_logp=abstract((b, t), jnp.float32), advantages=abstract((b,), jnp.float32),
        role_id=abstract((b,), jnp.int32), attention_mask=abstract((b, t), jnp.int32),
        routing_replay=_replay_input(s, b, t) if train.router_replay else None)
    step = make_train_step(s.graphdef, train, s.mesh, s.rules)
    compiled, seconds = _timed_compile(step.lower(s.state, batch), "train")
    # The TPU compiler's cost analysis counts every trip of the microbatch scan (checked:
    # M=1 and M=4 report the same FLOPs for the same batch).
    shape = f"B={b} T={t} M={train.microbatches}"
    shape += _replay_note(s) if train.router_replay else ""
    return _program(
        "train", shape, compiled, seconds, resident=0,
        tokens=b * t, **analytic_cost("train", s.arch, s.options, s.par, rows=b, length=t,
                                      keys=t, microbatches=train.microbatches,
                                      param_itemsize=s.param_itemsize))


def _replay_input(s: _Setting, b: int, t: int) -> tuple:
    """Router replay's train-step input: per MoE layer the [B, T, X] int32 recorded experts."""
    import jax
    import jax.numpy as jnp

    from spade_jax import sharding

    rows3 = sharding.named_sharding(("batch", None, None), s.mesh, s.rules)
    return tuple(jax.ShapeDtypeStruct((b, t, s.arch.num_experts_per_tok), jnp.int32,
                                      sharding=rows3) if s.arch.is_moe_layer(i) else None
                 for i in range(s.arch.num_layers))


def _recorded_bytes_per_token(s: _Setting) -> tuple[int, int]:
    """(MoE layers, bytes per token of a routing recording in the compact dtype)."""
    from spade_jax.rollout.routing import bytes_per_token

    layers = sum(s.arch.is_moe_layer(i) for i in range(s.arch.num_layers))
    return layers, bytes_per_token(layers, s.arch.num_experts_per_tok, s.arch.num_experts)


def _replay_note(s: _Setting) -> str:
    """What router replay costs per token (docs/trainer.md): recorded, and in the batch."""
    layers, recorded = _recorded_bytes_per_token(s)
    return (f" replay {recorded} B/token recorded, "
            f"{4 * layers * s.arch.num_experts_per_tok} B/token in the batch")


def _sampler_replay_note(s: _Setting) -> str:
    """The sampler's recording cost per generated token (experts only, compact dtype)."""
    return f" replay {_recorded_bytes_per_token(s)[1]} B/token in the decode state"


def _sampler_programs(config: AotConfig, s: _Setting) -> list[ProgramCost]:
    """The agent sampler's prefill of the last turn's prompt and one decode step, per
    decode layout. The prefill is one call's: within the agent loop's prefill budget
    (the agent sampler's ``max_prefill_tokens``, what the engine's admits take too) a row group of the
    batch, written into the full batch's decode state (``sampler.lower_prefill``)."""
    from spade_jax.rollout.sampler import next_pow2, round_up

    agent, spade = s.experiment.agent, s.experiment.spade
    episodes = spade.envs_per_round * (spade.plays_per_game + spade.hint_plays)
    b = config.sample_batch or min(episodes, agent.sampler.max_rows or episodes)
    p = config.prompt_len or next_pow2(agent.max_episode_tokens - agent.max_turn_tokens)
    n = round_up(config.new_tokens or agent.sampler.max_new_tokens,
                 agent.sampler.new_tokens_bucket)
    # Sampling with the experiment's settings, top-k left out. With router replay (or its
    # telemetry) the run's samplers record the selected experts (return_router="experts"),
    # so the decode state here carries that [B, N, L, X] buffer too.
    record = "experts" if s.train.router_replay or s.experiment.record_routing else False
    sampler = dataclasses.replace(
        agent.sampler, max_new_tokens=n, top_k=0, return_router=record)
    programs = []
    for layout in config.decode_layouts:
        programs += _layout_programs(config, s, sampler, layout, rows=b, prompt_len=p)
    return programs


def _layout_programs(config: AotConfig, s: _Setting, sampler: Any, layout: str, *, rows: int,
                     prompt_len: int) -> list[ProgramCost]:
    """The prefill and one decode step with the sampler's weights in ``layout`` (those of
    ``config.programs``), from one lowering of the prefill (its output is the decode state);
    ``rows`` rounded up to the batch shards of the layout's mesh. The prefill is one call
    of ``sampler.prefill_chunk_rows`` rows within ``sampler.max_prefill_tokens``."""
    from spade_jax.rollout.sampler import prefill_chunk_rows, round_up

    mesh = _decode_mesh(s, layout)
    shards = parallelism(_shape(mesh), s.par.chips, s.rules).batch
    rows = round_up(rows, shards)
    group = prefill_chunk_rows(rows, prompt_len, sampler.max_prefill_tokens, shards)
    params = _decode_params(s, mesh)
    prefill = _lower_layout_prefill(s, sampler, mesh, params, rows=group, prompt_len=prompt_len,
                                    batch=rows)
    programs = []
    if "prefill" in config.programs:
        programs.append(_prefill_program(s, prefill, layout, mesh, params, rows=group,
                                         batch=rows, prompt_len=prompt_len,
                                         new_tokens=sampler.max_new_tokens))
    if "decode" in config.programs:
        programs.append(_decode_program(s, sampler, layout, prefill, mesh, params, rows=rows))
    return programs


def _lower_layout_prefill(s: _Setting, sampler: Any, mesh: Any, params: Any, *, rows: int,
                          prompt_len: int, batch: int | None = None) -> Any:
    """The sampler's prefill lowered on ``mesh`` reading ``params`` (``_decode_params``):
    ``rows`` prompts, a row group of a ``batch``-row decode state when ``batch`` > rows."""
    from spade_jax.rollout import sampler as sampler_lib

    return sampler_lib.lower_prefill(s.sample_graphdef, params, s.options, sampler, rows=rows,
                                     prompt_len=prompt_len, mesh=mesh, rules=s.rules,
                                     batch=batch)


def _sampler_resident(s: _Setting, mesh: Any) -> int:
    """Bytes per chip that stay while the sampler runs on ``mesh``: the Adam moments, and
    the trainer's parameters too when the sampler reads its own copy."""
    return s.moments_bytes + (0 if mesh is s.mesh else _bytes_per_chip(s.state.params))


def _prefill_program(s: _Setting, lowered: Any, layout: str, mesh: Any, params: Any, *,
                     rows: int, batch: int, prompt_len: int, new_tokens: int) -> ProgramCost:
    """The prefill of ``rows`` prompts of ``prompt_len`` tokens (of a ``batch``-row decode
    state) with the sampler's weights in ``layout``: "prefill" on the trainer's layout, else
    "prefill:<layout>" on its decode mesh (the per-step reshard is reported with the decode
    step). Shape "B=rows P= S=", "B=rows of batch P= S=" for a row group."""
    name = "prefill" if layout == "train" else f"prefill:{layout}"
    compiled, seconds = _timed_compile(lowered, name)
    itemsize = _bytes_per_param(params)
    keys = prompt_len + new_tokens
    of = f" of {batch}" if batch > rows else ""
    return _program(
        name, f"B={rows}{of} P={prompt_len} S={keys}", compiled, seconds,
        resident=_sampler_resident(s, mesh), tokens=rows * prompt_len,
        mesh_shape=None if mesh is s.mesh else _shape(mesh), param_itemsize=itemsize,
        **analytic_cost("prefill", s.arch, s.options,
                        parallelism(_shape(mesh), s.par.chips, s.rules), rows=rows,
                        length=prompt_len, keys=keys, param_itemsize=itemsize))


def _decode_mesh(s: _Setting, layout: str):
    from spade_jax import sharding

    mesh_config = dataclasses.replace(s.experiment.mesh, decode_layout=layout)
    return sharding.decode_mesh(s.mesh, mesh_config, s.arch)


def _decode_params(s: _Setting, mesh) -> Any:
    """The abstract parameters the sampler reads on ``mesh``: the master parameters on the
    trainer's mesh, else the run's copy (``rl.trainer.DecodeCopy``: cast by
    ``sharding.cast_for_decode``, placed for ``mesh``)."""
    import jax

    from spade_jax import sharding

    if mesh is s.mesh:
        return s.state.params
    copy = jax.eval_shape(lambda p: sharding.cast_for_decode(p, s.decode_dtype), s.state.params)
    return _sds(copy, sharding.tree_shardings(copy, mesh, s.rules))


def _bytes_per_param(params: Any) -> float:
    """Bytes per parameter of an abstract parameter tree (mixed dtypes: the mean)."""
    import jax

    leaves = jax.tree.leaves(params)
    total = sum(int(np.prod(x.shape)) for x in leaves)
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in leaves) / total


def _decode_program(s: _Setting, sampler: Any, layout: str, prefill: Any, mesh: Any,
                    params: Any, *, rows: int) -> ProgramCost:
    """One decode step (one token per row) with the sampler's weights ``params`` in
    ``layout`` on its decode ``mesh``, from the state the lowered ``prefill`` returns; beside
    it the per-step cost of resharding the trained weights there."""
    import jax

    from spade_jax.rollout import sampler as sampler_lib

    state = sampler_lib.place_decode_state(prefill.out_info[0], mesh, s.rules)
    lowered = sampler_lib.lower_decode_step(s.sample_graphdef, params, s.options, sampler,
                                            state, mesh=mesh, rules=s.rules)
    name = "decode" if layout == "train" else f"decode:{layout}"
    compiled, seconds = _timed_compile(lowered, name)
    par = parallelism(dict(mesh.shape), s.par.chips, s.rules)
    cache_itemsize = np.dtype(jax.tree.leaves(state.cache.k)[0].dtype).itemsize
    keys = jax.tree.leaves(state.cache.valid_bs)[0].shape[1]
    itemsize = _bytes_per_param(params)
    moved = {} if mesh is s.mesh else dict(
        reshard_bytes=reshard_bytes(s.arch, s.par, par, itemsize),
        reshard_hlo_bytes=_compiled_reshard_bytes(s, mesh, name))
    note = _sampler_replay_note(s) if sampler.return_router and s.arch.is_moe else ""
    return _program(
        name, f"B={rows} S={keys} (1 token){note}", compiled, seconds,
        resident=_sampler_resident(s, mesh), tokens=rows,
        mesh_shape=None if mesh is s.mesh else _shape(mesh), **moved, param_itemsize=itemsize,
        **analytic_cost("decode", s.arch, s.options, par, rows=rows, length=1, keys=keys,
                        cache_itemsize=cache_itemsize, param_itemsize=itemsize))


def _compiled_reshard_bytes(s: _Setting, mesh: Any, name: str) -> float:
    """The run's per-step copy of the master parameters from the trainer's layout onto
    ``mesh`` (``sharding.resharder``, cast as the run casts it), compiled: result bytes per
    chip of its collectives."""
    from spade_jax import sharding
    from spade_jax.aot.hlo import collective_bytes

    lowered = sharding.resharder(s.state.params, mesh, s.rules,
                                 s.decode_dtype).lower(s.state.params)
    compiled, _ = _timed_compile(lowered, f"reshard for {name}")
    return float(sum(collective_bytes(compiled.as_text()).values()))


def _shape(mesh) -> dict[str, int]:
    return {k: int(v) for k, v in mesh.shape.items()}


def _rl_steps(config: AotConfig, s: _Setting) -> tuple[RlStepEstimate, ...]:
    """The RL step estimate per decode layout (cost model only: nothing more compiles)."""
    import jax.numpy as jnp

    sampler = s.experiment.agent.sampler
    cache_itemsize = (jnp.dtype(sampler.cache_dtype).itemsize if sampler.cache_dtype
                      else jnp.dtype(s.options.compute_dtype).itemsize)
    out = []
    for layout in config.decode_layouts:
        mesh = _decode_mesh(s, layout)
        par = parallelism(_shape(mesh), s.par.chips, s.rules)
        itemsize = _bytes_per_param(_decode_params(s, mesh))
        out.append(estimate_rl_step(
            s.experiment, s.arch, s.options, layout=layout, train_par=s.par, decode_par=par,
            chip=parse_topology(config.topology).chip,
            reshard_bytes=0.0 if mesh is s.mesh else reshard_bytes(s.arch, s.par, par, itemsize),
            param_itemsize=s.param_itemsize, decode_itemsize=itemsize,
            cache_itemsize=cache_itemsize, episode=config.episodes))
    return tuple(out)


def plan(config: AotConfig, devices: Sequence | None = None) -> Plan:
    """Compiles the experiment's programs for ``config.topology`` and measures them.

    ``devices`` defaults to libtpu's abstract devices of the topology (tests may pass CPU
    devices to check the plumbing without libtpu).
    """
    s = _setting(config, devices)
    programs: list[ProgramCost] = []
    if "train" in config.programs:
        programs.append(_train_program(config, s))
    if {"prefill", "decode"} & set(config.programs):
        programs += _sampler_programs(config, s)
    return Plan(
        experiment=s.experiment.name, topology=parse_topology(config.topology),
        mesh_shape={k: int(v) for k, v in s.mesh.shape.items()},
        params=s.arch.param_count(), active_params=matmul_params(s.arch),
        hbm_fraction=config.hbm_fraction, programs=tuple(programs), rl_steps=_rl_steps(config, s),
    )
