"""The multi-turn agent loop on scripted environments: streams, masks, returns, log-probs."""

from __future__ import annotations

import json

import gymnasium
import jax
import numpy as np
import pytest
from flax import nnx

from spade_jax.rollout import SamplerConfig
from spade_jax.rollout.agent_loop import (
    ActionParser,
    AgentLoopConfig,
    ChatTurns,
    EpisodeSpec,
    run_episodes,
)

TEMPERATURE = 0.9
TURN_TOKENS = 6


class ScriptedEnv(gymnasium.Env):
    """Rewards and ending scripted per step; records the actions it was given."""

    def __init__(self, name: str, rewards: list[float], end: str | None):
        self.name, self.rewards, self.end = name, rewards, end
        self.actions: list[str] = []

    def reset(self, *, seed=None, options=None):
        self.t, self.actions = 0, []
        return f"{self.name} start seed {seed}", {}

    def step(self, action):
        self.actions.append(action)
        self.t += 1
        last = self.t == len(self.rewards)
        return (f"{self.name} obs {self.t}", self.rewards[self.t - 1],
                last and self.end == "terminated", last and self.end == "truncated", {})


@pytest.fixture
def tokenizer(chat_tokenizer):
    return chat_tokenizer  # conftest.py: shared with the envs tests


@pytest.fixture
def model(chat_model):
    return chat_model


def _chatml(role: str, content: str) -> str:
    return f"<|im_start|>{role}\n{content}<|im_end|>\n"


def test_chat_turn_pieces_match_chatml(tokenizer):
    turns = ChatTurns(tokenizer, "be brief", enable_thinking=True)
    assert turns.first_prompt("alpha obs 1") == tokenizer.encode(
        _chatml("system", "be brief") + _chatml("user", "alpha obs 1") + "<|im_start|>assistant\n")
    after = "\n" + _chatml("user", "beta 2") + "<|im_start|>assistant\n"
    assert turns.after_policy("beta 2", closed=True) == tokenizer.encode(after)
    assert turns.after_policy("beta 2", closed=False) == tokenizer.encode("<|im_end|>" + after)


def test_action_parser():
    assert ActionParser()("<think>plan</think> move left ") == ("move left", True)
    assert ActionParser()("<think>never closed") == ("", False)
    tagged = ActionParser(answer_tag="answer")
    assert tagged("<think>x</think>so <answer>1</answer> or <answer> 42 </answer>") == ("42", True)
    assert tagged("no tag here") == ("no tag here", False)


@pytest.mark.slow  # > 5 s quiet (fast-tier budget)
def test_multi_turn_episodes_record_streams_masks_and_returns(model, tokenizer):
    envs = {
        "alpha": ScriptedEnv("alpha", [0.25, 0.5], "terminated"),
        "beta": ScriptedEnv("beta", [1.0], "truncated"),
        "gamma": ScriptedEnv("gamma", [0.125] * 10, None),  # never ends: hits max_turns
    }
    specs = [EpisodeSpec(env, name, seed=seed) for seed, (name, env) in enumerate(envs.items())]
    config = AgentLoopConfig(
        max_turns=3, max_turn_tokens=TURN_TOKENS, enable_thinking=True,
        sampler=SamplerConfig(max_new_tokens=TURN_TOKENS, temperature=TEMPERATURE, seed=1,
                              prompt_bucket_min=128, compact_batch=False),
    )
    records = run_episodes(model, tokenizer, specs, config,
                           parser=ActionParser(answer_tag="answer"))

    expected = {"alpha": ([0.25, 0.5], "terminated", 2), "beta": ([1.0], "truncated", 1),
                "gamma": ([0.125] * 3, "max_turns", 3)}
    turns = ChatTurns(tokenizer, None, enable_thinking=True)
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda s, ids: nnx.merge(graphdef, s)(ids).logits)
    for rec, (name, env) in zip(records, envs.items(), strict=True):
        rewards, end_reason, n_turns = expected[name]
        assert (rec.env_id, rec.seed, rec.end_reason) == (name, specs[records.index(rec)].seed,
                                                         end_reason)
        assert rec.step_rewards == rewards and rec.return_ == sum(rewards)
        assert rec.observations == [f"{name} start seed {rec.seed}"] + [
            f"{name} obs {t}" for t in range(1, n_turns + 1)]
        assert env.actions == rec.actions and len(rec.turn_spans) == n_turns == rec.cost.turns
        # Rebuild the stream from its parts: template pieces between the policy spans.
        want = turns.first_prompt(rec.observations[0])
        mask = [0] * len(want)
        for t, (start, end) in enumerate(rec.turn_spans):
            assert start == len(want)
            policy = rec.token_ids[start:end]
            assert 1 <= len(policy) <= TURN_TOKENS
            want, mask = want + policy, mask + [1] * len(policy)
            if t + 1 < n_turns:
                closed = policy[-1] in turns.eos_ids
                assert closed == (rec.turn_done_reasons[t] == "eos")
                piece = turns.after_policy(rec.observations[t + 1], closed)
                want, mask = want + piece, mask + [0] * len(piece)
            text = tokenizer.decode(policy, skip_special_tokens=True)
            assert rec.actions[t] == ActionParser(answer_tag="answer")(text)[0]
        assert rec.token_ids == want and rec.loss_mask == mask
        assert rec.cost.tokens_generated == sum(mask)
        assert rec.cost.context_tokens == len(rec.token_ids)
        assert rec.cost.parse_failures == n_turns  # a random policy writes no <answer> tags
        assert rec.cost.env_seconds > 0
        # Every sampled log-prob is recomputed by one forward pass over the final stream:
        # the stream is exactly what the policy saw, turn after turn.
        arrays = rec.arrays()
        padded = np.zeros((1, 128), np.int32)  # one shape: one compile for all records
        padded[0, :len(want)] = arrays["token_ids"]
        logits = np.asarray(forward(state, padded)[0, :len(want)], np.float64) / TEMPERATURE
        logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
        lp = logits[np.arange(len(want) - 1), arrays["token_ids"][1:]] - logz[:-1]
        policy_pos = np.flatnonzero(arrays["loss_mask"])
        np.testing.assert_allclose(arrays["logprobs"][policy_pos], lp[policy_pos - 1], atol=1e-4)
        assert not arrays["logprobs"][arrays["loss_mask"] == 0].any()


def test_a_reply_cut_at_the_turn_cap_ends_the_episode_when_asked(model, tokenizer):
    """Issue 30 item 4: the recipe ends an episode whose reply hit the per-turn token cap
    without an end of turn (truncated, score 0) and never steps the game with it; by
    default the cut reply is played. The same seeds draw the same first turns both ways."""
    def play(end_on_cut_reply):
        envs = [ScriptedEnv(f"e{k}", [1.0], "terminated") for k in range(4)]
        config = AgentLoopConfig(
            max_turns=2, max_turn_tokens=TURN_TOKENS, enable_thinking=True,
            end_on_cut_reply=end_on_cut_reply,
            sampler=SamplerConfig(TURN_TOKENS, temperature=TEMPERATURE, seed=3,
                                  prompt_bucket_min=128, compact_batch=False))
        specs = [EpisodeSpec(env, env.name, seed=k) for k, env in enumerate(envs)]
        return envs, run_episodes(model, tokenizer, specs, config)

    envs, records = play(True)
    cut = [r for r in records if r.turn_done_reasons[0] == "max_tokens"]
    assert cut, "a random policy's 6-token replies should hit the cap"
    for env, rec in zip(envs, records, strict=True):
        if rec.turn_done_reasons[0] == "max_tokens":
            assert (rec.end_reason, rec.truncated, rec.return_) == ("cut_reply", True, 0.0)
            assert env.actions == [] and rec.step_rewards == [] and rec.cost.turns == 1
        else:
            assert rec.end_reason == "terminated" and rec.return_ == 1.0
    played_envs, played = play(False)
    for env, rec, first in zip(played_envs, played, records, strict=True):
        assert rec.token_ids[:first.turn_spans[0][1]] == first.token_ids[:first.turn_spans[0][1]]
        assert env.actions and rec.end_reason == "terminated" and rec.return_ == 1.0


class ScriptedReplies:
    """Stands in for the ``SlotEngine`` (patched into ``agent_loop``): turn t of episode i,
    known by its seed ``derive_seed(base, i, t)``, answers as ``script[i][t]`` says: "eos"
    a closed reply (two words, then the end of turn), "cut" the turn's whole token budget
    without an end of turn. No model, no compile: the scheduler's handling of each is
    what runs."""

    def __init__(self, tokenizer, script: list[list[str]], base_seed: int):
        from spade_jax.seeding import derive_seed

        self.word, self.eos = tokenizer.encode("alpha")[0], sorted(tokenizer.eos_ids)[0]
        self.kind = {derive_seed(base_seed, i, t): kind
                     for i, kinds in enumerate(script) for t, kind in enumerate(kinds)}
        self.running, self.done, self.stats = {}, [], {}

    def __call__(self, model, num_slots, config, **kwargs):  # the engine's constructor
        self.num_slots = num_slots
        return self

    @property
    def generating(self) -> bool:
        return bool(self.running)

    def ensure_cache(self, length: int) -> None:
        pass

    def admit(self, requests) -> None:
        self.running.update({r.slot: r for r in requests})

    def decode(self, steps: int) -> None:
        from spade_jax.rollout.engine import Finished

        for slot, request in self.running.items():
            closed = self.kind[request.seed] == "eos"
            tokens = [self.word] * 2 + [self.eos] if closed else [self.word] * request.limit
            self.done.append(Finished(slot, tokens, [-1.0] * len(tokens),
                                      "eos" if closed else "max_tokens"))
        self.running = {}

    def finished(self):
        done, self.done = self.done, []
        return done


@pytest.mark.parametrize("end_on_cut_reply", [True, False], ids=["ends", "plays"])
def test_a_cut_reply_after_a_rewarded_turn_scores_0(tokenizer, monkeypatch, end_on_cut_reply):
    """Issue 30 item 4, the rest of the recipe's rule: the episode of a cut reply scores 0
    even when an earlier step paid (the recipe scores an episode that did not terminate 0),
    the cut reply is never sent, and its tokens stay in the record, trained (loss mask 1,
    as the recipe keeps them). By default the same script plays on to the game's end."""
    from spade_jax.rollout import agent_loop

    script = [["eos", "cut", "eos"], ["cut", "eos", "eos"], ["eos", "eos", "eos"]]
    engine = ScriptedReplies(tokenizer, script, base_seed=3)
    monkeypatch.setattr(agent_loop, "SlotEngine", engine)
    envs = [ScriptedEnv(f"e{k}", [0.5, 1.0], "terminated") for k in range(3)]
    config = AgentLoopConfig(max_turns=3, max_turn_tokens=TURN_TOKENS,
                             end_on_cut_reply=end_on_cut_reply)
    specs = [EpisodeSpec(env, env.name, seed=k) for k, env in enumerate(envs)]
    records = run_episodes(None, tokenizer, specs, config, seed=3)
    for rec, env, kinds in zip(records, envs, script, strict=True):
        assert rec.turn_done_reasons == ["eos" if k == "eos" else "max_tokens"
                                         for k in kinds[:rec.cost.turns]]
        if end_on_cut_reply and "cut" in kinds[:2]:
            cut = kinds.index("cut")
            assert (rec.end_reason, rec.truncated, rec.terminated) == ("cut_reply", True, False)
            assert rec.return_ == 0.0 and rec.step_rewards == [0.5] * cut
            assert rec.cost.turns == cut + 1 and len(env.actions) == cut
            assert env.actions == rec.actions[:cut]
            start, end = rec.turn_spans[-1]  # the cut reply closes the record, trained
            assert end == len(rec.token_ids) and end - start == TURN_TOKENS
            assert rec.loss_mask[start:] == [1] * TURN_TOKENS
            assert rec.logprobs[start:] == [-1.0] * TURN_TOKENS
        else:
            assert (rec.end_reason, rec.return_, rec.step_rewards) == ("terminated", 1.5,
                                                                       [0.5, 1.0])
            assert env.actions == rec.actions and rec.cost.turns == 2


def test_env_errors_end_the_episode(model, tokenizer):
    class Broken(ScriptedEnv):
        def step(self, action):
            raise RuntimeError("boom")

    class LimitBroken(Exception):  # what the sandbox raises for a broken run-time limit
        end_reason = "env_limit"

    class Limited(ScriptedEnv):
        def step(self, action):
            raise LimitBroken("slow_call: the call used 2.1 s of CPU time")

    config = AgentLoopConfig(max_turns=2, max_turn_tokens=TURN_TOKENS, enable_thinking=True,
                             sampler=SamplerConfig(TURN_TOKENS, temperature=TEMPERATURE,
                                                   prompt_bucket_min=128, compact_batch=False))
    class Answered(ScriptedEnv):  # the sandbox's play wrapper answered a game's error
        def step(self, action):
            return "Error: boom", -1.0, True, False, {"program_error": True}

    specs = [EpisodeSpec(Broken("alpha", [1.0], None), "b", 0),
             EpisodeSpec(Limited("beta", [1.0], None), "l", 1),
             EpisodeSpec(Answered("gamma", [1.0], None), "a", 2)]
    broken, limited, answered = run_episodes(model, tokenizer, specs, config)
    assert broken.end_reason == "env_error" and broken.step_rewards == []
    assert broken.cost.turns == 1
    assert limited.end_reason == "env_limit" and limited.step_rewards == []
    # Issue 30 item 3: the agent saw the error and scored -1; the episode is over.
    assert (answered.end_reason, answered.step_rewards, answered.return_) == (
        "program_error", [-1.0], -1.0)
    assert answered.observations[-1] == "Error: boom" and answered.cost.turns == 1
    assert all(rec.cost.env_seconds > 0 for rec in (broken, limited, answered))
    with pytest.raises(ValueError, match="max_turns"):
        AgentLoopConfig(max_turns=0)


@pytest.mark.slow  # > 5 s quiet (fast-tier budget)
def test_env_steps_overlap_decoding_of_other_episodes(model, tokenizer, monkeypatch):
    """No per-turn barrier: while episode 1's env step is out, episode 0 keeps taking turns,
    so decode calls run during episode 1's steps. Checked on the schedule itself (which
    episodes' steps are out at each decode call), not on the clock: the schedule depends on
    no timing (the next test), so neither does this."""
    from spade_jax.rollout import agent_loop

    schedulers = []
    real_init = agent_loop._Scheduler.__init__

    def tracked(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        schedulers.append(self)

    stepping_at_decode: list[frozenset[int]] = []
    real_decode = agent_loop.SlotEngine.decode

    def counted(self, steps):
        stepping_at_decode.append(frozenset(schedulers[-1].stepping))
        return real_decode(self, steps)

    monkeypatch.setattr(agent_loop._Scheduler, "__init__", tracked)
    monkeypatch.setattr(agent_loop.SlotEngine, "decode", counted)
    config = AgentLoopConfig(max_turns=3, max_turn_tokens=TURN_TOKENS, enable_thinking=True,
                             sampler=SamplerConfig(TURN_TOKENS, temperature=TEMPERATURE,
                                                   chunk_steps=2))
    specs = [EpisodeSpec(ScriptedEnv("alpha", [0.0] * 3, None), "alpha", 0),
             EpisodeSpec(ScriptedEnv("beta", [0.0] * 3, None), "beta", 1)]
    records = run_episodes(model, tokenizer, specs, config)
    assert [r.cost.turns for r in records] == [3, 3]
    assert any(1 in out for out in stepping_at_decode), stepping_at_decode
    assert any(0 in out for out in stepping_at_decode), stepping_at_decode


@pytest.mark.slow  # ~5 s: two runs with slow envs
def test_env_timing_does_not_change_the_schedule(model, tokenizer, monkeypatch):
    """The same episodes form the same engine batches whichever env answers first: with
    default numerics a row's log-probs depend on who shares its batch, so a schedule that
    followed env timing made two runs of one command differ (the kill-9 resume test saw
    it). Two runs whose slow env is a different episode admit the same slots in the same
    calls and give bit-identical records."""
    import time

    from spade_jax.rollout import agent_loop

    admitted: list[list[tuple[int, bool]]] = []
    real_admit = agent_loop.SlotEngine.admit

    def logged(self, requests):
        if requests:
            admitted.append([(r.slot, r.fresh) for r in requests])
        return real_admit(self, requests)

    monkeypatch.setattr(agent_loop.SlotEngine, "admit", logged)

    class Delayed(ScriptedEnv):
        def __init__(self, name, delay):
            super().__init__(name, [0.0] * 3, None)
            self.delay = delay

        def step(self, action):
            time.sleep(self.delay)
            return super().step(action)

    config = AgentLoopConfig(max_turns=3, max_turn_tokens=TURN_TOKENS, enable_thinking=True,
                             sampler=SamplerConfig(TURN_TOKENS, temperature=TEMPERATURE,
                                                   chunk_steps=2))

    def run(slow: int):
        admitted.clear()
        specs = [EpisodeSpec(Delayed(name, 0.4 if i == slow else 0.0), name, i)
                 for i, name in enumerate(["alpha", "beta", "gamma"])]
        records = run_episodes(model, tokenizer, specs, config, seed=11)
        return list(admitted), [(r.token_ids, r.logprobs, r.turn_spans) for r in records]

    schedule_a, records_a = run(slow=0)
    schedule_b, records_b = run(slow=2)
    assert schedule_a == schedule_b
    assert records_a == records_b


@pytest.mark.slow  # over 5 s with a cold compile cache (fast tier < 5 min)
def test_sampling_noise_is_keyed_by_the_batch_seed_episode_and_turn(model, tokenizer):
    """Issue 16.3 / 18.3: turn t of episode i draws with derive_seed(seed, i, t). The loop
    passes one seed per (step, phase, batch), so two steps' batches of the same episodes
    draw different noise, and the same seed replays a batch exactly."""
    from spade_jax.seeding import Phase, derive_seed

    config = AgentLoopConfig(max_turns=2, max_turn_tokens=TURN_TOKENS, enable_thinking=True,
                             sampler=SamplerConfig(TURN_TOKENS, temperature=TEMPERATURE, seed=5,
                                                   prompt_bucket_min=128, compact_batch=False))

    def batch(seed):
        specs = [EpisodeSpec(ScriptedEnv(n, [0.0, 1.0], "terminated"), n, 7)
                 for n in ("alpha", "beta", "gamma")]
        return run_episodes(model, tokenizer, specs, config, seed=seed)

    step_seeds = [derive_seed(0, step, Phase.AGENT, 0) for step in range(2)]
    step0, step1, step0_again = batch(step_seeds[0]), batch(step_seeds[1]), batch(step_seeds[0])
    for records, base in ((step0, step_seeds[0]), (step1, step_seeds[1])):
        assert [r.sampler_seeds for r in records] == [
            [derive_seed(base, i, t) for t in range(2)] for i in range(3)]
    # Same seed: the same records (log-probs to float rounding: which rows shared a batch
    # depends on when env results arrived; bit for bit with a batch-invariant model);
    # another step's seed: other tokens on every episode.
    for a, b in zip(step0, step0_again, strict=True):
        assert (a.token_ids, a.actions) == (b.token_ids, b.actions)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-5)
    assert all(a.token_ids != b.token_ids for a, b in zip(step0, step1, strict=True))
    # No seed: the config's seed is the base.
    default = batch(None)
    assert default[0].sampler_seeds == [derive_seed(5, 0, 0), derive_seed(5, 0, 1)]
    assert len(set(default[0].sampler_seeds + default[1].sampler_seeds)) == 4


# ---- native tool calls (issue 32) --------------------------------------------------------

ROBOT_TOOLS = (
    {"type": "function", "function": {
        "name": "move", "description": "Move one cell.",
        "parameters": {"type": "object", "properties": {"direction": {"type": "string"}},
                       "required": ["direction"]}}},
)


def test_tool_calls_are_parsed_and_malformed_ones_are_errors():
    from spade_jax.rollout.agent_loop import parse_tool_calls

    text = ('Moving.\n<tool_call>\n{"name": "move", "arguments": {"direction": "north"}}\n'
            '</tool_call>\n<tool_call>{"name": "look"}</tool_call>'
            '<tool_call>{"name": "move", "arguments": "{\\"direction\\": \\"east\\"}"}</tool_call>'
            '<tool_call>{"name": "move", "arguments": [1]}</tool_call>'
            '<tool_call>{not json}</tool_call><tool_call>["no name"]</tool_call> done')
    calls, errors, outside = parse_tool_calls(text)
    assert calls == [{"name": "move", "arguments": {"direction": "north"}},
                     {"name": "look", "arguments": {}},
                     {"name": "move", "arguments": {"direction": "east"}}]
    assert len(errors) == 3 and "tool call 3 (move)" in errors[0]
    assert "tool call 4: not JSON" in errors[1] and "string 'name'" in errors[2]
    assert outside == "Moving.\n\n done"
    assert parse_tool_calls("<tool_call>{\"name\": \"x\"}")[1] == ["an unclosed <tool_call>"]
    action, ok = ActionParser(action_format="tool_call")(
        '<think>plan</think><tool_call>{"name": "move", "arguments": {"d": 1}}</tool_call>')
    assert ok and json.loads(action) == {"content": "", "errors": [],
                                         "tool_calls": [{"name": "move", "arguments": {"d": 1}}]}
    action, ok = ActionParser(action_format="tool_call")("<tool_call>oops</tool_call>")
    assert not ok and json.loads(action)["errors"]


@pytest.mark.slow  # a sampler compile
def test_tool_episodes_render_tools_first_and_observations_as_tool_turns(model, tokenizer):
    """The first prompt carries the env's tools (the template's tools turn); every later
    observation comes back as a tool response, not a user turn; the stream stays one
    append-only sequence (each turn adds tokens), equal to the template's rendering of the
    same conversation with tools."""
    env = ScriptedEnv("robot", [0.0, 1.0], "terminated")
    config = AgentLoopConfig(max_turns=2, max_turn_tokens=TURN_TOKENS, enable_thinking=False,
                             action_format="tool_call", observation_role="tool",
                             sampler=SamplerConfig(TURN_TOKENS, temperature=TEMPERATURE, seed=4,
                                                   prompt_bucket_min=128, compact_batch=False))
    rec, = run_episodes(model, tokenizer, [EpisodeSpec(env, "robot", 0, tools=ROBOT_TOOLS)],
                        config)
    assert rec.cost.turns == 2 and rec.end_reason == "terminated"
    first = tokenizer.apply_chat_template(
        [{"role": "user", "content": rec.observations[0]}], add_generation_prompt=True,
        enable_thinking=False, tools=list(ROBOT_TOOLS))
    assert rec.token_ids[:len(first)] == first
    assert '"name": "move"' in tokenizer.decode(first)
    start, end = rec.turn_spans[0]
    between = tokenizer.decode(rec.token_ids[end:rec.turn_spans[1][0]])
    assert f"<tool_response>\n{rec.observations[1]}\n</tool_response>" in between
    assert "<|im_start|>user\n<tool_response>" in between
    for action in env.actions:  # the env receives the structured reply
        assert set(json.loads(action)) == {"content", "tool_calls", "errors"}
    with pytest.raises(ValueError, match="observation_role"):
        AgentLoopConfig(observation_role="system")
