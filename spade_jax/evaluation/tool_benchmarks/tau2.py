"""tau2-bench-style customer-service tasks: reader, runner (agent + simulated user) and
scorer.

Files, in tau2-bench's layout (``data/tau2/domains/<domain>/``), supplied by the user:

- ``policy.md``: the domain policy, the agent's system prompt.
- ``db.json``: the domain database (one JSON document).
- ``tasks.json``: a JSON array of tasks ``{"id", "description"?, "user_scenario":
  {"persona"?, "instructions": str | {"domain", "reason_for_call", "known_info",
  "unknown_info", "task_instructions"}}, "initial_state"?: {"initialization_data"?:
  {"agent_data"?}, "initialization_actions"?: [{"env_type": "assistant", "func_name",
  "arguments"}]}, "evaluation_criteria"?: {"actions"?: [{"action_id", "name",
  "arguments", "compare_args"?, "requestor"?}], "env_assertions"?: [{"env_type",
  "func_name", "arguments", "assert_value"?}], "communicate_info"?: [str],
  "nl_assertions"?: [str], "reward_basis": ["DB", "ENV_ASSERTION", "ACTION",
  "COMMUNICATE", "NL_ASSERTION"]}}``. Errors name the line where the task starts.

Tools: tau2's tools are Python toolkits in its repository; supply your own class (or a
"module:Class" path). It is built as ``Toolkit(db)`` with a deep copy of the database
(``agent_data`` deep-merged in) and must keep the database, mutated by its tools, as
``self.db`` (a JSON-like dict, or an object with ``model_dump()``). Its tools are the
names in a ``TOOLS`` class attribute if present, else all public methods; schemas come
from ``tool_schemas()`` if defined, else from the method signatures (annotations
str/int/float/bool/list/dict) and the first docstring line. Env assertions may call any
public method.

Episode (`run_tau2`): system message = policy; the user simulator opens; the agent acts
(tool calls run on the toolkit) until it replies in text; the user answers; and so on.
Ends with ``agent_stop`` (the agent's text contains ``###STOP###``), ``user_stop`` (the
user returns None or a text with ``###STOP###``, ``###TRANSFER###`` or
``###OUT-OF-SCOPE###``), ``max_steps`` (messages of any role) or ``too_many_errors``
(failed or rejected tool calls).

Scoring (`score_tau2`), after tau2's evaluators: an episode that did not end by an agent
or user stop scores 0; no evaluation criteria scores 1. Otherwise components
- DB: the final database hash (SHA-256 of the key-sorted JSON) equals that of a fresh
  database on which the gold ``actions`` were replayed (errors in gold actions ignored);
  1 when both ``actions`` and ``env_assertions`` are absent.
- ENV_ASSERTION: each assertion's function, called on the final toolkit, returns
  ``assert_value`` (product).
- ACTION: each gold action is matched by some agent tool call: same name and, over
  ``compare_args`` (default: the call's own argument names), equal arguments.
- COMMUNICATE: each ``communicate_info`` string occurs, case-insensitively, in some agent
  text reply with commas removed.
- NL_ASSERTION: needs a judge model; with ``judge=`` (``judge(assertions, messages) ->
  [bool]``) it is the product of its verdicts, without one it is left out and
  ``reward_complete`` is False. An empty ``nl_assertions`` list counts as met.
``reward`` is the product of the components in ``reward_basis``; every component and
the fraction of matched actions / info strings / assertions are kept as partial scores.

Not supported (DataError at load): user-side tools (``requestor`` / ``env_type`` "user",
``user_data``) and a pre-filled ``message_history``.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from spade_jax.evaluation.data import DataError, Where, field
from spade_jax.evaluation.tool_benchmarks.common import (
    ERROR,
    INVALID,
    Message,
    Policy,
    ToolSchema,
    TurnLog,
    UserSimulator,
    invoke,
    new_task_id,
    parse_tool_doc,
    public_methods,
    read_json_array,
    read_json_file,
    resolve_backend,
    run_agent_turn,
)

STOP, TRANSFER, OUT_OF_SCOPE = "###STOP###", "###TRANSFER###", "###OUT-OF-SCOPE###"
REWARD_TYPES = ("DB", "ENV_ASSERTION", "NL_ASSERTION", "ACTION", "COMMUNICATE")
MAX_STEPS, MAX_ERRORS = 200, 10
Judge = Callable[[list[str], list[Message]], list[bool]]


@dataclasses.dataclass(frozen=True)
class Tau2Action:
    action_id: str
    name: str
    arguments: dict[str, Any]
    compare_args: tuple[str, ...] | None = None

    def matches(self, name: str | None, arguments: Mapping[str, Any]) -> bool:
        """tau2's rule: same name; equal values over `compare_args` (default: the names
        the call itself passed)."""
        if name != self.name:
            return False
        keys = set(arguments) if self.compare_args is None else set(self.compare_args)
        if not keys:
            return True
        return ({k: v for k, v in arguments.items() if k in keys}
                == {k: v for k, v in self.arguments.items() if k in keys})


@dataclasses.dataclass(frozen=True)
class Tau2Assertion:
    func_name: str
    arguments: dict[str, Any]
    assert_value: bool = True


@dataclasses.dataclass(frozen=True)
class Tau2Criteria:
    actions: tuple[Tau2Action, ...] | None
    env_assertions: tuple[Tau2Assertion, ...] | None
    communicate_info: tuple[str, ...]
    nl_assertions: tuple[str, ...]
    reward_basis: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Tau2Task:
    id: str
    instructions: str  # what the user simulator is told
    agent_data: dict[str, Any] | None
    initialization_actions: tuple[tuple[str, dict[str, Any]], ...]
    criteria: Tau2Criteria | None
    purpose: str = ""


@dataclasses.dataclass(frozen=True)
class Tau2Domain:
    name: str
    policy: str
    db: dict[str, Any]
    tasks: tuple[Tau2Task, ...]


# ----------------------------------------------------------------------------- loading


def _opt(record: dict[str, Any], name: str, kind: type | tuple[type, ...], where: Where,
         label: str) -> Any:
    value = record.get(name)
    if value is None:
        return None
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise where.error(f"field '{label}{name}' must be {names}, got {type(value).__name__}")
    return value


def _instructions(scenario: Any, where: Where) -> str:
    if not isinstance(scenario, dict):
        raise where.error("field 'user_scenario' must be an object")
    raw = scenario.get("instructions")
    parts = []
    persona = _opt(scenario, "persona", str, where, "user_scenario.")
    if persona:
        parts.append(f"Persona:\n{persona}")
    if isinstance(raw, str) and raw.strip():
        parts.append(raw)
    elif isinstance(raw, dict):
        labels = {"domain": "Domain", "reason_for_call": "Reason for call",
                  "known_info": "Known info", "unknown_info": "Unknown info",
                  "task_instructions": "Task instructions"}
        if not isinstance(raw.get("task_instructions"), str):
            raise where.error("field 'user_scenario.instructions.task_instructions' must "
                              "be a string")
        for key, label in labels.items():
            value = _opt(raw, key, str, where, "user_scenario.instructions.")
            if value:
                parts.append(f"{label}: {value}")
    else:
        raise where.error("field 'user_scenario.instructions' must be a string or an object")
    return "\n".join(parts)


def _call_dict(raw: Any, where: Where, label: str, name_key: str) -> tuple[str, dict[str, Any]]:
    if not isinstance(raw, dict):
        raise where.error(f"field '{label}' must be an object")
    name = raw.get(name_key)
    if not isinstance(name, str) or not name:
        raise where.error(f"field '{label}.{name_key}' must be a non-empty string")
    args = raw.get("arguments", {})
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise where.error(f"field '{label}.arguments' must be an object")
    side = raw.get("requestor", raw.get("env_type", "assistant"))
    if side not in (None, "assistant"):
        raise where.error(f"field '{label}' acts on the {side!r} side; user-side tools are "
                          "not supported")
    return name, args


def _criteria(raw: Any, where: Where) -> Tau2Criteria | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise where.error("field 'evaluation_criteria' must be an object")
    label = "evaluation_criteria."
    actions = None
    raw_actions = _opt(raw, "actions", list, where, label)
    if raw_actions is not None:
        actions = []
        for i, item in enumerate(raw_actions):
            name, args = _call_dict(item, where, f"{label}actions[{i}]", "name")
            compare = item.get("compare_args")
            if compare is not None and (not isinstance(compare, list) or not all(
                    isinstance(c, str) for c in compare)):
                raise where.error(f"field '{label}actions[{i}].compare_args' must be a list "
                                  "of argument names")
            actions.append(Tau2Action(str(item.get("action_id", f"{i}")), name, args,
                                      None if compare is None else tuple(compare)))
        actions = tuple(actions)
    assertions = None
    raw_assertions = _opt(raw, "env_assertions", list, where, label)
    if raw_assertions is not None:
        assertions = []
        for i, item in enumerate(raw_assertions):
            name, args = _call_dict(item, where, f"{label}env_assertions[{i}]", "func_name")
            value = item.get("assert_value", True)
            if not isinstance(value, bool):
                raise where.error(f"field '{label}env_assertions[{i}].assert_value' must be "
                                  "a boolean")
            assertions.append(Tau2Assertion(name, args, value))
        assertions = tuple(assertions)
    texts = {}
    for key in ("communicate_info", "nl_assertions"):
        values = _opt(raw, key, list, where, label) or []
        if not all(isinstance(v, str) for v in values):
            raise where.error(f"field '{label}{key}' must be a list of strings")
        texts[key] = tuple(values)
    basis = raw.get("reward_basis", ["DB", "COMMUNICATE"])
    if not isinstance(basis, list) or any(b not in REWARD_TYPES for b in basis):
        raise where.error(f"field '{label}reward_basis' must be a list of {list(REWARD_TYPES)}")
    return Tau2Criteria(actions, assertions, texts["communicate_info"], texts["nl_assertions"],
                        tuple(basis))


def load_tau2_tasks(path: str | Path) -> list[Tau2Task]:
    """Reads tau2's tasks.json (a JSON array); errors name the task's line and field."""
    tasks: list[Tau2Task] = []
    seen: set[str] = set()
    for where, record in read_json_array(path):
        if not isinstance(record, dict):
            raise where.error(f"expected a task object, got {type(record).__name__}")
        task_id = new_task_id(record, where, seen)
        instructions = _instructions(field(record, "user_scenario", dict, where), where)
        agent_data, init_actions = None, []
        state = _opt(record, "initial_state", dict, where, "")
        if state is not None:
            if state.get("message_history"):
                raise where.error("field 'initial_state.message_history' is not supported")
            data = _opt(state, "initialization_data", dict, where, "initial_state.")
            if data is not None:
                if data.get("user_data"):
                    raise where.error("field 'initial_state.initialization_data.user_data': "
                                      "user-side data is not supported")
                agent_data = _opt(data, "agent_data", dict, where,
                                  "initial_state.initialization_data.")
            for i, item in enumerate(_opt(state, "initialization_actions", list, where,
                                          "initial_state.") or []):
                init_actions.append(_call_dict(
                    item, where, f"initial_state.initialization_actions[{i}]", "func_name"))
        description = record.get("description")
        purpose = description.get("purpose") if isinstance(description, dict) else None
        tasks.append(Tau2Task(task_id, instructions, agent_data, tuple(init_actions),
                              _criteria(record.get("evaluation_criteria"), where),
                              purpose if isinstance(purpose, str) else ""))
    return tasks


def load_tau2_domain(directory: str | Path | None = None, *, policy: str | Path | None = None,
                     db: str | Path | None = None, tasks: str | Path | None = None,
                     name: str | None = None) -> Tau2Domain:
    """A domain from its directory (policy.md, db.json, tasks.json) or explicit paths."""
    base = Path(directory) if directory is not None else None

    def pick(given: str | Path | None, default: str) -> Path:
        if given is not None:
            return Path(given)
        if base is None:
            raise ValueError(f"load_tau2_domain: give a directory or the {default} path")
        return base / default

    policy_path, db_path, tasks_path = pick(policy, "policy.md"), pick(db, "db.json"), pick(
        tasks, "tasks.json")
    if not policy_path.is_file():
        raise DataError(f"{policy_path}: no such file")
    database = read_json_file(db_path)
    if not isinstance(database, dict):
        raise DataError(f"{db_path}:1: the database must be a JSON object")
    return Tau2Domain(name or (base.name if base else tasks_path.parent.name),
                      policy_path.read_text(encoding="utf-8"), database,
                      tuple(load_tau2_tasks(tasks_path)))


# ----------------------------------------------------------------------------- toolkit

_ANNOTATION_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean",
                     list: "array", dict: "object", "str": "string", "int": "integer",
                     "float": "number", "bool": "boolean", "list": "array", "dict": "object"}


def _deep_merge(base: dict[str, Any], update: Mapping[str, Any]) -> None:
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _deep_merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)


def db_of(toolkit: Any) -> Any:
    db = toolkit.db
    return db.model_dump() if hasattr(db, "model_dump") else db


def db_hash(db: Any) -> str:
    """SHA-256 of the key-sorted JSON of the database (tau2 hashes its DB the same way)."""
    return hashlib.sha256(json.dumps(db, sort_keys=True, default=str).encode()).hexdigest()


def tool_schemas(toolkit: Any) -> list[ToolSchema]:
    """The toolkit's tools as schemas (see the module docstring for where they come from)."""
    where = Where(type(toolkit).__name__, 0)
    if hasattr(toolkit, "tool_schemas"):
        return [parse_tool_doc(d, where, f"tool_schemas()[{i}]")
                for i, d in enumerate(toolkit.tool_schemas())]
    methods = public_methods(toolkit)
    names = list(getattr(toolkit, "TOOLS", None) or sorted(methods))
    schemas = []
    for name in names:
        method = methods[name]
        props, required = {}, []
        for param in inspect.signature(method).parameters.values():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                continue
            spec: dict[str, Any] = {}
            kind = _ANNOTATION_TYPES.get(param.annotation)
            if kind:
                spec["type"] = kind
            props[param.name] = spec
            if param.default is param.empty:
                required.append(param.name)
        doc = (inspect.getdoc(method) or "").strip().split("\n")[0]
        schemas.append(parse_tool_doc({"name": name, "description": doc, "parameters": {
            "type": "object", "properties": props, "required": required}}, where, name))
    return schemas


def make_toolkit(domain: Tau2Domain, task: Tau2Task, toolkit: type | str) -> Any:
    """A toolkit on a fresh copy of the database, with the task's initial state applied."""
    db = copy.deepcopy(domain.db)
    if task.agent_data:
        _deep_merge(db, task.agent_data)
    kit = resolve_backend(toolkit, "toolkit")(db)
    methods = public_methods(kit)
    for name, args in task.initialization_actions:
        if name not in methods:
            raise KeyError(f"task {task.id!r}: initialization action {name!r} is not a "
                           "toolkit method")
        methods[name](**copy.deepcopy(args))
    return kit


# ----------------------------------------------------------------------------- running


@dataclasses.dataclass
class Tau2Episode:
    task_id: str
    messages: list[Message]
    turns: list[TurnLog]
    termination: str  # agent_stop | user_stop | max_steps | too_many_errors
    toolkit: Any  # the toolkit after the episode (final database)


def _stops(text: str | None) -> bool:
    return text is None or any(m in text for m in (STOP, TRANSFER, OUT_OF_SCOPE))


def run_tau2(task: Tau2Task, domain: Tau2Domain, policy: Policy, user: UserSimulator,
             toolkit: type | str, *, max_steps: int = MAX_STEPS,
             max_errors: int = MAX_ERRORS) -> Tau2Episode:
    """Plays one task: simulated user and agent alternate until one of them stops."""
    kit = make_toolkit(domain, task, toolkit)
    tools = tool_schemas(kit)
    methods = public_methods(kit)
    messages: list[Message] = [{"role": "system", "content": domain.policy}]
    user_view: list[Message] = []
    turns: list[TurnLog] = []
    first = user.first_message(task.instructions)
    if first is not None:
        messages.append({"role": "user", "content": first})
        user_view.append({"role": "user", "content": first})
    if _stops(first):
        return Tau2Episode(task.id, messages, turns, "user_stop", kit)
    errors = 0
    while True:
        budget = max_steps - (len(messages) - 1)
        if budget <= 0:
            return Tau2Episode(task.id, messages, turns, "max_steps", kit)
        log = run_agent_turn(policy, messages, tools,
                             lambda name, args: invoke(methods[name], (), args), budget)
        turns.append(log)
        errors += sum(1 for c in log.calls if c.status in (INVALID, ERROR))
        if errors >= max_errors:
            return Tau2Episode(task.id, messages, turns, "too_many_errors", kit)
        if log.hit_step_limit or len(messages) - 1 >= max_steps:
            return Tau2Episode(task.id, messages, turns, "max_steps", kit)
        if STOP in (log.reply or ""):
            return Tau2Episode(task.id, messages, turns, "agent_stop", kit)
        user_view.append({"role": "assistant", "content": log.reply})
        said = user.respond(copy.deepcopy(user_view))
        if said is not None:
            messages.append({"role": "user", "content": said})
            user_view.append({"role": "user", "content": said})
        if _stops(said):
            return Tau2Episode(task.id, messages, turns, "user_stop", kit)


# ----------------------------------------------------------------------------- scoring


def score_tau2(task: Tau2Task, episode: Tau2Episode, domain: Tau2Domain, toolkit: type | str,
               *, judge: Judge | None = None) -> dict[str, Any]:
    """tau2's reward and its components (see the module docstring)."""
    out: dict[str, Any] = {"id": task.id, "termination": episode.termination}
    if episode.termination not in ("agent_stop", "user_stop"):
        return {**out, "reward": 0.0, "pass": False, "reward_complete": True,
                "error_type": f"terminated:{episode.termination}"}
    crit = task.criteria
    if crit is None:
        return {**out, "reward": 1.0, "pass": True, "reward_complete": True,
                "error_type": None}
    final_db = db_of(episode.toolkit)
    if crit.actions is None and crit.env_assertions is None:
        db_match = True
        gold_hash = db_hash(final_db)
    else:
        gold = make_toolkit(domain, task, toolkit)
        gold_methods = public_methods(gold)
        for action in crit.actions or ():
            method = gold_methods.get(action.name)
            if method is not None:
                invoke(method, (), action.arguments)  # gold errors are ignored, as in tau2
        gold_hash = db_hash(db_of(gold))
        db_match = gold_hash == db_hash(final_db)
    methods = public_methods(episode.toolkit)
    assertion_met = []
    for assertion in crit.env_assertions or ():
        method = methods.get(assertion.func_name)
        try:
            value = method(**copy.deepcopy(assertion.arguments)) if method else None
        except Exception:  # noqa: BLE001 - a failing assertion function is not met
            value = None
        assertion_met.append(method is not None and bool(value) == assertion.assert_value)
    calls = [c for log in episode.turns for c in log.calls]
    action_met = [any(a.matches(c.name, c.arguments) for c in calls) for a in crit.actions or ()]
    said = [m["content"].lower().replace(",", "") for m in episode.messages
            if m["role"] == "assistant" and m.get("content")]
    info_met = [any(info.lower() in text for text in said) for info in crit.communicate_info]
    nl_met: list[bool] | None = []
    if crit.nl_assertions:
        nl_met = None
        if judge is not None:
            verdicts = list(judge(list(crit.nl_assertions), copy.deepcopy(episode.messages)))
            if len(verdicts) != len(crit.nl_assertions):
                raise ValueError(f"judge returned {len(verdicts)} verdicts for "
                                 f"{len(crit.nl_assertions)} assertions")
            nl_met = [bool(v) for v in verdicts]
    parts = {
        "DB": 1.0 if db_match else 0.0,
        "ENV_ASSERTION": float(all(assertion_met)),
        "ACTION": float(all(action_met)),
        "COMMUNICATE": float(all(info_met)),
        "NL_ASSERTION": None if nl_met is None else float(all(nl_met)),
    }
    reward, complete, failed = 1.0, True, []
    for basis in crit.reward_basis:
        value = parts["DB" if basis == "DB" else basis]
        if value is None:
            complete = False
            continue
        reward *= value
        if value < 1.0:
            failed.append(basis)
    return {
        **out, "reward": reward, "pass": reward == 1.0, "reward_complete": complete,
        "error_type": ("wrong:" + "+".join(failed)) if failed else None,
        "reward_basis": list(crit.reward_basis),
        "reward_breakdown": {b: parts[b] for b in crit.reward_basis},
        "db_match": db_match, "db_hash": db_hash(final_db), "gold_db_hash": gold_hash,
        "env_assertions_met": f"{sum(assertion_met)}/{len(assertion_met)}",
        "actions_matched": sum(action_met), "actions_total": len(action_met),
        "action_fraction": sum(action_met) / len(action_met) if action_met else 1.0,
        "communicate_met": sum(info_met), "communicate_total": len(info_met),
        "nl_assertions": ("not_evaluated" if nl_met is None
                          else f"{sum(nl_met)}/{len(nl_met)}"),
        "tool_calls": len(calls),
    }


def evaluate_tau2(domain: Tau2Domain, policy: Policy,
                  users: Callable[[Tau2Task], UserSimulator], toolkit: type | str, *,
                  judge: Judge | None = None, max_steps: int = MAX_STEPS,
                  max_errors: int = MAX_ERRORS,
                  tasks: Sequence[Tau2Task] | None = None) -> list[dict[str, Any]]:
    """Runs and scores every task of the domain; `users(task)` gives each task's user."""
    return [score_tau2(task, run_tau2(task, domain, policy, users(task), toolkit,
                                      max_steps=max_steps, max_errors=max_errors),
                       domain, toolkit, judge=judge)
            for task in (domain.tasks if tasks is None else tasks)]
