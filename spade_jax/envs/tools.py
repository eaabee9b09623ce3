"""Tool calling for tool environments: schemas, argument checks, actions, observations.

Used on both sides of the sandbox with the same code: inside a worker (the program's own
process), where a turn's calls are dispatched to the program's methods, and in the trainer,
which re-checks the tool list a worker reports and decides from the action itself whether a
turn ends the episode (see `spade_jax.envs.pool`). Standard library only: the sandbox
zygote imports this module before it forks workers.

Tools are declared in the OpenAI / Hugging Face function format::

    {"type": "function",
     "function": {"name": "transfer", "description": "Move money between accounts.",
                  "parameters": {"type": "object",
                                 "properties": {"amount": {"type": "number"}, ...},
                                 "required": ["amount", ...]}}}

An action is either the JSON object the agent loop sends under ``action_format="tool_call"``
(``{"content": str, "tool_calls": [{"name", "arguments"}, ...], "errors": [str, ...]}``) or
a plain reply text, whose ``<tool_call>{json}</tool_call>`` blocks are read the same way.
"""

from __future__ import annotations

import json
import keyword
import math
import re
from typing import Any

# JSON schema type name -> the Python types of a decoded JSON value of that type
# (bool is excluded from integer and number by an explicit check).
JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}
MAX_TOOLS = 32
# The tool list is rendered into every agent prompt.
MAX_TOOLS_JSON_CHARS = 16384
MAX_SCHEMA_DEPTH = 6
# Tool calls run per turn; further calls of the same reply are refused with an error.
MAX_CALLS_PER_TURN = 16
TOOL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
# Keywords checked at run time; other keywords (default, format, pattern, title, ...) are
# allowed in a schema and shown to the agent, but not enforced.
_ENFORCED = ("type", "enum", "properties", "required", "additionalProperties", "items",
             "minimum", "maximum")
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
FORMAT_REMINDER = (
    'Call a tool as <tool_call>{"name": "<tool name>", "arguments": {...}}</tool_call>; '
    "reply without a tool call to give your final answer."
)


class ToolSchemaError(ValueError):
    """A tool list that breaks the schema rules; the message names the tool and the problem."""


# ----------------------------------------------------------------------------- schemas


def check_tool_schemas(tools: Any, *, identifiers: bool = True) -> list[dict[str, Any]]:
    """``tools`` as a list of function schemas, or ToolSchemaError naming the tool and the
    problem. Exact JSON types only (dict, list, str, int, float, bool, None), so a value
    decoded from a worker's reply and a program's own literal are judged alike.

    ``identifiers``: argument names must be Python identifiers (they are passed as keyword
    arguments to the program's methods)."""
    if type(tools) not in (list, tuple):
        raise ToolSchemaError(f"the tool list must be a list, got {type(tools).__name__}")
    if not tools:
        raise ToolSchemaError("the tool list is empty: declare at least one tool")
    if len(tools) > MAX_TOOLS:
        raise ToolSchemaError(f"{len(tools)} tools declared; at most {MAX_TOOLS}")
    names: set[str] = set()
    out = []
    for index, tool in enumerate(tools):
        label = f"tool {index}"
        if type(tool) is not dict:
            raise ToolSchemaError(f"{label}: expected an object, got {type(tool).__name__}")
        function = tool.get("function")
        if type(function) is dict and type(function.get("name")) is str:
            label = f"tool {function['name']!r}"
        if tool.get("type") != "function":
            raise ToolSchemaError(f'{label}: "type" must be "function", got {tool.get("type")!r}')
        if type(function) is not dict:
            raise ToolSchemaError(f'{label}: "function" must be an object with name, '
                                  "description and parameters")
        name = function.get("name")
        if type(name) is not str or not TOOL_NAME.fullmatch(name):
            raise ToolSchemaError(f"{label}: the name must match [A-Za-z_][A-Za-z0-9_]* "
                                  f"(at most 64 characters), got {name!r}")
        if name in names:
            raise ToolSchemaError(f"{label}: declared twice")
        names.add(name)
        unknown = set(function) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise ToolSchemaError(f"{label}: unknown keys {sorted(unknown)} in \"function\"")
        if type(function.get("description", "")) is not str:
            raise ToolSchemaError(f"{label}: the description must be a string")
        if "parameters" not in function:
            raise ToolSchemaError(f'{label}: "parameters" is missing (a tool without '
                                  'arguments declares {"type": "object", "properties": {}})')
        parameters = function["parameters"]
        if type(parameters) is not dict or parameters.get("type") != "object":
            raise ToolSchemaError(f'{label}: "parameters" must be a schema of type "object"')
        _check_schema(parameters, f"{label}: parameters", 0)
        if identifiers:
            for arg in parameters.get("properties", {}):
                if not arg.isidentifier() or keyword.iskeyword(arg):
                    raise ToolSchemaError(f"{label}: argument name {arg!r} is not a Python "
                                          "identifier (it is passed as a keyword argument)")
        out.append(tool)
    try:
        size = len(json.dumps(out))
    except (TypeError, ValueError) as err:
        raise ToolSchemaError(f"the tool list is not plain JSON: {err}") from None
    if size > MAX_TOOLS_JSON_CHARS:
        raise ToolSchemaError(f"the tool list is {size} characters of JSON; at most "
                              f"{MAX_TOOLS_JSON_CHARS}")
    return out


def _types_of(schema: dict, where: str) -> list[str] | None:
    kind = schema.get("type")
    if kind is None:
        return None
    kinds = [kind] if type(kind) is str else kind
    if type(kinds) is not list or not kinds or any(type(k) is not str for k in kinds):
        raise ToolSchemaError(f'{where}: "type" must be a type name or a list of them')
    for k in kinds:
        if k not in JSON_TYPES:
            raise ToolSchemaError(f"{where}: unknown type {k!r} (expected one of "
                                  f"{', '.join(JSON_TYPES)})")
    return kinds


def _check_schema(schema: Any, where: str, depth: int) -> None:
    if type(schema) is not dict:
        raise ToolSchemaError(f"{where}: a schema must be an object, got {type(schema).__name__}")
    if depth > MAX_SCHEMA_DEPTH:
        raise ToolSchemaError(f"{where}: nested deeper than {MAX_SCHEMA_DEPTH} levels")
    if type(schema.get("description", "")) is not str:
        raise ToolSchemaError(f"{where}: the description must be a string")
    kinds = _types_of(schema, where)
    if kinds is None and "enum" not in schema:
        raise ToolSchemaError(f'{where}: give a "type" (or an "enum")')
    if "enum" in schema:
        values = schema["enum"]
        if type(values) is not list or not values:
            raise ToolSchemaError(f'{where}: "enum" must be a non-empty list')
        for value in values:
            if type(value) not in (str, int, float, bool, type(None)):
                raise ToolSchemaError(f'{where}: "enum" values must be strings, numbers, '
                                      "booleans or null")
            if kinds is not None and not any(_is_type(value, k) for k in kinds):
                raise ToolSchemaError(f'{where}: enum value {value!r} is not of type {kinds}')
    for bound in ("minimum", "maximum"):
        if bound in schema and (type(schema[bound]) not in (int, float)
                                or not math.isfinite(schema[bound])):
            raise ToolSchemaError(f'{where}: "{bound}" must be a finite number')
    if "properties" in schema or (kinds is not None and "object" in kinds):
        properties = schema.get("properties", {})
        if type(properties) is not dict:
            raise ToolSchemaError(f'{where}: "properties" must be an object')
        for name, sub in properties.items():
            _check_schema(sub, f"{where}.properties.{name}", depth + 1)
        required = schema.get("required", [])
        if type(required) is not list or any(type(r) is not str for r in required):
            raise ToolSchemaError(f'{where}: "required" must be a list of argument names')
        for name in required:
            if name not in properties:
                raise ToolSchemaError(f'{where}: required argument {name!r} is not in '
                                      '"properties"')
        if type(schema.get("additionalProperties", False)) is not bool:
            raise ToolSchemaError(f'{where}: "additionalProperties" must be true or false')
    if "items" in schema:
        _check_schema(schema["items"], f"{where}.items", depth + 1)


def _is_type(value: Any, kind: str) -> bool:
    if kind in ("integer", "number") and type(value) is bool:
        return False
    if kind == "number" and type(value) is float and not math.isfinite(value):
        return False
    return type(value) in JSON_TYPES[kind]


def _type_name(value: Any) -> str:
    for name, types in JSON_TYPES.items():
        if type(value) in types and not (name in ("integer", "number") and type(value) is bool):
            return name
    return type(value).__name__


def signature(tool: dict) -> str:
    """``name(arg: type, opt?: type)``: how an error message reminds the agent of a tool."""
    function = tool["function"]
    parameters = function["parameters"]
    required = set(parameters.get("required", []))
    args = []
    for name, schema in parameters.get("properties", {}).items():
        kind = schema.get("type", "enum")
        kind = "|".join(kind) if type(kind) is list else kind
        args.append(f"{name}{'' if name in required else '?'}: {kind}")
    return f"{function['name']}({', '.join(args)})"


def check_arguments(parameters: dict, arguments: Any) -> list[str]:
    """What is wrong with ``arguments`` for a tool whose (checked) parameters schema is
    ``parameters``: unknown argument names, missing required ones, wrong types, values
    outside an enum or a minimum/maximum. Empty when the call may run."""
    if type(arguments) is not dict:
        return [f"the arguments must be an object, got {_type_name(arguments)}"]
    return _check_value(parameters, arguments, "")


def _check_value(schema: dict, value: Any, where: str) -> list[str]:
    label = f"argument '{where}'" if where else "arguments"
    kinds = schema.get("type")
    kinds = [kinds] if type(kinds) is str else kinds
    if kinds is not None and not any(_is_type(value, k) for k in kinds):
        return [f"{label}: expected {' or '.join(kinds)}, got {_type_name(value)}"]
    if "enum" in schema and not any(type(value) is type(v) and value == v
                                    for v in schema["enum"]):
        return [f"{label}: {value!r} is not one of {schema['enum']}"]
    if type(value) in (int, float) and type(value) is not bool:
        if "minimum" in schema and value < schema["minimum"]:
            return [f"{label}: {value!r} is below the minimum {schema['minimum']!r}"]
        if "maximum" in schema and value > schema["maximum"]:
            return [f"{label}: {value!r} is above the maximum {schema['maximum']!r}"]
    problems: list[str] = []
    if type(value) is dict and ("properties" in schema or kinds == ["object"]):
        properties = schema.get("properties", {})
        prefix = f"{where}." if where else ""
        for name in value:
            if name not in properties and schema.get("additionalProperties") is not True:
                expected = ", ".join(properties) or "none"
                problems.append(f"unknown argument '{prefix}{name}' (expected: {expected})")
        for name in schema.get("required", []):
            if name not in value:
                problems.append(f"missing required argument '{prefix}{name}'")
        for name, item in value.items():
            if name in properties:
                problems += _check_value(properties[name], item, f"{prefix}{name}")
    elif type(value) is list and "items" in schema:
        for index, item in enumerate(value[:1000]):
            problems += _check_value(schema["items"], item, f"{where}[{index}]")
    return problems


# ----------------------------------------------------------------------------- actions


def parse_reply(text: str) -> tuple[list[dict[str, Any]], list[str], str]:
    """The tool calls of a plain reply text: (calls, errors, the text outside the calls).
    Each ``<tool_call>...</tool_call>`` holds one JSON object with a string "name" and an
    object "arguments" (absent = {}; a JSON string holding an object is accepted); one that
    does not is an error naming the call, not a call. An unclosed ``<tool_call>`` is an
    error too. The agent loop reads replies with it too
    (`spade_jax.rollout.agent_loop.parse_tool_calls`)."""
    calls: list[dict[str, Any]] = []
    errors: list[str] = []
    for index, match in enumerate(_TOOL_CALL.finditer(text)):
        try:
            value = json.loads(match.group(1).strip())
        except json.JSONDecodeError as err:
            errors.append(f"tool call {index}: not JSON ({err.msg} at char {err.pos})")
            continue
        except (ValueError, RecursionError):
            errors.append(f"tool call {index}: not JSON")
            continue
        if type(value) is not dict or type(value.get("name")) is not str:
            errors.append(f"tool call {index}: expected an object with a string 'name'")
            continue
        arguments = value.get("arguments", {})
        if type(arguments) is str:
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):
                pass
        if type(arguments) is not dict:
            errors.append(f"tool call {index} ({value['name']}): 'arguments' must be an object")
            continue
        calls.append({"name": value["name"], "arguments": arguments})
    outside = _TOOL_CALL.sub("", text)
    if "<tool_call>" in outside:
        errors.append("an unclosed <tool_call>")
    return calls, errors, outside.strip()


def parse_action(action: str) -> tuple[list[dict[str, Any]], list[str], str]:
    """(calls, errors, content) of one action: the agent loop's JSON object (``tool_calls``
    a list) or, for any other text, the reply read by `parse_reply`. Never raises."""
    try:
        value = json.loads(action)
    except (ValueError, RecursionError):
        value = None
    if type(value) is not dict or type(value.get("tool_calls")) is not list:
        return parse_reply(action)
    content = value.get("content")
    content = content if type(content) is str else ""
    given = value.get("errors")
    errors = [e for e in given if type(e) is str] if type(given) is list else []
    calls = []
    for index, call in enumerate(value["tool_calls"]):
        arguments = call.get("arguments", {}) if type(call) is dict else None
        if type(call) is dict and type(call.get("name")) is str and type(arguments) is dict:
            calls.append({"name": call["name"], "arguments": arguments})
        else:
            errors.append(f"tool call {index}: expected an object with a string 'name' and "
                          "an object 'arguments'")
    return calls, errors, content.strip()


def answer_tag(content: str) -> str | None:
    """The content of the last ``<answer>...</answer>`` of the text outside the calls."""
    found = _ANSWER.findall(content)
    return found[-1].strip() if found else None


def final_answer(calls: list, errors: list, content: str) -> str | None:
    """The final answer a turn gives under the "tool" contract, or None when the turn goes
    on: the last ``<answer>...</answer>`` (its calls are then not run), else the text of a
    reply with no tool call and no malformed call."""
    tagged = answer_tag(content)
    if tagged is not None:
        return tagged
    if not calls and not errors:
        return content.strip()
    return None


def split_calls(calls: list) -> tuple[list, list[str]]:
    """The calls of a turn that run (the first `MAX_CALLS_PER_TURN`) and the error for the
    rest."""
    if len(calls) <= MAX_CALLS_PER_TURN:
        return calls, []
    return calls[:MAX_CALLS_PER_TURN], [
        f"{len(calls) - MAX_CALLS_PER_TURN} tool calls dropped: at most "
        f"{MAX_CALLS_PER_TURN} run per reply"]


def call_problems(tools: dict[str, dict], call: dict) -> list[str]:
    """Why a parsed call may not run against a checked tool list (name -> tool), or []."""
    tool = tools.get(call["name"])
    if tool is None:
        return [f"unknown tool {call['name']!r} (available: {', '.join(tools)})"]
    return check_arguments(tool["function"]["parameters"], call["arguments"])


def audit_calls(tools: dict[str, dict], action: str) -> dict[str, int]:
    """The trainer's own count of a turn's calls: ``tool_calls`` (calls that parsed),
    ``invalid_tool_calls`` (parsed calls that may not run: unknown tool, wrong arguments)
    and ``malformed_tool_calls`` (parse errors), from the action and the checked tools."""
    calls, errors, _ = parse_action(action)
    calls, dropped = split_calls(calls)
    invalid = sum(1 for call in calls if call_problems(tools, call))
    return {"tool_calls": len(calls), "invalid_tool_calls": invalid,
            "malformed_tool_calls": len(errors) + len(dropped)}


def result_text(value: Any) -> str:
    """A tool result as text: a str unchanged, plain JSON values as JSON."""
    if type(value) is str:
        return value
    return json.dumps(value, ensure_ascii=False, sort_keys=True)


def render_observation(results: list[tuple[str, bool, str]], errors: list[str],
                       tail: str | None = None) -> str:
    """One observation for a turn: each call's result (``name -> text``) or error
    (``name -> error: ...``), then the parse errors with a format reminder, then ``tail``
    (the next user instruction, when there is one)."""
    parts = [f"{name} -> {text}" if ok else f"{name} -> error: {text}"
             for name, ok, text in results]
    if errors:
        parts.append("\n".join(f"error: {e}" for e in errors) + "\n" + FORMAT_REMINDER)
    if not results and not errors:
        parts.append(FORMAT_REMINDER)
    if tail:
        parts.append(tail)
    return "\n\n".join(parts)
