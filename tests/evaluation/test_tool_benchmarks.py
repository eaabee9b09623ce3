"""Tool-use benchmark readers and scorers (BFCL v4 multi-turn, tau2-bench, ACEBench-Agent).

Fixtures in each benchmark's own file format are written to tmp_path, with tiny backend
classes of our own standing in for the benchmarks' Python APIs. Scripted policies play
right, wrong-argument, wrong-order, hallucinated-tool and missing-call episodes, and the
scores are compared with values worked out by hand from each benchmark's rules. Pure
Python; no JAX.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spade_jax.evaluation.data import DataError
from spade_jax.evaluation.tool_benchmarks import (
    CallableUser,
    ScriptedUser,
    evaluate_bfcl,
    load_acebench,
    load_bfcl,
    load_tau2_domain,
    parse_call_text,
    run_acebench,
    run_bfcl,
    run_tau2,
    score_acebench,
    score_bfcl,
    score_tau2,
    suite_result,
)
from spade_jax.evaluation.tool_benchmarks.common import read_json_array


def _jsonl(path: Path, records: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def calls(*pairs: tuple[str, dict]) -> dict:
    return {"content": "", "tool_calls": [{"name": n, "arguments": a} for n, a in pairs]}


class Script:
    """Returns the given replies in order ("done" after them); records what it was shown."""

    def __init__(self, *replies) -> None:
        self.replies = list(replies)
        self.tools_seen: list[list[str]] = []
        self.messages_seen: list[list[dict]] = []

    def __call__(self, messages, tools):
        self.messages_seen.append(messages)
        self.tools_seen.append([t["name"] for t in tools])
        return self.replies.pop(0) if self.replies else "done"


# ============================================================================ common


def test_call_text_is_parsed_not_evaluated():
    (call,) = parse_call_text("mv(source='a.txt', destination='tmp', n=-2, tags=['x', None])")
    assert (call.name, call.kwargs) == ("mv", {"source": "a.txt", "destination": "tmp",
                                               "n": -2, "tags": ["x", None]})
    first, second = parse_call_text("[sort('f.txt'), ls(a=True)]")
    assert first.args == ("f.txt",) and second.kwargs == {"a": True}
    for bad in ("f(x=__import__('os'))", "os.system('ls')", "f(x=1+1)", "f(**k)", "x"):
        with pytest.raises((ValueError, SyntaxError)):
            parse_call_text(bad)


def test_json_array_reader_reports_element_lines(tmp_path):
    path = tmp_path / "tasks.json"
    path.write_text('[\n  {"id": 1},\n\n  {"id": 2}\n]\n')
    assert [(w.line, r["id"]) for w, r in read_json_array(path)] == [(2, 1), (4, 2)]
    path.write_text('[\n  {"id": 1},\n  {"id": 2,}\n]')
    with pytest.raises(DataError, match=r"tasks.json:3: malformed JSON"):
        list(read_json_array(path))


# ============================================================================ BFCL


class Ledger:
    """A tiny stateful BFCL-style backend (public attributes are the checked state)."""

    def __init__(self) -> None:
        self.balance = 0
        self.history: list = []

    def _load_scenario(self, config: dict, long_context: bool = False) -> None:
        self.balance = config.get("balance", 0)
        self.history = []

    def deposit(self, amount: int) -> dict:
        self.balance += amount
        self.history.append(["deposit", amount])
        return {"balance": self.balance}

    def double(self) -> dict:
        self.balance *= 2
        self.history.append(["double"])
        return {"balance": self.balance}

    def get_balance(self) -> str:
        return f"balance={self.balance}"

    def get_history(self) -> list:
        return list(self.history)

    def audit(self) -> str:
        return f"audited {len(self.history)} entries"


_LEDGER_DOCS = [
    {"name": "deposit", "description": "Add money.", "parameters": {
        "type": "dict", "properties": {"amount": {"type": "integer", "description": "."}},
        "required": ["amount"]}},
    {"name": "double", "description": "Double the balance.",
     "parameters": {"type": "dict", "properties": {}, "required": []}},
    {"name": "get_balance", "description": "Read the balance.",
     "parameters": {"type": "dict", "properties": {}, "required": []}},
    {"name": "get_history", "description": "Read the history.",
     "parameters": {"type": "dict", "properties": {}, "required": []}},
    {"name": "audit", "description": "Audit the account.",
     "parameters": {"type": "dict", "properties": {}, "required": []}},
]


def _bfcl_files(tmp_path: Path) -> tuple[Path, Path, Path]:
    docs = tmp_path / "func_doc"
    _jsonl(docs / "ledger.json", _LEDGER_DOCS)
    questions = _jsonl(tmp_path / "BFCL_v4_multi_turn_base.json", [
        {"id": "multi_turn_base_0",
         "question": [[{"role": "user", "content": "Deposit 5, then double it."}],
                      [{"role": "user", "content": "What is my balance?"}]],
         "initial_config": {"Ledger": {"balance": 10}}, "path": ["Ledger.deposit"],
         "involved_classes": ["Ledger"]},
        {"id": "multi_turn_miss_func_0",
         "question": [[{"role": "user", "content": "Audit my account."}], []],
         "initial_config": {"Ledger": {"balance": 1}}, "involved_classes": ["Ledger"],
         "missed_function": {"1": ["audit"]}},
    ])
    answers = _jsonl(tmp_path / "possible_answer" / "BFCL_v4_multi_turn_base.json", [
        # positional argument in the ground truth, as BFCL's files have ("sort('x')")
        {"id": "multi_turn_base_0", "ground_truth": [["deposit(5)", "double()"],
                                                     ["get_balance()"]]},
        {"id": "multi_turn_miss_func_0", "ground_truth": [[], ["audit()"]]},
    ])
    return questions, answers, docs


@pytest.fixture
def bfcl_tasks(tmp_path):
    questions, answers, docs = _bfcl_files(tmp_path)
    return {t.id: t for t in load_bfcl(questions, answers, docs, doc_files={"Ledger": "ledger.json"})}


def _bfcl(task, *replies, **kw):
    policy = Script(*replies)
    episode = run_bfcl(task, policy, {"Ledger": Ledger}, **kw)
    return score_bfcl(task, episode, {"Ledger": Ledger}), policy, episode


RIGHT_TURN0 = calls(("deposit", {"amount": 5}), ("double", {}))


def test_bfcl_reader(bfcl_tasks):
    task = bfcl_tasks["multi_turn_base_0"]
    assert task.category == "multi_turn_base" and task.involved_classes == ("Ledger",)
    assert [t.name for t in task.functions] == ["deposit", "double", "get_balance",
                                                 "get_history", "audit"]
    assert task.ground_truth[0][0].args == (5,)
    held = bfcl_tasks["multi_turn_miss_func_0"]
    assert "audit" not in [t.name for t in held.functions]
    assert [t.name for t in held.held_out[1]] == ["audit"]


def test_bfcl_correct_policy_is_valid(bfcl_tasks):
    score, _, episode = _bfcl(bfcl_tasks["multi_turn_base_0"], RIGHT_TURN0, "Done: 30.",
                              calls(("get_balance", {})), "Your balance is 30.")
    assert score["valid"] is True and score["error_type"] is None
    assert (score["turns_checked"], score["turns_passed"], score["turn_accuracy"]) == (2, 2, 1.0)
    assert episode.states[-1]["Ledger"] == {"balance": 30,
                                            "history": [["deposit", 5], ["double"]]}
    assert episode.messages[2] == {"role": "tool", "name": "deposit",
                                   "content": '{"balance": 15}'}


def test_bfcl_wrong_argument_fails_the_state_check(bfcl_tasks):
    score, _, _ = _bfcl(bfcl_tasks["multi_turn_base_0"],
                        calls(("deposit", {"amount": 6}), ("double", {})), "ok",
                        calls(("get_balance", {})), "32")
    assert score["valid"] is False
    assert (score["error_type"], score["error_turn"]) == ("multi_turn:instance_state_mismatch", 0)
    # the state stays wrong in turn 1 (balance 32 != 30), and "balance=30" is never produced
    assert (score["turns_passed"], score["state_checks_passed"]) == (0, 0)
    assert score["turn_checks"][0]["differences"]["Ledger.balance"] == {"model": 32,
                                                                       "ground_truth": 30}


def test_bfcl_wrong_order_changes_state(bfcl_tasks):
    score, _, _ = _bfcl(bfcl_tasks["multi_turn_base_0"],
                        calls(("double", {}), ("deposit", {"amount": 5})), "ok",
                        calls(("get_balance", {})), "25")
    assert score["valid"] is False
    assert score["error_type"] == "multi_turn:instance_state_mismatch"
    assert score["turns_passed"] == 0


def test_bfcl_wrong_argument_type_is_rejected_not_raised(bfcl_tasks):
    score, policy, episode = _bfcl(bfcl_tasks["multi_turn_base_0"],
                                   calls(("deposit", {"amount": "5"}), ("double", {})), "ok",
                                   calls(("get_balance", {})), "20")
    assert "argument 'amount' must be of type integer" in episode.messages[2]["content"]
    assert score["invalid_calls"] == 1 and score["valid"] is False
    assert episode.states[0]["Ledger"]["balance"] == 20  # only double() ran


def test_bfcl_hallucinated_extra_call_is_harmless_by_bfcl_rules(bfcl_tasks):
    # BFCL checks state and that the ground-truth results are present; an extra call to a
    # tool that does not exist changes nothing, so the entry stays valid.
    turn0 = calls(("withdraw", {"amount": 1}), ("deposit", {"amount": 5}), ("double", {}))
    score, _, episode = _bfcl(bfcl_tasks["multi_turn_base_0"], turn0, "ok",
                              calls(("get_balance", {})), "30")
    assert episode.messages[2]["content"] == "Error: unknown tool 'withdraw'"
    assert score["valid"] is True and score["invalid_calls"] == 1


def test_bfcl_missing_call_fails_the_turn(bfcl_tasks):
    # no tool call at all in turn 1: BFCL's empty-turn failure
    score, _, _ = _bfcl(bfcl_tasks["multi_turn_base_0"], RIGHT_TURN0, "ok", "It is 30.")
    assert (score["error_type"], score["error_turn"]) == (
        "multi_turn:empty_turn_model_response", 1)
    assert (score["turns_passed"], score["turn_accuracy"]) == (1, 0.5)
    # a read-only call that leaves state equal but never yields "balance=30"
    score, _, _ = _bfcl(bfcl_tasks["multi_turn_base_0"], RIGHT_TURN0, "ok",
                        calls(("get_history", {})), "It is 30.")
    assert (score["error_type"], score["error_turn"]) == (
        "multi_turn:execution_response_mismatch", 1)
    assert score["turn_checks"][1]["missing_results"] == ["balance=30"]
    assert score["turn_checks"][1]["state_ok"] is True


def test_bfcl_response_check_is_cumulative_and_unordered(bfcl_tasks):
    # get_balance already called in turn 0 (after the state changes): its result counts
    # for turn 1, so a turn-1 call of any read-only tool is enough.
    turn0 = calls(("deposit", {"amount": 5}), ("double", {}), ("get_balance", {}))
    score, _, _ = _bfcl(bfcl_tasks["multi_turn_base_0"], turn0, "ok",
                        calls(("get_history", {})), "30")
    assert score["valid"] is True


def test_bfcl_held_out_function_and_unchecked_empty_turn(bfcl_tasks):
    task = bfcl_tasks["multi_turn_miss_func_0"]
    score, policy, episode = _bfcl(task, "I have no audit tool.", calls(("audit", {})), "Done.")
    assert score["valid"] is True and score["turns_checked"] == 1
    assert "audit" not in policy.tools_seen[0] and "audit" in policy.tools_seen[1]
    assert episode.messages[2]["role"] == "user"  # the note replacing the empty question
    # calling a tool in the empty-ground-truth turn is recorded, not failed (BFCL today)
    score, _, _ = _bfcl(task, calls(("get_balance", {})), "No audit tool.",
                        calls(("audit", {})), "Done.")
    assert score["valid"] is True and score["calls_in_empty_turns"] is True
    # the held-out function cannot be called before its turn
    score, _, episode = _bfcl(task, calls(("audit", {})), "?", "no call")
    assert episode.messages[2]["content"] == "Error: unknown tool 'audit'"
    assert score["error_type"] == "multi_turn:empty_turn_model_response"


def test_bfcl_step_limit_force_terminates(bfcl_tasks):
    task = bfcl_tasks["multi_turn_base_0"]
    episode = run_bfcl(task, lambda m, t: calls(("get_balance", {})), {"Ledger": Ledger},
                       max_steps=3)
    score = score_bfcl(task, episode, {"Ledger": Ledger})
    assert episode.force_terminated and len(episode.turns) == 1
    assert score["valid"] is False and score["error_type"] == "multi_turn:force_terminated"


def test_bfcl_backends_by_registry_and_path(bfcl_tasks, tmp_path, monkeypatch):
    from spade_jax.evaluation.tool_benchmarks import common

    task = bfcl_tasks["multi_turn_base_0"]
    with pytest.raises(KeyError, match="needs backend class 'Ledger'"):
        run_bfcl(task, Script())
    monkeypatch.setitem(common.BACKEND_REGISTRY, "Ledger", Ledger)
    scores = evaluate_bfcl([task], Script(RIGHT_TURN0, "ok", calls(("get_balance", {})), "30"))
    assert scores[0]["valid"] is True
    (tmp_path / "my_ledger_backend.py").write_text(
        "from tests.evaluation.test_tool_benchmarks import Ledger\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    episode = run_bfcl(task, Script(RIGHT_TURN0, "ok", calls(("get_balance", {})), "30"),
                       {"Ledger": "my_ledger_backend:Ledger"})
    assert score_bfcl(task, episode, {"Ledger": Ledger})["valid"] is True
    result = suite_result("BFCL", "bfcl", [task.id], scores, "valid")
    assert result.pass_at_1 == 1.0 and result.reasons == {"correct": 1}


def test_bfcl_malformed_files_name_file_line_and_field(tmp_path):
    questions, answers, docs = _bfcl_files(tmp_path)
    files = {"Ledger": "ledger.json"}
    lines = questions.read_text().splitlines()
    broken = json.loads(lines[1])
    del broken["involved_classes"]
    questions.write_text(lines[0] + "\n" + json.dumps(broken) + "\n")
    with pytest.raises(DataError, match=r"BFCL_v4_multi_turn_base.json:2: missing field "
                                        r"'involved_classes'"):
        load_bfcl(questions, answers, docs, doc_files=files)
    questions, answers, docs = _bfcl_files(tmp_path)
    _jsonl(answers, [{"id": "multi_turn_base_0", "ground_truth": [["deposit(amount=x+1)"], []]}])
    with pytest.raises(DataError, match=r"possible_answer/BFCL_v4_multi_turn_base.json:1: "
                                        r"field 'ground_truth\[0\]\[0\]' is not a literal"):
        load_bfcl(questions, answers, docs, doc_files=files)
    _jsonl(answers, [{"id": "multi_turn_base_0", "ground_truth": [["double()"]]}])
    with pytest.raises(DataError, match=r":1: field 'ground_truth' has 1 turns, the question "
                                        r"has 2"):
        load_bfcl(questions, answers, docs, doc_files=files)
    questions, answers, docs = _bfcl_files(tmp_path)
    (docs / "ledger.json").write_text(json.dumps(_LEDGER_DOCS[0]) + "\n" + json.dumps(
        {"name": "x", "parameters": {"properties": ["y"]}}) + "\n")
    with pytest.raises(DataError, match=r"ledger.json:2: field 'function.parameters.properties' "
                                        r"must be an object"):
        load_bfcl(questions, answers, docs, doc_files=files)
    with pytest.raises(DataError, match=r":1: field 'involved_classes': no function-doc file "
                                        r"known for 'Ledger'"):
        load_bfcl(questions, answers, docs)


# ============================================================================ tau2


class ShopTools:
    """A tau2-style toolkit over a JSON database; TOOLS limits what the agent sees."""

    TOOLS = ("get_order", "cancel_order")

    def __init__(self, db: dict) -> None:
        self.db = db

    def get_order(self, order_id: str) -> dict:
        """Look up an order."""
        if order_id not in self.db["orders"]:
            raise ValueError(f"order {order_id} not found")
        return self.db["orders"][order_id]

    def cancel_order(self, order_id: str, reason: str) -> dict:
        """Cancel a pending order."""
        order = self.get_order(order_id)
        if order["status"] != "pending":
            raise ValueError("only pending orders can be cancelled")
        order["status"], order["reason"] = "cancelled", reason
        return order

    def order_status_is(self, order_id: str, status: str) -> bool:
        return self.db["orders"][order_id]["status"] == status


_TAU2_TASKS = [
    {"id": "cancel", "description": {"purpose": "cancel a pending order"},
     "user_scenario": {"persona": None, "instructions": {
         "domain": "shop", "reason_for_call": "Cancel order A1.", "known_info": "order A1",
         "unknown_info": None, "task_instructions": "Say it is no longer needed."}},
     "initial_state": None,
     "evaluation_criteria": {
         "actions": [{"action_id": "c_0", "name": "get_order", "arguments": {"order_id": "A1"}},
                     {"action_id": "c_1", "name": "cancel_order",
                      "arguments": {"order_id": "A1", "reason": "no longer needed"},
                      "compare_args": ["order_id"]}],
         "env_assertions": [{"env_type": "assistant", "func_name": "order_status_is",
                             "arguments": {"order_id": "A1", "status": "cancelled"},
                             "assert_value": True}],
         "communicate_info": ["A1 is cancelled"], "nl_assertions": [],
         "reward_basis": ["DB", "ENV_ASSERTION", "ACTION", "COMMUNICATE"]}},
    {"id": "refuse", "user_scenario": {"instructions": "Cancel order D1 (delivered)."},
     "evaluation_criteria": {"actions": [], "communicate_info": [],
                             "nl_assertions": ["Agent refuses to cancel."],
                             "reward_basis": ["DB", "NL_ASSERTION"]}},
    {"id": "seeded", "user_scenario": {"instructions": "Ask about order B2."},
     "initial_state": {"initialization_data": {"agent_data": {
         "orders": {"B2": {"status": "delivered", "items": ["lamp"]}}}},
         "initialization_actions": [{"env_type": "assistant", "func_name": "cancel_order",
                                     "arguments": {"order_id": "A1", "reason": "setup"}}]},
     "evaluation_criteria": {"communicate_info": ["delivered"],
                             "reward_basis": ["DB", "COMMUNICATE"]}},
]


def _tau2_dir(tmp_path: Path, tasks=None) -> Path:
    domain = tmp_path / "shop"
    domain.mkdir(exist_ok=True)
    (domain / "policy.md").write_text("# Shop policy\nOnly pending orders can be cancelled.\n")
    (domain / "db.json").write_text(json.dumps({"orders": {
        "A1": {"status": "pending", "items": ["mug"]},
        "D1": {"status": "delivered", "items": ["pen"]}}}))
    (domain / "tasks.json").write_text(json.dumps(tasks or _TAU2_TASKS, indent=1))
    return domain


@pytest.fixture
def shop(tmp_path):
    return load_tau2_domain(_tau2_dir(tmp_path))


def _tau2(domain, task_id, *replies, user=("Please cancel A1.", "Thanks"), **kw):
    task = next(t for t in domain.tasks if t.id == task_id)
    judge = kw.pop("judge", None)
    policy = Script(*replies)
    episode = run_tau2(task, domain, policy, ScriptedUser(list(user)), ShopTools, **kw)
    return score_tau2(task, episode, domain, ShopTools, judge=judge), policy, episode


GET_A1 = calls(("get_order", {"order_id": "A1"}))
CANCEL_A1 = calls(("cancel_order", {"order_id": "A1", "reason": "no longer needed"}))


def test_tau2_reader(shop):
    assert shop.name == "shop" and shop.policy.startswith("# Shop policy")
    cancel = shop.tasks[0]
    assert "Reason for call: Cancel order A1." in cancel.instructions
    assert cancel.criteria.actions[1].compare_args == ("order_id",)
    assert shop.tasks[2].agent_data["orders"]["B2"]["status"] == "delivered"


def test_tau2_correct_policy_scores_one(shop):
    score, policy, episode = _tau2(shop, "cancel", GET_A1, CANCEL_A1,
                                   "Done: order A1 is cancelled, anything else?")
    assert episode.termination == "user_stop"
    assert score["reward"] == 1.0 and score["pass"] and score["reward_complete"]
    assert score["reward_breakdown"] == {"DB": 1.0, "ENV_ASSERTION": 1.0, "ACTION": 1.0,
                                         "COMMUNICATE": 1.0}
    assert policy.messages_seen[0][0] == {"role": "system", "content": shop.policy}
    assert policy.tools_seen[0] == ["get_order", "cancel_order"]


def test_tau2_wrong_argument_outside_compare_args_fails_db_only(shop):
    # reason differs: the action matches (compare_args = order_id) but the DB hash does not
    wrong = calls(("cancel_order", {"order_id": "A1", "reason": "changed my mind"}))
    score, _, _ = _tau2(shop, "cancel", GET_A1, wrong, "Order A1 is cancelled.")
    assert score["reward"] == 0.0 and score["db_match"] is False
    assert score["reward_breakdown"] == {"DB": 0.0, "ENV_ASSERTION": 1.0, "ACTION": 1.0,
                                         "COMMUNICATE": 1.0}
    assert score["error_type"] == "wrong:DB"


def test_tau2_wrong_argument_in_compare_args(shop):
    wrong = calls(("cancel_order", {"order_id": "D1", "reason": "no longer needed"}))
    score, _, episode = _tau2(shop, "cancel", GET_A1, wrong, "Order A1 is cancelled.")
    assert "only pending orders" in episode.messages[5]["content"]  # error observation
    assert score["reward"] == 0.0
    assert (score["actions_matched"], score["actions_total"]) == (1, 2)
    assert score["env_assertions_met"] == "0/1" and score["db_match"] is False


def test_tau2_action_order_does_not_matter(shop):
    score, _, _ = _tau2(shop, "cancel", CANCEL_A1, GET_A1, "A1 is cancelled.")
    assert score["reward"] == 1.0


def test_tau2_hallucinated_tool_and_missing_call(shop):
    score, _, episode = _tau2(shop, "cancel", calls(("refund", {"order_id": "A1"})),
                              GET_A1, CANCEL_A1, "A1 is cancelled.")
    assert episode.messages[3]["content"] == "Error: unknown tool 'refund'"
    assert score["reward"] == 1.0  # an extra failed call changes nothing
    # the helper method is not a tool (TOOLS), so calling it is a hallucination too
    _, _, episode = _tau2(shop, "cancel", calls(("order_status_is", {"order_id": "A1",
                                                                    "status": "x"})), "?")
    assert "unknown tool 'order_status_is'" in episode.messages[3]["content"]
    score, _, _ = _tau2(shop, "cancel", CANCEL_A1, "A1 is cancelled.")  # no get_order
    assert score["reward"] == 0.0 and score["action_fraction"] == 0.5 and score["db_match"]
    score, _, _ = _tau2(shop, "cancel", GET_A1, CANCEL_A1, "Done.")  # nothing communicated
    assert score["reward"] == 0.0 and score["communicate_met"] == 0
    assert score["error_type"] == "wrong:COMMUNICATE"


def test_tau2_refusal_and_nl_assertions(shop):
    score, _, _ = _tau2(shop, "refuse", "I cannot cancel a delivered order.",
                        user=["Cancel D1 please."])
    # actions == []: DB must equal the untouched database; NL needs a judge
    assert score["db_match"] is True and score["reward_complete"] is False
    assert score["nl_assertions"] == "not_evaluated" and score["reward"] == 1.0
    score, _, _ = _tau2(shop, "refuse", "I cannot cancel a delivered order.",
                        user=["Cancel D1 please."], judge=lambda a, m: [True])
    assert score["reward_complete"] and score["reward"] == 1.0 and score["nl_assertions"] == "1/1"
    score, _, _ = _tau2(shop, "refuse", GET_A1, CANCEL_A1, "Cancelled A1 instead.",
                        user=["Cancel D1 please."], judge=lambda a, m: [False])
    assert score["reward"] == 0.0 and score["reward_breakdown"] == {"DB": 0.0,
                                                                    "NL_ASSERTION": 0.0}


def test_tau2_initial_state_and_terminations(shop):
    score, policy, episode = _tau2(shop, "seeded", calls(("get_order", {"order_id": "B2"})),
                                   "B2 was delivered.", user=["Where is B2?"])
    assert episode.toolkit.db["orders"]["A1"]["status"] == "cancelled"  # init action ran
    assert score["reward"] == 1.0 and score["db_match"]  # no actions/assertions -> DB 1
    score, _, episode = _tau2(shop, "cancel", GET_A1, CANCEL_A1, "A1 is cancelled. ###STOP###")
    assert episode.termination == "agent_stop" and score["reward"] == 1.0
    score, _, episode = _tau2(shop, "cancel", *([GET_A1] * 10), max_steps=6)
    assert episode.termination == "max_steps" and score["reward"] == 0.0
    score, _, episode = _tau2(shop, "cancel", *([calls(("nope", {}))] * 5), max_errors=3)
    assert episode.termination == "too_many_errors" and score["pass"] is False
    user = CallableUser(lambda instr, hist: "Cancel A1." if not hist else "###STOP###")
    task = shop.tasks[0]
    episode = run_tau2(task, shop, Script(GET_A1, CANCEL_A1, "A1 is cancelled."), user,
                       ShopTools)
    assert episode.termination == "user_stop"
    assert score_tau2(task, episode, shop, ShopTools)["reward"] == 1.0


def test_tau2_malformed_files_name_file_line_and_field(tmp_path):
    bad = json.loads(json.dumps(_TAU2_TASKS))
    del bad[1]["user_scenario"]
    domain = _tau2_dir(tmp_path, bad)
    line = next(i for i, text in enumerate((domain / "tasks.json").read_text().splitlines(), 1)
                if '"refuse"' in text) - 1  # the task's "{" is on the line before its id
    with pytest.raises(DataError, match=rf"tasks.json:{line}: missing field 'user_scenario'"):
        load_tau2_domain(domain)
    bad = json.loads(json.dumps(_TAU2_TASKS))
    bad[0]["evaluation_criteria"]["reward_basis"] = ["DB", "VIBES"]
    with pytest.raises(DataError, match=r"field 'evaluation_criteria.reward_basis' must be"):
        load_tau2_domain(_tau2_dir(tmp_path, bad))
    bad = json.loads(json.dumps(_TAU2_TASKS))
    bad[0]["evaluation_criteria"]["actions"][0]["requestor"] = "user"
    with pytest.raises(DataError, match=r"evaluation_criteria.actions\[0\]' acts on the 'user'"):
        load_tau2_domain(_tau2_dir(tmp_path, bad))
    domain = _tau2_dir(tmp_path)
    (domain / "db.json").write_text('{"orders": {\n  "A1": }\n}')
    with pytest.raises(DataError, match=r"db.json:2: malformed JSON"):
        load_tau2_domain(domain)


# ============================================================================ ACEBench


class BaseApi:
    def __init__(self) -> None:
        self.wifi = False
        self.logged_in = True

    def _load_scenario(self, scenario: dict, long_context: bool = False) -> None:
        self.wifi = scenario.get("wifi", False)
        self.logged_in = scenario.get("logged_in", True)

    def turn_on_wifi(self) -> dict:
        self.wifi = True
        return {"status": True, "message": "Wi-Fi on"}


class MessageApi(BaseApi):
    def __init__(self) -> None:
        super().__init__()
        self.inbox = {1: {"from": "Bob", "to": "Ann", "message": "old"},
                      2: {"from": "Cy", "to": "Ann", "message": "older"}}
        self.next_id = 3

    def send_message(self, sender_name: str, receiver_name: str, message: str) -> dict:
        if not self.wifi:
            return {"status": False, "message": "Wi-Fi is off"}
        self.inbox[self.next_id] = {"from": sender_name, "to": receiver_name, "message": message}
        self.next_id += 1
        return {"status": True}

    def delete_message(self, message_id: int) -> dict:
        if message_id not in self.inbox:
            raise KeyError(message_id)
        del self.inbox[message_id]
        return {"status": True}


ACE_BACKENDS = {"BaseApi": BaseApi, "MessageApi": MessageApi}
_ACE_DOCS = [
    {"name": "turn_on_wifi", "description": "Turn on Wi-Fi.",
     "parameters": {"type": "dict", "required": [], "properties": {}}},
    {"name": "send_message", "description": "Send a message.", "parameters": {
        "type": "dict", "required": ["sender_name", "receiver_name", "message"],
        "properties": {"sender_name": {"type": "string"}, "receiver_name": {"type": "string"},
                       "message": {"type": "string"}}}},
    {"name": "delete_message", "description": "Delete a message.", "parameters": {
        "type": "dict", "required": ["message_id"],
        "properties": {"message_id": {"type": "integer"}}}},
]
_ACE_TRUTH = [{"BaseApi": {"wifi": True, "logged_in": True}},
              {"MessageApi": {"inbox": {"1": {"from": "Bob", "to": "Ann", "message": "old"},
                                        "3": {"from": "Ann", "to": "Bob", "message": "hi"}}}}]
_ACE_STONES = ["[turn_on_wifi()]", "[delete_message(message_id=2)]",
               "[send_message(sender_name='Ann', receiver_name='Bob', message='hi')]"]


def _ace_files(tmp_path: Path) -> tuple[Path, Path]:
    common = {"initial_config": {"BaseApi": {"wifi": False, "logged_in": True}}, "path": [],
              "function": _ACE_DOCS, "involved_classes": ["BaseApi", "MessageApi"]}
    questions = _jsonl(tmp_path / "data_agent_multi_turn.json", [
        {"id": "agent_multi_turn_0", "question": "You are Ann. Send 'hi' to Bob; delete the "
                                                 "oldest message from Cy first.", **common},
        {"id": "agent_multi_step_0", "question": "I am Ann. Delete message 2 and send 'hi' to "
                                                 "Bob.", **common},
    ])
    answers = _jsonl(tmp_path / "possible_answer" / "data_agent_multi_turn.json", [
        {"id": "agent_multi_turn_0", "ground_truth": _ACE_TRUTH, "mile_stone": _ACE_STONES},
        {"id": "agent_multi_step_0", "ground_truth": _ACE_TRUTH,
         "mile_stone": [_ACE_STONES, [_ACE_STONES[0], _ACE_STONES[2]]]},
    ])
    return questions, answers


@pytest.fixture
def ace_tasks(tmp_path):
    return {t.id: t for t in load_acebench(*_ace_files(tmp_path))}


WIFI = calls(("turn_on_wifi", {}))
DELETE2 = calls(("delete_message", {"message_id": 2}))
SEND_HI = calls(("send_message", {"message": "hi", "sender_name": "Ann", "receiver_name": "Bob"}))


def _ace(task, *replies, user=("Please message Bob.", "finish conversation")):
    episode = run_acebench(task, Script(*replies), ACE_BACKENDS,
                           user=ScriptedUser(list(user)) if task.mode == "multi_turn" else None)
    return score_acebench(task, episode), episode


def test_acebench_reader(ace_tasks):
    task = ace_tasks["agent_multi_turn_0"]
    assert task.mode == "multi_turn" and ace_tasks["agent_multi_step_0"].mode == "multi_step"
    assert [f.name for f in task.functions] == ["turn_on_wifi", "send_message", "delete_message"]
    assert task.ground_truth[0] == ("BaseApi", {"wifi": True, "logged_in": True})
    assert len(task.milestones) == 1 and task.milestones[0][1].calls[0].kwargs == {
        "message_id": 2}
    assert len(ace_tasks["agent_multi_step_0"].milestones) == 2


def test_acebench_correct_policy(ace_tasks):
    score, episode = _ace(ace_tasks["agent_multi_turn_0"], WIFI, DELETE2, SEND_HI, "Sent.")
    assert episode.ended_by == "user_finish"
    assert score["end_to_end"] is True and score["process_accuracy"] == 1.0
    assert score["milestone_accuracy"] == 1.0  # keyword order differs from the milestone
    assert episode.objects["MessageApi"].wifi is True  # turn_on_wifi ran on both instances


def test_acebench_wrong_argument_wrong_order_missing_call(ace_tasks):
    task = ace_tasks["agent_multi_turn_0"]
    wrong = calls(("send_message", {"sender_name": "Ann", "receiver_name": "Bob",
                                    "message": "hello"}))
    score, _ = _ace(task, WIFI, DELETE2, wrong, "Sent.")
    assert score["end_to_end"] is False and score["process_accuracy"] == 0.667
    assert score["error_type"] == "class attributes wrong"
    assert any("MessageApi.inbox.3" in e for e in score["errors"])
    # send before Wi-Fi: the send fails; milestones found in order: wifi, delete -> 2/3
    score, _ = _ace(task, SEND_HI, WIFI, DELETE2, "Sent.")
    assert score["end_to_end"] is False and score["process_accuracy"] == 0.667
    # Wi-Fi never turned on: the first milestone is never found, so the greedy in-order
    # search runs off the end and finds none of the later ones either -> 0/3
    score, _ = _ace(task, DELETE2, SEND_HI, "Sent.")
    assert score["end_to_end"] is False and score["process_accuracy"] == 0.0


def test_acebench_state_check_ignores_extra_keys(ace_tasks):
    # ACEBench compares only the ground truth's keys of a dict attribute: without the
    # delete, message 2 stays in the inbox and the entry still passes end to end.
    score, _ = _ace(ace_tasks["agent_multi_turn_0"], WIFI, SEND_HI, "Sent.")
    assert score["end_to_end"] is True and score["process_accuracy"] == 1.0
    # the milestones alone: wifi found; the search for delete consumes the send message,
    # so send is not found either -> 1/3 (ACEBench's greedy search)
    assert score["milestone_accuracy"] == 0.333


def test_acebench_hallucinated_tool_and_no_calls(ace_tasks):
    task = ace_tasks["agent_multi_turn_0"]
    score, episode = _ace(task, calls(("call_bob", {})), WIFI, DELETE2, SEND_HI, "Sent.")
    assert episode.messages[2]["content"] == "Error: unknown tool 'call_bob'"
    assert score["end_to_end"] is True
    score, _ = _ace(task, calls(("delete_message", {"message_id": "2"})), "Sorry.")
    assert score["error_type"] == "no_state" and score["process_accuracy"] == 0.0


def test_acebench_multi_step_and_alternative_milestones(ace_tasks):
    task = ace_tasks["agent_multi_step_0"]
    score, episode = _ace(task, WIFI, SEND_HI, "Let me think.", "finish conversation")
    assert episode.ended_by == "agent_finish"
    assert episode.messages[-2]["role"] == "user"  # the nudge after a text-only reply
    assert score["end_to_end"] is True  # extra inbox key allowed (see above)
    wrong = calls(("send_message", {"sender_name": "Ann", "receiver_name": "Bob",
                                    "message": "yo"}))
    score, _ = _ace(task, WIFI, wrong, "finish conversation")
    # path 1: wifi only -> 1/3; path 2: wifi only -> 1/2; best = 0.5
    assert score["end_to_end"] is False and score["process_accuracy"] == 0.5


def test_acebench_malformed_files_name_file_line_and_field(tmp_path):
    questions, answers = _ace_files(tmp_path)
    lines = answers.read_text().splitlines()
    record = json.loads(lines[1])
    record["ground_truth"] = [{"MessageApi": ["not", "a", "dict"]}]
    answers.write_text(lines[0] + "\n" + json.dumps(record) + "\n")
    with pytest.raises(DataError, match=r"possible_answer/data_agent_multi_turn.json:2: field "
                                        r"'ground_truth\[0\]' must be"):
        load_acebench(questions, answers)
    questions, answers = _ace_files(tmp_path)
    lines = questions.read_text().splitlines()
    record = json.loads(lines[0])
    record["function"][1] = {"description": "no name"}
    questions.write_text(json.dumps(record) + "\n" + lines[1] + "\n")
    with pytest.raises(DataError, match=r"data_agent_multi_turn.json:1: field "
                                        r"'function\[1\].name' must be a non-empty string"):
        load_acebench(questions, answers)
    questions.write_text(lines[0] + "\n{not json\n")
    with pytest.raises(DataError, match=r"data_agent_multi_turn.json:2: malformed JSON"):
        load_acebench(questions, answers)
