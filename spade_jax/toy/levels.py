"""Which levels a run's designer wrote, by part of the run, from its ``designs.jsonl``.

    python -m spade_jax.toy.levels runs/chain_s0 runs/chain_s1 --parts 3

For each run: the share of each stated level (``LEVEL = n``) among the valid programs of
each part of the run (thirds by default, split by step). ``designer/difficulty_mean`` is
the mean of the same levels per round; a mean moves with the rare high levels as much as
with the common ones, so where the designer's mass goes (off a level the agent has
mastered, onto the next one) is read here.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from spade_jax.metrics import DESIGNS_FILE


def level_shares(run_dir: str | Path, parts: int = 3) -> list[dict[int, float]]:
    """Per part of the run (by step, ``parts`` equal spans of the steps logged), the share
    of each stated level among the valid programs written in it. Programs stating no
    level are left out; a part with no valid program is an empty dict."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    path = Path(run_dir) / DESIGNS_FILE
    if not path.exists():
        raise FileNotFoundError(f"no {DESIGNS_FILE} in {run_dir} (runs before 2026-12-04 "
                                "wrote none)")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not records:
        return [{} for _ in range(parts)]
    last = max(r["step"] for r in records) + 1
    counts = [Counter() for _ in range(parts)]
    for record in records:
        if record["verdict"] == "valid" and record.get("level") is not None:
            counts[min(parts - 1, record["step"] * parts // last)][int(record["level"])] += 1
    return [{level: n / sum(c.values()) for level, n in sorted(c.items())} for c in counts]


def format_table(runs: Sequence[str | Path], parts: int = 3) -> str:
    """A markdown table: one row per run and part, one column per level."""
    shares = {str(run): level_shares(run, parts) for run in runs}
    levels = sorted({level for per_run in shares.values() for part in per_run for level in part})
    lines = ["| run | part | " + " | ".join(f"L{level}" for level in levels) + " |",
             "|---|---|" + "---|" * len(levels)]
    for run, per_run in shares.items():
        for index, part in enumerate(per_run):
            cells = " | ".join(f"{part.get(level, 0.0):.2f}" for level in levels)
            lines.append(f"| {run} | {index + 1}/{parts} | {cells} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="run directories (each with designs.jsonl)")
    parser.add_argument("--parts", type=int, default=3, help="spans of the run (default 3)")
    args = parser.parse_args(argv)
    print(format_table(args.runs, args.parts))


if __name__ == "__main__":
    main()
