"""The tool-environment contracts ("tool" and "reference_tool_use"), run in the real sandbox.

A small bank program (three tools the task needs, one distractor that ruins it) is
validated and played through `make_env` with actions as the agent loop's
``action_format="tool_call"`` parser sends them. Expected returns are written out by hand
from the program's state check: 0.5 for the transfer done exactly, 0.5 more for the final
answer naming the new savings balance, 0 once any account is closed.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from spade_jax.envs import EnvPool, EnvProgramError, SandboxConfig, make_env, validate_program
from spade_jax.envs import tools as tool_rules
from spade_jax.envs.contract import TOOL_CONTRACT, check_contract_name
from spade_jax.rollout.agent_loop import ActionParser, parse_tool_calls
from spade_jax.spade.prompts import (
    TOOL_HINT_WRITER_SYSTEM_PROMPT,
    tool_hint_writer_messages,
    tool_prompts,
)

BANK = '''
import random

def _fn(name, description, properties, required):
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required}}}

ACCOUNT = {"type": "string", "enum": ["checking", "savings"]}


class ToolEnvironment:
    TOOLS = [
        _fn("list_accounts", "Names of the user's accounts.", {}, []),
        _fn("get_balance", "Balance of one account.", {"account": ACCOUNT}, ["account"]),
        _fn("transfer", "Move money between accounts.",
            {"from_account": ACCOUNT, "to_account": ACCOUNT,
             "amount": {"type": "integer", "minimum": 1}},
            ["from_account", "to_account", "amount"]),
        _fn("close_account", "Close an account for good.", {"account": ACCOUNT}, ["account"]),
    ]

    def reset(self, seed=None):
        rng = random.Random(seed)
        self.balance = {"checking": rng.randint(100, 200), "savings": rng.randint(10, 90)}
        self.amount = rng.randint(5, 50)
        self.start = dict(self.balance)
        self.closed = []
        self.told = False
        return f"Please move {self.amount} from checking to savings.", {"amount": self.amount}

    def tool_list_accounts(self):
        return [name for name in self.balance if name not in self.closed]

    def tool_get_balance(self, account):
        if account in self.closed:
            return f"error: {account} is closed"
        return str(self.balance[account])

    def tool_transfer(self, from_account, to_account, amount):
        if amount > self.balance[from_account]:
            return "error: not enough money"
        self.balance[from_account] -= amount
        self.balance[to_account] += amount
        return f"moved {amount} from {from_account} to {to_account}"

    def tool_close_account(self, account):
        self.closed.append(account)
        return f"{account} closed"

    def _moved(self):
        return (self.balance["savings"] == self.start["savings"] + self.amount
                and self.balance["checking"] == self.start["checking"] - self.amount)

    def next_instruction(self):
        if self._moved() and not self.told:
            self.told = True
            return "Thanks. What is my savings balance now?"
        return None

    def check(self, answer):
        if self.closed:
            return 0.0
        score = 0.5 if self._moved() else 0.0
        if answer is not None and self._moved() and answer.strip() == str(self.balance["savings"]):
            score += 0.5
        return score
'''


def _call(name: str, **arguments) -> str:
    """A reply calling one tool, as a model writes it."""
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


PARSE = ActionParser(action_format="tool_call")


def _play(env, replies: list[str], seed: int = 7):
    """Plays model replies through the agent loop's parser; (first observation and info,
    [(observation, reward, terminated, truncated, info)])."""
    first = env.reset(seed=seed)
    steps = []
    for reply in replies:
        action, _ = PARSE(reply)
        steps.append(env.step(action))
        if steps[-1][2] or steps[-1][3]:
            break
    return first, steps


def _solution(first_info: dict, start_savings: int) -> list[str]:
    amount = first_info["amount"]
    return [_call("transfer", from_account="checking", to_account="savings", amount=amount),
            _call("get_balance", account="savings"), str(start_savings + amount)]


@pytest.fixture(scope="module")
def pool():
    with EnvPool(SandboxConfig(call_deadline_s=2.0, load_deadline_s=5.0)) as p:
        yield p


@pytest.fixture(scope="module")
def open_pool():
    """Static gate off: the program may patch its own worker (the runtime layers hold)."""
    with EnvPool(SandboxConfig(call_deadline_s=1.0, load_deadline_s=5.0,
                               static_gate=False)) as p:
        yield p


def _bank_env(pool, source: str = BANK, max_turns: int = 8):
    return make_env(source, pool, contract="tool", max_turns=max_turns)


def _savings(env, seed: int = 7) -> int:
    """The starting savings balance, read through the tool itself."""
    env.reset(seed=seed)
    observation = env.step(PARSE(_call("get_balance", account="savings"))[0])[0]
    return int(observation.split("-> ")[1])


# ----------------------------------------------------------------------------- contract


def test_contract_names_and_text():
    assert check_contract_name("tool") == "tool"
    assert check_contract_name("reference_tool_use") == "reference_tool_use"
    assert "class ToolEnvironment" in TOOL_CONTRACT and "check(self, answer" in TOOL_CONTRACT


def test_tool_prompts():
    full = tool_prompts("full", max_turns=12)
    assert "class ToolEnvironment" in full.designer_system and "after 12 turns" in full.designer_system
    for idea in ("distractor", "leaves a\n  value out", "no tool can serve", "check()"):
        assert idea in full.designer_system, idea
    assert tool_prompts("compact").designer_system != full.designer_system
    assert full.hint_writer_system == TOOL_HINT_WRITER_SYSTEM_PROMPT
    assert "Give no concrete values" in TOOL_HINT_WRITER_SYSTEM_PROMPT
    messages = tool_hint_writer_messages(BANK)
    assert messages[0]["content"] == TOOL_HINT_WRITER_SYSTEM_PROMPT and BANK in messages[1]["content"]
    with pytest.raises(ValueError, match="prompt_style"):
        tool_prompts("huge")


def test_parser_agrees_with_the_agent_loop():
    replies = [_call("a", x=1) + " text " + _call("b"), "<tool_call>{bad</tool_call>",
               '<tool_call>{"name": 3}</tool_call>', "<tool_call>{\"name\": \"a\"}",
               '<tool_call>{"name": "a", "arguments": "{\\"x\\": 2}"}</tool_call>', "plain"]
    for reply in replies:
        assert tool_rules.parse_reply(reply) == parse_tool_calls(reply)
        assert tool_rules.parse_action(PARSE(reply)[0]) == parse_tool_calls(reply)


def test_the_bank_validates_and_exposes_its_tools(pool):
    report = validate_program(BANK, pool=pool, contract="tool", max_turns=8, seed=3)
    assert report.ok, report.reason
    env = _bank_env(pool)
    assert [t["function"]["name"] for t in env.tools] == [
        "list_accounts", "get_balance", "transfer", "close_account"]
    env.close()


# ----------------------------------------------------------------------------- scores


def test_the_correct_call_sequence_scores_1(pool):
    env = _bank_env(pool)
    savings = _savings(env)
    (_, info), _ = _play(env, [])
    amount = info["amount"]
    _, steps = _play(env, _solution(info, savings))
    assert [s[1] for s in steps] == [0.5, 0.0, 0.5]  # hand-written: transfer, read, answer
    assert "What is my savings balance now?" in steps[0][0]
    assert steps[1][0] == f"get_balance -> {savings + amount}"
    assert [s[2] for s in steps] == [False, False, True]
    assert steps[-1][4]["progress"] == 1.0
    assert steps[0][4]["tool_calls"] == 1 and steps[0][4]["invalid_tool_calls"] == 0
    env.close()


def test_an_answer_tag_ends_the_episode_and_its_calls_do_not_run(pool):
    env = _bank_env(pool)
    savings = _savings(env)
    _, info = env.reset(seed=7)
    move = _call("transfer", from_account="checking", to_account="savings",
                 amount=info["amount"])
    _, steps = _play(env, [move + f"<answer>{savings + info['amount']}</answer>"])
    assert steps[0][1] == 0.0 and steps[0][2]  # the transfer never ran: 0
    env.close()


def test_a_wrong_argument_type_is_an_error_observation_and_scores_0(pool):
    env = _bank_env(pool)
    _, info = env.reset(seed=7)
    bad = _call("transfer", from_account="checking", to_account="savings",
                amount=str(info["amount"]))  # a string where the schema says integer
    _, steps = _play(env, [bad, "I could not do it."])
    observation, reward, terminated, _, step_info = steps[0]
    assert "argument 'amount': expected integer, got string" in observation
    assert "usage: transfer(from_account: string" in observation
    assert (reward, terminated, step_info["invalid_tool_calls"]) == (0.0, False, 1)
    assert sum(s[1] for s in steps) == 0.0 and steps[-1][2]


def test_wrong_argument_names_and_missing_ones_are_errors(pool):
    env = _bank_env(pool)
    _, info = env.reset(seed=7)
    _, steps = _play(env, [_call("transfer", source="checking", to_account="savings",
                                 amount=info["amount"])])
    assert "unknown argument 'source'" in steps[0][0]
    assert "missing required argument 'from_account'" in steps[0][0]
    assert steps[0][1] == 0.0
    env.close()


def test_a_wrong_amount_scores_0(pool):
    env = _bank_env(pool)
    savings = _savings(env)
    _, info = env.reset(seed=7)
    wrong = info["amount"] + 1
    _, steps = _play(env, [_call("transfer", from_account="checking", to_account="savings",
                                 amount=wrong), str(savings + wrong)])
    assert [s[1] for s in steps] == [0.0, 0.0]
    env.close()


def test_the_wrong_order_scores_by_the_state_check(pool):
    env = _bank_env(pool)
    savings = _savings(env)
    _, info = env.reset(seed=7)
    # Answer first: the transfer never happened -> 0.
    _, steps = _play(env, [str(savings)])
    assert sum(s[1] for s in steps) == 0.0 and steps[-1][2]
    # Read, transfer, then answer the stale balance: the transfer's 0.5 only.
    _, steps = _play(env, [_call("get_balance", account="savings"),
                           _call("transfer", from_account="checking", to_account="savings",
                                 amount=info["amount"]), str(savings)])
    assert [s[1] for s in steps] == [0.0, 0.5, 0.0]
    env.close()


def test_a_hallucinated_tool_is_an_error_and_the_episode_goes_on(pool):
    env = _bank_env(pool)
    savings = _savings(env)
    (_, info), _ = _play(env, [])
    _, steps = _play(env, [_call("deposit", account="savings", amount=5)]
                     + _solution(info, savings))
    assert "unknown tool 'deposit' (available: list_accounts, get_balance" in steps[0][0]
    assert [s[1] for s in steps] == [0.0, 0.5, 0.0, 0.5]  # then solved: 1
    env.close()


def test_malformed_json_is_an_error_observation_and_scores_0(pool):
    env = _bank_env(pool)
    env.reset(seed=7)
    _, steps = _play(env, ['<tool_call>{"name": "transfer", "arguments": {</tool_call>'])
    observation, reward, terminated, _, info = steps[0]
    assert "error: tool call 0: not JSON" in observation and tool_rules.FORMAT_REMINDER in observation
    assert (reward, terminated, info["malformed_tool_calls"]) == (0.0, False, 1)
    # The same reply as raw text (no agent loop in between) reads the same.
    env.reset(seed=7)
    raw = env.step('<tool_call>{"name": "transfer", "arguments": {</tool_call>')
    assert raw[0] == observation
    env.close()


def test_the_distractor_ruins_the_episode(pool):
    env = _bank_env(pool)
    savings = _savings(env)
    (_, info), _ = _play(env, [])
    _, steps = _play(env, [_call("close_account", account="checking")]
                     + _solution(info, savings))
    assert sum(s[1] for s in steps) == 0.0
    env.close()


def test_the_turn_budget_truncates_with_the_partial_score(pool):
    env = _bank_env(pool, max_turns=3)
    (_, info), _ = _play(env, [])
    move = _call("transfer", from_account="checking", to_account="savings", amount=info["amount"])
    _, steps = _play(env, [move] + [_call("list_accounts")] * 5)
    assert len(steps) == 3 and steps[-1][3] and not steps[-1][2]
    assert sum(s[1] for s in steps) == 0.5
    env.close()


# ----------------------------------------------------------------------------- schemas


@pytest.mark.parametrize("old, new, message", [
    ('"amount": {"type": "integer", "minimum": 1}', '"amount": {"type": "float"}',
     "tool 'transfer': parameters.properties.amount: unknown type 'float'"),
    ('["from_account", "to_account", "amount"]', '["from_account", "to_account", "sum"]',
     "tool 'transfer': parameters: required argument 'sum' is not in \"properties\""),
    ('_fn("list_accounts", "Names', '_fn("list accounts", "Names',
     "tool 'list accounts': the name must match"),
    ("def tool_close_account", "def close_account", "tool 'close_account' has no method"),
])
def test_a_schema_error_is_refused_at_validation_naming_the_tool(pool, old, new, message):
    assert old in BANK
    report = validate_program(BANK.replace(old, new), pool=pool, contract="tool", seed=1)
    assert not report.ok and report.code == "bad_tools"
    assert message in report.reason, report.reason


def test_schema_rules():
    with pytest.raises(tool_rules.ToolSchemaError, match="declared twice"):
        fn = {"type": "function", "function": {"name": "a", "parameters": {
            "type": "object", "properties": {}}}}
        tool_rules.check_tool_schemas([fn, fn])
    with pytest.raises(tool_rules.ToolSchemaError, match='"parameters" is missing'):
        tool_rules.check_tool_schemas([{"type": "function", "function": {"name": "a"}}])
    parameters = {"type": "object", "properties": {"n": {"type": "integer"},
                  "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["n"]}
    assert tool_rules.check_arguments(parameters, {"n": 1, "tags": ["x"]}) == []
    assert tool_rules.check_arguments(parameters, {"n": True}) == [
        "argument 'n': expected integer, got boolean"]
    assert tool_rules.check_arguments(parameters, {"n": 1, "tags": ["x", 2]}) == [
        "argument 'tags[1]': expected string, got integer"]


# ----------------------------------------------------------------------------- hostile


def _tool_program(**methods: str) -> str:
    """The bank with some methods replaced (source of each, dedented, at class level)."""
    source = BANK
    for body in methods.values():
        source += textwrap.indent(textwrap.dedent(body), "    ")
    return source


HOSTILE = [
    # A tool that raises: the program's error, contained as for every program.
    ("raises", _tool_program(a="""
        def tool_get_balance(self, account):
            raise KeyError(account)
    """), "program_error"),
    # A tool that never returns: the call's deadline.
    ("loops", _tool_program(a="""
        def tool_list_accounts(self):
            while True:
                pass
    """), ("timeout", "slow_call")),
    # A state check outside [0, 1], with the worker's own number check patched away.
    ("check_out_of_range", _tool_program(a="""
        def check(self, answer):
            import sys
            sys.modules['spade_jax.envs.worker']._number = lambda v: v
            return 7.0
    """), "reward_out_of_range"),
    # The worker patched to call every turn final (and pay 1): the trainer reads the
    # turn from the action itself.
    ("patched_final", _tool_program(a="""
        def check(self, answer):
            import sys
            sys.modules['spade_jax.envs.tools'].final_answer = lambda *a: 'x'
            return 1.0
    """), "protocol_violation"),
    # The worker patched to report another tool list at reset: the trainer compares.
    ("patched_tools", _tool_program(a="""
        def tool_list_accounts(self):
            type(self).TOOLS = self.TOOLS[:1]
            return []
    """), "bad_tools"),
]


@pytest.mark.parametrize("name, source, code", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_tool_programs_are_contained(open_pool, name, source, code):
    codes = code if isinstance(code, tuple) else (code,)
    env = make_env(source, open_pool, contract="tool", max_turns=8)
    env.reset(seed=1)
    with pytest.raises(EnvProgramError) as raised:
        for reply in [_call("list_accounts"), _call("get_balance", account="savings")]:
            env.step(PARSE(reply)[0])
        env.reset(seed=2)  # the tool list is re-checked at every reset
    assert raised.value.error.code in codes, raised.value.error
    env.close()
    # And validation refuses it (with the gate on, the imports are refused first).
    report = validate_program(source, pool=open_pool, contract="tool", max_turns=8, seed=1)
    assert not report.ok


def test_the_pool_still_plays_after_the_hostile_programs(open_pool):
    env = _bank_env(open_pool)
    savings = _savings(env)
    (_, info), _ = _play(env, [])
    _, steps = _play(env, _solution(info, savings))
    assert sum(s[1] for s in steps) == 1.0
    env.close()


# ----------------------------------------------------------------------------- recipe tools

# A game written for the recipe's tool base class (its shape: `_tools` and the expected
# answer set in reset(), one tool_<name> method per tool, solution()).
RECIPE_GAME = '''
from tool_use_base_env import ToolUseBaseEnv


class InventoryLookupEnv(ToolUseBaseEnv):
    def reset(self, seed=None):
        self.turn_count = 0
        self._call_history = []
        rng = random.Random(seed)
        self._state = {"stock": {item: rng.randint(1, 9) for item in ("bolt", "nut", "gear")}}
        self._tools = {
            "count": {"description": "Units in stock of one item.",
                      "parameters": {"type": "object",
                                     "properties": {"item": {"type": "string"}},
                                     "required": ["item"]}},
            "restock": {"description": "Order more of an item (not needed here).",
                        "parameters": {"type": "object",
                                       "properties": {"item": {"type": "string"},
                                                      "units": {"type": "integer"}},
                                       "required": ["item", "units"]}},
        }
        self._expected_answer = str(self._state["stock"]["bolt"] + self._state["stock"]["nut"])
        return ("How many bolts and nuts are in stock together? "
                "Submit <answer>N</answer>."), {}

    def tool_count(self, item=""):
        if item not in self._state["stock"]:
            return f"Error: no item {item}"
        return str(self._state["stock"][item])

    def tool_restock(self, item="", units=0):
        return "ordered"

    def solution(self):
        return f"count bolt, count nut, <answer>{self._expected_answer}</answer>"
'''


def test_a_recipe_tool_game_loads_validates_and_scores_as_the_recipe(pool):
    report = validate_program(RECIPE_GAME, pool=pool, contract="reference_tool_use",
                              max_turns=8, seed=2)
    assert report.ok, report.reason
    env = make_env(RECIPE_GAME, pool, contract="reference_tool_use", max_turns=8)
    assert [t["function"]["name"] for t in env.tools] == ["count", "restock"]
    observation, _ = env.reset(seed=5)
    assert "bolts and nuts" in observation
    bolts = int(env.step(PARSE(_call("count", item="bolt"))[0])[0].split("-> ")[1])
    nut_step, bad_type, unknown, malformed, wrong, right = (
        env.step(PARSE(reply)[0]) for reply in (
            _call("count", item="nut"), _call("restock", item="nut", units="2"),
            _call("sell", item="nut"), "<tool_call>{oops</tool_call>", "<answer>-1</answer>",
            "<answer>?</answer>"))
    nuts = int(nut_step[0].split("-> ")[1])
    assert "argument 'units': expected integer" in bad_type[0]
    assert "unknown tool 'sell'" in unknown[0]
    # A malformed call goes to the game's step(): its format error (-0.1, not the score).
    assert "not JSON" in malformed[0] and "Format error" in malformed[0]
    assert malformed[4]["raw_reward"] == -0.1 and malformed[1] == 0.0
    # A wrong answer does not end a recipe tool game; the score is paid at the end only.
    assert (wrong[1], wrong[2]) == (0.0, False) and "Incorrect" in wrong[0]
    assert not right[2]
    final = env.step(PARSE(f"<answer>{bolts + nuts}</answer>")[0])
    assert (final[0], final[1], final[2]) == ("Correct!", 1.0, True)
    env.close()


def test_a_recipe_tool_game_is_cut_at_the_turn_budget_with_score_0(pool):
    env = make_env(RECIPE_GAME, pool, contract="reference_tool_use", max_turns=3)
    env.reset(seed=5)
    steps = [env.step(PARSE(_call("count", item="bolt"))[0]) for _ in range(3)]
    assert steps[-1][3] and sum(s[1] for s in steps) == 0.0
    env.close()


def test_the_docs_quote_the_tool_contract_verbatim():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "environments.md").read_text()
    section = doc.split("## Tool environments", 1)[1].split("### tool\n", 1)[1]
    block = section.split("```\n", 1)[1].split("\n```", 1)[0]
    assert block + "\n" == TOOL_CONTRACT
