"""``python -m spade_jax.steer identify``: which experts go with which behaviour, and does
the association hold across datasets?

The paper's Identify step over the output directories of ``read`` (one per dataset):

    python -m spade_jax.steer identify --read=gsm8k=runs/read_gsm8k \\
        --read=math=runs/read_math --out=runs/identify [--top_n=5] [--layer=all|L] \\
        [--sweep=1,2,5,10] [--permutations=200] [--seed=0]

Per dataset: selection counts and router probability mass by behaviour, accumulated from
the telemetry and token labels chunk by chunk (``ExpertCounts``, ``RoutingMass``); risk
difference ``P(e selected | b) - P(e selected)`` (paper eq. 4) and its Top-n experts per
behaviour, written as ``expert_sets_<NAME>.json`` (``python -m spade_jax.steer run
--expert_sets`` reads it). ``expert_sets.json`` holds the Top-n of the pooled counts of all
datasets. ``--layer=L`` (a decoder layer, as in the paper's Top-10 at L12 / L36) lets only
that layer's experts compete; ``all`` ranks every (layer, expert) pair together.

With two datasets or more, the cross-dataset tables: profile correlations (same behaviour
on two datasets vs two behaviours), Top-n Jaccard across datasets against a label
permutation null (whole segments shuffled, ``--permutations``; 0 skips it), the experts in
every dataset's Top-n set and the share of the behaviour's selections and routing mass they
carry, and the Top-n sweep (``--sweep`` sizes) of Jaccard and transfer AUC (a source
dataset's set ranks the target's segments by routing mass on it). With one dataset they are
skipped with a note. A behaviour without tokens in some dataset is left out of every table
(named in identify.md).

Outputs in --out: identify.md (all tables), expert_sets.csv, profile_correlations.csv,
jaccard.csv, shared_experts.csv, sweep.csv, jaccard.png, sweep.png, the expert-set files,
and counts_<NAME>.npz: the per-dataset accumulation, reused by a re-run while the read
directory's telemetry and --layer are unchanged. Memory: the cross-dataset tables hold the
labelled tokens' selections and router logits of the competing layers (all MoE layers with
--layer=all; one with --layer=L). Exit status: 0 done, 2 bad input (one ``error:`` line).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from spade_jax.steering.commands._common import (
    CommandError,
    Progress,
    markdown_table,
    new_figure,
    parse_int_list,
    run_command,
    safe_name,
    write_csv,
)
from spade_jax.steering.commands.read import TokenTable
from spade_jax.steering.expert_sets import ExpertSets, expert_sets_from_scores, save_expert_sets
from spade_jax.steering.experts import (
    ExpertCounts,
    RoutingMass,
    multi_dataset_jaccard,
    profile_correlations,
    shared_experts,
    top_n_sweep,
)
from spade_jax.steering.labels import BEHAVIOURS
from spade_jax.steering.telemetry import TelemetryReader


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m spade_jax.steer identify", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--read", action="append", required=True, metavar="NAME=DIR",
                   help="a dataset name and its `read` output dir (repeat per dataset)")
    p.add_argument("--out", required=True, help="output dir")
    p.add_argument("--top_n", type=int, default=5, help="experts per behaviour set")
    p.add_argument("--layer", default="all", help="competing decoder layer, or all")
    p.add_argument("--sweep", default="1,2,5,10", help="set sizes of the Top-n sweep")
    p.add_argument("--permutations", type=int, default=200, help="Jaccard null size (0: skip)")
    p.add_argument("--seed", type=int, default=0, help="seed of the permutation null")
    return p


@dataclasses.dataclass
class Dataset:
    """One dataset's accumulation. ``*_x`` arrays are the labelled tokens on the competing
    rows only (what the cross-dataset tables need)."""

    name: str
    moe_layers: tuple[int, ...]
    top_k: int
    counts: ExpertCounts
    mass: RoutingMass
    selected_xlk: np.ndarray
    logits_xle: np.ndarray
    labels_x: np.ndarray
    segments_x: np.ndarray


def parse_reads(values: Sequence[str]) -> list[tuple[str, Path]]:
    reads, names = [], set()
    for value in values:
        name, sep, directory = value.partition("=")
        if not sep or not name or not directory:
            raise CommandError(f"--read {value!r}: expected NAME=DIR")
        if name in names:
            raise CommandError(f"--read: dataset name {name!r} given twice")
        if not (Path(directory) / "read.json").is_file():
            raise CommandError(f"--read {name}={directory}: not a `read` output dir (no read.json)")
        names.add(name)
        reads.append((safe_name(name), Path(directory)))
    return reads


def _fingerprint(directory: Path, layer: str) -> str:
    manifest = json.loads((directory / "telemetry" / "manifest.json").read_text())
    return json.dumps({"dir": str(directory.resolve()), "layer": layer,
                       "chunks": manifest["chunks"], "tokens": manifest["num_tokens"]},
                      sort_keys=True)


def accumulate(name: str, directory: Path, layer: str) -> Dataset:
    """One pass over the telemetry: counts and mass of every layer, and the labelled
    tokens' selections / logits / segments on the competing rows."""
    telemetry = directory / "telemetry"
    reader = TelemetryReader(telemetry)
    if not reader.complete:
        raise CommandError(f"{telemetry}: capture not finished (re-run `read` on {directory})")
    moe_layers = tuple(reader.metadata["moe_layers"])
    rows = competing_rows(moe_layers, layer)
    table = TokenTable.load(directory / "tokens.npz")
    shape = (len(BEHAVIOURS), reader.num_layers, reader.num_experts)
    counts, mass = ExpertCounts(*shape), RoutingMass(*shape)
    pieces: list[list[np.ndarray]] = [[], [], [], []]
    for chunk in reader.iter_chunks(residuals=False):
        labels_n = table.labels_of(chunk)
        counts.update(chunk.selected, labels_n)
        mass.update(chunk.router_logits, labels_n)
        keep = labels_n >= 0
        for piece, array in zip(pieces, (chunk.selected[keep][:, rows],
                                         chunk.router_logits[keep][:, rows],
                                         labels_n[keep], table.segments_of(chunk)[keep]),
                                strict=True):
            piece.append(array)
    arrays = [np.concatenate(p) for p in pieces]
    return Dataset(name, moe_layers, reader.top_k, counts, mass, *arrays)


def save_dataset(path: Path, data: Dataset, fingerprint: str) -> None:
    np.savez(path, fingerprint=np.array(fingerprint), moe_layers=np.array(data.moe_layers),
             top_k=data.top_k, selected_cle=data.counts.selected_cle,
             tokens_c=data.counts.tokens_c, mass_cle=data.mass.mass_cle,
             mass_tokens_c=data.mass.tokens_c, selected_xlk=data.selected_xlk,
             logits_xle=data.logits_xle, labels_x=data.labels_x, segments_x=data.segments_x)


def load_dataset(path: Path, name: str, fingerprint: str) -> Dataset | None:
    """The cached accumulation, or None when absent or made from other telemetry."""
    if not path.is_file():
        return None
    with np.load(path) as z:
        if str(z["fingerprint"]) != fingerprint:
            return None
        shape = z["selected_cle"].shape
        counts, mass = ExpertCounts(*shape), RoutingMass(*shape)
        counts.selected_cle, counts.tokens_c = z["selected_cle"], z["tokens_c"]
        mass.mass_cle, mass.tokens_c = z["mass_cle"], z["mass_tokens_c"]
        return Dataset(name, tuple(z["moe_layers"].tolist()), int(z["top_k"]), counts, mass,
                       z["selected_xlk"], z["logits_xle"], z["labels_x"], z["segments_x"])


def competing_rows(moe_layers: Sequence[int], layer: str) -> list[int]:
    if layer == "all":
        return list(range(len(moe_layers)))
    try:
        decoder = int(layer)
    except ValueError:
        raise CommandError(f"--layer: expected 'all' or a decoder layer index, got {layer!r}") from None
    if decoder not in moe_layers:
        raise CommandError(f"--layer {decoder} is not an MoE layer (MoE layers: {list(moe_layers)})")
    return [list(moe_layers).index(decoder)]


def restricted(table: ExpertCounts | RoutingMass, classes: Sequence[int],
               rows: Sequence[int]) -> ExpertCounts | RoutingMass:
    """The same table over a subset of behaviours and layers (fields copied, not recounted)."""
    out = type(table)(len(classes), len(rows), table.num_experts)
    field = "selected_cle" if isinstance(table, ExpertCounts) else "mass_cle"
    setattr(out, field, getattr(table, field)[np.ix_(list(classes), list(rows))])
    out.tokens_c = table.tokens_c[list(classes)]
    return out


def _set_text(experts: Sequence[tuple[int, int]], moe_layers: Sequence[int], rows: Sequence[int]) -> str:
    return " ".join(f"L{moe_layers[rows[r]]}:{e}" for r, e in sorted(experts)) or "-"


def expert_set_rows(name: str, sets: ExpertSets) -> list[dict[str, Any]]:
    return [{"dataset": name, "behaviour": b,
             "experts": " ".join(f"L{layer}:{e}" for layer, experts in sorted(layers.items())
                                 for e in experts)}
            for b, layers in sets.sets.items()]


def cross_dataset(datasets: Sequence[Dataset], classes: Sequence[int], rows: Sequence[int],
                  args: argparse.Namespace, sweep_ns: Sequence[int]) -> tuple[dict, list[str]]:
    """The cross-dataset tables; an analysis the data cannot support is skipped with a note."""
    names = [BEHAVIOURS[c] for c in classes]
    moe_layers = datasets[0].moe_layers
    counts = [restricted(d.counts, classes, rows) for d in datasets]
    masses = [restricted(d.mass, classes, rows) for d in datasets]
    remap = np.full(len(BEHAVIOURS), -1)
    remap[list(classes)] = np.arange(len(classes))
    labels = [remap[d.labels_x] for d in datasets]
    keep = [lab >= 0 for lab in labels]
    tables: dict[str, list[dict[str, Any]]] = {}
    notes: list[str] = []
    try:
        corr = profile_correlations({d.name: c for d, c in zip(datasets, counts, strict=True)},
                                    names)
        tables["profile_correlations"] = list(corr.rows)
        notes.append(f"- profile correlation: same behaviour across datasets "
                     f"{corr.same_behaviour_mean:.3f}, different behaviours across datasets "
                     f"{corr.cross_behaviour_mean:.3f} (within one dataset "
                     f"{corr.cross_behaviour_within_dataset_mean:.3f}, negative by construction)")
    except ValueError as err:
        notes.append(f"- profile correlations skipped: {err}")
    if args.permutations > 0:
        try:
            result = multi_dataset_jaccard(
                [(d.selected_xlk[k], lab[k]) for d, lab, k in zip(datasets, labels, keep, strict=True)],
                datasets[0].counts.num_experts, len(classes), n=args.top_n,
                num_permutations=args.permutations, seed=args.seed,
                groups=[d.segments_x[k] for d, k in zip(datasets, keep, strict=True)])
            tables["jaccard"] = [{"behaviour": b, "jaccard": float(j)}
                                 for b, j in zip(names, result.per_class, strict=True)]
            tables["jaccard"].append({"behaviour": "mean", "jaccard": result.mean,
                                      "null_mean": result.null_mean, "null_std": result.null_std,
                                      "p_value": result.p_value})
        except ValueError as err:
            notes.append(f"- Jaccard skipped: {err}")
    else:
        notes.append("- Jaccard null skipped (--permutations=0)")
    try:
        shared = shared_experts(counts, args.top_n, mass_by_dataset=masses)
        tables["shared_experts"] = [dict(
            behaviour=names[s.behaviour], experts=_set_text(s.experts, moe_layers, rows),
            count=len(s.experts), chance_share=s.chance_share,
            **{f"selection_share_{d.name}": float(v)
               for d, v in zip(datasets, s.selection_share_d, strict=True)},
            **{f"mass_share_{d.name}": float(v)
               for d, v in zip(datasets, s.mass_share_d, strict=True)}) for s in shared]
    except ValueError as err:
        notes.append(f"- shared experts skipped: {err}")
    try:
        transfer = [(d.logits_xle[k], d.segments_x[k], lab[k])
                    for d, lab, k in zip(datasets, labels, keep, strict=True)]
        tables["sweep"] = top_n_sweep(counts, sweep_ns, layers=[None], transfer_data=transfer,
                                      behaviours=names)
        for row in tables["sweep"]:
            row["layer"] = "all" if len(rows) > 1 else f"L{moe_layers[rows[0]]}"
    except ValueError as err:
        notes.append(f"- sweep skipped: {err}")
    return tables, notes


def write_plots(out: Path, tables: dict[str, list[dict[str, Any]]]) -> None:
    if "jaccard" in tables:
        rows = tables["jaccard"]
        plt, fig, ax = new_figure(6.5, 4.0)
        per = rows[:-1]
        ax.bar([r["behaviour"] for r in per], [r["jaccard"] for r in per], label="observed")
        mean = rows[-1]
        ax.axhline(mean["null_mean"], color="black", linestyle="--",
                   label=f"permutation null {mean['null_mean']:.2f}")
        ax.axhspan(mean["null_mean"] - mean["null_std"], mean["null_mean"] + mean["null_std"],
                   color="grey", alpha=0.3)
        ax.set_ylabel("Top-n Jaccard across datasets")
        ax.set_ylim(0, 1.02)
        ax.tick_params(axis="x", labelsize=8)
        ax.legend(fontsize=8)
        fig.savefig(out / "jaccard.png", dpi=100)
        plt.close(fig)
    if "sweep" in tables:
        rows = tables["sweep"]
        plt, fig, ax = new_figure(8.0, 4.0, legend_right=2.2)
        colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for i, behaviour in enumerate(dict.fromkeys(r["behaviour"] for r in rows)):
            mine = [r for r in rows if r["behaviour"] == behaviour]
            colour = colours[i % len(colours)]
            ax.plot([r["n"] for r in mine], [r["jaccard"] for r in mine], "o-", color=colour,
                    label=f"{behaviour} Jaccard")
            ax.plot([r["n"] for r in mine], [r["auc"] for r in mine], "s--", color=colour,
                    label=f"{behaviour} AUC")
        ax.set_xlabel("Top-n")
        ax.set_ylim(0, 1.02)
        ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=7)
        fig.savefig(out / "sweep.png", dpi=100)
        plt.close(fig)


TABLE_COLUMNS = {
    "expert_sets": ("dataset", "behaviour", "experts"),
    "profile_correlations": ("behaviour_a", "dataset_a", "behaviour_b", "dataset_b", "r"),
    "jaccard": ("behaviour", "jaccard", "null_mean", "null_std", "p_value"),
    "sweep": ("n", "layer", "behaviour", "jaccard", "auc"),
}


def _columns(name: str, rows: list[dict[str, Any]]) -> Sequence[str]:
    return TABLE_COLUMNS.get(name) or list(rows[0])


def _identify(args: argparse.Namespace) -> None:
    reads = parse_reads(args.read)
    sweep_ns = parse_int_list(args.sweep, "--sweep")
    if args.top_n < 1 or args.permutations < 0:
        raise CommandError("--top_n must be >= 1 and --permutations >= 0")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    progress = Progress("identify")
    datasets = []
    for name, directory in reads:
        fingerprint = _fingerprint(directory, args.layer)
        path = out / f"counts_{name}.npz"
        data = load_dataset(path, name, fingerprint)
        note = "cached"
        if data is None:
            data = accumulate(name, directory, args.layer)
            save_dataset(path, data, fingerprint)
            note = ""
        progress.done(f"counts {name}", int(data.counts.tokens_c.sum()), "labelled tokens", note)
        datasets.append(data)
    first = datasets[0]
    for data in datasets[1:]:
        if (data.moe_layers, data.counts.num_experts, data.top_k) != \
                (first.moe_layers, first.counts.num_experts, first.top_k):
            raise CommandError(f"datasets {first.name} and {data.name} come from different "
                               f"models (MoE layers / experts / top-k differ)")
    rows = competing_rows(first.moe_layers, args.layer)
    decoder_layer = None if args.layer == "all" else first.moe_layers[rows[0]]
    candidates = first.counts.num_experts * len(rows)
    if args.top_n > candidates:
        raise CommandError(f"--top_n {args.top_n} exceeds the {candidates} competing experts")
    all_layers = list(range(first.counts.num_layers))
    present = [c for c in range(len(BEHAVIOURS)) if all(d.counts.tokens_c[c] > 0 for d in datasets)]
    if not present:
        raise CommandError("no behaviour has labelled tokens in every dataset")
    notes = [f"- datasets: {', '.join(d.name for d in datasets)}; Top-{args.top_n} by risk "
             f"difference, competing layer(s): {args.layer}"]
    missing = [BEHAVIOURS[c] for c in range(len(BEHAVIOURS)) if c not in present]
    if missing:
        notes.append(f"- left out (no tokens in some dataset): {', '.join(missing)}")
    names = [BEHAVIOURS[c] for c in present]
    tables: dict[str, list[dict[str, Any]]] = {"expert_sets": []}
    pooled = restricted(first.counts, present, all_layers)
    for data in datasets:
        counts = restricted(data.counts, present, all_layers)
        if data is not first:
            pooled.selected_cle = pooled.selected_cle + counts.selected_cle
            pooled.tokens_c = pooled.tokens_c + counts.tokens_c
        sets = expert_sets_from_scores(counts.risk_difference(), args.top_n, data.moe_layers,
                                       data.top_k, names, layer=decoder_layer)
        save_expert_sets(out / f"expert_sets_{data.name}.json", sets)
        tables["expert_sets"] += expert_set_rows(data.name, sets)
    sets = expert_sets_from_scores(pooled.risk_difference(), args.top_n, first.moe_layers,
                                   first.top_k, names, layer=decoder_layer)
    save_expert_sets(out / "expert_sets.json", sets)
    tables["expert_sets"] += expert_set_rows("pooled", sets)
    progress.done("expert sets", len(datasets) + 1, "files")
    if len(datasets) >= 2:
        bad = [n for n in sweep_ns if not 1 <= n <= candidates]
        if bad:
            notes.append(f"- sweep sizes {bad} dropped (more than the {candidates} competing experts)")
        cross, cross_notes = cross_dataset(datasets, present, rows, args,
                                           [n for n in sweep_ns if n not in bad])
        tables.update(cross)
        notes += cross_notes
        progress.done("cross-dataset", len(cross), "tables")
    else:
        notes.append("- one dataset: the cross-dataset tables (profile correlations, Jaccard, "
                     "shared experts, sweep) need two or more and are skipped")
    for name in ("profile_correlations", "jaccard", "shared_experts", "sweep"):
        if not tables.get(name):  # an earlier run's table this run did not make
            for stale in (out / f"{name}.csv", out / f"{name}.png"):
                stale.unlink(missing_ok=True)
    sections = [f"# Identify\n\n{''.join(n + chr(10) for n in notes)}"]
    for name, table in tables.items():
        if table:
            columns = _columns(name, table)
            write_csv(out / f"{name}.csv", table, columns)
            sections.append(f"## {name.replace('_', ' ')}\n\n{markdown_table(table, columns)}")
    (out / "identify.md").write_text("\n".join(sections))
    write_plots(out, tables)
    progress.done("report", sum(len(t) for t in tables.values()), "rows", str(out / "identify.md"))
    print("\n".join(sections))


def main(argv: Sequence[str]) -> int:
    """``identify`` entry point: 0 done, 2 bad input (``error: ...`` on stderr)."""
    return run_command(build_parser(), argv, _identify)

