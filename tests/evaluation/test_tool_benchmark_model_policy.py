"""The model-backed tool-benchmark policy and user (`tool_benchmarks.model_policy`).

Most tests inject a stand-in sampler that returns the token ids of chosen reply texts (and
records the prompts and seeds it was given), so rendering, parsing and the scorers' view of
the replies are checked exactly; one test samples the tiny random model (`chat_model`) to
check the seeding. The benchmark fixtures come from test_tool_benchmarks.py.
"""

from __future__ import annotations

import types

from test_tool_benchmarks import (
    _LEDGER_DOCS,
    GET_A1,
    Ledger,
    Script,
    ShopTools,
    _bfcl_files,
    _tau2_dir,
)

from spade_jax.envs.tools import parse_reply
from spade_jax.evaluation.tool_benchmarks import (
    ModelUser,
    load_bfcl,
    load_tau2_domain,
    model_tool_policy,
    run_bfcl,
    run_tau2,
    score_bfcl,
    score_tau2,
)
from spade_jax.evaluation.tool_benchmarks.acebench import FINISH
from spade_jax.evaluation.tool_benchmarks.model_policy import (
    USER_OPENING,
    parse_model_reply,
)
from spade_jax.rollout import SamplerConfig
from spade_jax.seeding import derive_seed

SAMPLER = SamplerConfig(max_new_tokens=8, temperature=1.0)


class FakeSampler:
    """Stands in for `rollout.sampler.sample`: the given texts in order ("done" after them),
    each as token ids ending in a stop token; records every prompt and config."""

    def __init__(self, tokenizer, *texts: str) -> None:
        self.tokenizer, self.texts = tokenizer, list(texts)
        self.prompts: list[list[int]] = []
        self.seeds: list[int] = []

    def __call__(self, model, prompts, config, *, stop_tokens, mesh):
        assert model is None and mesh is None and len(prompts) == 1
        self.prompts.append(list(prompts[0]))
        self.seeds.append(config.seed)
        text = self.texts.pop(0) if self.texts else "done"
        return types.SimpleNamespace(tokens=[self.tokenizer.encode(text) + [min(stop_tokens)]])


def _policy(tokenizer, *texts: str, seed: int = 7):
    fake = FakeSampler(tokenizer, *texts)
    return model_tool_policy(None, tokenizer, sampler=SAMPLER, seed=seed, sample_fn=fake), fake


def test_prompt_is_the_chat_template_with_the_offered_tools(chat_tokenizer):
    policy, fake = _policy(chat_tokenizer)
    messages = [{"role": "user", "content": "Deposit 5."}]
    tools = [dict(t) for t in _LEDGER_DOCS[:2]]  # benchmark form: name/description/parameters
    policy(messages, tools)
    policy(messages, tools)
    wrapped = [{"type": "function", "function": t} for t in tools]
    expected = chat_tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  enable_thinking=False, tools=wrapped)
    assert fake.prompts[0] == expected and fake.prompts[1] == expected
    assert expected != chat_tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                          enable_thinking=False)
    text = chat_tokenizer.decode(fake.prompts[0])
    assert '"name": "deposit"' in text and '"name": "double"' in text and "<tools>" in text
    assert fake.seeds == [derive_seed(7, 0), derive_seed(7, 1)] and policy.calls == 2


MIXED = ('<think>deposit first</think>Depositing.\n'
         '<tool_call>{"name": "deposit", "arguments": {"amount": 5}}</tool_call>\n'
         '<tool_call>{"name": "double", "arguments": [}</tool_call>')


def test_reply_is_read_by_the_shared_parser():
    reply = parse_model_reply(MIXED)
    calls, errors, content = parse_reply(MIXED.split("</think>")[1].strip())
    assert reply["content"] == content == "Depositing."
    assert reply["tool_calls"][0] == calls[0] == {"name": "deposit", "arguments": {"amount": 5}}
    assert reply["tool_calls"][1]["name"] is None and reply["errors"] == errors
    assert len(errors) == 1 and errors[0].startswith("tool call 1: not JSON")
    # block order is kept: a malformed first block stays first
    swapped = parse_model_reply('<tool_call>oops</tool_call><tool_call>{"name": "double"}'
                                '</tool_call>')
    assert [c["name"] for c in swapped["tool_calls"]] == [None, "double"]
    unclosed = parse_model_reply('<tool_call>{"name": "double"}')
    assert [c["name"] for c in unclosed["tool_calls"]] == [None]
    assert unclosed["errors"] == ["an unclosed <tool_call>"]
    assert parse_model_reply("<think>never closed")["content"] == ""
    assert parse_model_reply("plan</think>Answer")["content"] == "Answer"


def test_bfcl_run_counts_the_malformed_call_as_invalid(chat_tokenizer, tmp_path):
    questions, answers, docs = _bfcl_files(tmp_path)
    tasks = {t.id: t for t in load_bfcl(questions, answers, docs,
                                        doc_files={"Ledger": "ledger.json"})}
    task = tasks["multi_turn_base_0"]
    policy, fake = _policy(chat_tokenizer, MIXED,
                           '<tool_call>{"name": "double", "arguments": {}}</tool_call>',
                           "Done.",
                           '<tool_call>{"name": "get_balance", "arguments": {}}</tool_call>',
                           "Your balance is 30.")
    episode = run_bfcl(task, policy, {"Ledger": Ledger})
    score = score_bfcl(task, episode, {"Ledger": Ledger})
    assert score["invalid_calls"] == 1 and score["valid"] is True
    assert episode.states[0]["Ledger"]["balance"] == 30
    assert [m["role"] for m in episode.messages[:4]] == ["user", "assistant", "tool", "tool"]
    assert episode.messages[2]["content"] == '{"balance": 15}'
    assert episode.messages[3]["content"].startswith("Error: ")
    # the next prompt shows the model its own reply as written (malformed block included)
    # and both tool responses
    second = chat_tokenizer.decode(fake.prompts[1])
    assert '<tool_call>{"name": "double", "arguments": [}</tool_call>' in second
    assert "deposit first" not in second  # the reasoning is not carried over
    assert '<tool_response>\n{"balance": 15}\n</tool_response>' in second
    assert "<tool_response>\nError: " in second
    assert len(fake.prompts) == 5


def test_history_not_written_by_the_policy_renders_its_valid_calls(chat_tokenizer):
    policy, _ = _policy(chat_tokenizer)
    history = [{"role": "user", "content": "Deposit 1."},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"invalid": "bad"}, {"name": "deposit", "arguments": {"amount": 1}}]},
               {"role": "tool", "name": None, "content": "Error: bad"},
               {"role": "tool", "name": "deposit", "content": '{"balance": 1}'}]
    text = chat_tokenizer.decode(policy.prompt(history, [dict(_LEDGER_DOCS[0])]))
    assert '<tool_call>\n{"name": "deposit", "arguments": {"amount": 1}}\n</tool_call>' in text
    assert "<tool_response>\nError: bad\n</tool_response>" in text


def test_same_seed_same_replies_other_seed_other_replies(chat_model, chat_tokenizer):
    messages = [{"role": "user", "content": "alpha"}]
    tools = [{"name": "beta", "description": "gamma",
              "parameters": {"type": "object", "properties": {}}}]

    def raws(seed: int) -> list[str]:
        policy = model_tool_policy(chat_model, chat_tokenizer, sampler=SAMPLER, seed=seed)
        replies = [policy(messages, tools) for _ in range(3)]
        assert all(set(r) >= {"content", "tool_calls"} for r in replies)
        assert policy.calls == 3 and len(policy.generated_tokens) == 3
        return [r["raw"] for r in replies]

    first = raws(0)
    assert raws(0) == first
    assert raws(1) != first
    assert len(set(first)) > 1  # call k draws with derive_seed(seed, k)


def test_model_user_plays_the_user_and_ends_on_the_stop_marker(chat_tokenizer, tmp_path):
    shop = load_tau2_domain(_tau2_dir(tmp_path))
    task = shop.tasks[0]
    fake = FakeSampler(chat_tokenizer, "I want to cancel an order.", "It is A1.",
                       "<think>done</think>Great, thanks! ###stop### bye")
    user = ModelUser(None, chat_tokenizer, sampler=SAMPLER, seed=3, sample_fn=fake)
    cancel = {"content": "", "tool_calls": [
        {"name": "cancel_order", "arguments": {"order_id": "A1", "reason": "no longer needed"}}]}
    policy = Script("Which order?", GET_A1, cancel, "A1 is cancelled.")
    episode = run_tau2(task, shop, policy, user, ShopTools)
    assert episode.termination == "user_stop"
    said = [m["content"] for m in episode.messages if m["role"] == "user"]
    assert said == ["I want to cancel an order.", "It is A1.", "Great, thanks! ###STOP###"]
    assert score_tau2(task, episode, shop, ShopTools)["reward"] == 1.0
    assert fake.seeds == [derive_seed(3, k) for k in range(3)]
    # the user model's prompt: its instructions, the opening, then the roles swapped
    system = user.chat_messages([])[0]["content"]
    assert task.instructions in system and "###STOP###" in system
    expected = chat_tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": USER_OPENING},
         {"role": "assistant", "content": "I want to cancel an order."},
         {"role": "user", "content": "Which order?"}],
        add_generation_prompt=True, enable_thinking=False)
    assert fake.prompts[1] == expected

    ace = ModelUser(None, chat_tokenizer, sampler=SAMPLER, seed=3, stop_marker=FINISH,
                    sample_fn=FakeSampler(chat_tokenizer, "All set. Finish Conversation now"))
    assert ace.first_message("Send Bob a message.") == "All set. finish conversation"
    assert "finish conversation" in ace.chat_messages([])[0]["content"]
