"""Shared pieces of the tool-use benchmark readers: policies, tool schemas, safe call
parsing, user-supplied backends and the agent-turn loop.

Why one module: BFCL v4 multi-turn, tau2-bench and ACEBench-Agent all drive the same kind
of episode (an assistant that may emit tool calls, tools that run against live state, a
user that speaks in turns) and differ only in how files are laid out and how episodes are
scored. The pieces here are the parts that must behave identically everywhere:

- A *policy* is any callable ``policy(messages, tools) -> reply``. ``messages`` is the
  chat so far (``{"role": "system"|"user"|"assistant"|"tool", "content": str, ...}``),
  ``tools`` the schemas offered this step (``{"name", "description", "parameters"}``).
  The reply is a string (a text answer) or a dict ``{"content": str, "tool_calls":
  [{"name": str, "arguments": dict | JSON str}, ...]}`` (OpenAI's nested
  ``{"function": {...}}`` form is accepted too). Scripted policies test the scorers now;
  the model's sampler plugs in later behind the same signature.
- Tool calls are validated against the offered schemas before anything runs: malformed
  calls, unknown (hallucinated) tools, missing / unexpected argument names and wrong JSON
  types become an error observation for the agent and never an exception.
- Executable backends (BFCL's ``GorillaFileSystem``, ACEBench's ``MessageApi``, a tau2
  toolkit) are Python classes the *user* supplies: a class object, a name registered with
  `register_backend`, or a ``"package.module:Class"`` import path given in code/config.
  Data files only name classes, which are looked up in that user mapping; nothing read
  from a data file is imported, evaluated or executed.
- Ground-truth calls written as Python call text (``cd(folder='docs')``) are parsed with
  `ast` into a name plus literal arguments; anything that is not a literal is rejected.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import importlib
import inspect
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from spade_jax.evaluation.data import DataError, Where, field

Message = dict[str, Any]
Policy = Callable[[list[Message], list[dict[str, Any]]], Any]

# JSON-schema-ish type names used by the three benchmarks -> accepted Python types.
_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "str": (str,),
    "integer": (int,), "int": (int,),
    "number": (int, float), "float": (int, float),
    "boolean": (bool,), "bool": (bool,),
    "array": (list, tuple), "list": (list, tuple), "tuple": (list, tuple),
    "object": (dict,), "dict": (dict,),
    "null": (type(None),),
}
OK, INVALID, ERROR = "ok", "invalid", "error"


# ----------------------------------------------------------------------------- files


def read_json_file(path: str | Path) -> Any:
    """A whole JSON document (policy-free data such as a tau2 db.json); errors name the file
    and the line of the syntax error."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise DataError(f"{path}: not UTF-8 text") from None
    except json.JSONDecodeError as err:
        raise DataError(f"{path}:{err.lineno}: malformed JSON ({err.msg} at column "
                        f"{err.colno})") from None


def new_task_id(record: Mapping[str, Any], where: Where, seen: set[str]) -> str:
    """A task record's "id" (a string or an integer, read as a string), added to ``seen``;
    one already there is an error naming the record's file and line."""
    task_id = str(field(record, "id", (str, int), where))
    if task_id in seen:
        raise where.error(f"field 'id': duplicate id {task_id!r}")
    seen.add(task_id)
    return task_id


def read_json_array(path: str | Path) -> Iterator[tuple[Where, Any]]:
    """(position, element) for each element of a top-level JSON array, the position being
    the line where the element starts, so errors in a 2 MB tasks.json name a line."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise DataError(f"{path}: not UTF-8 text") from None
    decoder = json.JSONDecoder()

    def line_of(pos: int) -> int:
        return text.count("\n", 0, pos) + 1

    def skip(pos: int) -> int:
        while pos < len(text) and text[pos] in " \t\r\n":
            pos += 1
        return pos

    pos = skip(0)
    if pos >= len(text) or text[pos] != "[":
        raise DataError(f"{path}:{line_of(pos)}: expected a JSON array of tasks")
    pos = skip(pos + 1)
    if pos < len(text) and text[pos] == "]":
        return
    while True:
        try:
            value, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{err.lineno}: malformed JSON ({err.msg} at column "
                            f"{err.colno})") from None
        yield Where(str(path), line_of(pos)), value
        pos = skip(end)
        if pos < len(text) and text[pos] == ",":
            pos = skip(pos + 1)
            continue
        if pos < len(text) and text[pos] == "]":
            if skip(pos + 1) != len(text):
                raise DataError(f"{path}:{line_of(pos)}: text after the closing ']'")
            return
        raise DataError(f"{path}:{line_of(pos)}: malformed JSON (expected ',' or ']')")


# ----------------------------------------------------------------------------- schemas


@dataclasses.dataclass(frozen=True)
class ToolSchema:
    """One tool as offered to the agent, with what argument validation needs."""

    name: str
    description: str
    properties: Mapping[str, Any]
    required: tuple[str, ...]
    raw: Mapping[str, Any]

    def offered(self) -> dict[str, Any]:
        """The schema shown to the policy (name, description, parameters)."""
        return {"name": self.name, "description": self.description,
                "parameters": copy.deepcopy(dict(self.raw.get("parameters") or {}))}


def parse_tool_doc(doc: Any, where: Where, label: str) -> ToolSchema:
    """A function doc in BFCL / ACEBench / OpenAI form -> ToolSchema (DataError if bad)."""
    if isinstance(doc, dict) and doc.get("type") == "function" and isinstance(
            doc.get("function"), dict):
        doc = doc["function"]
    if not isinstance(doc, dict):
        raise where.error(f"field '{label}' must be an object")
    name = doc.get("name")
    if not isinstance(name, str) or not name.strip():
        raise where.error(f"field '{label}.name' must be a non-empty string")
    params = doc.get("parameters", {}) or {}
    if not isinstance(params, dict):
        raise where.error(f"field '{label}.parameters' must be an object")
    props = params.get("properties", {}) or {}
    if not isinstance(props, dict):
        raise where.error(f"field '{label}.parameters.properties' must be an object")
    required = params.get("required", []) or []
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise where.error(f"field '{label}.parameters.required' must be a list of names")
    # Published docs sometimes list a required name that has no property (ACEBench); it
    # could never be passed without being "unexpected", so it is not enforced.
    required = [r for r in required if r in props]
    return ToolSchema(name, str(doc.get("description", "")), dict(props), tuple(required),
                      dict(doc))


def _type_ok(value: Any, spec: Any) -> bool:
    if not isinstance(spec, dict):
        return True
    kind = spec.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    allowed: list[type] = []
    for k in kinds:
        if k is None or k == "any" or k not in _TYPES:
            return True  # untyped or a type we do not know: accept
        allowed.extend(_TYPES[k])
    if isinstance(value, bool) and bool not in allowed:
        return False
    if not isinstance(value, tuple(allowed)):
        return False
    if "enum" in spec and isinstance(spec["enum"], list) and value not in spec["enum"]:
        return False
    if isinstance(value, list | tuple) and isinstance(spec.get("items"), dict):
        return all(_type_ok(v, spec["items"]) for v in value)
    return True


def check_arguments(schema: ToolSchema, args: Mapping[str, Any]) -> str | None:
    """Why a call's arguments do not fit the schema, or None when they do."""
    missing = [r for r in schema.required if r not in args]
    extra = sorted(set(args) - set(schema.properties))
    if missing or extra:
        return f"{schema.name}: missing arguments {missing}, unexpected arguments {extra}"
    for name, value in args.items():
        spec = schema.properties[name]
        if not _type_ok(value, spec):
            kind = spec.get("type") if isinstance(spec, dict) else spec
            return f"{schema.name}: argument '{name}' must be of type {kind}"
    return None


# ----------------------------------------------------------------------------- replies


@dataclasses.dataclass(frozen=True)
class ToolCallRecord:
    """One tool call the agent made and what came of it.

    status: OK (ran on the backend), INVALID (malformed, unknown tool or bad arguments;
    nothing ran) or ERROR (the backend raised; its state may have changed)."""

    name: str | None
    arguments: dict[str, Any]
    result: str
    status: str


@dataclasses.dataclass(frozen=True)
class Reply:
    content: str
    calls: tuple[dict[str, Any], ...]  # {"name", "arguments"} or {"invalid": reason}


def normalize_reply(raw: Any) -> Reply:
    """A policy's return value -> Reply; a bad call becomes {"invalid": reason}, never an
    exception (the agent sees the reason)."""
    if isinstance(raw, str):
        return Reply(raw, ())
    if not isinstance(raw, dict):
        return Reply("" if raw is None else str(raw), ())
    content = raw.get("content")
    content = "" if content is None else content if isinstance(content, str) else str(content)
    calls = []
    raw_calls = raw.get("tool_calls") or []
    if not isinstance(raw_calls, list):
        raw_calls = [raw_calls]
    for call in raw_calls:
        if isinstance(call, dict) and isinstance(call.get("function"), dict):
            call = call["function"]
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append({"invalid": 'a tool call is {"name": ..., "arguments": {...}}'})
            continue
        args = call.get("arguments", {})
        if args is None:
            args = {}
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as err:
                calls.append({"invalid": f"{call['name']}: arguments are not JSON ({err.msg})",
                              "name": call["name"]})
                continue
        if not isinstance(args, dict):
            calls.append({"invalid": f"{call['name']}: arguments must be an object",
                          "name": call["name"]})
            continue
        calls.append({"name": call["name"], "arguments": args})
    return Reply(content, tuple(calls))


def format_result(value: Any) -> str:
    """A backend's return value as the text the agent sees (str as is, dicts as JSON,
    anything else through str); BFCL's response check compares these strings."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        try:
            return json.dumps(value)
        except (TypeError, ValueError):
            return str(value)
    return str(value)


# ----------------------------------------------------------------------------- backends

BACKEND_REGISTRY: dict[str, type] = {}


def register_backend(name: str, cls: type) -> type:
    """Makes `cls` available as backend `name` (e.g. "GorillaFileSystem")."""
    if not isinstance(cls, type):
        raise TypeError(f"backend {name!r} must be a class, got {type(cls).__name__}")
    BACKEND_REGISTRY[name] = cls
    return cls


def resolve_backend(spec: type | str, name: str) -> type:
    """A backend given as a class, or as a "package.module:Class" path written by the user
    in code or config (never taken from a data file)."""
    if isinstance(spec, type):
        return spec
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"backend for {name!r} must be a class or 'module:Class', got {spec!r}")
    module_name, _, attr = spec.partition(":")
    module = importlib.import_module(module_name)
    cls = getattr(module, attr, None)
    if not isinstance(cls, type):
        raise ValueError(f"backend for {name!r}: {spec!r} is not a class")
    return cls


def backend_classes(names: Sequence[str], backends: Mapping[str, type | str] | None,
                    task_id: str) -> dict[str, type]:
    """The classes of `names`, from `backends` first and then the registry."""
    out = {}
    for name in names:
        if backends is not None and name in backends:
            out[name] = resolve_backend(backends[name], name)
        elif name in BACKEND_REGISTRY:
            out[name] = BACKEND_REGISTRY[name]
        else:
            raise KeyError(f"task {task_id!r} needs backend class {name!r}: pass it in "
                           f"backends= or register_backend({name!r}, cls)")
    return out


def public_methods(instance: Any) -> dict[str, Callable[..., Any]]:
    return {name: member for name, member in inspect.getmembers(instance, inspect.ismethod)
            if not name.startswith("_")}


def public_state(instance: Any) -> dict[str, Any]:
    """A deep copy of an instance's public attributes (what BFCL's state check compares)."""
    return {k: copy.deepcopy(v) for k, v in vars(instance).items() if not k.startswith("_")}


def invoke(method: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]
           ) -> tuple[str, str]:
    """(result text, status) of one backend call; an exception is an ERROR result."""
    try:
        return format_result(method(*copy.deepcopy(list(args)), **copy.deepcopy(dict(kwargs)))), OK
    except Exception as err:  # noqa: BLE001 - backend failures are observations
        return f"Error during execution: {err}", ERROR


# ----------------------------------------------------------------------------- call text


@dataclasses.dataclass(frozen=True)
class ParsedCall:
    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def canonical(self) -> tuple[str, tuple[Any, ...], tuple[tuple[str, str], ...]]:
        return (self.name, self.args,
                tuple(sorted((k, json.dumps(v, sort_keys=True, default=repr))
                             for k, v in self.kwargs.items())))


def _literal(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _literal(node.operand)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("'**' in a dict literal")
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values, strict=True)}
    if isinstance(node, ast.Name) and node.id in ("True", "False", "None"):
        return {"True": True, "False": False, "None": None}[node.id]
    raise ValueError(f"not a literal: {ast.unparse(node)}")


def parse_call_text(text: str) -> list[ParsedCall]:
    """'f(a=1)', 'f(1, b=[2])' or '[f(), g(x="y")]' -> calls with literal arguments; a
    non-literal argument, a method path or anything that is not a call raises ValueError.
    Nothing is evaluated."""
    tree = ast.parse(text.strip(), mode="eval")
    body = tree.body
    nodes = body.elts if isinstance(body, ast.List | ast.Tuple) else [body]
    calls = []
    for node in nodes:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            raise ValueError(f"not a plain function call: {ast.unparse(node)}")
        if any(isinstance(a, ast.Starred) for a in node.args) or any(
                k.arg is None for k in node.keywords):
            raise ValueError("'*' / '**' arguments are not allowed")
        calls.append(ParsedCall(node.func.id, tuple(_literal(a) for a in node.args),
                                {k.arg: _literal(k.value) for k in node.keywords}))
    return calls


def render_call(name: str, arguments: Mapping[str, Any]) -> str:
    """The Python-call text of a structured call (ACEBench's milestone spelling)."""
    return f"{name}(" + ", ".join(f"{k}={v!r}" for k, v in arguments.items()) + ")"


# ----------------------------------------------------------------------------- agent turn


@dataclasses.dataclass
class TurnLog:
    """What the agent did between two user messages.

    steps: the tool calls of each assistant message that made calls; reply: the text of
    the final message without calls (None if the step limit cut the turn off)."""

    steps: list[list[ToolCallRecord]] = dataclasses.field(default_factory=list)
    reply: str | None = None
    hit_step_limit: bool = False

    @property
    def calls(self) -> list[ToolCallRecord]:
        return [c for step in self.steps for c in step]


Executor = Callable[[str, dict[str, Any]], tuple[str, str]]


def execute_reply(reply: Reply, tools: Mapping[str, ToolSchema], execute: Executor
                  ) -> list[ToolCallRecord]:
    """Validates and runs each call of one assistant message, in order."""
    records = []
    for call in reply.calls:
        if "invalid" in call:
            records.append(ToolCallRecord(call.get("name"), {}, f"Error: {call['invalid']}",
                                          INVALID))
            continue
        name, args = call["name"], call["arguments"]
        schema = tools.get(name)
        if schema is None:
            records.append(ToolCallRecord(name, args, f"Error: unknown tool {name!r}", INVALID))
            continue
        problem = check_arguments(schema, args)
        if problem is not None:
            records.append(ToolCallRecord(name, args, f"Error: {problem}", INVALID))
            continue
        result, status = execute(name, args)
        records.append(ToolCallRecord(name, args, result, status))
    return records


def run_agent_turn(policy: Policy, messages: list[Message], tools: Sequence[ToolSchema],
                   execute: Executor, max_steps: int) -> TurnLog:
    """Asks the policy for messages until one has no tool call (the reply to the user) or
    `max_steps` assistant messages were made; appends everything to `messages`."""
    by_name = {t.name: t for t in tools}
    offered = [t.offered() for t in tools]
    log = TurnLog()
    for _ in range(max_steps):
        reply = normalize_reply(policy(copy.deepcopy(messages), copy.deepcopy(offered)))
        message: Message = {"role": "assistant", "content": reply.content}
        if reply.calls:
            message["tool_calls"] = [dict(c) for c in reply.calls]
        messages.append(message)
        if not reply.calls:
            log.reply = reply.content
            return log
        records = execute_reply(reply, by_name, execute)
        log.steps.append(records)
        for record in records:
            messages.append({"role": "tool", "name": record.name, "content": record.result})
    log.hit_step_limit = True
    return log


# ----------------------------------------------------------------------------- users


class UserSimulator(Protocol):
    """The simulated user of tau2 / ACEBench multi-turn episodes.

    `first_message(instructions)` opens the conversation; `respond(history)` answers the
    agent's last text (``history`` is the conversation as the user sees it: its own
    messages as "user" and the agent's text replies as "assistant"). Returning None ends
    the conversation (as does a reply containing the benchmark's stop marker)."""

    def first_message(self, instructions: str) -> str | None: ...

    def respond(self, history: list[Message]) -> str | None: ...


class ScriptedUser:
    """A user that says the given messages in order and then stops."""

    def __init__(self, messages: Sequence[str]) -> None:
        self.messages = list(messages)
        self._next = 0

    def first_message(self, instructions: str) -> str | None:
        del instructions
        self._next = 0
        return self.respond([])

    def respond(self, history: list[Message]) -> str | None:
        del history
        if self._next >= len(self.messages):
            return None
        self._next += 1
        return self.messages[self._next - 1]


class CallableUser:
    """A user backed by a function ``fn(instructions, history) -> str | None`` (e.g. a
    model behind our sampler prompted with the task's user instructions)."""

    def __init__(self, fn: Callable[[str, list[Message]], str | None]) -> None:
        self.fn = fn
        self.instructions = ""

    def first_message(self, instructions: str) -> str | None:
        self.instructions = instructions
        return self.fn(instructions, [])

    def respond(self, history: list[Message]) -> str | None:
        return self.fn(self.instructions, copy.deepcopy(history))


# ----------------------------------------------------------------------------- reports


def suite_result(name: str, kind: str, task_ids: Sequence[str],
                 scores: Sequence[Mapping[str, Any]], pass_key: str) -> Any:
    """Per-task score dicts -> a `report.SuiteResult` (one sample per task) so pass/fail
    lands in results.md/.csv and every partial score in samples.jsonl (as the JSON of the
    task's score dict in the "completion" field)."""
    import numpy as np

    from spade_jax.evaluation.report import SuiteResult

    passed = [bool(s.get(pass_key)) for s in scores]
    reasons = [["correct" if ok else str(s.get("error_type") or "wrong")]
               for ok, s in zip(passed, scores, strict=True)]
    counts: dict[str, int] = {}
    for (reason,) in reasons:
        counts[reason] = counts.get(reason, 0) + 1
    return SuiteResult(name, kind, list(task_ids),
                       np.asarray([[float(ok)] for ok in passed]).reshape(len(passed), 1),
                       counts, reasons,
                       [[json.dumps(dict(s), sort_keys=True, default=str)] for s in scores])
