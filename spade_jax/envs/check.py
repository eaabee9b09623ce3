"""CLI: validate an environment program and print a JSON report.

    python -m spade_jax.envs.check PROGRAM.py [--hint TEXT | --hint-file FILE]
                                   [--allow-weak-isolation] [--deadline SECONDS]
                                   [--contract auto|paper|reference|tool|reference_tool_use] [--max-turns N]

Exit status: 0 if the program is valid, 1 if it is not, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import json
import sys

from spade_jax.envs.config import SandboxConfig
from spade_jax.envs.contract import ALL_CONTRACTS, AUTO_CONTRACT, REFERENCE_MAX_TURNS
from spade_jax.envs.pool import EnvPool
from spade_jax.envs.validate import validate_program


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spade_jax.envs.check", description=__doc__)
    parser.add_argument("program", help="path of the environment program (.py)")
    hints = parser.add_mutually_exclusive_group()
    hints.add_argument("--hint", help="the designer's hint text")
    hints.add_argument("--hint-file", help="file holding the designer's hint")
    parser.add_argument("--allow-weak-isolation", action="store_true")
    parser.add_argument("--deadline", type=float, default=5.0, help="seconds per call")
    parser.add_argument(
        "--contract", choices=[AUTO_CONTRACT, *ALL_CONTRACTS], default=AUTO_CONTRACT,
        help="program contract (auto: paper if it defines class Environment)",
    )
    parser.add_argument(
        "--max-turns", type=int, default=REFERENCE_MAX_TURNS,
        help="turn budget of the reference and tool contracts",
    )
    args = parser.parse_args(argv)
    try:
        with open(args.program, encoding="utf-8") as f:
            source = f.read()
        hint = args.hint
        if args.hint_file is not None:
            with open(args.hint_file, encoding="utf-8") as f:
                hint = f.read()
    except (OSError, UnicodeDecodeError) as err:
        print(f"error: cannot read input: {err}", file=sys.stderr)
        return 2
    try:
        config = SandboxConfig(
            call_deadline_s=args.deadline, allow_weak_isolation=args.allow_weak_isolation
        )
    except ValueError as err:
        print(f"error: --deadline: {err}", file=sys.stderr)
        return 2
    if args.max_turns < 1:
        print(f"error: --max-turns must be >= 1, got {args.max_turns}", file=sys.stderr)
        return 2
    with EnvPool(config) as pool:
        report = validate_program(
            source, hint, pool=pool, contract=args.contract, max_turns=args.max_turns
        )
        payload = json.loads(report.to_json())
        payload["program"] = args.program
        payload["isolation"] = pool.isolation_report().as_dict()
    print(json.dumps(payload, indent=2))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
