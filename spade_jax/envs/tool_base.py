"""The base class that programs written for the published recipe's tool-use games subclass.

The recipe's tool games are subclasses of a base named ``ToolUseBaseEnv`` that the recipe's
loader puts into the game's namespace (or lets it import from ``tool_use_base_env``). This
module is this project's own implementation of the behaviour those games rely on, bound
inside the sandbox worker only (`spade_jax.envs.worker`, contract "reference_tool_use"):

- ``__init__(max_turns=10, **kwargs)`` sets ``max_turns``, ``turn_count``, ``_tools``
  (name -> {"description", "parameters"}), ``_state``, ``_call_history``,
  ``_expected_answer``, then calls ``self.reset()``;
- ``get_tools()`` turns ``_tools`` into function schemas;
- ``execute_tool(name, arguments)`` calls ``tool_<name>(**arguments)`` and returns
  ``{"output": str, "returncode": 0 or 1}`` (an unknown tool or an exception is an output
  with returncode 1);
- ``step(action)`` counts the turn and reads ``<answer>...</answer>`` (checked by
  ``_check_answer``: 1.0 and terminated when right, 0.0 and the episode goes on when wrong)
  or one ``<tool_call>{json}</tool_call>``; anything else is a format error (-0.1). When
  the turn budget is spent the step is truncated with the solution shown.

Standard library only: the zygote imports it before it forks workers.
"""

from __future__ import annotations

import json
import re
from typing import Any

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
FORMAT_PENALTY = -0.1


class ToolUseBaseEnv:
    """Base of a recipe tool-use game: subclasses write reset(), solution() and one
    ``tool_<name>(**arguments) -> str`` method per tool."""

    def __init__(self, max_turns: int = 10, **kwargs: Any) -> None:
        self.max_turns = max_turns
        self.turn_count = 0
        self._tools: dict[str, dict] = {}
        self._state: dict = {}
        self._call_history: list = []
        self._expected_answer = None
        self.reset()

    def reset(self, seed=None):
        raise NotImplementedError("a tool-use game defines reset()")

    def solution(self) -> str:
        raise NotImplementedError("a tool-use game defines solution()")

    def get_tools(self) -> list[dict]:
        schemas = []
        for name, spec in self._tools.items():
            spec = spec if isinstance(spec, dict) else {}
            schemas.append({"type": "function", "function": {
                "name": name,
                "description": spec.get("description", ""),
                "parameters": spec.get("parameters", {"type": "object", "properties": {}}),
            }})
        return schemas

    def _call(self, name: str, arguments: dict) -> tuple[bool, str]:
        method = getattr(self, f"tool_{name}", None) if isinstance(name, str) else None
        if method is None:
            return False, f"Unknown tool '{name}'"
        try:
            result = method(**arguments)
        except Exception as err:  # noqa: BLE001 - the game's error is the agent's observation
            return False, f"Error calling {name}: {err}"
        self._call_history.append({"name": name, "arguments": arguments, "result": str(result)})
        return True, str(result)

    def execute_tool(self, name: str, arguments: dict) -> dict:
        ok, output = self._call(name, arguments)
        return {"output": output, "returncode": 0 if ok else 1}

    def _time_up(self, prefix: str = "") -> tuple[str, float, bool, bool, dict]:
        return (f"{prefix}Time up. Solution:\n{self.solution()}", 0.0, False, True, {})

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        self.turn_count += 1
        out_of_turns = self.turn_count >= self.max_turns
        answered = _ANSWER.search(action)
        if answered:
            if self._check_answer(answered.group(1).strip()):
                return ("Correct!", 1.0, True, False, {})
            if out_of_turns:
                return (f"Wrong answer. Solution:\n{self.solution()}", 0.0, False, True, {})
            return (self._incorrect_answer_feedback(), 0.0, False, False, {})
        found = _CALL.search(action)
        if not found:
            if out_of_turns:
                return self._time_up()
            return ("Format error: call a tool, or submit with <answer>result</answer>.",
                    FORMAT_PENALTY, False, False, {})
        try:
            call = json.loads(found.group(1))
            name, arguments = call.get("name", ""), call.get("arguments", {})
        except (ValueError, AttributeError, RecursionError):
            if out_of_turns:
                return self._time_up()
            return ("Format error: the tool call is not valid JSON.", FORMAT_PENALTY, False,
                    False, {})
        if not isinstance(arguments, dict):
            arguments = {}
        if not isinstance(name, str) or getattr(self, f"tool_{name}", None) is None:
            if out_of_turns:
                return self._time_up()
            return (f"Unknown tool '{name}'. Available: {', '.join(self._tools)}", 0.0, False,
                    False, {})
        _, output = self._call(name, arguments)
        observation = f"Tool result:\n{output}"
        if out_of_turns:
            return self._time_up(observation + "\n\n")
        return (observation, 0.0, False, False, {})

    def _obs_suffix(self) -> str:
        return ""  # older games append it to observations; tools are in the prompt now

    def _incorrect_answer_feedback(self) -> str:
        messages = getattr(self, "_user_messages", None)
        current = getattr(self, "_current_msg", None)
        if (isinstance(messages, (list, tuple)) and isinstance(current, int)
                and 0 <= current < len(messages)):
            return (f"Incorrect. Not every step is done: step {current + 1} of "
                    f"{len(messages)} is still open: \"{messages[current]}\". Do it with the "
                    "tools before you submit.")
        return "Incorrect. Keep using tools."

    def _check_answer(self, answer: str) -> bool:
        given, expected = str(answer).strip(), str(self._expected_answer).strip()
        if given.lower() == expected.lower():
            return True
        try:
            def number(text: str) -> float:
                return float(text.replace("$", "").replace(",", "").strip())

            return abs(number(given) - number(expected)) < 0.01
        except (ValueError, TypeError):
            return False

    def close(self) -> None:
        pass
