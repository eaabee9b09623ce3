"""Hint-regret filter from the command line: keep the frontier tasks of a JSONL file.

    python -m spade_jax.filter --tasks=tasks.jsonl --checkpoint=ckpt/model --out=filtered/ \
        --samples_hint=16 --samples_no_hint=16

Each task is played `--samples_hint` times with its hint and `--samples_no_hint` times
without; regret = mean return with the hint - without (the SPADE designer reward's regret)
sorts it into frontier (regret > --frontier_regret: keep), mastered (better arm's mean >=
--mastered_return: drop) or intractable / broken (drop). Task format: see
spade_jax.hint_filter.tasks. Writes frontier.jsonl, mastered.jsonl, intractable.jsonl (each
task with its statistics), summary.json and regret_vs_win_rate.png to --out.

Resumable: progress.jsonl in --out records finished chunks; rerunning the same command
continues where a crash or interrupt stopped, without re-sampling finished tasks.
--policy=scripted:FILE.json replaces the model with forced outputs (a testing aid).
Exit status: 0 done, 2 bad arguments or input (the message names the line and field).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from spade_jax.evaluation import DataError, SamplerPolicyConfig, load_policy
from spade_jax.hint_filter import FilterConfig, load_filter_tasks, run_filter, write_outputs
from spade_jax.spade import DesignerRewardConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m spade_jax.filter", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", required=True, help="JSONL of tasks")
    p.add_argument("--out", required=True, help="output directory (also holds the progress)")
    p.add_argument("--checkpoint", help="Orbax (config.json + params/) or HF model dir")
    p.add_argument("--tokenizer", help="tokenizer dir or file (default: the checkpoint dir)")
    p.add_argument("--policy", help="scripted:FILE.json (testing aid: forced outputs)")
    p.add_argument("--samples_hint", type=int, default=16)
    p.add_argument("--samples_no_hint", type=int, default=16)
    p.add_argument("--success_threshold", type=float, default=1.0)
    p.add_argument("--frontier_regret", type=float, default=0.2)
    p.add_argument("--mastered_return", type=float, default=0.5)
    p.add_argument("--max_tasks", type=int, default=None, help="random sub-sample size")
    p.add_argument("--subsample_seed", type=int, default=0)
    p.add_argument("--chunk_size", type=int, default=8, help="tasks per batch and commit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max_new_tokens", type=int, default=1024)
    p.add_argument("--max_turns", type=int, default=8, help="turns per program episode")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top_p", type=float, default=1.0)
    p.add_argument("--batch_size", type=int, default=64, help="rows per generate() call")
    p.add_argument("--no_validate", action="store_true", help="skip validate_program")
    p.add_argument("--restart", action="store_true", help="discard progress in --out")
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = FilterConfig(
            samples_hint=args.samples_hint, samples_no_hint=args.samples_no_hint,
            success_threshold=args.success_threshold,
            reward=DesignerRewardConfig(frontier_regret=args.frontier_regret,
                                        mastered_return=args.mastered_return),
            max_tasks=args.max_tasks, subsample_seed=args.subsample_seed,
            chunk_size=args.chunk_size, seed=args.seed, max_new_tokens=args.max_new_tokens,
            max_turns=args.max_turns, validate_programs=not args.no_validate)
        tasks = load_filter_tasks(args.tasks)
        policy = load_policy(args.checkpoint, tokenizer=args.tokenizer, policy=args.policy,
                             config=SamplerPolicyConfig(temperature=args.temperature,
                                                        top_p=args.top_p,
                                                        batch_size=args.batch_size))
        stats = run_filter(policy, tasks, args.out, config, restart=args.restart,
                           progress=not args.no_progress)
    except (ValueError, DataError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    summary = write_outputs(tasks, stats, args.out, config)
    print(json.dumps({"counts": summary["counts"], "out": args.out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
