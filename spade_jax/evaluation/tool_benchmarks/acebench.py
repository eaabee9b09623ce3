"""ACEBench-Agent (``agent_multi_turn`` / ``agent_multi_step``): reader, runner, scorer.

Files, in ACEBench's layout (``data_all/data_en/``), JSON lines, supplied by the user:

- question file (``data_agent_multi_turn.json`` / ``data_agent_multi_step.json``):
  ``{"id", "question": str, "initial_config": {Class: config}, "involved_classes":
  [Class, ...], "function": [function doc, ...], "path"?}``. In ``multi_turn`` entries
  the question is the *user's* instruction (a simulated user talks to the agent); in
  ``multi_step`` entries it is the request the agent works on alone.
- possible-answer file (``possible_answer/...``): ``{"id", "ground_truth": [{Class:
  {attribute: value}}, ...], "mile_stone": [call text, ...] or [[call text, ...], ...]}``;
  a milestone is the text of one agent message of calls, e.g.
  ``"[delete_message(message_id=3)]"``, and a list of lists gives alternative paths.

Backends: ACEBench's scenario classes (``BaseApi``, ``MessageApi``, ...) are Python code
in its repository; pass ``backends={"MessageApi": cls_or_"module:Class", ...}`` or use
`common.register_backend`. Like ACEBench, each class is instantiated with no arguments,
then ``_load_scenario(initial_config[Class])`` and ``_load_scenario(initial_config
["BaseApi"])`` are called (when it has that method); a call runs on *every* involved
instance that has the method, and the last result is shown to the agent.

Episode (`run_acebench`): ``multi_turn``: the user simulator opens (given the question)
and answers each text reply of the agent; ``multi_step``: the question is the only user
message and a text reply without calls gets a nudge to keep using the tools. The episode
ends when the agent or the user says "finish conversation", the user returns None, or
``max_messages`` messages were exchanged.

Scoring (`score_acebench`), after ACEBench's agent evaluation:
- end-to-end (``end_to_end``): for every ``{Class: {attr: value}}`` of the ground truth,
  the final instance's attribute equals ``value``; when ``value`` is an object, only its
  keys are compared (extra keys in the model's state are allowed, as in ACEBench); the
  state is compared after a JSON round trip (integer dict keys become strings, as in
  ACEBench's saved results). A ground-truth class that is not an involved class (the
  public answer files have a few misspelt ones) is skipped and listed in
  ``skipped_classes``, as ACEBench's matching ends up ignoring it. An
  episode in which no call reached a backend fails (ACEBench then has no state to check).
- process accuracy (``process_accuracy``): 1.0 if end-to-end holds, else the share of
  milestones found in order (greedy) among the agent's call messages, the best over
  alternative milestone lists, rounded to 3 places. Milestones and messages are compared
  as parsed calls (names and argument values; keyword order ignored), where ACEBench
  compares the raw message text.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from spade_jax.evaluation.data import Where, field, read_jsonl
from spade_jax.evaluation.tool_benchmarks.common import (
    ERROR,
    OK,
    Message,
    ParsedCall,
    Policy,
    ToolCallRecord,
    ToolSchema,
    TurnLog,
    UserSimulator,
    backend_classes,
    invoke,
    new_task_id,
    parse_call_text,
    parse_tool_doc,
    public_methods,
    render_call,
    run_agent_turn,
)

FINISH = "finish conversation"
MAX_MESSAGES = 40
NUDGE = ("No one else will answer. Continue with the available tools and the information "
         "you have; say 'finish conversation' when the task is done.")


@dataclasses.dataclass(frozen=True)
class Milestone:
    text: str
    calls: tuple[ParsedCall, ...] | None  # None when the text does not parse


@dataclasses.dataclass(frozen=True)
class AceTask:
    id: str
    mode: str  # "multi_turn" (simulated user) or "multi_step" (agent alone)
    question: str
    initial_config: dict[str, Any]
    involved_classes: tuple[str, ...]
    functions: tuple[ToolSchema, ...]
    ground_truth: tuple[tuple[str, dict[str, Any]], ...]
    milestones: tuple[tuple[Milestone, ...], ...]  # alternatives


# ----------------------------------------------------------------------------- loading


def _milestone(text: Any, where: Where, label: str) -> Milestone:
    if not isinstance(text, str):
        raise where.error(f"field '{label}' must be a string")
    try:
        calls: tuple[ParsedCall, ...] | None = tuple(parse_call_text(text))
    except (SyntaxError, ValueError):
        calls = None
    return Milestone(text, calls)


def _answers(path: str | Path) -> dict[str, tuple[Where, dict[str, Any]]]:
    out: dict[str, tuple[Where, dict[str, Any]]] = {}
    for where, record in read_jsonl(path):
        task_id = str(field(record, "id", (str, int), where))
        if task_id in out:
            raise where.error(f"field 'id': duplicate id {task_id!r}")
        truth = field(record, "ground_truth", (list, dict), where)
        truth = [truth] if isinstance(truth, dict) else truth
        states = []
        for i, item in enumerate(truth):
            if not isinstance(item, dict) or len(item) != 1 or not isinstance(
                    next(iter(item.values())), dict):
                raise where.error(f"field 'ground_truth[{i}]' must be {{Class: {{attribute: "
                                  "value}}}")
            (name, attrs), = item.items()
            states.append((name, attrs))
        stones = field(record, "mile_stone", list, where, required=False, default=[])
        if stones and all(isinstance(s, list) for s in stones):
            paths = [tuple(_milestone(t, where, f"mile_stone[{i}][{j}]")
                           for j, t in enumerate(s)) for i, s in enumerate(stones)]
        else:
            paths = [tuple(_milestone(t, where, f"mile_stone[{j}]")
                           for j, t in enumerate(stones))]
        out[task_id] = (where, {"states": tuple(states), "milestones": tuple(paths)})
    return out


def load_acebench(question_path: str | Path, answer_path: str | Path) -> list[AceTask]:
    """Reads an ACEBench agent question file and its possible-answer file; a malformed
    record raises DataError naming file, line and field."""
    answers = _answers(answer_path)
    tasks: list[AceTask] = []
    seen: set[str] = set()
    for where, record in read_jsonl(question_path):
        task_id = new_task_id(record, where, seen)
        question = field(record, "question", str, where)
        config = field(record, "initial_config", dict, where, required=False, default={})
        classes = field(record, "involved_classes", list, where)
        if not classes or not all(isinstance(c, str) and c for c in classes):
            raise where.error("field 'involved_classes' must be a non-empty list of names")
        docs = field(record, "function", list, where)
        functions = tuple(parse_tool_doc(d, where, f"function[{i}]") for i, d in enumerate(docs))
        if task_id not in answers:
            raise where.error(f"field 'id': no possible answer with id {task_id!r} in "
                              f"{answer_path}")
        _, answer = answers[task_id]
        mode = "multi_step" if "multi_step" in task_id else "multi_turn"
        tasks.append(AceTask(task_id, mode, question, config, tuple(classes), functions,
                             answer["states"], answer["milestones"]))
    return tasks


# ----------------------------------------------------------------------------- running


class _Scene:
    def __init__(self, task: AceTask, classes: Mapping[str, type]) -> None:
        self.objects: dict[str, Any] = {}
        self.methods: dict[str, list[Any]] = {}
        base = task.initial_config.get("BaseApi", {})
        for name in task.involved_classes:
            obj = classes[name]()
            if hasattr(obj, "_load_scenario"):
                obj._load_scenario(copy.deepcopy(task.initial_config.get(name, {})))
                obj._load_scenario(copy.deepcopy(base))
            self.objects[name] = obj
            for method_name, method in public_methods(obj).items():
                self.methods.setdefault(method_name, []).append(method)

    def call(self, name: str, args: Mapping[str, Any]) -> tuple[str, str]:
        methods = self.methods.get(name)
        if not methods:
            return f"Error during execution: no backend method {name!r}", ERROR
        result = ("", OK)
        for method in methods:
            result = invoke(method, (), args)
            if result[1] != OK:
                return result
        return result


@dataclasses.dataclass
class AceEpisode:
    task_id: str
    messages: list[Message]
    turns: list[TurnLog]
    objects: dict[str, Any]  # the backend instances after the episode
    ended_by: str  # agent_finish | user_finish | max_messages


def run_acebench(task: AceTask, policy: Policy,
                 backends: Mapping[str, type | str] | None = None, *,
                 user: UserSimulator | None = None,
                 max_messages: int = MAX_MESSAGES) -> AceEpisode:
    """Plays one entry; ``multi_turn`` entries need a `user` simulator."""
    scene = _Scene(task, backend_classes(task.involved_classes, backends, task.id))
    messages: list[Message] = []
    turns: list[TurnLog] = []
    user_view: list[Message] = []
    if task.mode == "multi_turn":
        if user is None:
            raise ValueError(f"task {task.id!r} is multi_turn: pass a user simulator")
        first = user.first_message(task.question)
        if first is None:
            return AceEpisode(task.id, messages, turns, scene.objects, "user_finish")
        user_view.append({"role": "user", "content": first})
    else:
        first = task.question
    messages.append({"role": "user", "content": first})
    while True:
        budget = max_messages - len(messages)
        if budget <= 0:
            return AceEpisode(task.id, messages, turns, scene.objects, "max_messages")
        log = run_agent_turn(policy, messages, task.functions, scene.call, budget)
        turns.append(log)
        if log.hit_step_limit:
            return AceEpisode(task.id, messages, turns, scene.objects, "max_messages")
        if FINISH in (log.reply or "").lower():
            return AceEpisode(task.id, messages, turns, scene.objects, "agent_finish")
        if task.mode == "multi_step":
            messages.append({"role": "user", "content": NUDGE})
            continue
        user_view.append({"role": "assistant", "content": log.reply})
        said = user.respond(copy.deepcopy(user_view))  # type: ignore[union-attr]
        if said is None:
            return AceEpisode(task.id, messages, turns, scene.objects, "user_finish")
        user_view.append({"role": "user", "content": said})
        messages.append({"role": "user", "content": said})
        if FINISH in said.lower():
            return AceEpisode(task.id, messages, turns, scene.objects, "user_finish")


# ----------------------------------------------------------------------------- scoring


_ABSENT = object()


def _step_text(step: Sequence[ToolCallRecord]) -> str:
    return "[" + ", ".join(render_call(c.name or "?", c.arguments) for c in step) + "]"


def _step_matches(step: Sequence[ToolCallRecord], stone: Milestone) -> bool:
    if stone.calls is None:
        return _step_text(step).strip() == stone.text.strip()
    if len(step) != len(stone.calls):
        return False
    for record, want in zip(step, stone.calls, strict=True):
        if want.args:  # a positional milestone argument cannot be matched by name
            return False
        got = ParsedCall(record.name or "", (), dict(record.arguments))
        if got.canonical() != want.canonical():
            return False
    return True


def _process(steps: list[list[ToolCallRecord]], path: Sequence[Milestone]) -> float:
    if not path:
        return 1.0
    hits, cursor = 0, 0
    for stone in path:
        while cursor < len(steps):
            cursor += 1
            if _step_matches(steps[cursor - 1], stone):
                hits += 1
                break
    return hits / len(path)


def score_acebench(task: AceTask, episode: AceEpisode) -> dict[str, Any]:
    """End-to-end state check and milestone process accuracy (module docstring)."""
    steps = [step for log in episode.turns for step in log.steps]
    reached = any(c.status in (OK, ERROR) for step in steps for c in step)
    errors: list[str] = []
    if not reached:
        errors.append("no call reached a backend: no final state to compare")
    skipped = []
    for name, attrs in task.ground_truth:
        obj = episode.objects.get(name)
        if obj is None:  # e.g. a misspelt class in the answer file: ACEBench matches no
            skipped.append(name)  # model state to it and checks nothing
            continue
        for attr, want in attrs.items():
            have = getattr(obj, attr, _ABSENT)
            if have is not _ABSENT:  # ACEBench compares the state after a JSON round trip
                have = json.loads(json.dumps(have, default=str))
            if have is _ABSENT:
                errors.append(f"{name}.{attr} is missing")
            elif isinstance(want, dict) and isinstance(have, dict):
                for key, value in want.items():
                    if key not in have or have[key] != value:
                        errors.append(f"{name}.{attr}.{key} wrong: expected {value!r}, "
                                      f"got {have.get(key, '<missing>')!r}")
            elif have != want:
                errors.append(f"{name}.{attr} wrong: expected {want!r}, got {have!r}")
    end_to_end = not errors
    best = max(_process(steps, path) for path in task.milestones) if task.milestones else 1.0
    return {
        "id": task.id, "end_to_end": end_to_end,
        "process_accuracy": 1.0 if end_to_end else round(best, 3),
        "milestone_accuracy": round(best, 3),
        "error_type": None if end_to_end else (
            "no_state" if not reached else "class attributes wrong"),
        "errors": errors, "ended_by": episode.ended_by, "skipped_classes": skipped,
        "call_messages": [_step_text(s) for s in steps],
    }


def evaluate_acebench(tasks: Sequence[AceTask], policy: Policy,
                      backends: Mapping[str, type | str] | None = None, *,
                      users: Callable[[AceTask], UserSimulator] | None = None,
                      max_messages: int = MAX_MESSAGES
                      ) -> list[dict[str, Any]]:
    """Runs and scores every task; `users(task)` gives multi_turn tasks their user."""
    return [score_acebench(task, run_acebench(
        task, policy, backends, user=users(task) if users is not None else None,
        max_messages=max_messages)) for task in tasks]
