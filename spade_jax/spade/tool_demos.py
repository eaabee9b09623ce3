"""Scripted solutions of the tool seed programs (`seed_programs.TOOL_SEED_PROGRAMS`):
demonstrations of native tool calling for a CPU-sized policy's warm start.

A random-init tiny policy never writes ``<tool_call>{json}</tool_call>`` by chance, so in a
tool run its agent answers at once and every return is 0. A few demonstrated episodes
(the calls a competent agent makes, values read from the tool results, then a final
answer) teach the format and the turn structure; the environments the run plays are the
designer's, with other tools and values, so the demonstrations do not answer them.

A solver maps (the user's request, the observations so far) to the next reply. Episodes
are played in the real sandbox (`demo_turns`), so what the warm start shows is what the
agent loop sends and receives.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

Solver = Callable[[str, list[str]], str]


def tool_call(name: str, **arguments: Any) -> str:
    """One tool call as a reply writes it."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def _result(observation: str, tool: str) -> str:
    """The result of ``tool``'s first call in a turn's observation ("tool -> result")."""
    found = re.search(rf"^{tool} -> (.*)$", observation, re.M)
    if found is None:
        raise ValueError(f"no {tool} result in {observation[:200]!r}")
    return found.group(1)


def _order_status(request: str, observations: list[str]) -> str:
    """Find the customer's order id, read its status, report it."""
    if not observations:
        return tool_call("find_order", customer=re.search(r"this is (\w+)\.", request).group(1))
    if len(observations) == 1:
        return tool_call("order_status", order_id=int(_result(observations[0], "find_order")))
    return f"Your order is {_result(observations[1], 'order_status')}."


def _stock_levels(request: str, observations: list[str]) -> str:
    """Read both items' stock, adjust each by its difference to the target, confirm."""
    targets = {item: int(n) for n, item in re.findall(r"(\d+) (\w+)", request)}
    if not observations:
        return "".join(tool_call("get_stock", item=item) for item in targets)
    if len(observations) == 1:
        levels = [int(x) for x in re.findall(r"^get_stock -> (\d+)$", observations[0], re.M)]
        return "".join(tool_call("adjust_stock", item=item, change=target - level)
                       for (item, target), level in zip(targets.items(), levels, strict=True))
    return "Done: both items are at the requested levels."


def _room_booking(request: str, observations: list[str]) -> str:
    """Find the room's id, book it for the hour, report the booking code."""
    room, hour = re.search(r"book the (\w+) room for (\d+):00", request).groups()
    if not observations:
        return tool_call("find_room", room=room)
    if len(observations) == 1:
        return tool_call("book_room", room_id=int(_result(observations[0], "find_room")),
                         hour=int(hour))
    code = re.search(r"BK-\d+", _result(observations[1], "book_room")).group(0)
    return f"Your booking code is {code}."


# Seed program name -> its solver (three replies each: two turns of calls, an answer).
SOLVERS: dict[str, Solver] = {
    "tool_order_status": _order_status,
    "tool_stock_levels": _stock_levels,
    "tool_room_booking": _room_booking,
}


def demo_turns(env: Any, solver: Solver, seed: int, max_turns: int
               ) -> tuple[str, list[tuple[str, str]]]:
    """Plays one episode of a sandboxed tool env with ``solver``: the first observation and
    the (reply, observation after it) of every turn, ending on the final answer. Raises
    ValueError when the episode does not reach a full score (a solver that no longer
    fits its program)."""
    from spade_jax.rollout.agent_loop import ActionParser

    parse = ActionParser(action_format="tool_call")
    first, _ = env.reset(seed=seed)
    observations: list[str] = []
    turns: list[tuple[str, str]] = []
    total, done = 0.0, False
    while not done and len(turns) < max_turns:
        reply = solver(first, observations)
        observation, reward, terminated, truncated, _ = env.step(parse(reply)[0])
        total += float(reward)
        done = terminated or truncated
        observations.append(observation)
        turns.append((reply, observation))
    if not done or abs(total - 1.0) > 1e-9:
        raise ValueError(f"the demonstration scored {total} (done={done}) on seed {seed}: "
                         f"its solver no longer solves the program")
    return first, turns
