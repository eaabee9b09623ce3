"""The tool seed programs' scripted solutions (`spade.tool_demos`), played in the sandbox:
each solves its program on fresh seeds (full score, ending on the final answer), a solver
that no longer fits is refused, and the warm start lays a demonstration out as the agent
loop lays out an episode (the first prompt with the env's tools, tool turns after)."""

from __future__ import annotations

import dataclasses

import pytest

from spade_jax.envs import EnvPool, SandboxConfig, make_env
from spade_jax.experiment import load_experiment
from spade_jax.rollout.agent_loop import ChatTurns
from spade_jax.spade.seed_programs import TOOL_SEED_PROGRAMS
from spade_jax.spade.tool_demos import SOLVERS, demo_turns, tool_call

BY_NAME = {p.name: p for p in TOOL_SEED_PROGRAMS}


@pytest.fixture(scope="module")
def pool():
    with EnvPool(SandboxConfig(call_deadline_s=5.0)) as p:
        yield p


def test_every_tool_seed_has_a_solver():
    assert set(SOLVERS) == set(BY_NAME)


@pytest.mark.parametrize("name", sorted(SOLVERS))
def test_each_solver_solves_its_program_on_fresh_seeds(pool, name):
    for seed in (3, 1234, 99991):
        env = make_env(BY_NAME[name].source, pool, contract="tool", max_turns=3)
        try:
            first, turns = demo_turns(env, SOLVERS[name], seed, max_turns=3)
        finally:
            env.close()
        assert len(turns) == 3 and "<tool_call>" in turns[0][0] and "<tool_call>" in turns[1][0]
        assert "<tool_call>" not in turns[2][0]  # the final answer
        assert first and all(observation is not None for _, observation in turns)


def test_a_solver_that_misses_is_refused(pool):
    def wrong(request, observations):
        return tool_call("write_off", item="bolts") if not observations else "Done."

    env = make_env(BY_NAME["tool_stock_levels"].source, pool, contract="tool", max_turns=3)
    try:
        with pytest.raises(ValueError, match="demonstration scored 0.0"):
            demo_turns(env, wrong, 5, max_turns=3)
    finally:
        env.close()


class CharTokenizer:
    eos_ids = frozenset({0})
    pad_id = 0

    def apply_chat_template(self, messages, add_generation_prompt=False, enable_thinking=True,
                            tools=None):
        ids = [] if tools is None else self.encode("<tools>" + ",".join(
            t["function"]["name"] for t in tools) + "</>")
        for m in messages:  # each turn closed by the end-of-turn token 0
            ids += self.encode(f"<{m['role']}>{m['content']}") + [0]
        return ids + (self.encode("<assistant>") if add_generation_prompt else [])

    def encode(self, text):
        return [ord(c) + 1 for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i - 1) for i in ids if i > 0)


def test_warm_start_lays_demonstrations_out_as_the_agent_loop(pool):
    from spade_jax.run import _tool_agent_sequences

    config = load_experiment("tiny_tool_use")
    config = dataclasses.replace(config, warm_start=dataclasses.replace(
        config.warm_start, agent_demos=1))
    tok = CharTokenizer()
    seqs = _tool_agent_sequences(config, tok, pool, list(TOOL_SEED_PROGRAMS))
    assert len(seqs) == 3 * 3  # one episode of each program, three replies
    turns = ChatTurns(tok, config.agent.system_prompt, False, "{observation}", "tool")
    order = seqs[:3]  # tool_order_status's episode
    text = [tok.decode(s.token_ids) for s in order]
    assert text[0].startswith(tok.decode(turns.first_prompt("x", [
        {"type": "function", "function": {"name": n}}
        for n in ("find_order", "order_status", "cancel_order")]))[:60])
    assert "<tools>find_order,order_status,cancel_order</>" in text[0]
    # Each example's prefix is the previous example whole plus a tool turn; the loss
    # covers the reply only.
    for before, after in zip(order, order[1:], strict=False):
        assert after.token_ids[:len(before.token_ids)] == before.token_ids
        assert "<tool>find_order -> " in tok.decode(after.token_ids[len(before.token_ids):]) or \
            "<tool>order_status -> " in tok.decode(after.token_ids[len(before.token_ids):])
    for seq in order:
        target = tok.decode([t for t, m in zip(seq.token_ids, seq.loss_mask, strict=True) if m])
        assert target.startswith(("<tool_call>", "Your order is "))
