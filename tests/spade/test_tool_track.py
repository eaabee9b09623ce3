"""The tool track in the SPADE loop (issue 32 item 4), with a scripted policy: under
``spade.contract="tool"`` the designer is asked for tool environments, the hint writer for
tool hints, the written programs are validated as tool programs, and every episode (both
hint arms) carries its environment's tool list to the chat template; the tool agent's
actions reach the real sandboxed program (its check() gives the returns)."""

from __future__ import annotations

import json

import pytest
from byte_tokenizer import ByteTokenizer

from spade_jax.envs import EnvPool, SandboxConfig
from spade_jax.rollout.records import EpisodeRecord
from spade_jax.spade.config import SpadeConfig
from spade_jax.spade.loop import HintedEnv, SpadeLoop
from spade_jax.spade.memory import EnvironmentMemory, MemoryConfig
from spade_jax.spade.prompts import (
    COMPACT_TOOL_DESIGNER_SYSTEM_PROMPT,
    TOOL_HINT_WRITER_SYSTEM_PROMPT,
    format_program_reply,
    parse_designer_output,
    tool_designer_system_prompt,
)
from spade_jax.spade.reward import make_designer_reward
from spade_jax.spade.seed_programs import TOOL_SEED_PROGRAMS
from spade_jax.spade.skills import TOOL_SKILLS

ORDERS = next(p for p in TOOL_SEED_PROGRAMS if p.name == "tool_order_status")
STOCK = next(p for p in TOOL_SEED_PROGRAMS if p.name == "tool_stock_levels")
TOOL_HINT = "Look the id up first, then read its status; never cancel."


class ScriptedToolPolicy:
    """The designer replies with the tool seed programs (and one unterminated reply), the
    hint writer with TOOL_HINT; an episode calls ``find_order`` for its customer when the
    environment offers it, then answers."""

    def __init__(self, replies):
        self.replies, self.design_prompts, self.hint_prompts, self.plays = replies, [], [], []

    def generate(self, prompts, *, seed, purpose):
        tok = ByteTokenizer()
        if purpose == "hint":
            self.hint_prompts += [tok.decode(p) for p in prompts]
            outs = [TOOL_HINT] * len(prompts)
        else:
            start = len(self.design_prompts)
            self.design_prompts += [tok.decode(p) for p in prompts]
            outs = [self.replies[(start + i) % len(self.replies)] for i in range(len(prompts))]
        tokens = [tok.encode(t) for t in outs]
        return tokens, [[-1.0] * len(t) for t in tokens]

    def run_episodes(self, specs, *, seed):
        records = []
        for spec in specs:
            obs, _ = spec.env.reset(seed=spec.seed)
            names = [t["function"]["name"] for t in spec.tools]
            call = {"content": "", "errors": [], "tool_calls": [
                {"name": "find_order", "arguments": {"customer": obs.split(" ")[3].rstrip(".")}}]}
            result, *_ = spec.env.step(json.dumps(call)) if "find_order" in names else ("",)
            _, reward, terminated, _, _ = spec.env.step("I could not finish.")
            self.plays.append({"env_id": spec.env_id, "tools": names, "obs": obs,
                               "hinted": isinstance(spec.env, HintedEnv), "result": result,
                               "terminated": terminated})
            rec = EpisodeRecord(env_id=spec.env_id, seed=spec.seed, observations=[obs])
            rec.append([1, 2], policy=False)
            rec.append([3, 4], policy=True, logprobs=[-0.5, -0.5])
            rec.return_, rec.step_rewards = float(reward), [float(reward)]
            rec.turn_spans = [(2, 4)] * (1 + ("find_order" in names))  # one per step
            records.append(rec)
        return records

    def update(self, seqs):
        return {"loss": 0.0}


@pytest.fixture(scope="module")
def pool():
    with EnvPool(SandboxConfig(call_deadline_s=2.0)) as p:
        yield p


CONFIG = SpadeConfig(rounds=2, envs_per_round=3, regeneration_interval=2, plays_per_game=2,
                     hint_plays=1, designer_delay=1, contract="tool", skills="tool",
                     skills_per_window=3, hint_mode="self", use_corpus=False, eval_every=0,
                     max_design_attempts=2, probe_episodes=0, prompt_style="full")


@pytest.mark.slow  # sandboxed tool programs: validation and play (~15 s)
def test_a_tool_window_designs_validates_hints_and_plays_with_the_tool_lists(pool):
    cut = format_program_reply(STOCK.source)[:200]  # a reply cut before its block closes
    policy = ScriptedToolPolicy([format_program_reply(ORDERS.source), cut,
                                 format_program_reply(STOCK.source)])
    loop = SpadeLoop(CONFIG, tokenizer=ByteTokenizer(), pool=pool, generate=policy.generate,
                     run_episodes=policy.run_episodes, update=policy.update,
                     corpus_sampler=None, memory=EnvironmentMemory(MemoryConfig(seed=0)),
                     reward_rule=make_designer_reward("blend"), seed=0, max_turns=4)
    metrics = loop.run_step(0)

    # Designer: the tool system prompt and a tool request per slot, one slot per skill.
    first = policy.design_prompts[:3]
    assert all(p.startswith(f"<system>{tool_designer_system_prompt(4)}") for p in first)
    assert [p.split("trains the skill '")[1].split("'")[0] for p in first] == [
        s.name for s in TOOL_SKILLS[:3]]
    assert all("Design one new tool environment" in p for p in first)
    # The cut reply was resampled once (rejection sampling); all three games validated.
    assert len(policy.design_prompts) == 4 and metrics["valid_envs"] == 3
    assert metrics["invalid/parse_error/unterminated_program_block"] == 1
    # Hints: the tool hint writer read each program; the hint reaches the hinted arm only.
    assert len(policy.hint_prompts) == 3
    assert all(TOOL_HINT_WRITER_SYSTEM_PROMPT[:60] in p for p in policy.hint_prompts)
    assert all(TOOL_HINT in p["obs"] for p in policy.plays if p["hinted"])
    assert not any(TOOL_HINT in p["obs"] for p in policy.plays if not p["hinted"])

    # Every play, hinted or not, carries its program's tools; the calls reach the program.
    assert len(policy.plays) == 3 * (CONFIG.plays_per_game + CONFIG.hint_plays)
    for play in policy.plays:
        orders = play["tools"] == ["find_order", "order_status", "cancel_order"]
        assert orders or play["tools"] == ["get_stock", "adjust_stock", "write_off"]
        assert play["terminated"]  # a reply without a tool call is the final answer
        if orders:
            assert play["result"] and "error" not in play["result"], play
    assert {p["hinted"] for p in policy.plays} == {True, False}
    # Finding an order's id is not reading its status and the answer names no status;
    # no stock was adjusted: every play scores 0 under the programs' own checks.
    assert metrics["return_no_hint_mean"] == 0.0
    turns = [1 + ("find_order" in p["tools"]) for p in policy.plays]
    assert metrics["agent/turns_mean"] == pytest.approx(sum(turns) / len(turns))
    assert 1 < metrics["agent/turns_mean"] < 2  # both kinds of game were played


def test_tool_designer_prompts_follow_the_prompt_style():
    from spade_jax.spade.design import Designer

    compact = Designer(SpadeConfig(contract="tool", skills="tool", prompt_style="compact"),
                       tokenizer=ByteTokenizer(), pool=None, generate=None, corpus_sampler=None,
                       memory=EnvironmentMemory(MemoryConfig()), seed=0, max_turns=5)
    examples = [{"program": ORDERS.source, "hint": None, "regime": "frontier", "win_rate": 0.5,
                 "regret": 0.2, "build_on": True},
                {"program": STOCK.source, "hint": None, "regime": "mastered", "win_rate": 0.9,
                 "regret": 0.0, "build_on": False}]
    system, user = compact.messages("Data Retrieval", ["a text about libraries"], examples)
    assert system == {"role": "system", "content": COMPACT_TOOL_DESIGNER_SYSTEM_PROMPT}
    text = user["content"]
    assert "'Data Retrieval'" in text and "a text about libraries" in text
    assert ORDERS.source.strip() in text  # the frontier program to build on
    assert "too easy (agent win rate 0.90): tools get_stock, adjust_stock, write_off" in text
    assert STOCK.source.strip() not in text  # one to avoid is a line, not its code
    # The warm start's target reads back as the program alone.
    reply = parse_designer_output(format_program_reply(ORDERS.source), require_hint=False)
    assert reply.program == ORDERS.source


ORDERS_TOOLS = [{"type": "function", "function": {"name": n}}
                for n in ("find_order", "order_status", "cancel_order")]


def test_tool_lists_are_agreed_across_hosts(monkeypatch):
    """A host renders the first prompt of every episode, also of copies another host opened:
    each episode's tools come from whichever host holds its copy (an all-gather), the same
    on every host; a host with another episode count fails loudly."""
    from spade_jax import distributed
    from spade_jax.spade import agreement

    orders = tuple(ORDERS_TOOLS)
    stock = ({"type": "function", "function": {"name": "get_stock"}},)
    per_host = [[orders, None, None], [None, list(stock), None]]  # episode 2: a text env
    monkeypatch.setattr(agreement, "single_host", lambda: False)
    monkeypatch.setattr(distributed, "all_gather_json", lambda value: [
        [None if t is None else list(t) for t in host] for host in per_host])
    for mine in per_host:
        assert agreement.agree_tools(mine) == [orders, stock, None]
    with pytest.raises(RuntimeError, match="a host has 3 episodes where this one"):
        agreement.agree_tools([orders, None])

