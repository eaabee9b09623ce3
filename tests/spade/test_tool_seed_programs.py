"""The "tool" seed programs (`seed_programs.TOOL_SEED_PROGRAMS`), run in the real sandbox.

Each seed is validated under the "tool" contract, then played through `make_env` with the
replies a competent agent would write (found by reading the program: the calls it needs,
with values read from the observations, then a final answer), which must score 1.0, and
with wrong plays (a wrong argument, the distractor tool, an answer without any call),
which must score less. Replies go through the agent loop's ``action_format="tool_call"``
parser, as in tests/envs/test_tool_contract.py.
"""

from __future__ import annotations

import json
import re

import pytest

from spade_jax.envs import EnvPool, SandboxConfig, make_env, validate_program
from spade_jax.rollout.agent_loop import ActionParser
from spade_jax.spade import seed_programs
from spade_jax.spade.seed_programs import (
    SEED_PROGRAMS,
    TOOL_SEED_PROGRAMS,
    SeedProgram,
    seed_programs_for,
)

BY_NAME = {program.name: program for program in TOOL_SEED_PROGRAMS}
PARSE = ActionParser(action_format="tool_call")
SEEDS = (0, 7, 12345)
MAX_TURNS = 10


def _call(name: str, **arguments) -> str:
    """One tool call, as a model writes it."""
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def _result(observation: str, tool: str) -> str:
    """The result text of `tool`'s (first) call in a turn's observation."""
    match = re.search(rf"^{tool} -> (.*)$", observation, re.M)
    assert match, observation
    return match.group(1)


class _Game:
    """An episode of one seed program, played a reply at a time."""

    def __init__(self, env, seed: int):
        self.env = env
        self.request, _ = env.reset(seed=seed)
        self.total = 0.0
        self.done = False
        self.observations: list[str] = []

    def say(self, reply: str) -> str:
        assert not self.done, "the episode is over"
        observation, reward, terminated, truncated, _ = self.env.step(PARSE(reply)[0])
        self.total += reward
        self.done = terminated or truncated
        self.observations.append(observation)
        return observation


@pytest.fixture(scope="module")
def pool():
    with EnvPool(SandboxConfig(call_deadline_s=5.0, load_deadline_s=15.0)) as p:
        yield p


@pytest.fixture(scope="module")
def envs(pool):
    made = {name: make_env(p.source, pool, contract="tool", max_turns=MAX_TURNS)
            for name, p in BY_NAME.items()}
    yield made
    for env in made.values():
        env.close()


# ----------------------------------------------------------------------------- the table


def test_the_tool_seeds_and_their_metadata():
    assert list(BY_NAME) == ["tool_order_status", "tool_stock_levels", "tool_room_booking"]
    # The recipe's tool skill names, exactly as written (spade.skills' tool skills).
    assert [p.skill for p in TOOL_SEED_PROGRAMS] == [
        "Data Retrieval", "State Modification", "Multi-Step Workflows"]
    for program in TOOL_SEED_PROGRAMS:
        assert program.contract == "tool"
        lines = program.source.rstrip("\n").count("\n") + 1
        assert 25 <= lines <= 40, (program.name, lines)
        assert re.findall(r"^(?:import|from) (\w+)", program.source, re.M) == ["random"]
        assert "random.Random(seed)" in program.source and "class ToolEnvironment" in program.source
        assert program.hint and not re.search(r"\d", program.hint), program.hint
        assert program.hint.count(".") <= 2
    assert len({p.hint for p in TOOL_SEED_PROGRAMS}) == len(TOOL_SEED_PROGRAMS)
    assert not {p.name for p in TOOL_SEED_PROGRAMS} & {p.name for p in SEED_PROGRAMS}


def test_seed_programs_for():
    assert seed_programs_for("paper") is SEED_PROGRAMS
    assert seed_programs_for("tool") is TOOL_SEED_PROGRAMS
    assert all(p.contract == "paper" for p in SEED_PROGRAMS)
    for bad in ("reference", "reference_tool_use", "auto", "Tool", ""):
        with pytest.raises(ValueError, match=rf"{re.escape(repr(bad))}.*'paper', 'tool'"):
            seed_programs_for(bad)


def test_seed_program_accepts_every_contract():
    for contract in ("paper", "reference", "tool", "reference_tool_use"):
        assert SeedProgram("x", "s", "source", None, contract).contract == contract
    with pytest.raises(ValueError, match="contract must be one of"):
        SeedProgram("x", "s", "source", None, "auto")
    assert seed_programs.TOOL_SEED_PROGRAMS is TOOL_SEED_PROGRAMS


@pytest.mark.parametrize("name", list(BY_NAME))
def test_every_tool_seed_validates(pool, name):
    program = BY_NAME[name]
    report = validate_program(program.source, program.hint, pool=pool, contract="tool",
                              max_turns=MAX_TURNS, seed=11)
    assert report.ok, report.reason


# ----------------------------------------------------------------------------- Data Retrieval


def _customer(game: _Game) -> str:
    return re.search(r"this is (\w+)\.", game.request).group(1)


@pytest.mark.parametrize("seed", SEEDS)
def test_order_status_correct_play_scores_1(envs, seed):
    game = _Game(envs["tool_order_status"], seed)
    order = int(_result(game.say(_call("find_order", customer=_customer(game))), "find_order"))
    status = _result(game.say(_call("order_status", order_id=order)), "order_status")
    assert game.total == 0.5  # partial credit: the right order was read
    game.say(f"Your order is {status}.")
    assert game.done and game.total == 1.0


def test_order_status_wrong_plays_score_less(envs):
    env = envs["tool_order_status"]
    game = _Game(env, 7)
    game.say("It has shipped.")  # an answer without any call
    assert game.done and game.total <= 0.5
    # Another customer's order (a wrong argument): at most the answer's half, by luck.
    game = _Game(env, 7)
    other = next(n for n in ("Ada", "Ben", "Cleo") if n != _customer(game))
    order = int(_result(game.say(_call("find_order", customer=other)), "find_order"))
    status = _result(game.say(_call("order_status", order_id=order)), "order_status")
    game.say(f"Your order is {status}.")
    assert game.total <= 0.5
    # An unknown customer is an error result, not a crash.
    game = _Game(env, 7)
    assert "error: no customer named" in game.say(_call("find_order", customer="Nobody"))
    # The right play plus the distractor: 0.
    game = _Game(env, 7)
    order = int(_result(game.say(_call("find_order", customer=_customer(game))), "find_order"))
    status = _result(game.say(_call("order_status", order_id=order)
                              + _call("cancel_order", order_id=order)), "order_status")
    game.say(f"Your order is {status}.")
    assert game.total == 0.0


# ----------------------------------------------------------------------------- State Modification


def _targets(game: _Game) -> dict[str, int]:
    return {item: int(n) for n, item in re.findall(r"(\d+) (\w+)", game.request)}


def _adjust_to_targets(game: _Game, sign: int = 1) -> None:
    targets = _targets(game)
    assert len(targets) == 2
    reads = game.say("".join(_call("get_stock", item=item) for item in targets))
    levels = [int(x) for x in re.findall(r"^get_stock -> (\d+)$", reads, re.M)]
    game.say("".join(_call("adjust_stock", item=item, change=sign * (target - level))
                     for (item, target), level in zip(targets.items(), levels, strict=True)))


@pytest.mark.parametrize("seed", SEEDS)
def test_stock_levels_correct_play_scores_1(envs, seed):
    game = _Game(envs["tool_stock_levels"], seed)
    _adjust_to_targets(game)
    assert game.total == 1.0  # the state alone scores
    game.say("Done: both items are at the requested levels.")
    assert game.done and game.total == 1.0


def test_stock_levels_wrong_plays_score_less(envs):
    env = envs["tool_stock_levels"]
    game = _Game(env, 7)
    game.say("Done.")  # no call: nothing changed
    assert game.done and game.total == 0.0
    game = _Game(env, 7)
    _adjust_to_targets(game, sign=-1)  # each change with the wrong sign
    game.say("Done.")
    assert game.total == 0.0
    # The right changes, then the distractor on an item that was to be left alone: 0.
    game = _Game(env, 7)
    _adjust_to_targets(game)
    other = next(i for i in ("bolts", "nuts", "gears", "springs") if i not in _targets(game))
    game.say(_call("write_off", item=other))
    game.say("Done.")
    assert game.total == 0.0
    # A value outside the schema never reaches the program.
    game = _Game(env, 7)
    observation = game.say(_call("adjust_stock", item="widgets", change=1))
    assert "is not one of" in observation and game.total == 0.0


# ----------------------------------------------------------------------------- Multi-Step Workflows


def _booking_request(game: _Game) -> tuple[str, int]:
    room, hour = re.search(r"book the (\w+) room for (\d+):00", game.request).groups()
    return room, int(hour)


def _book(game: _Game, hour_shift: int = 0) -> str:
    room, hour = _booking_request(game)
    room_id = int(_result(game.say(_call("find_room", room=room)), "find_room"))
    return game.say(_call("book_room", room_id=room_id, hour=hour + hour_shift))


@pytest.mark.parametrize("seed", SEEDS)
def test_room_booking_correct_play_scores_1(envs, seed):
    game = _Game(envs["tool_room_booking"], seed)
    assert "booking code" not in game.say(_call("find_room", room=_booking_request(game)[0]))
    game = _Game(envs["tool_room_booking"], seed)
    booked = _book(game)
    assert game.total == 0.5
    assert "tell me the booking code" in booked  # the next stage of the request
    code = re.search(r"BK-\d+", _result(booked, "book_room")).group(0)
    game.say(f"Your booking code is {code}.")
    assert game.done and game.total == 1.0


def test_room_booking_wrong_plays_score_less(envs):
    env = envs["tool_room_booking"]
    game = _Game(env, 7)
    game.say("Booked!")  # no call
    assert game.done and game.total == 0.0
    game = _Game(env, 7)
    hour = _booking_request(game)[1]
    booked = _book(game, hour_shift=1 if hour < 17 else -1)  # the wrong hour
    assert "code BK-" in _result(booked, "book_room") and "tell me" not in booked
    game.say(f"Your code is {re.search(r'BK-[0-9]+', booked).group(0)}.")
    assert game.total == 0.0
    # The right booking, then the distractor: 0.
    game = _Game(env, 7)
    booked = _book(game)
    game.say(_call("cancel_all"))
    game.say(f"Your code is {re.search(r'BK-[0-9]+', booked).group(0)}.")
    assert game.total == 0.0
    # The right booking and a wrong code: the booking's half only.
    game = _Game(env, 7)
    _book(game)
    game.say("Your code is BK-0.")
    assert game.total == 0.5
    # A room id that does not exist, or an hour after closing, is an error result; a room
    # name outside the enum never reaches the program.
    game = _Game(env, 7)
    assert "error: cannot book room" in game.say(_call("book_room", room_id=1, hour=9))
    room, _ = _booking_request(game)
    room_id = int(_result(game.say(_call("find_room", room=room)), "find_room"))
    assert "error: cannot book room" in game.say(_call("book_room", room_id=room_id, hour=18))
    assert "is not one of" in game.say(_call("find_room", room="Lobby"))
    game.say("Sorry, I could not book it.")
    assert game.done and game.total == 0.0
