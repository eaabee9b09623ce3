"""Multi-turn tool-calling tasks (modelled on BFCL v4 multi-turn and tau2-bench).

A task is data, not code: a JSON state, tools declared as small operations on that state,
user turns, and goal checks on the final state (and on what the agent told the user).
Nothing from a data file is executed, so these environments run in the trainer process.

One JSON object per line:

    {"id": "bank-1",
     "user_turns": ["Move 30 from checking to savings.", "What is my savings balance now?"],
     "initial_state": {"accounts": {"checking": 100, "savings": 5}},
     "tools": [
       {"name": "get_balance", "description": "Balance of an account.",
        "parameters": {"account": "string"},
        "returns": "accounts.{account}"},
       {"name": "transfer", "description": "Move money between accounts.",
        "parameters": {"source": "string", "target": "string", "amount": "number"},
        "requires": [{"path": "accounts.{source}", "op": "gte", "value": "{amount}"}],
        "effects": [{"op": "sub", "path": "accounts.{source}", "value": "{amount}"},
                    {"op": "add", "path": "accounts.{target}", "value": "{amount}"}]}],
     "goal": [{"path": "accounts.savings", "op": "eq", "value": 35},
              {"answer_contains": "35"}],
     "max_turns": 8}

- parameters: name -> "string" | "number" | "integer" | "boolean" | "array" | "object";
  every parameter is required and type-checked.
- paths: dot-separated keys (list indices as integers); "{param}" inside a path or value
  is replaced by the call's argument ("{amount}" alone keeps the argument's JSON type).
- effects (in order, all-or-nothing): set, add, sub (numbers), append (to a list),
  remove (a key of an object, or a value from a list). `returns`: a path whose value is
  the tool's result (default {"ok": true}).
- requires / goal checks: {"path", "op", "value"} with op in exists, absent, eq, ne, lt,
  lte, gt, gte, contains; goal also takes {"answer_contains": text}: some reply of the agent
  to the user contains the text (case-insensitive).

The agent calls tools with `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
(several per message allowed) and answers the user with a message without a tool call,
which moves on to the next user turn. The episode ends after the reply to the last user
turn, or at `max_turns` agent messages. Reward 1.0 at the end if every goal check holds,
else 0.0 (info["checks_passed"] gives the fraction); malformed calls get an error result
and change nothing.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

from spade_jax.evaluation.data import Where, check_unique_ids, field, read_jsonl, record_id

PARAM_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "number": (int, float), "integer": (int,), "boolean": (bool,),
    "array": (list,), "object": (dict,),
}
EFFECT_OPS = ("set", "add", "sub", "append", "remove")
CHECK_OPS = ("exists", "absent", "eq", "ne", "lt", "lte", "gt", "gte", "contains")
_TEMPLATE = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_MISSING = object()


@dataclasses.dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, str]
    requires: tuple[dict[str, Any], ...] = ()
    effects: tuple[dict[str, Any], ...] = ()
    returns: str | None = None

    def schema(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description,
                "parameters": dict(self.parameters)}


@dataclasses.dataclass(frozen=True)
class ToolTask:
    id: str
    user_turns: tuple[str, ...]
    initial_state: dict[str, Any]
    tools: tuple[Tool, ...]
    goal: tuple[dict[str, Any], ...]
    max_turns: int = 8


# ----------------------------------------------------------------------------- loading


def _check_templates(text: Any, params: dict[str, str], where: Where, name: str) -> None:
    if isinstance(text, str):
        for ref in _TEMPLATE.findall(text):
            if ref not in params:
                raise where.error(f"field '{name}' refers to unknown parameter '{{{ref}}}'")


def _parse_check(raw: Any, where: Where, name: str, params: dict[str, str],
                 allow_answer: bool) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise where.error(f"field '{name}' must be an object")
    if allow_answer and "answer_contains" in raw:
        if not isinstance(raw["answer_contains"], str) or not raw["answer_contains"]:
            raise where.error(f"field '{name}.answer_contains' must be a non-empty string")
        return {"answer_contains": raw["answer_contains"]}
    if not isinstance(raw.get("path"), str):
        raise where.error(f"field '{name}.path' must be a string")
    if raw.get("op") not in CHECK_OPS:
        raise where.error(f"field '{name}.op' must be one of {list(CHECK_OPS)}, got {raw.get('op')!r}")
    if raw["op"] not in ("exists", "absent") and "value" not in raw:
        raise where.error(f"field '{name}.value' is missing (op {raw['op']!r} compares a value)")
    _check_templates(raw["path"], params, where, f"{name}.path")
    _check_templates(raw.get("value"), params, where, f"{name}.value")
    return dict(raw)


def _parse_tool(raw: Any, where: Where, k: int) -> Tool:
    name = f"tools[{k}]"
    if not isinstance(raw, dict):
        raise where.error(f"field '{name}' must be an object")
    if not isinstance(raw.get("name"), str) or not raw["name"]:
        raise where.error(f"field '{name}.name' must be a non-empty string")
    params = raw.get("parameters", {})
    if not isinstance(params, dict):
        raise where.error(f"field '{name}.parameters' must be an object")
    for param, kind in params.items():
        if kind not in PARAM_TYPES:
            raise where.error(f"field '{name}.parameters.{param}' must be one of "
                              f"{list(PARAM_TYPES)}, got {kind!r}")
    requires = [_parse_check(c, where, f"{name}.requires[{i}]", params, False)
                for i, c in enumerate(raw.get("requires", []))]
    effects = []
    for i, effect in enumerate(raw.get("effects", [])):
        label = f"{name}.effects[{i}]"
        if not isinstance(effect, dict) or effect.get("op") not in EFFECT_OPS:
            raise where.error(f"field '{label}.op' must be one of {list(EFFECT_OPS)}")
        if not isinstance(effect.get("path"), str):
            raise where.error(f"field '{label}.path' must be a string")
        if "value" not in effect and effect["op"] != "remove":
            raise where.error(f"field '{label}.value' is missing")
        _check_templates(effect["path"], params, where, f"{label}.path")
        _check_templates(effect.get("value"), params, where, f"{label}.value")
        effects.append(dict(effect))
    returns = raw.get("returns")
    if returns is not None and not isinstance(returns, str):
        raise where.error(f"field '{name}.returns' must be a path string")
    _check_templates(returns, params, where, f"{name}.returns")
    return Tool(raw["name"], str(raw.get("description", "")), dict(params), tuple(requires),
                tuple(effects), returns)


def load_tool_tasks(path: str | Path) -> list[ToolTask]:
    tasks = []
    for where, record in read_jsonl(path):
        turns = field(record, "user_turns", list, where)
        if not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise where.error("field 'user_turns' must be a non-empty list of non-empty strings")
        state = field(record, "initial_state", dict, where)
        raw_tools = field(record, "tools", list, where)
        tools = tuple(_parse_tool(t, where, k) for k, t in enumerate(raw_tools))
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise where.error(f"field 'tools' has duplicate names {names}")
        raw_goal = field(record, "goal", list, where)
        if not raw_goal:
            raise where.error("field 'goal' is empty")
        goal = tuple(_parse_check(g, where, f"goal[{i}]", {}, True) for i, g in enumerate(raw_goal))
        max_turns = field(record, "max_turns", int, where, required=False, default=8)
        if max_turns < len(turns):
            raise where.error(f"field 'max_turns' ({max_turns}) is below the number of user turns")
        tasks.append(ToolTask(record_id(record, where), tuple(turns), state, tools, goal, max_turns))
    check_unique_ids(tasks, path)
    return tasks


# ----------------------------------------------------------------------------- state ops


class ToolError(Exception):
    """A tool call failed; the message is shown to the agent."""


def _fill(template: Any, args: dict[str, Any]) -> Any:
    if not isinstance(template, str):
        return template
    whole = _TEMPLATE.fullmatch(template)
    if whole:
        return args[whole.group(1)]
    return _TEMPLATE.sub(lambda m: str(args[m.group(1)]), template)


def _keys(path: str, args: dict[str, Any]) -> list[str | int]:
    keys: list[str | int] = []
    for part in path.split("."):
        value = _fill(part, args)
        keys.append(int(value) if isinstance(value, str) and value.lstrip("-").isdigit() else value)
    return keys


def _get(state: Any, keys: list[Any]) -> Any:
    node = state
    for key in keys:
        if isinstance(node, dict) and isinstance(key, str) and key in node:
            node = node[key]
        elif isinstance(node, list) and isinstance(key, int) and -len(node) <= key < len(node):
            node = node[key]
        else:
            return _MISSING
    return node


def _parent(state: Any, keys: list[Any], path: str) -> tuple[Any, Any]:
    parent = _get(state, keys[:-1])
    if parent is _MISSING or not isinstance(parent, dict | list):
        raise ToolError(f"not found: {path}")
    return parent, keys[-1]


def _compare(op: str, got: Any, want: Any) -> bool:
    if op == "exists":
        return got is not _MISSING
    if op == "absent":
        return got is _MISSING
    if got is _MISSING:
        return False
    if op == "eq":
        return got == want
    if op == "ne":
        return got != want
    if op == "contains":
        return isinstance(got, list | dict | str) and want in got
    numbers = (int, float)
    if not (isinstance(got, numbers) and isinstance(want, numbers)):
        return False
    return {"lt": got < want, "lte": got <= want, "gt": got > want, "gte": got >= want}[op]


def _apply(state: Any, effect: dict[str, Any], args: dict[str, Any]) -> None:
    op = effect["op"]
    keys = _keys(effect["path"], args)
    label = ".".join(map(str, keys))
    value = _fill(effect.get("value"), args)
    parent, key = _parent(state, keys, label)
    current = _get(state, keys)
    if op == "set":
        if isinstance(parent, list) and current is _MISSING:
            raise ToolError(f"not found: {label}")
        parent[key] = copy.deepcopy(value)
    elif op in ("add", "sub"):
        if not isinstance(current, int | float) or not isinstance(value, int | float):
            raise ToolError(f"{op} needs numbers at {label}")
        parent[key] = current + value if op == "add" else current - value
    elif op == "append":
        if not isinstance(current, list):
            raise ToolError(f"not a list: {label}")
        current.append(copy.deepcopy(value))
    elif op == "remove":
        if "value" in effect:
            if not isinstance(current, list) or value not in current:
                raise ToolError(f"{value!r} not found in {label}")
            current.remove(value)
        elif current is _MISSING:
            raise ToolError(f"not found: {label}")
        else:
            del parent[key]


# ----------------------------------------------------------------------------- env


class ToolTaskEnv:
    """A `ToolTask` as a text environment (reset(seed=) / step(text), gymnasium-style)."""

    def __init__(self, task: ToolTask) -> None:
        self.task = task
        self.tools = {t.name: t for t in task.tools}
        self.state: dict[str, Any] = {}
        self.replies: list[str] = []
        self.turn = 0
        self.messages = 0

    def reset(self, *, seed: int | None = None, **kwargs: Any) -> tuple[str, dict[str, Any]]:
        del seed, kwargs  # the task is deterministic
        self.state = copy.deepcopy(self.task.initial_state)
        self.replies, self.turn, self.messages = [], 0, 0
        tools = json.dumps([t.schema() for t in self.task.tools], indent=1)
        intro = ("You can use these tools:\n" + tools + "\n\nTo call a tool, write "
                 '<tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>. '
                 "Reply without a tool call to answer the user.\n\nUser: ")
        return intro + self.task.user_turns[0], {}

    def call(self, raw: str) -> Any:
        """Runs one tool call (its JSON text); raises ToolError with the agent-facing reason."""
        try:
            request = json.loads(raw)
        except json.JSONDecodeError as err:
            raise ToolError(f"invalid tool call JSON: {err.msg}") from None
        if not isinstance(request, dict) or not isinstance(request.get("name"), str):
            raise ToolError('a tool call is {"name": ..., "arguments": {...}}')
        tool = self.tools.get(request["name"])
        if tool is None:
            raise ToolError(f"unknown tool {request['name']!r}")
        args = request.get("arguments", {})
        if not isinstance(args, dict):
            raise ToolError("arguments must be an object")
        missing = sorted(set(tool.parameters) - set(args))
        extra = sorted(set(args) - set(tool.parameters))
        if missing or extra:
            raise ToolError(f"{tool.name}: missing arguments {missing}, unexpected {extra}")
        for name, kind in tool.parameters.items():
            allowed = PARAM_TYPES[kind]
            if not isinstance(args[name], allowed) or (
                    isinstance(args[name], bool) and bool not in allowed):
                raise ToolError(f"{tool.name}: argument '{name}' must be a {kind}")
        for check in tool.requires:
            got = _get(self.state, _keys(check["path"], args))
            if not _compare(check["op"], got, _fill(check.get("value"), args)):
                raise ToolError(f"{tool.name}: precondition failed ({check['path']} "
                                f"{check['op']} {check.get('value', '')})".strip())
        draft = copy.deepcopy(self.state)
        for effect in tool.effects:
            _apply(draft, effect, args)
        self.state = draft
        if tool.returns is None:
            return {"ok": True}
        value = _get(self.state, _keys(tool.returns, args))
        if value is _MISSING:
            raise ToolError(f"not found: {_fill(tool.returns, args)}")
        return value

    def goal_checks(self) -> list[bool]:
        said = "\n".join(self.replies).lower()
        return [
            check["answer_contains"].lower() in said if "answer_contains" in check
            else _compare(check["op"], _get(self.state, _keys(check["path"], {})),
                          check.get("value"))
            for check in self.task.goal
        ]

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.messages += 1
        calls = _TOOL_CALL.findall(action)
        if not calls and "<tool_call>" in action:
            calls = [action.split("<tool_call>", 1)[1]]  # unterminated: reported as malformed
        if calls:
            results = []
            for raw in calls:
                try:
                    results.append(json.dumps({"result": self.call(raw.strip())}))
                except ToolError as err:
                    results.append(json.dumps({"error": str(err)}))
            observation = "\n".join(f"<tool_response>{r}</tool_response>" for r in results)
        else:
            self.replies.append(action)
            self.turn += 1
            observation = (f"User: {self.task.user_turns[self.turn]}"
                           if self.turn < len(self.task.user_turns) else "")
        finished = self.turn >= len(self.task.user_turns)
        out_of_turns = self.messages >= self.task.max_turns
        if finished or out_of_turns:
            checks = self.goal_checks()
            reward = 1.0 if all(checks) else 0.0
            info = {"checks_passed": sum(checks) / len(checks)}
            return observation, reward, finished, not finished, info
        return observation, 0.0, False, False, {}

