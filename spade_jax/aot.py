"""Compiled memory / cost plan for a TPU topology, on a CPU host (no TPU needed).

    python -m spade_jax.aot --experiment=qwen3_30b_a3b --topology=v5p-64
    python -m spade_jax.aot --experiment=qwen3_4b --topology=v5e-16 --set train.microbatches=16

``libtpu`` (``pip install libtpu==0.0.42.1``, the build ``jax[tpu]==0.10.2`` pins) supplies
an abstract device set for the named topology (``jax.experimental.topologies``). The real
train step (``rl.train_step.train_step``) and the sampler's jitted prefill and one decode
step (``rollout.sampler``) are lowered with ``jax.ShapeDtypeStruct`` inputs that carry the
experiment's ``NamedSharding``s and compiled by the TPU compiler. Nothing is allocated.

Per chip it prints XLA's argument / output / temp bytes against the chip's HBM, XLA's
estimated FLOPs and roofline seconds, and the implied MFU and tokens/s/chip. It exits 1
with "DOES NOT FIT" when a program's peak bytes exceed ``hbm_fraction`` of HBM.

Peak bytes of a program = argument + output - aliased (donated) + temp. While the sampler
runs, the Adam moments stay resident on the chip (the sampler reads the master params), so
they are added to the sampler programs' peaks.

XLA's cost analysis counts the body of every loop once, and with scan over layers, the
microbatch scan and query-chunked attention most of the work is in loops; so the step time
is a roofline on analytic counts (:func:`analytic_cost`): max(FLOPs / peak FLOP/s, HBM
bytes / HBM bandwidth, ICI bytes / ICI bandwidth) per chip, perfect overlap assumed, a lower
bound; MFU = model FLOPs / (chips * peak * step time) is then an upper bound. Model FLOPs
follow PaLM: 3 forwards for training (6 N_active per token plus attention), 1 for sampling;
N_active = parameters a token multiplies through (active parameters less the untied input
embedding). XLA's own numbers are printed too.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

GIB = 1 << 30


# ---- TPU topologies -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ChipSpec:
    """One TPU generation: HBM per chip, peak bf16 FLOP/s and HBM bytes/s per chip, how the slice name counts
    (TensorCores for v4/v5p, chips for v5e/v6e), and libtpu's name for its topologies."""

    hbm_bytes: int
    peak_flops: float
    hbm_bandwidth: float
    cores_per_chip: int
    libtpu_name: str
    three_d: bool
    ici_bandwidth: float  # bytes/s per chip, all links (Cloud TPU's published Gbps / 8)


CHIPS: dict[str, ChipSpec] = {
    "v4": ChipSpec(32 * GIB, 275e12, 1.23e12, 2, "v4", True, 2400e9 / 8),
    "v5p": ChipSpec(95 * GIB, 459e12, 2.77e12, 2, "v5", True, 4800e9 / 8),
    "v5e": ChipSpec(16 * GIB, 197e12, 0.82e12, 1, "v5e", False, 1600e9 / 8),
    "v6e": ChipSpec(32 * GIB, 918e12, 1.64e12, 1, "v6e", False, 3584e9 / 8),
}


@dataclasses.dataclass(frozen=True)
class Topology:
    """A named slice such as ``v5p-64`` (64 TensorCores = 32 chips)."""

    name: str
    generation: str
    chips: int
    shape: tuple[int, ...]

    @property
    def chip(self) -> ChipSpec:
        return CHIPS[self.generation]

    @property
    def libtpu_topology(self) -> str:
        return f"{self.chip.libtpu_name}:{'x'.join(map(str, self.shape))}"


def _grid(chips: int, three_d: bool) -> tuple[int, ...]:
    """Chip grid of a slice: 2D for v5e/v6e (2x4, 4x4, 4x8, ...), 3D for v4/v5p (2x2x1, 2x2x2,
    2x2x4, 2x4x4, 4x4x4, ...), doubling the smallest axis first as Cloud TPU does."""
    if three_d:
        if chips < 4:
            raise ValueError(f"a v4/v5p slice has at least 4 chips, got {chips}")
        dims = [2, 2, 1]
        while math.prod(dims) < chips:
            dims[dims.index(min(dims))] *= 2
        dims = sorted(dims[:2]) + [dims[2]] if dims[2] == 1 else sorted(dims)
    else:
        if chips < 1:
            raise ValueError(f"a slice has at least 1 chip, got {chips}")
        dims = [1, 1]
        while math.prod(dims) < chips:
            dims[dims.index(min(dims))] *= 2
        dims = sorted(dims)
    if math.prod(dims) != chips:
        raise ValueError(f"topology of {chips} chips: not a power-of-two slice")
    return tuple(dims)


def parse_topology(name: str) -> Topology:
    """``"v5p-64"`` -> Topology(generation="v5p", chips=32, shape=(2, 4, 4))."""
    generation, sep, count = name.partition("-")
    if not sep or generation not in CHIPS or not count.isdigit():
        raise ValueError(
            f"topology must look like <generation>-<size> with generation in {sorted(CHIPS)}, "
            f"e.g. v5p-64 or v5e-16; got {name!r}"
        )
    chip = CHIPS[generation]
    cores = int(count)
    if cores % chip.cores_per_chip:
        raise ValueError(f"topology {name}: {generation} sizes count TensorCores (2 per chip), "
                         f"{cores} is odd")
    chips = cores // chip.cores_per_chip
    return Topology(name, generation, chips, _grid(chips, chip.three_d))


def topology_devices(topology: Topology) -> list:
    """Abstract devices of the slice from libtpu (raises ImportError naming the fix)."""
    try:
        import libtpu  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "spade_jax.aot needs libtpu for the TPU compiler: pip install libtpu==0.0.42.1"
        ) from e
    # libtpu probes the GCE metadata server for a real TPU VM; on a CPU host, say so up front.
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    # Any other jax process on this host (one run without JAX_PLATFORMS=cpu) holds libtpu's
    # lockfile; compiling needs no chip, so share it.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    desc = topologies.get_topology_desc(
        topology_name=topology.libtpu_topology,
        platform="tpu",
        chip_config_name="megacore" if topology.chip.cores_per_chip == 2 else "default",
        chips_per_host_bounds=(2, 2, 1),
        num_slices=1,
    )
    devices = list(desc.devices)
    if len(devices) != topology.chips:
        raise RuntimeError(f"libtpu gave {len(devices)} devices for {topology.name}, "
                           f"expected {topology.chips} chips")
    return devices


# ---- the plan -----------------------------------------------------------------------------


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
        x (plays_per_game + hint_plays), at most the agent sampler's ``max_rows``, rounded
        up to the batch shards).
      prompt_len: prefill length (0 = next power of two >= max_episode_tokens -
        max_turn_tokens, the last turn's prompt).
      new_tokens: decode buffer (0 = the agent sampler's ``max_new_tokens``).
      hbm_fraction: a program fits when its peak is at most this share of HBM.
      programs: which programs to compile, from "train", "prefill", "decode".
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
        tokens=tokens, model_flops=model_flops, compile_seconds=seconds, **analytic,
    )


def _timed_compile(lowered, name: str) -> tuple[Any, float]:
    start = time.time()
    compiled = lowered.compile()
    seconds = time.time() - start
    print(f"[aot] compiled {name} in {seconds:.0f} s", file=sys.stderr, flush=True)
    return compiled, seconds


def _matmul_params(arch) -> int:
    """Parameters a token multiplies through (N_active of the MFU): the active parameters
    less the input embedding table, a gather (unless it is tied to the LM head)."""
    embedding = 0 if arch.tie_word_embeddings else arch.vocab_size * arch.hidden_size
    return arch.param_count(active=True) - embedding


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class Parallelism:
    """Ways the slice splits the work: batch rows, FSDP parameter shards, expert shards."""

    chips: int
    batch: int
    fsdp: int
    expert: int


def _batch_axes(rules, mesh=None) -> tuple[str, ...]:
    """Mesh axes the "batch" rule splits rows over (size-1 axes dropped when ``mesh``)."""
    from spade_jax import sharding

    axes = sharding.logical_to_spec(("batch",), rules, mesh)[0]
    return (axes,) if isinstance(axes, str) else tuple(axes or ())


def _parallelism(mesh_shape: dict[str, int], chips: int, rules=None) -> Parallelism:
    """Ways a mesh of ``mesh_shape`` splits rows (by the "batch" rule), parameters and experts."""
    from spade_jax import sharding

    batch = _batch_axes(rules or sharding.DEFAULT_RULES)
    return Parallelism(chips=chips, batch=int(np.prod([mesh_shape.get(a, 1) for a in batch])),
                       fsdp=int(mesh_shape.get("fsdp", 1)), expert=int(mesh_shape.get("expert", 1)))


def analytic_cost(program: str, arch, options, par: Parallelism, *, rows: int, length: int,
                  keys: int, microbatches: int = 1, cache_itemsize: int = 2) -> dict[str, float]:
    """FLOPs and bytes of one call, counted from the architecture (whole-slice FLOPs, per-chip
    bytes). ``rows`` x ``length`` tokens each attend to ``keys`` key slots (the full masked
    score matrix is computed, as the model does).

    FLOPs: a forward is 2 N_active per token plus 4 n h S per token and layer for attention
    (QK^T and PV); training is forward + 2x backward, plus what remat recomputes ("full": the
    forward again; "dots_no_batch": attention; a query-chunked attention recomputes its
    blocks once more). ``model_flops`` (for MFU, PaLM's definition) is 3 forwards for
    training and 1 for sampling, no recomputation.

    HBM bytes per chip (lower bound): the bf16 weights a chip multiplies through (after the
    FSDP all-gather: every dense weight, and its expert shard's experts) once per pass, plus
    its fp32 parameter shard; for decode also its rows' KV cache.

    ICI bytes per chip (lower bound): FSDP all-gathers of bf16 weights per pass and a
    reduce-scatter of fp32 gradients per microbatch; expert-parallel all-to-alls of token
    rows (``"expert_parallel"`` is dropless: its buffers hold ``expert`` x the average
    load, and the whole buffer moves).
    """
    n, h, layers, d = arch.num_heads, arch.head_dim, arch.num_layers, arch.hidden_size
    active = _matmul_params(arch)
    total = arch.param_count()
    moe_layers = sum(arch.is_moe_layer(i) for i in range(layers))
    expert_params = moe_layers * arch.num_experts * 3 * d * arch.moe_intermediate_size
    tokens = rows * length
    attention = 4 * n * h * keys * layers  # per token
    forward = tokens * (2 * active + attention)
    # bf16 weights one chip multiplies through, after FSDP gathers (experts: its shard only).
    gathered = 2 * ((total - expert_params) + expert_params / par.expert)
    fsdp_gather = gathered * (par.fsdp - 1) / par.fsdp if par.fsdp > 1 else 0.0
    tokens_per_chip = tokens / par.batch  # over the whole call (all microbatches)
    a2a_layer = 0.0  # bytes one chip receives per MoE layer per pass, whole call
    if options.moe_impl == "expert_parallel" and par.expert > 1 and moe_layers:
        # dropless: N x C slots, C = t * min(k, E / N) per (source, destination) pair
        per_pair = min(arch.num_experts_per_tok, arch.num_experts // par.expert)
        buffer = tokens_per_chip * per_pair * par.expert
        a2a_layer = 2 * buffer * d * 2 * (par.expert - 1) / par.expert  # there and back, bf16

    if program == "train":
        policy = options.remat_policy
        recompute = {"full": forward, "dots_no_batch": tokens * attention}.get(policy, 0.0)
        if options.attention_chunk and length > options.attention_chunk:
            recompute += tokens * attention
        passes = 3 if policy != "none" else 2  # forward (+ remat forward) + backward
        return dict(
            hardware_flops=3 * forward + recompute,
            model_flops=3 * forward,
            hbm_traffic=microbatches * passes * gathered + 3 * 4 * total / par.chips,
            # per microbatch: weight gathers per pass and a gradient reduction (fp32); the
            # token all-to-alls scale with tokens, so they are counted for the whole call
            ici_traffic=(microbatches * (passes * fsdp_gather
                                         + 2 * gathered * (par.batch - 1) / par.batch)
                         + passes * moe_layers * a2a_layer),
        )
    kv_bytes = 0.0
    if program == "decode":
        kv_bytes = (rows / par.batch) * keys * layers * 2 * arch.num_kv_heads * h * cache_itemsize
    return dict(
        hardware_flops=forward,
        model_flops=forward,
        hbm_traffic=gathered + 4 * total / par.chips + kv_bytes,
        ici_traffic=fsdp_gather + moe_layers * a2a_layer,
    )


def plan(config: AotConfig, devices: Sequence | None = None) -> Plan:
    """Compiles the experiment's programs for ``config.topology`` and measures them.

    ``devices`` defaults to libtpu's abstract devices of the topology (tests may pass CPU
    devices to check the plumbing without libtpu).
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from spade_jax import sharding
    from spade_jax.experiment import load_experiment, train_config_for_run
    from spade_jax.models import abstract_model, preset
    from spade_jax.rl.batch import TrainBatch
    from spade_jax.rl.optim import MASTER_DTYPES, make_optimizer
    from spade_jax.rl.train_step import TrainState, train_step, tree_shardings
    from spade_jax.rollout import sampler as sampler_lib

    topology = parse_topology(config.topology)
    experiment = load_experiment(config.experiment, list(config.overrides))
    devices = list(devices) if devices is not None else topology_devices(topology)
    mesh = sharding.make_mesh(experiment.mesh, devices)
    rules = sharding.DEFAULT_RULES  # what spade.run trains with
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
    with sharding.activate(mesh, rules):
        state_sds = _sds(state_abstract, tree_shardings(state_abstract, mesh, rules))
    moments_bytes = _bytes_per_chip(state_sds.opt_state)
    batch_axes = _batch_axes(rules, mesh)
    par = _parallelism(dict(mesh.shape), len(devices), rules)
    data_ways = par.batch
    rows = NamedSharding(mesh, PartitionSpec(batch_axes or None))
    rows2 = NamedSharding(mesh, PartitionSpec(batch_axes or None, None))
    active = _matmul_params(arch)
    programs: list[ProgramCost] = []

    if "train" in config.programs:
        b = config.train_batch or train.microbatches * data_ways
        t = config.seq_len or experiment.agent.max_episode_tokens
        if b % (train.microbatches * data_ways):
            raise ValueError(f"train_batch {b} must be a multiple of microbatches x data ways "
                             f"= {train.microbatches} x {data_ways}")
        batch = TrainBatch(
            input_ids=jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=rows2),
            loss_mask=jax.ShapeDtypeStruct((b, t), jnp.float32, sharding=rows2),
            old_logp=jax.ShapeDtypeStruct((b, t), jnp.float32, sharding=rows2),
            advantages=jax.ShapeDtypeStruct((b,), jnp.float32, sharding=rows),
            role_id=jax.ShapeDtypeStruct((b,), jnp.int32, sharding=rows),
            attention_mask=jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=rows2),
            # Router replay: per MoE layer the [B, T, X] int32 experts recorded at sampling.
            routing_replay=tuple(
                jax.ShapeDtypeStruct((b, t, arch.num_experts_per_tok), jnp.int32,
                                     sharding=NamedSharding(mesh, PartitionSpec(
                                         batch_axes or None, None, None)))
                if arch.is_moe_layer(i) else None for i in range(arch.num_layers))
            if train.router_replay else None,
        )
        replay_note = ""
        if train.router_replay:  # what a recorded token costs (docs/trainer.md)
            from spade_jax.rollout.routing import bytes_per_token

            moe_layers = sum(arch.is_moe_layer(i) for i in range(arch.num_layers))
            recorded = bytes_per_token(moe_layers, arch.num_experts_per_tok, arch.num_experts)
            in_batch = 4 * moe_layers * arch.num_experts_per_tok  # int32 in the TrainBatch
            replay_note = f" replay {recorded} B/token recorded, {in_batch} B/token in the batch"
        step = jax.jit(functools.partial(train_step, graphdef=graphdef, config=train),
                       donate_argnums=0)
        with sharding.activate(mesh, rules):
            compiled, seconds = _timed_compile(step.lower(state_sds, batch), "train")
        # The TPU compiler's cost analysis counts every trip of the microbatch scan (checked:
        # M=1 and M=4 report the same FLOPs for the same batch).
        programs.append(_program(
            "train", f"B={b} T={t} M={train.microbatches}{replay_note}", compiled, seconds, resident=0,
            tokens=b * t, **analytic_cost("train", arch, options, par, rows=b, length=t, keys=t,
                                          microbatches=train.microbatches)))

    if {"prefill", "decode"} & set(config.programs):
        agent = experiment.agent
        episodes = (experiment.spade.envs_per_round
                    * (experiment.spade.plays_per_game + experiment.spade.hint_plays))
        b = config.sample_batch or min(episodes, agent.sampler.max_rows or episodes)
        b = _round_up(b, data_ways)
        p = config.prompt_len or _next_pow2(agent.max_episode_tokens - agent.max_turn_tokens)
        n = config.new_tokens or agent.sampler.max_new_tokens
        n = _round_up(n, agent.sampler.new_tokens_bucket)
        cache_dtype = jnp.dtype(agent.sampler.cache_dtype or spec.dtype)
        static = sampler_lib._Static(
            greedy=False, top_k=0, use_top_p=agent.sampler.top_p < 1,
            return_router=train.router_replay,  # the run's samplers record routing for replay
            cache_dtype=cache_dtype, cache_len=p + n, router_hook=None,
            batch_invariant=spec.batch_invariant)
        params_sds = state_sds.params
        scalars = sampler_lib._Scalars(
            temperature=jax.ShapeDtypeStruct((), jnp.float32),
            top_p=jax.ShapeDtypeStruct((), jnp.float32),
            seed=jax.ShapeDtypeStruct((), jnp.int32),
            row_offset=jax.ShapeDtypeStruct((), jnp.int32))
        prefill_args = (
            jax.ShapeDtypeStruct((b, p), jnp.int32, sharding=rows2),
            jax.ShapeDtypeStruct((b, p), jnp.int32, sharding=rows2),
            jax.ShapeDtypeStruct((b,), jnp.int32, sharding=rows),
            jax.ShapeDtypeStruct((b,), jnp.int32, sharding=rows),
            jax.ShapeDtypeStruct((b, 1), jnp.int32, sharding=rows2),
        )
        with sharding.activate(mesh, rules):
            lowered = sampler_lib._prefill.lower(sample_graphdef, params_sds, *prefill_args, scalars,
                                                 static=static, new_buffer=n)
        compiled, seconds = _timed_compile(lowered, "prefill")
        if "prefill" in config.programs:
            programs.append(_program(
                "prefill", f"B={b} P={p} S={p + n}", compiled, seconds, resident=moments_bytes,
                tokens=b * p, **analytic_cost("prefill", arch, options, par, rows=b, length=p,
                                              keys=p + n)))
        if "decode" in config.programs:
            decode_state = jax.tree.map(
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                lowered.out_info[0], compiled.output_shardings[0])

            def one_step(params, state, scalars):
                model = nnx.merge(sample_graphdef, params)
                return sampler_lib._decode_step(model, state, scalars, static)

            step = jax.jit(one_step, donate_argnums=1)
            with sharding.activate(mesh, rules):
                compiled, seconds = _timed_compile(
                    step.lower(params_sds, decode_state, scalars), "decode")
            programs.append(_program(
                "decode", f"B={b} S={p + n} (1 token)", compiled, seconds,
                resident=moments_bytes, tokens=b, **analytic_cost(
                    "decode", arch, options, par, rows=b, length=1, keys=p + n,
                    cache_itemsize=cache_dtype.itemsize)))

    return Plan(
        experiment=experiment.name, topology=topology,
        mesh_shape={k: int(v) for k, v in mesh.shape.items()},
        params=arch.param_count(), active_params=active,
        hbm_fraction=config.hbm_fraction, programs=tuple(programs),
    )


# ---- report -------------------------------------------------------------------------------


def write_plan(result: Plan, path: str) -> None:
    """The plan's raw numbers as JSON (re-reported later without recompiling)."""
    import json

    data = dataclasses.asdict(result)
    data["topology"] = result.topology.name
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def recost(result: Plan, overrides: tuple[str, ...] = ()) -> Plan:
    """The stored compile results with the analytic counts recomputed by today's
    :func:`analytic_cost` (memory is the compiler's; the cost model can improve later).
    Shapes come from each program's ``shape`` string, the model from the experiment."""
    import re

    from spade_jax.experiment import load_experiment
    from spade_jax.models import preset

    experiment = load_experiment(result.experiment, list(overrides))
    spec = experiment.model
    arch = preset(spec.preset) if spec.preset else spec.architecture
    par = _parallelism(result.mesh_shape, result.topology.chips)
    cache = experiment.agent.sampler.cache_dtype or spec.dtype
    programs = []
    for p in result.programs:
        dims = {k: int(v) for k, v in re.findall(r"([A-Z])=(\d+)", p.shape)}
        if p.name == "train":
            cost = analytic_cost("train", arch, spec.options(), par, rows=dims["B"],
                                 length=dims["T"], keys=dims["T"], microbatches=dims["M"])
        elif p.name == "prefill":
            keys = dims.get("S") or dims["P"] + _round_up(  # (older plans: no S label)
                experiment.agent.sampler.max_new_tokens, experiment.agent.sampler.new_tokens_bucket)
            cost = analytic_cost("prefill", arch, spec.options(), par, rows=dims["B"],
                                 length=dims["P"], keys=keys)
        else:
            cost = analytic_cost("decode", arch, spec.options(), par, rows=dims["B"], length=1,
                                 keys=dims["S"], cache_itemsize=_itemsize(cache))
        programs.append(dataclasses.replace(p, **cost))
    return dataclasses.replace(result, programs=tuple(programs))


def _itemsize(dtype: str) -> int:
    import jax.numpy as jnp

    return jnp.dtype(dtype).itemsize


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def read_plan(path: str) -> Plan:
    import json

    with open(path) as f:
        data = json.load(f)
    data["topology"] = parse_topology(data["topology"])
    data["programs"] = tuple(ProgramCost(**p) for p in data["programs"])
    return Plan(**data)


def format_plan(result: Plan) -> str:
    """A per-chip report, one block per program."""
    from spade_jax.models.config import human_count

    topo = result.topology
    hbm = topo.chip.hbm_bytes
    lines = [
        f"{result.experiment} on {topo.name} ({topo.chips} chips {topo.libtpu_topology}, "
        f"{hbm / GIB:.0f} GiB HBM, {topo.chip.peak_flops / 1e12:.0f} TFLOP/s bf16 per chip)",
        f"mesh {result.mesh_shape}; {human_count(result.params)} params, "
        f"{human_count(result.active_params)} active per token",
    ]
    for p in result.programs:
        verdict = "fits" if result.fits(p) else "DOES NOT FIT"
        lines += [
            f"  {p.name:8s} {p.shape}  (compiled in {p.compile_seconds:.0f} s)",
            f"    per chip: arguments {p.argument_bytes / GIB:.2f} GiB, outputs "
            f"{p.output_bytes / GIB:.2f} GiB (aliased {p.alias_bytes / GIB:.2f}), temp "
            f"{p.temp_bytes / GIB:.2f} GiB, resident {p.resident_bytes / GIB:.2f} GiB",
            f"    peak {p.peak_bytes / GIB:.2f} GiB = {100 * p.peak_bytes / hbm:.1f}% of HBM "
            f"(limit {100 * result.hbm_fraction:.0f}%): {verdict}",
            f"    XLA (each loop body counted once): {p.flops / 1e12:.3f} TFLOP, "
            f"{p.bytes_accessed / GIB:.2f} GiB accessed per chip, optimal_seconds "
            f"{p.xla_optimal_seconds * 1e3:,.1f} ms",
            f"    analytic per chip: {p.hardware_flops / topo.chips / 1e12:,.1f} TFLOP, HBM "
            f"{p.hbm_traffic / GIB:,.1f} GiB, ICI {p.ici_traffic / GIB:,.1f} GiB",
            f"    roofline {result.seconds(p) * 1e3:,.1f} ms ({result.bound(p)}-bound); MFU at "
            f"most {100 * result.mfu(p):.1f}%, {result.tokens_per_second_per_chip(p):,.0f} "
            f"tokens/s/chip",
        ]
    return "\n".join(lines)


TABLE_HEADER = ("| experiment | topology | mesh | train step | prefill | decode (1 token) |\n"
                "|---|---|---|---|---|---|")


def table_row(result: Plan) -> str:
    """One markdown row: experiment | topology | mesh | per-program HBM%, ms, MFU."""
    cells = [result.experiment, result.topology.name,
             "x".join(f"{k}{v}" for k, v in result.mesh_shape.items() if v > 1) or "1"]
    for p in result.programs:
        hbm = 100 * p.peak_bytes / result.topology.chip.hbm_bytes
        cells.append(f"{p.name}: {hbm:.0f}% HBM, {result.seconds(p) * 1e3:,.1f} ms "
                     f"({result.bound(p)}), MFU ≤{100 * result.mfu(p):.0f}%")
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str]) -> int:
    from absl import flags

    from spade_jax.overrides import OverrideError

    FLAGS = flags.FLAGS
    if len(argv) > 1:
        print(f"error: unexpected arguments {argv[1:]}", file=sys.stderr)
        return 2
    if FLAGS.render:
        rows = []
        for path in FLAGS.render:
            try:
                rows.append(table_row(recost(read_plan(path), tuple(FLAGS.set))))
            except (OSError, ValueError, KeyError, TypeError) as e:  # missing / not a plan
                print(f"error: --render: {path} is not a readable --json_out plan: "
                      f"{type(e).__name__}: {e}", file=sys.stderr)
                return 2
        print("\n".join([TABLE_HEADER, *rows]))
        return 0
    try:
        config = AotConfig(
            experiment=FLAGS.experiment, topology=FLAGS.topology, overrides=tuple(FLAGS.set),
            train_batch=FLAGS.train_batch, seq_len=FLAGS.seq_len,
            sample_batch=FLAGS.sample_batch, prompt_len=FLAGS.prompt_len,
            new_tokens=FLAGS.new_tokens, hbm_fraction=FLAGS.hbm_fraction,
            programs=tuple(FLAGS.programs))
        result = plan(config)
    except (ValueError, ImportError, FileNotFoundError, OverrideError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # the TPU compiler refuses programs that exceed HBM outright
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        print(f"DOES NOT FIT: {config.experiment} on {config.topology}: the TPU compiler ran "
              f"out of HBM: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    print(format_plan(result))
    print(table_row(result))
    if FLAGS.json_out:
        write_plan(result, FLAGS.json_out)
    failed = [p.name for p in result.programs if not result.fits(p)]
    if failed:
        print(f"DOES NOT FIT: {', '.join(failed)} exceed {100 * config.hbm_fraction:.0f}% of "
              f"{result.topology.chip.hbm_bytes / GIB:.0f} GiB per chip on "
              f"{result.topology.name}", file=sys.stderr)
        return 1
    return 0


def _define_flags() -> None:
    from absl import flags

    flags.DEFINE_string("experiment", "qwen3_30b_a3b", "Experiment name or path.")
    flags.DEFINE_string("topology", "v5p-64", "TPU slice, e.g. v5p-64, v4-8, v5e-16, v6e-8.")
    flags.DEFINE_multi_string("set", [], "Config override section.field=value (repeatable).")
    flags.DEFINE_integer("train_batch", 0, "Global train rows (0 = microbatches x data ways).")
    flags.DEFINE_integer("seq_len", 0, "Train sequence length (0 = agent.max_episode_tokens).")
    flags.DEFINE_integer("sample_batch", 0, "Sampler rows (0 = agent episodes per round).")
    flags.DEFINE_integer("prompt_len", 0, "Prefill length (0 = the last turn's prompt bucket).")
    flags.DEFINE_integer("new_tokens", 0, "Decode buffer (0 = agent sampler max_new_tokens).")
    flags.DEFINE_float("hbm_fraction", 0.85, "Fit limit as a share of HBM.")
    flags.DEFINE_list("programs", ["train", "prefill", "decode"], "Programs to compile.")
    flags.DEFINE_string("json_out", "", "Also write the plan's raw numbers to this JSON file.")
    flags.DEFINE_list("render", [], "Compile nothing: print the markdown table of these "
                      "--json_out files.")


if __name__ == "__main__":
    # The TPU compiler runs on this host; the host's own backend stays CPU.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from absl import app

    _define_flags()
    app.run(main)
