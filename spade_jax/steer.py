"""Routes of Reasoning from the command line: read, identify, steer.

    python -m spade_jax.steer read ...      # router / residual telemetry, probes, controls
    python -m spade_jax.steer identify ...  # expert sets per behaviour, cross-dataset analyses
    python -m spade_jax.steer rewind ...    # back up at check starts, regenerate steered / not
    python -m spade_jax.steer run ...       # steered evaluation (below; ``run`` may be omitted)

Each subcommand prints its own ``--help``. The steered evaluation:

    python -m spade_jax.steer run --checkpoint=ckpt/model --tokenizer=ckpt/model \
        --suite=RG-Math --expert_sets=runs/x/expert_sets.json --suppress=planning \
        --schedule=after_first_answer --samples=4 --out=steer_results/

Runs one benchmark four times: unmodified, steered (suppress / activate the named
behaviours' expert sets through the router hook), random-control (random expert sets of the
same sizes per layer, disjoint from the named behaviours' sets) and prompt-control (the "be
concise" system prompt, no hook). Writes results.md, results.csv and results.png to --out:
mean tokens generated per completion, accuracy (pass@1, scored by the evaluation harness),
relative token change vs unmodified and accuracy delta, each with its standard error (over
problems; deltas paired per problem).

--schedule: always | after_first_answer (edit only after the first answer) |
before_first_answer (the cut: edit only until the first answer) | window (edit the first
--window_tokens=W generated tokens, then release). The first answer is found on device by
the text markers of `steering.schedule.DEVICE_ANSWER_PATTERNS` (\\boxed{, "final answer
is/:", "the answer is", **Answer**, a line starting "Answer:"), whatever their tokenisation.

--dose=1,2,4: a dose sweep. For each n, steer with the top n experts of each layer's set
(the order of the expert-set file's lists, or by a "scores" object parallel to "sets" when
the file has one) and a random control of the same sizes disjoint from the full sets; rows
"steered n=2", "random-control n=2", ... replace steered / random-control, and dose.png
plots the token change against n.

--suite: RG-Math | RG-Algo | RG-Cog | RG-Logic (reasoning-gym, generated offline) |
jsonl:FILE (math problems {"problem", "answer"}, checked by math-verify) | KIND:PATH as in
`python -m spade_jax.evaluate`. --checkpoint: Orbax (config.json + params/) or HF dir.
--expert_sets: a JSON file written by `spade_jax.steering.expert_sets.save_expert_sets`.
Exit status: 0 done, 2 bad arguments, data or expert-set file.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from spade_jax.evaluation import DataError, EvalConfig, SuiteConfig, evaluate_suites, load_policy
from spade_jax.evaluation.policy import SamplerPolicy, SamplerPolicyConfig
from spade_jax.steering import compare
from spade_jax.steering.expert_sets import (
    ExpertSetError,
    ExpertSets,
    load_expert_sets,
    steering_masks,
)
from spade_jax.steering.operator import (
    CONCISE_SYSTEM_PROMPT,
    SCHEDULE_DETECTORS,
    SCHEDULES,
    make_steering_hook,
    random_expert_sets_like,
)
from spade_jax.steering.schedule import detector_for_schedule


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
    p.add_argument("--window_tokens", type=int,
                   help="W of --schedule=window: steer the first W generated tokens")
    p.add_argument("--dose", help="dose sweep: comma list of experts per layer, e.g. 1,2,4")
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


def parse_doses(spec: str | None) -> list[int] | None:
    """``"1,2,4"`` -> ``[1, 2, 4]`` (sorted, distinct, each >= 1); None -> None."""
    if spec is None:
        return None
    try:
        doses = sorted({int(n) for n in spec.split(",") if n.strip()})
    except ValueError:
        raise ValueError(f"--dose must be a comma list of integers, got {spec!r}") from None
    if not doses or doses[0] < 1:
        raise ValueError(f"--dose needs integers >= 1, got {spec!r}")
    return doses


def check_schedule(schedule: str, window_tokens: int | None) -> None:
    """The schedule's options, checked before any model is loaded."""
    if schedule == "window":
        detector_for_schedule(schedule, window_tokens=window_tokens)
    elif window_tokens is not None:
        raise ValueError(f"--window_tokens is only for --schedule=window, not {schedule!r}")


def ranked_expert_lists(path: str | Path, sets: ExpertSets, names: Sequence[str]
                        ) -> dict[str, dict[int, list[int]]]:
    """Per behaviour and layer, the experts in rank order: by the file's optional
    ``"scores"`` (``{behaviour: {layer: [score per listed expert]}}``, highest first) where
    given, else in the order the file lists them. (``save_expert_sets`` writes ids sorted,
    so for its files the order is by id unless the lists were reordered.)"""
    raw = json.loads(Path(path).read_text())
    ranked: dict[str, dict[int, list[int]]] = {}
    for name in names:
        listed = {int(layer): list(e) for layer, e in raw["sets"][name].items()}
        scores = (raw.get("scores") or {}).get(name) or {}
        if not isinstance(scores, dict):
            raise ExpertSetError(f"{path}: 'scores' must be {{behaviour: {{layer: [scores]}}}}")
        ranked[name] = {}
        for layer, experts in listed.items():
            layer_scores = scores.get(str(layer))
            if layer_scores is not None:
                if not isinstance(layer_scores, list) or len(layer_scores) != len(experts) \
                        or not all(isinstance(x, int | float) for x in layer_scores):
                    raise ExpertSetError(
                        f"{path}: scores of {name!r} layer {layer} must list one score per "
                        f"expert ({len(experts)} numbers), got {layer_scores!r}")
                order = np.argsort(-np.asarray(layer_scores, np.float64), kind="stable")
                experts = [experts[i] for i in order]
            ranked[name][layer] = experts
    return ranked


def dose_masks(path: str | Path, sets: ExpertSets, suppress: Sequence[str],
               activate: Sequence[str], n: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """The steering masks of the top ``n`` experts per layer of each named set (a layer
    with fewer than ``n`` keeps all of its experts)."""
    ranked = ranked_expert_lists(path, sets, [*suppress, *activate])
    top = ExpertSets(sets.num_experts, sets.top_k,
                     {name: {layer: e[:n] for layer, e in layers.items()}
                      for name, layers in ranked.items()})
    return steering_masks(top, suppress=suppress, activate=activate)


def _condition_result(name: str, policy: SamplerPolicy, result, samples: int,
                      dose: int | None) -> compare.ConditionResult:
    problems = len(result.problem_ids)
    counts = np.asarray(policy.generated_tokens, np.float64)
    # One count per completion, problem-major (tool suites do not report them).
    tokens_ps = counts.reshape(problems, samples) if counts.size == problems * samples else None
    return compare.ConditionResult(
        name, compare.mean_tokens(policy.generated_tokens), result.pass_at_1, result.stderr,
        len(policy.generated_tokens), tokens_ps=tokens_ps, scores_ps=result.scores, dose=dose)


# Arguments that change a condition's result: a re-run into the same --out with the same
# values reuses the conditions already written there; other values are refused.
_RUN_KEYS = ("checkpoint", "tokenizer", "suite", "suppress", "activate", "schedule",
             "window_tokens", "eps", "samples", "max_new_tokens", "temperature", "top_p",
             "problems_per_task", "max_problems", "dataset_seed", "seed", "random_seed", "dose")


class ConditionCache:
    """Each finished condition's result in ``OUT/conditions/``, so an interrupted ``run``
    re-run with the same arguments evaluates only the conditions still missing.
    ``OUT/run.json`` holds the arguments (and the expert-set file's digest); a re-run with
    other values is refused, naming the first that differs."""

    def __init__(self, args: argparse.Namespace) -> None:
        from spade_jax import storage

        self.dir = storage.as_path(args.out) / "conditions"
        key = {name: getattr(args, name) for name in _RUN_KEYS}
        key["expert_sets_sha256"] = hashlib.sha256(Path(args.expert_sets).read_bytes()).hexdigest()
        record = storage.as_path(args.out) / "run.json"
        if record.exists():
            try:
                old = json.loads(record.read_text())
            except json.JSONDecodeError:
                old = None
            if isinstance(old, dict):
                differ = [k for k in key if old.get(k) != key[k]]
                if differ:
                    raise ValueError(
                        f"--out {args.out} holds a run with other arguments ({differ[0]}: "
                        f"{old.get(differ[0])!r}, now {key[differ[0]]!r}); use another --out")
        self.dir.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps(key, indent=1, sort_keys=True))

    def _path(self, condition: str):
        return self.dir / (re.sub(r"[^A-Za-z0-9_.-]+", "_", condition) + ".json")

    def load(self, condition: str) -> compare.ConditionResult | None:
        path = self._path(condition)
        if not path.exists():
            return None
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError:  # cut short by a crash: evaluated again
            return None
        for name in ("tokens_ps", "scores_ps"):
            if data.get(name) is not None:
                data[name] = np.asarray(data[name], np.float64)
        return compare.ConditionResult(**data)

    def save(self, result: compare.ConditionResult) -> None:
        data = dataclasses.asdict(result)
        for name in ("tokens_ps", "scores_ps"):
            if data[name] is not None:
                data[name] = np.asarray(data[name]).tolist()
        self._path(result.condition).write_text(json.dumps(data))


def run(args: argparse.Namespace) -> list[dict[str, object]]:
    check_schedule(args.schedule, args.window_tokens)
    doses = parse_doses(args.dose)
    suite = parse_suite(args.suite, problems_per_task=args.problems_per_task,
                        max_problems=args.max_problems, dataset_seed=args.dataset_seed)
    sets = load_expert_sets(args.expert_sets)
    suppress, activate = _names(args.suppress), _names(args.activate)
    masks = steering_masks(sets, suppress=suppress, activate=activate)
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
    first_answer = None
    if SCHEDULE_DETECTORS.get(args.schedule) == "first_answer":
        first_answer = compare.answer_detector(tokenizer)
    detector = detector_for_schedule(args.schedule, first_answer=first_answer,
                                     window_tokens=args.window_tokens)

    def hooks_for(steer_masks, suffix: str = "") -> dict[str, object]:
        return {
            f"steered{suffix}": make_steering_hook(steer_masks, k, args.eps, args.schedule),
            f"random-control{suffix}": make_steering_hook(
                # The control never overlaps the named behaviours' full sets (same sizes per
                # layer as the steered sets).
                random_expert_sets_like(steer_masks, cfg.num_experts, args.random_seed,
                                        disjoint_from=masks),
                k, args.eps, args.schedule),
        }

    # (condition, hook, dose) in table order.
    plan: list[tuple[str, object, int | None]] = [("unmodified", None, None)]
    if doses is None:
        plan += [(name, hook, None) for name, hook in hooks_for(masks).items()]
    else:
        for n in doses:
            plan += [(name, hook, n) for name, hook in hooks_for(
                dose_masks(args.expert_sets, sets, suppress, activate, n), f" n={n}").items()]
    plan.append(("prompt-control", None, None))

    base = SamplerPolicyConfig(temperature=args.temperature, top_p=args.top_p, top_k=0,
                               batch_size=args.batch_size)
    eval_config = EvalConfig(samples_per_problem=args.samples, seed=args.seed,
                             max_new_tokens=args.max_new_tokens)
    cache = ConditionCache(args)
    results = []
    for condition, hook, dose in plan:
        done = cache.load(condition)
        if done is not None:
            results.append(done)
            print(f"{condition}: reused from {cache.dir}", file=sys.stderr)
            continue
        config = base
        if condition == "prompt-control":
            config = dataclasses.replace(base, system_prompt=CONCISE_SYSTEM_PROMPT)
        policy = SamplerPolicy(
            model, tokenizer, config, router_hook=hook,
            answer_detector=detector if hook is not None else None)
        (result,) = evaluate_suites(policy, [suite], eval_config)
        results.append(_condition_result(condition, policy, result, args.samples, dose))
        cache.save(results[-1])
        print(f"{condition}: {results[-1]}", file=sys.stderr)
    rows = compare.table_rows(results)
    steer_desc = ", ".join(f"{verb} {names}" for verb, names in (
        ("suppress", suppress), ("activate", activate)) if names)
    schedule = args.schedule + (f", W={args.window_tokens}" if args.schedule == "window" else "")
    compare.write_table(rows, args.out, f"{suite.name}: {steer_desc} ({schedule})")
    return rows


# Subcommands with a module of their own (``main(argv) -> exit status``); ``run`` (or no
# subcommand, as before the subcommands existed) is the steered evaluation below.
SUBCOMMANDS = {
    "read": "spade_jax.steering.commands.read",
    "identify": "spade_jax.steering.commands.identify",
    "rewind": "spade_jax.steering.commands.rewind",
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
