"""Runs the toy world's learning check clean and under each planted fault, and prints
which claims each run passes (issue 29: the check must fail under every fault).

    python scripts/planted_faults.py --workdir runs/faults            # ~2 min a run
    python scripts/planted_faults.py --workdir runs/faults --check designer_path  # ~3.5 min
    python scripts/planted_faults.py --workdir runs/faults --faults none,advantage_sign --seed 1
    python scripts/planted_faults.py --workdir runs/faults --check full   # toy, ~35 min a run

The learning checks are two short runs, each checked on its own claims: ``key_digit:check``
(``--check agent_path``, the default, CI's: the agent's signal path; it has no designer, so
the designer faults cannot show there) and ``toy:check`` (``--check designer_path``: the
designer's). ``--check full`` is the toy world's claims on ``toy``. The runs are one per
fault, in this process (the faults patch the loop and the trainer in memory:
``spade_jax.planted_faults``). Exit status 0 when the clean run passes every claim and
every faulted run fails one.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time
from pathlib import Path

from spade_jax.experiment import load_experiment
from spade_jax.metrics import read_metrics
from spade_jax.planted_faults import FAULTS, planted
from spade_jax.run import run_experiment
from spade_jax.toy.check import check_agent_path, check_designer_path, check_run

CHECKS = {"agent_path": ("key_digit:check", check_agent_path),
          "designer_path": ("toy:check", check_designer_path),
          "full": ("toy", check_run)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", required=True, type=Path)
    parser.add_argument("--faults", default=",".join(("none",) + FAULTS),
                        help="comma-separated: 'none' (the clean run) and fault names")
    parser.add_argument("--experiment", default="",
                        help="the runs' experiment (default: the check's own, below)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every run, as train's --set (e.g. "
                        "warm_start.cache_dir=runs/warm_cache: one warm start for all)")
    parser.add_argument("--check", choices=tuple(CHECKS), default="agent_path",
                        help="agent_path: key_digit:check's claims (check_agent_path); "
                        "designer_path: toy:check's (check_designer_path); full: the toy "
                        "world's claims on toy (check_run)")
    args = parser.parse_args(argv)
    experiment, check = CHECKS[args.check]
    experiment = args.experiment or experiment
    faults = [f for f in args.faults.split(",") if f]
    unknown = [f for f in faults if f != "none" and f not in FAULTS]
    if unknown:
        parser.error(f"unknown fault(s) {unknown}; known: none, {', '.join(FAULTS)}")
    logging.basicConfig(level=logging.WARNING)
    verdicts = {}
    for fault in faults:
        workdir = args.workdir / f"seed{args.seed}_{fault}"
        if not (workdir / "metrics.jsonl").exists():
            workdir.mkdir(parents=True, exist_ok=True)
            config = load_experiment(experiment, [f"seed={args.seed}", *args.set])
            start = time.time()
            with planted(fault) if fault != "none" else contextlib.nullcontext():
                run_experiment(config, workdir)
            print(f"[{fault}] ran in {time.time() - start:.0f} s", flush=True)
        curves = read_metrics(workdir)
        findings = check(curves)
        verdicts[fault] = findings
        print(f"\n[{fault}]\n" + "\n".join(f.line() for f in findings), flush=True)
    names = [f.name for f in next(iter(verdicts.values()))]
    print("\n| run | " + " | ".join(names) + " | check |")
    print("|---|" + "---|" * (len(names) + 1))
    for fault, findings in verdicts.items():
        cells = [("pass" if f.ok else "**FAIL**") + f" ({f.value:.2f})" for f in findings]
        print(f"| {fault} | " + " | ".join(cells)
              + f" | {'passes' if all(f.ok for f in findings) else 'fails'} |")
    clean_ok = all(f.ok for f in verdicts.get("none", []))
    faults_caught = all(not all(f.ok for f in v) for k, v in verdicts.items() if k != "none")
    return 0 if clean_ok and faults_caught else 1


if __name__ == "__main__":
    sys.exit(main())
