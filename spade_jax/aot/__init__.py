"""Compiled memory / cost plan for a TPU topology, on a CPU host (no TPU needed).

    python -m spade_jax.aot --experiment=qwen3_30b_a3b --topology=v5p-64
    python -m spade_jax.aot --experiment=qwen3_4b --topology=v5e-16 --set train.microbatches=16

``libtpu`` (``pip install libtpu==0.0.42.1``, the build ``jax[tpu]==0.10.2`` pins) supplies
an abstract device set for the named topology (``jax.experimental.topologies``). The real
train step (``rl.train_step.TrainStep.lower``) and the sampler's jitted prefill and one
decode step (``rollout.sampler.lower_prefill`` / ``lower_decode_step``, public lowering
entries) are lowered with ``jax.ShapeDtypeStruct`` inputs that carry the experiment's
``NamedSharding``s and compiled by the TPU compiler. Nothing is allocated.

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

The prefill and the decode step are compiled once per sampler weight layout
(``--decode_layouts``, default ``train,auto``: the trainer's FSDP parameters, and the copy
the run reshards once per step onto a mesh without FSDP, ``sharding.decode_mesh``), with
the per-step reshard cost beside the decode step; an RL step estimate per layout (:mod:`~spade_jax.aot.rl_step`) follows from the same
cost model.

Modules: :mod:`~spade_jax.aot.topology` (slices and their chips),
:mod:`~spade_jax.aot.planner` (what is compiled and measured), :mod:`~spade_jax.aot.cost`
(the analytic cost model), :mod:`~spade_jax.aot.hlo` (collectives of a compiled program),
:mod:`~spade_jax.aot.rl_step` (the RL step estimate), :mod:`~spade_jax.aot.report` (JSON,
text, tables) and
:mod:`~spade_jax.aot.cli` (the command line). Importing the package does not import jax, so
the CLI can choose the host platform first.
"""

from spade_jax.aot.cost import Parallelism, analytic_cost, parallelism
from spade_jax.aot.planner import AotConfig, Plan, ProgramCost, plan
from spade_jax.aot.report import (
    DECODE_HEADER,
    PREFILL_HEADER,
    RL_HEADER,
    TABLE_HEADER,
    decode_rows,
    format_plan,
    prefill_rows,
    read_plan,
    recost,
    rl_rows,
    table_row,
    write_plan,
)
from spade_jax.aot.rl_step import EpisodeShape, RlStepEstimate, estimate_rl_step
from spade_jax.aot.topology import CHIPS, GIB, ChipSpec, Topology, parse_topology, topology_devices

__all__ = [
    "CHIPS", "DECODE_HEADER", "GIB", "PREFILL_HEADER", "RL_HEADER", "TABLE_HEADER", "AotConfig", "ChipSpec",
    "EpisodeShape", "Parallelism", "Plan", "ProgramCost", "RlStepEstimate", "Topology",
    "analytic_cost", "decode_rows", "estimate_rl_step", "format_plan", "parallelism",
    "parse_topology", "plan", "prefill_rows", "read_plan", "recost", "rl_rows", "table_row",
    "topology_devices", "write_plan",
]
