"""Routes of Reasoning from the command line: read, identify, steer.

    python -m spade_jax.steer read ...      # router / residual telemetry, probes, controls
    python -m spade_jax.steer identify ...  # expert sets per behaviour, cross-dataset analyses
    python -m spade_jax.steer run ...       # steered evaluation (below; ``run`` may be omitted)

Each subcommand prints its own ``--help``. The steered evaluation:

    python -m spade_jax.steer run --checkpoint=ckpt/model --tokenizer=ckpt/model \
        --suite=RG-Math --expert_sets=runs/x/expert_sets.json --suppress=planning \
        --schedule=after_first_answer --samples=4 --out=steer_results/

Runs one benchmark four times: unmodified, steered (suppress / activate the named
behaviours' expert sets through the router hook), random-control (random expert sets of the
same sizes per layer) and prompt-control (the "be concise" system prompt, no hook). Writes
results.md, results.csv and results.png to --out: mean tokens generated per completion,
accuracy (pass@1, scored by the evaluation harness), relative token change vs unmodified and
accuracy delta.

--suite: RG-Math | RG-Algo | RG-Cog | RG-Logic (reasoning-gym, generated offline) |
jsonl:FILE (math problems {"problem", "answer"}, checked by math-verify) | KIND:PATH as in
`python -m spade_jax.evaluate`. --checkpoint: Orbax (config.json + params/) or HF dir.
--expert_sets: a JSON file written by `spade_jax.steering.expert_sets.save_expert_sets`.
Exit status: 0 done, 2 bad arguments, data or expert-set file.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path

from spade_jax.evaluation import DataError, EvalConfig, SuiteConfig, evaluate_suites, load_policy
from spade_jax.evaluation.policy import SamplerPolicy, SamplerPolicyConfig
from spade_jax.steering import compare
from spade_jax.steering.expert_sets import load_expert_sets, steering_masks
from spade_jax.steering.operator import (
    CONCISE_SYSTEM_PROMPT,
    SCHEDULES,
    make_steering_hook,
    random_expert_sets_like,
)
from spade_jax.steering.schedule import TokenPatternDetector


def parse_suite(spec: str, *, problems_per_task: int, max_problems: int | None,
                dataset_seed: int) -> SuiteConfig:
    if spec.startswith("jsonl:"):
        path = spec.removeprefix("jsonl:")
        if not path:
            raise ValueError("--suite jsonl: needs a file, e.g. jsonl:problems.jsonl")
        return SuiteConfig(Path(path).stem, "math", path=path, max_problems=max_problems)
    from spade_jax.evaluate import parse_suite as parse_eval_suite

    suites = parse_eval_suite(spec, problems_per_task=problems_per_task,
                              max_problems=max_problems, dataset_seed=dataset_seed)
    if len(suites) != 1:
        raise ValueError(f"--suite {spec!r}: give exactly one benchmark")
    return suites[0]


def _names(values: Sequence[str] | None) -> list[str]:
    return [n.strip() for v in values or () for n in v.split(",") if n.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m spade_jax.steer run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="Orbax or HF model dir")
    p.add_argument("--tokenizer", help="tokenizer dir or file (default: the checkpoint dir)")
    p.add_argument("--suite", required=True, help="one benchmark; see above")
    p.add_argument("--expert_sets", required=True, help="expert-set JSON file")
    p.add_argument("--suppress", action="append", help="behaviour(s) to suppress (comma list)")
    p.add_argument("--activate", action="append", help="behaviour(s) to activate (comma list)")
    p.add_argument("--schedule", default="always", choices=SCHEDULES)
    p.add_argument("--eps", type=float, default=0.01, help="margin of the steering operator")
    p.add_argument("--samples", type=int, default=1, help="completions per problem")
    p.add_argument("--max_new_tokens", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top_p", type=float, default=1.0)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--problems_per_task", type=int, default=10, help="reasoning-gym items/task")
    p.add_argument("--max_problems", type=int, help="first N problems of a file suite")
    p.add_argument("--dataset_seed", type=int, default=0)
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--random_seed", type=int, default=0, help="seed of the random expert sets")
    p.add_argument("--out", default="steer_results", help="output directory")
    return p


def run(args: argparse.Namespace) -> list[dict[str, object]]:
    suite = parse_suite(args.suite, problems_per_task=args.problems_per_task,
                        max_problems=args.max_problems, dataset_seed=args.dataset_seed)
    sets = load_expert_sets(args.expert_sets)
    masks = steering_masks(sets, suppress=_names(args.suppress), activate=_names(args.activate))
    loaded = load_policy(args.checkpoint, tokenizer=args.tokenizer)
    model, tokenizer = loaded.model, loaded.tokenizer
    cfg = model.config
    if (sets.num_experts, sets.top_k) != (cfg.num_experts, cfg.num_experts_per_tok):
        raise ValueError(
            f"{args.expert_sets}: sets are for num_experts={sets.num_experts}, "
            f"top_k={sets.top_k} but the model has {cfg.num_experts}, {cfg.num_experts_per_tok}")
    bad_layers = sorted(layer for layer in masks
                        if layer >= cfg.num_layers or not cfg.is_moe_layer(layer))
    if bad_layers:
        raise ValueError(f"{args.expert_sets}: layers {bad_layers} are not MoE layers of the model")

    k = cfg.num_experts_per_tok
    detector = None
    if args.schedule == "after_first_answer":
        detector = TokenPatternDetector(compare.answer_token_patterns(tokenizer))
    hooks = {
        "steered": make_steering_hook(masks, k, args.eps, args.schedule),
        "random-control": make_steering_hook(
            # The control set never overlaps the steered one (same size per layer).
            random_expert_sets_like(masks, cfg.num_experts, args.random_seed,
                                    disjoint_from=masks),
            k, args.eps, args.schedule),
    }
    base = SamplerPolicyConfig(temperature=args.temperature, top_p=args.top_p, top_k=0,
                               batch_size=args.batch_size)
    eval_config = EvalConfig(samples_per_problem=args.samples, seed=args.seed,
                             max_new_tokens=args.max_new_tokens)
    results = []
    for condition in compare.CONDITIONS:
        hook = hooks.get(condition)
        config = base
        if condition == "prompt-control":
            config = dataclasses.replace(base, system_prompt=CONCISE_SYSTEM_PROMPT)
        policy = SamplerPolicy(
            model, tokenizer, config, router_hook=hook,
            answer_detector=detector if hook is not None else None)
        (result,) = evaluate_suites(policy, [suite], eval_config)
        results.append(compare.ConditionResult(
            condition, compare.mean_tokens(policy.generated_tokens), result.pass_at_1,
            result.stderr, len(policy.generated_tokens)))
        print(f"{condition}: {results[-1]}", file=sys.stderr)
    rows = compare.table_rows(results)
    steer_desc = ", ".join(f"{verb} {names}" for verb, names in (
        ("suppress", _names(args.suppress)), ("activate", _names(args.activate))) if names)
    compare.write_table(rows, args.out, f"{suite.name}: {steer_desc} ({args.schedule})")
    return rows


# Subcommands with a module of their own (``main(argv) -> exit status``); ``run`` (or no
# subcommand, as before the subcommands existed) is the steered evaluation below.
SUBCOMMANDS = {
    "read": "spade_jax.steering.commands.read",
    "identify": "spade_jax.steering.commands.identify",
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        return importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:])
    if argv and argv[0] == "run":
        argv = argv[1:]
    args = build_parser().parse_args(argv)
    try:
        if args.samples < 1 or args.max_new_tokens < 1:
            raise ValueError("--samples and --max_new_tokens must be >= 1")
        rows = run(args)
    except (ValueError, DataError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(compare.markdown_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
