"""BFCL v4 multi-turn (Berkeley Function Calling Leaderboard): reader, runner and scorer.

Files, in BFCL's own layout (all JSON lines, supplied by the user, read offline):

- question file (``BFCL_v4_multi_turn_base.json`` and the ``miss_func``, ``miss_param``,
  ``long_context`` variants): ``{"id", "question": [[{"role", "content"}, ...] per turn],
  "initial_config": {Class: config}, "involved_classes": [Class, ...], "path"?,
  "missed_function"?: {"<turn>": [function name, ...]}, "excluded_function"?}``.
- possible-answer file: ``{"id", "ground_truth": [[call text, ...] per turn]}`` where a
  call text is Python call syntax such as ``"mv(source='a.txt', destination='tmp')"``
  (parsed with `ast`; only literal arguments; never evaluated).
- function docs: a directory of ``<api>.json`` files (``gorilla_file_system.json``, ...),
  one function doc per line; class -> file name is `DOC_FILES` (override with
  ``doc_files=``).

Backends: BFCL's API classes are Python code in BFCL's repository, so they are not part
of this package. Pass ``backends={"GorillaFileSystem": cls_or_"module:Class", ...}`` or
register classes with `common.register_backend`. A backend is instantiated with no
arguments, then ``_load_scenario(copy of initial_config[Class], long_context=...)`` is
called when the class has that method; its public methods are the tools.

Episode (`run_bfcl`): turn by turn, the turn's messages are appended and the policy acts
until it answers without a tool call (at most ``max_steps`` assistant messages; running
out force-terminates the episode, which fails it, as in BFCL). In ``miss_func`` entries
the held-out functions become available at their turn, whose (empty) question is replaced
by a short note that new functions are available.

Scoring (`score_bfcl`), after BFCL's multi-turn checker: the ground truth runs turn by
turn on fresh backend instances; for every turn whose ground truth is non-empty
  1. the model made at least one tool call in that turn (else ``empty_turn_model_response``);
  2. state check: every public attribute of every involved instance equals the ground
     truth's after that turn (else ``instance_state_mismatch``);
  3. response check: the execution results of the turn's ground-truth calls are contained,
     as a multiset and in any order, in the results of all model calls so far (else
     ``execution_response_mismatch``).
The entry is valid only if every checked turn passes (BFCL stops at the first failing
turn; ``error_type`` / ``error_turn`` name it). Turns with empty ground truth (the model
should ask or notice a missing function) are not checked, as in BFCL's current checker;
``calls_in_empty_turns`` records whether the model called tools there. Partial scores
(not BFCL's): ``turns_passed`` / ``turns_checked`` = ``turn_accuracy`` over all checked
turns, each judged on its own.

Unlike BFCL, calls whose arguments do not fit the function doc (unknown names, missing
required arguments, wrong JSON types) are rejected with an error observation instead of
being executed.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from spade_jax.evaluation.data import Where, field, read_jsonl
from spade_jax.evaluation.tool_benchmarks.common import (
    ERROR,
    OK,
    Message,
    ParsedCall,
    Policy,
    ToolSchema,
    TurnLog,
    backend_classes,
    invoke,
    new_task_id,
    parse_call_text,
    parse_tool_doc,
    public_methods,
    public_state,
    run_agent_turn,
)

# Class -> function-doc file name, as BFCL lays out its multi_turn_func_doc directory.
DOC_FILES: dict[str, str] = {
    "GorillaFileSystem": "gorilla_file_system.json",
    "MathAPI": "math_api.json",
    "MessageAPI": "message_api.json",
    "TwitterAPI": "posting_api.json",
    "TicketAPI": "ticket_api.json",
    "TradingBot": "trading_bot.json",
    "TravelAPI": "travel_booking.json",
    "VehicleControlAPI": "vehicle_control.json",
    "WebSearchAPI": "web_search.json",
}
MAX_STEPS = 20  # assistant messages per user turn before the episode is force-terminated
HELD_OUT_NOTE = ("Additional functions are now available to you. Use them, if they help, "
                 "to finish what I asked for earlier.")


@dataclasses.dataclass(frozen=True)
class BfclTask:
    id: str
    category: str
    turns: tuple[tuple[Message, ...], ...]
    initial_config: dict[str, Any]
    involved_classes: tuple[str, ...]
    functions: tuple[ToolSchema, ...]  # offered from the first turn
    held_out: dict[int, tuple[ToolSchema, ...]]  # offered from that turn on
    ground_truth: tuple[tuple[ParsedCall, ...], ...]
    ground_truth_text: tuple[tuple[str, ...], ...]
    path: tuple[str, ...] = ()

    @property
    def long_context(self) -> bool:
        return "long_context" in self.category or "composite" in self.category


# ----------------------------------------------------------------------------- loading


def _load_docs(path: Path) -> list[ToolSchema]:
    return [parse_tool_doc(record, where, "function") for where, record in read_jsonl(path)]


def _parse_turns(raw: list[Any], where: Where) -> tuple[tuple[Message, ...], ...]:
    turns = []
    for i, turn in enumerate(raw):
        if not isinstance(turn, list):
            raise where.error(f"field 'question[{i}]' must be a list of messages")
        messages = []
        for j, msg in enumerate(turn):
            if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) or not \
                    isinstance(msg.get("content"), str):
                raise where.error(f"field 'question[{i}][{j}]' must be "
                                  '{"role": str, "content": str}')
            messages.append({"role": msg["role"], "content": msg["content"]})
        turns.append(tuple(messages))
    return tuple(turns)


def _read_answers(path: str | Path) -> dict[str, tuple[Where, list[list[str]]]]:
    answers: dict[str, tuple[Where, list[list[str]]]] = {}
    for where, record in read_jsonl(path):
        task_id = str(field(record, "id", (str, int), where))
        truth = field(record, "ground_truth", list, where)
        for i, turn in enumerate(truth):
            if not isinstance(turn, list) or not all(isinstance(c, str) for c in turn):
                raise where.error(f"field 'ground_truth[{i}]' must be a list of call strings")
        if task_id in answers:
            raise where.error(f"field 'id': duplicate id {task_id!r}")
        answers[task_id] = (where, truth)
    return answers


def load_bfcl(question_path: str | Path, answer_path: str | Path, func_doc_dir: str | Path,
              *, doc_files: Mapping[str, str] | None = None) -> list[BfclTask]:
    """Reads a BFCL multi-turn question file, its possible-answer file and the function
    docs of the classes it uses; any malformed record raises DataError naming file, line
    and field."""
    files = {**DOC_FILES, **(doc_files or {})}
    doc_cache: dict[str, list[ToolSchema]] = {}
    answers = _read_answers(answer_path)
    tasks: list[BfclTask] = []
    seen: set[str] = set()
    for where, record in read_jsonl(question_path):
        task_id = new_task_id(record, where, seen)
        turns = _parse_turns(field(record, "question", list, where), where)
        if not turns:
            raise where.error("field 'question' is empty")
        config = field(record, "initial_config", dict, where, required=False, default={})
        classes = field(record, "involved_classes", list, where)
        if not classes or not all(isinstance(c, str) and c for c in classes):
            raise where.error("field 'involved_classes' must be a non-empty list of names")
        docs: list[ToolSchema] = []
        for name in classes:
            if name not in files:
                raise where.error(f"field 'involved_classes': no function-doc file known for "
                                  f"{name!r} (pass doc_files={{{name!r}: 'file.json'}})")
            if name not in doc_cache:
                doc_cache[name] = _load_docs(Path(func_doc_dir) / files[name])
            docs.extend(doc_cache[name])
        missed = field(record, "missed_function", dict, where, required=False, default={})
        held_out: dict[int, tuple[ToolSchema, ...]] = {}
        for key, names in missed.items():
            if not key.isdigit() or int(key) >= len(turns):
                raise where.error(f"field 'missed_function' key {key!r} is not a turn index")
            if turns[int(key)]:
                raise where.error(f"field 'question[{key}]' must be empty: functions are "
                                  "added at that turn")
            if not isinstance(names, list):
                raise where.error(f"field 'missed_function.{key}' must be a list of names")
            moved = []
            for name in names:
                match = [d for d in docs if d.name == name]
                if not match:
                    raise where.error(f"field 'missed_function.{key}' names unknown "
                                      f"function {name!r}")
                docs.remove(match[0])
                moved.append(match[0])
            held_out[int(key)] = tuple(moved)
        if task_id not in answers:
            raise where.error(f"field 'id': no possible answer with id {task_id!r} in "
                              f"{answer_path}")
        answer_where, truth = answers[task_id]
        if len(truth) != len(turns):
            raise answer_where.error(f"field 'ground_truth' has {len(truth)} turns, the "
                                     f"question has {len(turns)}")
        parsed = []
        for i, turn in enumerate(truth):
            calls = []
            for j, text in enumerate(turn):
                try:
                    calls.extend(parse_call_text(text))
                except (SyntaxError, ValueError) as err:
                    raise answer_where.error(f"field 'ground_truth[{i}][{j}]' is not a "
                                             f"literal function call ({err})") from None
            parsed.append(tuple(calls))
        path = field(record, "path", list, where, required=False, default=[])
        tasks.append(BfclTask(task_id, task_id.rsplit("_", 1)[0], turns, config,
                              tuple(classes), tuple(docs), held_out, tuple(parsed),
                              tuple(tuple(t) for t in truth), tuple(map(str, path))))
    return tasks


# ----------------------------------------------------------------------------- running


class _Instances:
    """The live backend objects of one episode (or of the ground-truth replay)."""

    def __init__(self, task: BfclTask, classes: Mapping[str, type]) -> None:
        self.objects: dict[str, Any] = {}
        self.methods: dict[str, Any] = {}
        for name in task.involved_classes:
            obj = classes[name]()
            if hasattr(obj, "_load_scenario"):
                obj._load_scenario(copy.deepcopy(task.initial_config.get(name, {})),
                                   long_context=task.long_context)
            self.objects[name] = obj
            self.methods.update(public_methods(obj))

    def call(self, name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[str, str]:
        method = self.methods.get(name)
        if method is None:
            return f"Error during execution: no backend method {name!r}", ERROR
        return invoke(method, args, kwargs)

    def states(self) -> dict[str, dict[str, Any]]:
        return {name: public_state(obj) for name, obj in self.objects.items()}


@dataclasses.dataclass
class BfclEpisode:
    task_id: str
    turns: list[TurnLog]
    states: list[dict[str, dict[str, Any]]]  # public state of each class after each turn
    messages: list[Message]
    force_terminated: bool


def run_bfcl(task: BfclTask, policy: Policy,
             backends: Mapping[str, type | str] | None = None, *,
             max_steps: int = MAX_STEPS) -> BfclEpisode:
    """Plays one entry: every user turn in order, tools executed live on the backends."""
    live = _Instances(task, backend_classes(task.involved_classes, backends, task.id))
    tools = list(task.functions)
    messages: list[Message] = []
    turns: list[TurnLog] = []
    states = []
    for index, turn in enumerate(task.turns):
        if index in task.held_out:
            tools.extend(task.held_out[index])
            turn = ({"role": "user", "content": HELD_OUT_NOTE},)
        messages.extend(copy.deepcopy(list(turn)))
        log = run_agent_turn(policy, messages, tools,
                             lambda name, args: live.call(name, (), args), max_steps)
        turns.append(log)
        states.append(live.states())
        if log.hit_step_limit:
            return BfclEpisode(task.id, turns, states, messages, True)
    return BfclEpisode(task.id, turns, states, messages, False)


# ----------------------------------------------------------------------------- scoring


_ABSENT = object()


def _missing(expected: list[str], got: list[str]) -> list[str]:
    pool = list(got)
    missing = []
    for item in expected:
        if item in pool:
            pool.remove(item)
        else:
            missing.append(item)
    return missing


def score_bfcl(task: BfclTask, episode: BfclEpisode,
               backends: Mapping[str, type | str] | None = None) -> dict[str, Any]:
    """BFCL's state-based and response-based checks per turn (see the module docstring)."""
    gold = _Instances(task, backend_classes(task.involved_classes, backends, task.id))
    gold_results, gold_states = [], []
    for calls in task.ground_truth:
        gold_results.append([gold.call(c.name, c.args, c.kwargs)[0] for c in calls])
        gold_states.append(gold.states())
    turn_checks: list[dict[str, Any]] = []
    model_results: list[str] = []
    first_error: tuple[str, int] | None = None
    calls_in_empty = False
    for index, log in enumerate(episode.turns):
        model_results.extend(record.result for record in log.calls)
        if not task.ground_truth[index]:
            calls_in_empty = calls_in_empty or bool(log.calls)
            continue
        empty = not log.calls
        differences = {}
        for name, want in gold_states[index].items():
            have = episode.states[index].get(name, {})
            for attr, value in want.items():
                if have.get(attr, _ABSENT) != value:
                    differences[f"{name}.{attr}"] = {"model": have.get(attr), "ground_truth": value}
        missing = _missing(gold_results[index], model_results)
        check = {"turn": index, "empty": empty, "state_ok": not differences,
                 "response_ok": not missing, "differences": differences,
                 "missing_results": missing}
        check["passed"] = not empty and not differences and not missing
        turn_checks.append(check)
        if not check["passed"] and first_error is None:
            kind = ("multi_turn:empty_turn_model_response" if empty else
                    "multi_turn:instance_state_mismatch" if differences else
                    "multi_turn:execution_response_mismatch")
            first_error = (kind, index)
    checked = sum(1 for t in task.ground_truth if t)
    passed = sum(1 for c in turn_checks if c["passed"])
    if episode.force_terminated:
        first_error = ("multi_turn:force_terminated", len(episode.turns) - 1)
    valid = first_error is None
    return {
        "id": task.id, "valid": valid,
        "error_type": None if valid else first_error[0],
        "error_turn": None if valid else first_error[1],
        "turns_checked": checked, "turns_passed": passed,
        "turn_accuracy": passed / checked if checked else 1.0,
        "state_checks_passed": sum(1 for c in turn_checks if c["state_ok"]),
        "response_checks_passed": sum(1 for c in turn_checks if c["response_ok"]),
        "calls_in_empty_turns": calls_in_empty,
        "force_terminated": episode.force_terminated,
        "tool_calls": sum(len(log.calls) for log in episode.turns),
        "invalid_calls": sum(1 for log in episode.turns for c in log.calls
                             if c.status not in (OK, ERROR)),
        "turn_checks": turn_checks,
    }


def evaluate_bfcl(tasks: Sequence[BfclTask], policy: Policy,
                  backends: Mapping[str, type | str] | None = None, *,
                  max_steps: int = MAX_STEPS) -> list[dict[str, Any]]:
    """Runs and scores every task; one score dict per task (see `score_bfcl`)."""
    return [score_bfcl(task, run_bfcl(task, policy, backends, max_steps=max_steps), backends)
            for task in tasks]
