"""Plans on disk and on screen: ``--json_out`` files (the compile results, re-costed later
by today's cost model without recompiling), the per-chip report and the markdown table row."""

from __future__ import annotations

import dataclasses

from spade_jax.aot.cost import analytic_cost, parallelism
from spade_jax.aot.planner import Plan, ProgramCost
from spade_jax.aot.rl_step import ANCHOR_TOKENS_PER_SECOND_PER_H100, RlStepEstimate
from spade_jax.aot.topology import GIB, parse_topology


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
    from spade_jax.rollout.sampler import round_up

    experiment = load_experiment(result.experiment, list(overrides))
    spec = experiment.model
    arch = preset(spec.preset) if spec.preset else spec.architecture
    cache = experiment.agent.sampler.cache_dtype or spec.dtype
    master = _itemsize(experiment.train.optimizer.master_dtype)
    programs = []
    for p in result.programs:
        par = parallelism(p.mesh_shape or result.mesh_shape, result.topology.chips)
        dims = {k: int(v) for k, v in re.findall(r"([A-Z])=(\d+)", p.shape)}
        if p.name == "train":
            cost = analytic_cost("train", arch, spec.options(), par, rows=dims["B"],
                                 length=dims["T"], keys=dims["T"], microbatches=dims["M"],
                                 param_itemsize=master)
        elif p.name.partition(":")[0] == "prefill":
            keys = dims.get("S") or dims["P"] + round_up(  # (older plans: no S label)
                experiment.agent.sampler.max_new_tokens, experiment.agent.sampler.new_tokens_bucket)
            cost = analytic_cost("prefill", arch, spec.options(), par, rows=dims["B"],
                                 length=dims["P"], keys=keys,
                                 param_itemsize=p.param_itemsize or master)
        else:
            cost = analytic_cost("decode", arch, spec.options(), par, rows=dims["B"], length=1,
                                 keys=dims["S"], cache_itemsize=_itemsize(cache),
                                 param_itemsize=p.param_itemsize or master)
        programs.append(dataclasses.replace(p, **cost))
    return dataclasses.replace(result, programs=tuple(programs))


def _itemsize(dtype: str) -> int:
    import jax.numpy as jnp

    return jnp.dtype(dtype).itemsize


def read_plan(path: str) -> Plan:
    import json

    with open(path) as f:
        data = json.load(f)
    data["topology"] = parse_topology(data["topology"])
    data["programs"] = tuple(ProgramCost(**p) for p in data["programs"])
    data["rl_steps"] = tuple(RlStepEstimate(**r) for r in data.get("rl_steps", ()))
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
        if p.collectives:
            lines.append("    HLO collectives (loop bodies once): " + ", ".join(
                f"{kind} {n / GIB:.3f} GiB" for kind, n in p.collectives.items() if n))
        if p.mesh_shape and p.name.startswith("prefill"):
            lines.append(f"    decode mesh {_mesh(p.mesh_shape)}, the sampler's copy of the "
                         f"weights ({p.param_itemsize:.2f} B/param; the reshard: see decode)")
        elif p.mesh_shape:
            lines.append(f"    decode mesh {_mesh(p.mesh_shape)}; resharding the weights to it "
                         f"once per step: {_reshard(result, p)}")
    for r in result.rl_steps:
        lines.append(
            f"  RL step estimate ({r.layout} layout, cost model): {r.episodes} episodes, "
            f"{r.slots} slots, cache {r.cache_len}: decode {r.decode_steps} steps "
            f"{r.decode_seconds:,.1f} s ({r.decode_bound}), prefill {r.prefill_seconds:,.1f} s, "
            f"reshard {r.reshard_seconds:,.2f} s, train {r.train_seconds:,.1f} s "
            f"({r.train_shape}) = {r.seconds:,.1f} s; {r.tokens_per_second_per_chip:,.0f} "
            f"generated tokens/s/chip (anchor: ~{ANCHOR_TOKENS_PER_SECOND_PER_H100:.0f}/H100)")
    return "\n".join(lines)


def _reshard(result: Plan, p: ProgramCost) -> str:
    """The per-step reshard of a decode layout: analytic bytes per chip and seconds on ICI,
    and the compiled copy's collective bytes."""
    ici = result.topology.chip.ici_bandwidth
    return (f"{p.reshard_bytes / GIB:.2f} GiB/chip, {p.reshard_bytes / ici * 1e3:,.1f} ms "
            f"(compiled: {p.reshard_hlo_bytes / GIB:.2f} GiB, "
            f"{p.reshard_hlo_bytes / ici * 1e3:,.1f} ms)")


def _mesh(shape: dict[str, int]) -> str:
    return "x".join(f"{k}{v}" for k, v in shape.items() if v > 1) or "1"


TABLE_HEADER = ("| experiment | topology | mesh | train step | prefill | decode (1 token) |\n"
                "|---|---|---|---|---|---|")


def table_row(result: Plan) -> str:
    """One markdown row: experiment | topology | mesh | per-program HBM%, ms, MFU."""
    cells = [result.experiment, result.topology.name, _mesh(result.mesh_shape)]
    for p in result.programs:
        if p.name not in ("train", "prefill", "decode"):  # other layouts: *_rows below
            continue
        hbm = 100 * p.peak_bytes / result.topology.chip.hbm_bytes
        cells.append(f"{p.name}: {hbm:.0f}% HBM, {result.seconds(p) * 1e3:,.1f} ms "
                     f"({result.bound(p)}), MFU ≤{100 * result.mfu(p):.0f}%")
    return "| " + " | ".join(cells) + " |"


DECODE_HEADER = (
    "| experiment | topology | layout | mesh | shape | HBM per chip | HBM / token | "
    "ICI / token | HLO all-gather | step (bound) | tokens/s/chip | reshard per step |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|")


def decode_rows(result: Plan) -> list[str]:
    """One markdown row per decode program: its layout, per-chip bytes moved per step and
    the roofline term that bounds it, and the per-step resharding cost of its layout."""
    rows = []
    for p in result.programs:
        if not p.name.startswith("decode"):
            continue
        layout = p.name.partition(":")[2] or "train"
        reshard = _reshard(result, p) if p.mesh_shape else "none"
        rows.append(
            f"| {result.experiment} | {result.topology.name} | {layout} | "
            f"{_mesh(p.mesh_shape or result.mesh_shape)} | {p.shape.replace(' (1 token)', '')} | "
            f"{100 * p.peak_bytes / result.topology.chip.hbm_bytes:.0f}% | "
            f"{p.hbm_traffic / GIB:,.2f} GiB | {p.ici_traffic / GIB:,.2f} GiB | "
            f"{(p.collectives or {}).get('all-gather', 0) / 2**20:,.1f} MiB | "
            f"{result.seconds(p) * 1e3:,.2f} ms ({result.bound(p)}) | "
            f"{result.tokens_per_second_per_chip(p):,.0f} | {reshard} |")
    return rows


PREFILL_HEADER = (
    "| experiment | topology | layout | mesh | shape | peak per chip | resident | "
    "weights | step (bound) | tokens/s/chip |\n|---|---|---|---|---|---|---|---|---|---|")


def prefill_rows(result: Plan) -> list[str]:
    """One markdown row per prefill program: its layout, peak HBM per chip against the fit
    limit (the resident trainer state included), the weights' bytes per parameter and the
    roofline term that bounds it."""
    hbm = result.topology.chip.hbm_bytes
    rows = []
    for p in result.programs:
        if p.name.partition(":")[0] != "prefill":
            continue
        verdict = "fits" if result.fits(p) else "DOES NOT FIT"
        rows.append(
            f"| {result.experiment} | {result.topology.name} | "
            f"{p.name.partition(':')[2] or 'train'} | "
            f"{_mesh(p.mesh_shape or result.mesh_shape)} | {p.shape} | "
            f"{100 * p.peak_bytes / hbm:.1f}% ({p.peak_bytes / GIB:.1f} GiB, {verdict}) | "
            f"{p.resident_bytes / GIB:.1f} GiB | {p.param_itemsize:.2f} B/param | "
            f"{result.seconds(p) * 1e3:,.1f} ms ({result.bound(p)}) | "
            f"{result.tokens_per_second_per_chip(p):,.0f} |")
    return rows


RL_HEADER = (
    "| experiment | topology | layout | episodes x tokens | decode | prefill | reshard | "
    "train | step | generated tokens/s/chip |\n|---|---|---|---|---|---|---|---|---|---|")


def rl_rows(result: Plan) -> list[str]:
    """One markdown row per RL step estimate (cost model; see ``aot.rl_step``)."""
    return [
        f"| {result.experiment} | {result.topology.name} | {r.layout} | "
        f"{r.episodes} x {r.generated_tokens // max(1, r.episodes)} ({r.slots} slots) | "
        f"{r.decode_seconds:,.1f} s ({r.decode_bound}) | {r.prefill_seconds:,.1f} s | "
        f"{r.reshard_seconds:,.2f} s | {r.train_seconds:,.1f} s | {r.seconds:,.1f} s | "
        f"{r.tokens_per_second_per_chip:,.0f} |"
        for r in result.rl_steps]
