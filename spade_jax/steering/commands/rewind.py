"""``python -m spade_jax.steer rewind``: does steering change the *next plan* at a check?

The paper's rewind experiment (section 6.4) as one resumable command. In every reasoning
trace, find the check starts (segments that open with a verification cue such as "Wait" or
"Let me double-check"), back up one segment (to the start of the segment before the check),
and regenerate from that prefix under each condition with the same seed: unmodified, steered
(the named behaviours' expert sets suppressed / activated through the router hook) and,
optionally, a random control (sets of the same sizes per layer, disjoint from the steered
ones). Each continuation is checked for the end of thinking and its next plan is labelled by
a judge: ``new_round`` (opens another round of checking / a new angle) or ``wrap_up``
(moves to the answer); ``unparsed`` when the judge's reply is not exactly one of the two.

    python -m spade_jax.steer rewind --checkpoint=ckpt/model --traces=traces.jsonl \\
        --expert_sets=runs/x/expert_sets.json --suppress=planning --out=runs/rewind \\
        [--conditions=none,steered,random] [--max_new_tokens=170] [--temperature=0.6] \\
        [--seed=0] [--judge=none|policy|scripted:FILE.json|JUDGE_CHECKPOINT] \\
        [--check_marker=REGEX ...] [--max_points=N] [--batch_size=16]

Inputs:
  --traces  JSONL, one trace per line: {"trace_id": "t1", "prompt": ..., "text": "..."} or
            {"trace_id": "t1", "prompt": ..., "token_ids": [..]}. "text" / "token_ids" is the
            generated reasoning (the model's tokens after the prompt). "prompt" is a string
            (one user turn) or a list of chat messages ({"role", "content"}), rendered with
            the chat template and a generation prompt (--enable_thinking, default on); no
            "prompt": the prefix is the trace tokens alone.
  --check_marker  a regex or phrase (repeat the flag for several; default
            DEFAULT_CHECK_MARKERS) matched case-insensitively at the start of a segment
            (after leading spaces and markup), ending at a word boundary.

Conditions (--conditions, a comma list, the first is the reference of the "changed"
column): none (no hook), steered (--suppress / --activate), random (random sets like the
steered ones, disjoint from them; --random_seed). A repeated name runs again as "none#2"
(``none,none`` checks that rewinding regenerates the same text when nothing is steered).
Every condition draws point p's tokens from the same random stream (seed, p).

End of thinking: the continuation generated ``</think>`` or an end-of-turn token (both stop
generation). ``answer_stated``: the continuation contains a first-answer marker
(``steering.schedule.find_first_answer``).

Outputs in --out:
  rewind.json     the run's settings and input digests (a re-run with others is refused)
  points.jsonl    the check starts found: trace_id, point, check segment, back-up token
  rewind.jsonl    one row per (point, condition): trace_id, point, global_point, condition,
                  text, tokens, token_ids, done_reason, ended_thinking, answer_stated,
                  label, judge_output
  rewind.md/.csv  per condition: points, mean tokens +- SE, end-of-thinking rate +- SE,
                  share of points whose text differs from the reference condition, label
                  counts
  rewind.png      bar charts of the same
Resuming: points run in fixed batches (--batch_size); a batch whose rows are all in
rewind.jsonl is skipped. Exit status: 0 done, 2 bad input (one ``error:`` line).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from spade_jax.steering.commands._common import (
    CommandError,
    Progress,
    check_run_record,
    file_digest,
    markdown_table,
    run_command,
    save_run_record,
    trace_content,
    trace_records,
    write_csv,
)

CONDITIONS = ("none", "steered", "random")
LABELS = ("new_round", "wrap_up", "unparsed")
DEFAULT_CHECK_MARKERS: tuple[str, ...] = (
    r"wait",
    r"hold on",
    r"let me (?:just )?(?:double[- ]?|re-?)?check",
    r"let me (?:just )?(?:re-?)?verify",
    r"let me confirm",
    r"let me make sure",
    r"let's (?:double[- ]?|re-?)?check",
    r"let's verify",
    r"double[- ]?check(?:ing)?",
    r"to (?:double[- ]?)?(?:check|verify|confirm)",
    r"verify(?:ing)?",
    r"checking",
)
TABLE_COLUMNS = ("condition", "points", "mean_tokens", "tokens_se", "end_of_thinking_rate",
                 "end_of_thinking_se", "changed", "new_round", "wrap_up", "unparsed")
_LEAD = re.compile(r"^[\s*_#>\-\"'`(\[]*")

JUDGE_PROMPT = (
    "You are reading part of a model's step-by-step reasoning. CONTEXT is the reasoning so "
    "far; CONTINUATION is what the model wrote next. Decide what the next plan in the "
    "CONTINUATION does:\n"
    "- new_round: it opens another round of work: re-checks or verifies an earlier result, "
    "recomputes something, or tries a new angle or approach.\n"
    "- wrap_up: it moves to finishing: accepts the result, summarises, states the final "
    "answer or ends the reasoning.\n"
    "Reply with exactly one word, new_round or wrap_up, and nothing else.\n\n"
    "CONTEXT:\n{context}\n\nCONTINUATION:\n{continuation}\n"
)


# ---------------------------------------------------------------- arguments


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m spade_jax.steer rewind", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="Orbax or HF model dir")
    p.add_argument("--tokenizer", help="tokenizer dir or file (default: the checkpoint dir)")
    p.add_argument("--traces", required=True, help="traces JSONL (trace_id, prompt, text|token_ids)")
    p.add_argument("--expert_sets", help="expert-set JSON file (needed by steered / random)")
    p.add_argument("--suppress", action="append", help="behaviour(s) to suppress (comma list)")
    p.add_argument("--activate", action="append", help="behaviour(s) to activate (comma list)")
    p.add_argument("--conditions", default="none,steered",
                   help=f"comma list of {', '.join(CONDITIONS)} (default: none,steered)")
    p.add_argument("--check_marker", "--check_markers", action="append", dest="check_markers",
                   help="regex / phrase opening a check (repeatable; default: a list of "
                        "verification cues)")
    p.add_argument("--out", required=True, help="output dir (re-run to resume)")
    p.add_argument("--max_new_tokens", type=int, default=170)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top_p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (same for every condition)")
    p.add_argument("--random_seed", type=int, default=0, help="seed of the random expert sets")
    p.add_argument("--eps", type=float, default=0.01, help="margin of the steering operator")
    p.add_argument("--judge", default="none",
                   help="none | policy (the model itself) | scripted:FILE.json | a checkpoint dir")
    p.add_argument("--judge_max_new_tokens", type=int, default=32)
    p.add_argument("--judge_context", type=int, default=4,
                   help="segments before the back-up point shown to the judge")
    p.add_argument("--enable_thinking", default="true", choices=("true", "false"),
                   help="chat template's enable_thinking for the prompt")
    p.add_argument("--max_points", type=int, help="first N check starts only")
    p.add_argument("--max_segment_tokens", type=int, default=125, help="segment length cap")
    p.add_argument("--batch_size", type=int, default=16, help="points per generate call")
    return p


def _names(values: Sequence[str] | None) -> list[str]:
    return [n.strip() for v in values or () for n in v.split(",") if n.strip()]


def parse_conditions(spec: str) -> list[str]:
    """``"none,steered,none"`` -> ``["none", "steered", "none#2"]``."""
    names, seen = [], {}
    for name in (n.strip() for n in spec.split(",")):
        if not name:
            continue
        if name not in CONDITIONS:
            raise CommandError(f"--conditions: unknown {name!r}; choose from {CONDITIONS}")
        seen[name] = seen.get(name, 0) + 1
        names.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    if not names:
        raise CommandError("--conditions: name at least one condition")
    return names


def base_condition(name: str) -> str:
    return name.split("#", 1)[0]


def compile_markers(markers: Sequence[str]) -> list[re.Pattern]:
    compiled = []
    for marker in markers:
        if not marker.strip():
            raise CommandError("--check_marker: empty marker")
        try:
            compiled.append(re.compile(rf"(?:{marker})(?!\w)", re.IGNORECASE))
        except re.error as err:
            raise CommandError(f"--check_marker {marker!r}: invalid regex ({err})") from None
    return compiled


def opens_check(text: str, markers: Sequence[re.Pattern]) -> bool:
    """Whether a segment's text starts (after spaces and markup) with a check marker."""
    body = text[_LEAD.match(text).end():]
    return any(m.match(body) for m in markers)


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    traces = Path(args.traces)
    if not traces.is_file():
        raise CommandError(f"--traces {traces}: no such file")
    if not Path(args.checkpoint).exists():
        raise CommandError(f"--checkpoint {args.checkpoint}: no such directory")
    if args.max_new_tokens < 1 or args.batch_size < 1 or args.judge_max_new_tokens < 1:
        raise CommandError("--max_new_tokens, --batch_size and --judge_max_new_tokens must be >= 1")
    if not args.temperature >= 0 or not 0 < args.top_p <= 1:
        raise CommandError("--temperature must be >= 0 and --top_p in (0, 1]")
    if args.max_points is not None and args.max_points < 1:
        raise CommandError("--max_points must be >= 1")
    if args.judge_context < 0:
        raise CommandError("--judge_context must be >= 0")
    conditions = parse_conditions(args.conditions)
    suppress, activate = _names(args.suppress), _names(args.activate)
    steers = any(base_condition(c) != "none" for c in conditions)
    if steers and not (suppress or activate):
        raise CommandError("conditions steered / random need --suppress or --activate")
    if steers and not args.expert_sets:
        raise CommandError("conditions steered / random need --expert_sets")
    markers = list(args.check_markers or DEFAULT_CHECK_MARKERS)
    compile_markers(markers)
    judge = args.judge.strip()
    if judge.startswith("scripted:"):
        if not Path(judge.removeprefix("scripted:")).is_file():
            raise CommandError(f"--judge {judge}: no such script file")
    elif judge not in ("none", "policy") and not Path(judge).exists():
        raise CommandError(f"--judge {judge}: not none, policy, scripted:FILE or a checkpoint dir")
    sets_path = Path(args.expert_sets) if args.expert_sets and steers else None
    return {
        "checkpoint": str(Path(args.checkpoint).resolve()),
        "tokenizer": str(Path(args.tokenizer).resolve()) if args.tokenizer else None,
        "traces": str(traces.resolve()), "traces_sha256": file_digest(traces),
        "expert_sets": str(sets_path.resolve()) if sets_path else None,
        "expert_sets_sha256": file_digest(sets_path) if sets_path and sets_path.is_file() else None,
        "suppress": suppress if steers else [], "activate": activate if steers else [],
        "conditions": conditions, "check_markers": markers,
        "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
        "top_p": args.top_p, "seed": args.seed, "random_seed": args.random_seed,
        "eps": args.eps, "judge": judge, "judge_max_new_tokens": args.judge_max_new_tokens,
        "judge_context": args.judge_context, "enable_thinking": args.enable_thinking == "true",
        "max_points": args.max_points, "max_segment_tokens": args.max_segment_tokens,
    }


# ---------------------------------------------------------------- traces and points


@dataclasses.dataclass(frozen=True)
class Trace:
    trace_id: str
    prompt: str | list[dict[str, str]] | None
    text: str | None
    token_ids: tuple[int, ...] | None


@dataclasses.dataclass(frozen=True)
class Point:
    """One check start: regenerate from ``prefix`` (prompt + trace[:backup])."""

    trace_id: str
    point: int  # index among the trace's check starts
    global_point: int  # index among all points of the run (the random stream)
    check_segment: int
    backup_token: int  # trace token where the regeneration starts
    prefix: tuple[int, ...]
    context: str  # the judge's context: the last segments before the back-up point
    check_text: str
    original: str  # the trace's own text from the back-up point on (first few segments)


def _is_messages(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str)
        and isinstance(m.get("content"), str) for m in prompt)


def load_traces(path: Path) -> list[Trace]:
    """Every trace of the file; errors name the file and line."""
    traces: list[Trace] = []
    for where, trace_id, obj in trace_records(path):
        prompt = obj.get("prompt")
        if prompt is not None and not (isinstance(prompt, str) and prompt) \
                and not _is_messages(prompt):
            raise CommandError(f"{where}: 'prompt' must be a non-empty string or a list of "
                               f"{{'role', 'content'}} messages")
        traces.append(Trace(trace_id, prompt, *trace_content(where, trace_id, obj)))
    if not traces:
        raise CommandError(f"--traces {path}: no traces")
    return traces


def prompt_ids(tokenizer: Any, prompt: Any, enable_thinking: bool) -> list[int]:
    if prompt is None:
        return []
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                              enable_thinking=enable_thinking))


def find_points(traces: Sequence[Trace], tokenizer: Any, settings: dict[str, Any]
                ) -> tuple[list[Point], int]:
    """The check starts of every trace, in file order (at most ``max_points``), and how
    many were passed over for lack of a segment before them."""
    from spade_jax.steering.commands.read import token_texts
    from spade_jax.steering.segment import SegmenterConfig, segment_tokens

    markers = compile_markers(settings["check_markers"])
    config = SegmenterConfig(max_tokens=settings["max_segment_tokens"])
    points: list[Point] = []
    first_segment = 0
    for trace in traces:
        ids = list(trace.token_ids) if trace.token_ids is not None else tokenizer.encode(trace.text)
        if not ids:
            raise CommandError(f"trace {trace.trace_id!r}: the text encodes to no tokens")
        if max(ids) >= tokenizer.vocab_size:
            raise CommandError(f"trace {trace.trace_id!r}: token ids outside the tokenizer's "
                               f"vocabulary [0, {tokenizer.vocab_size})")
        texts = token_texts(tokenizer, ids)
        segments = segment_tokens(texts, config)
        seg_texts = ["".join(texts[s.start:s.end]) for s in segments]
        prompt = prompt_ids(tokenizer, trace.prompt, settings["enable_thinking"])
        k = 0
        for index, text in enumerate(seg_texts):
            if not opens_check(text, markers):
                continue
            if index == 0:
                first_segment += 1
                continue
            backup = segments[index - 1].start
            lo = max(0, index - 1 - settings["judge_context"])
            points.append(Point(
                trace.trace_id, k, len(points), index, backup, tuple(prompt + ids[:backup]),
                "".join(seg_texts[lo:index - 1]), text.strip(),
                "".join(seg_texts[index - 1:index + 3])))
            k += 1
            if settings["max_points"] is not None and len(points) >= settings["max_points"]:
                return points, first_segment
    return points, first_segment


# ---------------------------------------------------------------- judge


def judge_prompt(context: str, continuation: str) -> str:
    return JUDGE_PROMPT.format(context=context.strip() or "(start of the reasoning)",
                               continuation=continuation.strip() or "(nothing)")


def parse_plan_label(reply: str) -> str:
    """``new_round`` / ``wrap_up`` when the whole reply (a leading ``<think>`` block,
    spaces, markup and a final period aside) is that label, else ``unparsed``."""
    text = re.sub(r"(?s)^\s*<think>.*?</think>", "", reply).strip()
    text = text.strip("*`\"'. \n\t").lower()
    text = re.sub(r"[\s-]+", "_", text)
    return text if text in ("new_round", "wrap_up") else "unparsed"


class PlanJudge:
    """Labels continuations through a ``TextPolicy`` (the model itself, another checkpoint
    or a scripted policy) as the judge protocol's ``PolicyJudge`` does, a batch per call."""

    def __init__(self, policy: Any, max_new_tokens: int, seed: int) -> None:
        from spade_jax.steering.labels import PolicyJudge, PolicyJudgeConfig

        self.judge = PolicyJudge(policy, PolicyJudgeConfig(max_new_tokens=max_new_tokens,
                                                           seed=seed))

    def __call__(self, prompts: Sequence[str]) -> list[str]:
        if not prompts:
            return []
        config = self.judge.config
        out = self.judge.policy.complete([[{"role": "user", "content": p}] for p in prompts],
                                         n=1, seed=config.seed,
                                         max_new_tokens=config.max_new_tokens)
        return [texts[0] for texts in out]


def make_judge(settings: dict[str, Any], model: Any, tokenizer: Any) -> PlanJudge | None:
    from spade_jax.evaluation.policy import SamplerPolicy, SamplerPolicyConfig, load_policy

    spec = settings["judge"]
    if spec == "none":
        return None
    config = SamplerPolicyConfig(temperature=0.0, top_p=1.0)
    if spec == "policy":
        policy = SamplerPolicy(model, tokenizer, config)
    elif spec.startswith("scripted:"):
        policy = load_policy(policy=spec)
    else:
        policy = load_policy(spec, config=config)
    return PlanJudge(policy, settings["judge_max_new_tokens"], settings["seed"])


# ---------------------------------------------------------------- generation


def condition_hooks(settings: dict[str, Any], model_config: Any) -> dict[str, Any]:
    """Router hook per condition (None: unmodified)."""
    from spade_jax.steering.expert_sets import load_expert_sets
    from spade_jax.steering.operator import make_steering_hook, random_expert_sets_like

    conditions = settings["conditions"]
    if all(base_condition(c) == "none" for c in conditions):
        return dict.fromkeys(conditions)
    masks = expert_masks(settings)
    cfg = model_config
    sets = load_expert_sets(settings["expert_sets"])
    if (sets.num_experts, sets.top_k) != (cfg.num_experts, cfg.num_experts_per_tok):
        raise CommandError(
            f"{settings['expert_sets']}: sets are for num_experts={sets.num_experts}, "
            f"top_k={sets.top_k} but the model has {cfg.num_experts}, {cfg.num_experts_per_tok}")
    bad = sorted(layer for layer in masks if layer >= cfg.num_layers or not cfg.is_moe_layer(layer))
    if bad:
        raise CommandError(f"{settings['expert_sets']}: layers {bad} are not MoE layers of the model")
    k, eps = cfg.num_experts_per_tok, settings["eps"]
    hooks: dict[str, Any] = {}
    for name in conditions:
        kind = base_condition(name)
        if kind == "none":
            hooks[name] = None
        elif kind == "steered":
            hooks[name] = make_steering_hook(masks, k, eps, "always")
        else:
            hooks[name] = make_steering_hook(
                random_expert_sets_like(masks, cfg.num_experts, settings["random_seed"],
                                        disjoint_from=masks), k, eps, "always")
    return hooks


def expert_masks(settings: dict[str, Any]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    from spade_jax.steering.expert_sets import load_expert_sets, steering_masks

    sets = load_expert_sets(settings["expert_sets"])
    return steering_masks(sets, suppress=settings["suppress"], activate=settings["activate"])


def stop_ids(tokenizer: Any) -> list[int]:
    """The ids that end thinking: end of turn, and ``</think>`` where it is one token."""
    from spade_jax.tokenizers.base import THINK_TOKENS

    think = tokenizer.encode(THINK_TOKENS[1])
    return sorted(set(tokenizer.eos_ids) | (set(think) if len(think) == 1 else set()))


def _mean_se(values: Sequence[float]) -> tuple[float, float]:
    x = np.asarray(values, np.float64)
    if x.size == 0:
        return float("nan"), float("nan")
    se = float(x.std(ddof=1) / math.sqrt(x.size)) if x.size > 1 else float("nan")
    return float(x.mean()), se


def summarise(rows: Sequence[dict[str, Any]], conditions: Sequence[str]) -> list[dict[str, Any]]:
    """Per condition: points, mean tokens +- SE, end-of-thinking rate +- SE, the share of
    points whose text differs from the first condition's, label counts."""
    reference = {(r["trace_id"], r["point"]): r["text"] for r in rows
                 if r["condition"] == conditions[0]}
    table = []
    for name in conditions:
        mine = [r for r in rows if r["condition"] == name]
        tokens, tokens_se = _mean_se([r["tokens"] for r in mine])
        ended, ended_se = _mean_se([float(r["ended_thinking"]) for r in mine])
        paired = [r for r in mine if (r["trace_id"], r["point"]) in reference]
        changed = (sum(r["text"] != reference[(r["trace_id"], r["point"])] for r in paired)
                   / len(paired)) if paired else float("nan")
        row = {"condition": name, "points": len(mine), "mean_tokens": tokens,
               "tokens_se": tokens_se, "end_of_thinking_rate": ended,
               "end_of_thinking_se": ended_se, "changed": changed}
        for label in LABELS:
            row[label] = sum(r["label"] == label for r in mine)
        table.append(row)
    return table


def write_report(out: Path, table: list[dict[str, Any]], title: str, notes: Sequence[str],
                 judged: bool) -> None:
    columns = TABLE_COLUMNS if judged else TABLE_COLUMNS[:-len(LABELS)]
    (out / "rewind.md").write_text(f"# Rewind: {title}\n\n" + "".join(f"{n}\n" for n in notes)
                                   + "\n" + markdown_table(table, columns))
    write_csv(out / "rewind.csv", table, columns)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 3 if judged else 2
    fig, axes = plt.subplots(1, panels, figsize=(3.6 * panels, 3.6))
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.22, top=0.85, wspace=0.35)
    names = [r["condition"] for r in table]
    x = np.arange(len(names))
    for ax, key, se, label in ((axes[0], "mean_tokens", "tokens_se", "mean tokens"),
                               (axes[1], "end_of_thinking_rate", "end_of_thinking_se",
                                "end-of-thinking rate")):
        values = [r[key] for r in table]
        errors = [0.0 if r[se] != r[se] else r[se] for r in table]
        ax.bar(x, values, yerr=errors, capsize=3, color="C0")
        ax.set_xticks(x, names, rotation=20)
        ax.set_ylabel(label)
    if judged:
        bottom = np.zeros(len(names))
        for i, label in enumerate(LABELS):
            counts = np.asarray([r[label] for r in table], np.float64)
            axes[2].bar(x, counts, bottom=bottom, label=label, color=f"C{i + 1}")
            bottom += counts
        axes[2].set_xticks(x, names, rotation=20)
        axes[2].set_ylabel("next plan (points)")
        axes[2].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.savefig(out / "rewind.png", dpi=100)
    plt.close(fig)


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows already written (a torn last line from a crash is dropped)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def _rewind(args: argparse.Namespace) -> None:
    from spade_jax.steering.schedule import find_first_answer
    from spade_jax.tokenizers import load_tokenizer

    progress = Progress("rewind")
    settings = _settings(args)
    out = Path(args.out)
    if any(base_condition(c) != "none" for c in settings["conditions"]):
        expert_masks(settings)  # unknown behaviours / bad sets: before the model loads
    traces = load_traces(Path(settings["traces"]))
    tokenizer = load_tokenizer(settings["tokenizer"] or settings["checkpoint"])
    points, at_start = find_points(traces, tokenizer, settings)
    if not points:
        raise CommandError(f"--traces {settings['traces']}: no check starts found (markers: "
                           f"{settings['check_markers']}; a check in a trace's first segment "
                           f"has nothing to back up to: {at_start})")
    recorded = check_run_record(out / "rewind.json", settings, "rewind")
    out.mkdir(parents=True, exist_ok=True)
    (out / "points.jsonl").write_text("".join(json.dumps({
        "trace_id": p.trace_id, "point": p.point, "global_point": p.global_point,
        "check_segment": p.check_segment, "backup_token": p.backup_token,
        "prefix_tokens": len(p.prefix), "check_text": p.check_text,
        "original": p.original}) + "\n" for p in points))

    conditions = settings["conditions"]
    rows_path = out / "rewind.jsonl"
    rows = read_rows(rows_path)
    done = {(r["trace_id"], r["point"], r["condition"]) for r in rows}
    batches = [points[i:i + args.batch_size] for i in range(0, len(points), args.batch_size)]
    todo = [b for b in batches
            if any((p.trace_id, p.point, c) not in done for p in b for c in conditions)]
    progress.done("points", len(points), "check starts",
                  f"{len(traces)} traces, {len(batches) - len(todo)} of {len(batches)} "
                  f"batches done before" + (f", {at_start} in a first segment skipped"
                                            if at_start else ""))
    if todo:
        from spade_jax.evaluation.policy import load_policy
        from spade_jax.rollout.sampler import SamplerConfig, sample

        loaded = load_policy(settings["checkpoint"], tokenizer=settings["tokenizer"])
        model = loaded.model
        hooks = condition_hooks(settings, model.config)
        judge = make_judge(settings, model, loaded.tokenizer)
        if not recorded:  # only once the model took the inputs: a fixed file may be re-run
            save_run_record(out / "rewind.json", settings, "rewind")
        stops = stop_ids(tokenizer)
        sampler = SamplerConfig(max_new_tokens=settings["max_new_tokens"],
                                temperature=settings["temperature"], top_p=settings["top_p"],
                                seed=settings["seed"])
        with rows_path.open("a", encoding="utf-8") as sink:
            for batch in todo:
                new_rows, generated = [], 0
                for name in conditions:
                    # Row r of the call draws from stream (seed, global_point): the same
                    # stream in every condition and on every resume.
                    result = sample(model, [list(p.prefix) for p in batch], sampler,
                                    stop_tokens=stops, router_hook=hooks[name],
                                    _row_offset=batch[0].global_point)
                    for p, ids, reason in zip(batch, result.tokens, result.done_reasons,
                                              strict=True):
                        text = tokenizer.decode(ids, skip_special_tokens=True)
                        generated += len(ids)
                        new_rows.append({
                            "trace_id": p.trace_id, "point": p.point,
                            "global_point": p.global_point, "condition": name,
                            "check_segment": p.check_segment, "backup_token": p.backup_token,
                            "text": text, "tokens": len(ids), "token_ids": list(ids),
                            "done_reason": reason,
                            # The stop ids are the end-of-turn ids and </think>.
                            "ended_thinking": reason == "eos",
                            "answer_stated": find_first_answer(text) is not None,
                            "label": None, "judge_output": None})
                new_rows = [r for r in new_rows
                            if (r["trace_id"], r["point"], r["condition"]) not in done]
                if judge is not None:
                    by_point = {p.global_point: p for p in batch}
                    replies = judge([judge_prompt(by_point[r["global_point"]].context,
                                                  r["text"]) for r in new_rows])
                    for r, reply in zip(new_rows, replies, strict=True):
                        r["label"], r["judge_output"] = parse_plan_label(reply), reply[:500]
                sink.write("".join(json.dumps(r) + "\n" for r in new_rows))
                sink.flush()
                rows += new_rows
                done |= {(r["trace_id"], r["point"], r["condition"]) for r in new_rows}
                progress.done(f"batch {batches.index(batch) + 1}/{len(batches)}", generated,
                              "tokens", f"points {batch[0].global_point}.."
                              f"{batch[-1].global_point}, {len(conditions)} conditions")
    keys = {(p.trace_id, p.point) for p in points}
    rows = [r for r in rows if (r["trace_id"], r["point"]) in keys]
    table = summarise(rows, conditions)
    steer = ", ".join(f"{verb} {', '.join(names)}" for verb, names in (
        ("suppress", settings["suppress"]), ("activate", settings["activate"])) if names)
    notes = [f"- {len(points)} check starts in {len(traces)} traces; each backed up one "
             f"segment and regenerated up to {settings['max_new_tokens']} tokens per condition "
             f"(seed {settings['seed']}, temperature {settings['temperature']})",
             f"- steered: {steer or '-'}; changed: share of points whose text differs from "
             f"{conditions[0]!r}",
             "- end of thinking: </think> or an end-of-turn token generated; mean +- SE over "
             "points"]
    if settings["judge"] != "none":
        notes.append(f"- next plan labelled by judge {settings['judge']!r}: new_round / "
                     "wrap_up / unparsed")
    write_report(out, table, Path(settings["traces"]).stem, notes, settings["judge"] != "none")
    progress.done("report", len(table), "rows", str(out / "rewind.md"))
    print(markdown_table(table, TABLE_COLUMNS if settings["judge"] != "none"
                         else TABLE_COLUMNS[:-len(LABELS)]))


def main(argv: Sequence[str]) -> int:
    """``rewind`` entry point: 0 done, 2 bad input (``error: ...`` on stderr)."""
    return run_command(build_parser(), argv, _rewind)
