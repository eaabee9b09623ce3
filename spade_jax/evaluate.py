"""Held-out evaluation from the command line (the same code the training loop calls).

    python -m spade_jax.evaluate --checkpoint=ckpt/model --suite=RG-Math --suite=RG-Logic \
        --suite=math:data/aime25.jsonl --suite=code:data/lcb_v6.jsonl --samples=4 --out=eval/

--suite (repeatable): RG-Math | RG-Algo | RG-Cog | RG-Logic | rg (all four) |
KIND:PATH with KIND in math, multiple_choice, code, tool (the suite is named after the file
stem; KIND:PATH=NAME names it). --checkpoint is an Orbax model dir (config.json + params/)
or a Hugging Face dir; --tokenizer defaults to it. --policy=scripted:FILE.json replaces the
model with forced outputs (a testing aid, see spade_jax.evaluation.policy.ScriptedPolicy).
Writes results.md, results.csv, results.png, samples.jsonl to --out and prints the table.
Exit status: 0 done, 2 bad arguments or data (the message names the file, line and field).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from spade_jax.evaluation import (
    CodeRunnerConfig,
    DataError,
    EvalConfig,
    SamplerPolicyConfig,
    SuiteConfig,
    evaluate_suites,
    load_policy,
    markdown_table,
    write_report,
)
from spade_jax.evaluation.suites import RG_SUITE_NAMES, SUITE_KINDS


def parse_suite(spec: str, *, problems_per_task: int, max_problems: int | None,
                dataset_seed: int) -> list[SuiteConfig]:
    """One --suite value -> suite configs (see the module docstring for the syntax)."""
    if spec == "rg":
        return [SuiteConfig(n, "reasoning_gym", problems_per_task=problems_per_task,
                            dataset_seed=dataset_seed) for n in RG_SUITE_NAMES]
    if spec in RG_SUITE_NAMES:
        return [SuiteConfig(spec, "reasoning_gym", problems_per_task=problems_per_task,
                            dataset_seed=dataset_seed)]
    kind, sep, rest = spec.partition(":")
    if not sep or kind not in SUITE_KINDS or kind == "reasoning_gym" or not rest:
        raise ValueError(f"--suite {spec!r}: expected one of {list(RG_SUITE_NAMES)}, 'rg' or "
                         f"KIND:PATH with KIND in {[k for k in SUITE_KINDS if k != 'reasoning_gym']}")
    path, _, name = rest.partition("=")
    return [SuiteConfig(name or Path(path).stem, kind, path=path, max_problems=max_problems)]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m spade_jax.evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", help="Orbax (config.json + params/) or HF model dir")
    p.add_argument("--tokenizer", help="tokenizer dir or file (default: the checkpoint dir)")
    p.add_argument("--policy", help="scripted:FILE.json (testing aid: forced outputs)")
    p.add_argument("--suite", action="append", required=True, help="repeatable; see above")
    p.add_argument("--out", default="eval_results", help="output directory")
    p.add_argument("--samples", type=int, default=4, help="samples per problem (n)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max_new_tokens", type=int, default=1024)
    p.add_argument("--max_turns", type=int, default=8, help="turns per tool-task episode")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top_p", type=float, default=0.95)
    p.add_argument("--batch_size", type=int, default=64, help="rows per generate() call")
    p.add_argument("--problems_per_task", type=int, default=10, help="reasoning-gym items/task")
    p.add_argument("--dataset_seed", type=int, default=0, help="reasoning-gym generator seed")
    p.add_argument("--max_problems", type=int, default=None, help="first k problems per file")
    p.add_argument("--time_limit_s", type=float, default=6.0, help="per code test")
    p.add_argument("--title", default="Evaluation")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        suites = [s for spec in args.suite for s in parse_suite(
            spec, problems_per_task=args.problems_per_task, max_problems=args.max_problems,
            dataset_seed=args.dataset_seed)]
        config = EvalConfig(samples_per_problem=args.samples, seed=args.seed,
                            max_new_tokens=args.max_new_tokens, max_turns=args.max_turns,
                            code=CodeRunnerConfig(time_limit_s=args.time_limit_s))
        policy = load_policy(args.checkpoint, tokenizer=args.tokenizer, policy=args.policy,
                             config=SamplerPolicyConfig(temperature=args.temperature,
                                                        top_p=args.top_p,
                                                        batch_size=args.batch_size))
        results = evaluate_suites(policy, suites, config)
    except (ValueError, DataError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    paths = write_report(results, args.out, args.title)
    print(markdown_table(results), end="")
    print(f"wrote {', '.join(str(p) for p in paths.values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
