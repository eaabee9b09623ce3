"""A model behind the tool-use benchmarks' policy and user-simulator signatures.

    policy = model_tool_policy(model, tokenizer, sampler=SamplerConfig(max_new_tokens=1024,
                               temperature=0.6, top_p=0.95), seed=0)
    user = ModelUser(model, tokenizer, sampler=..., seed=1)            # tau2 (###STOP###)
    user = ModelUser(model, tokenizer, sampler=..., seed=1, stop_marker=acebench.FINISH)

`model_tool_policy` is a `common.Policy`: each call renders the conversation with the
tokenizer's chat template *with the offered tools* (wrapped into the
``{"type": "function", "function": {...}}`` form chat templates expect), samples one reply
with the training sampler (`spade_jax.rollout.sampler.sample`), drops the reasoning
(``<think>...</think>``) and reads the ``<tool_call>{json}</tool_call>`` blocks with the
project's one parser (`spade_jax.envs.tools.parse_reply`, also used by the agent loop). A
block that does not parse becomes a tool-call entry without a name, which the scorers'
`common.normalize_reply` turns into an INVALID call (the agent sees an error observation
with the call format); nothing raises. An unclosed ``<tool_call>`` counts as one such call.

Earlier assistant messages that the policy itself produced are rendered as the text the
model wrote (the scorers keep only the parsed calls, and an invalid call has no form a chat
template can render); other assistant messages are rendered from their valid calls.

`ModelUser` is a `common.UserSimulator`: the model plays the user from the task's
instructions. Its prompt is a system message (``system_prompt``, with ``{instructions}``
and ``{stop}`` filled in), the agent's usual greeting as the first "user" turn, then the
conversation with the roles swapped (the simulated user's own lines are the model's
"assistant" turns). Its reply ends at the stop marker when it writes one (matched
case-insensitively and written back in the benchmark's spelling), which ends the episode:
tau2 stops on ``###STOP###``, ACEBench on "finish conversation".

Seeding: call k of a policy (or of a user, first_message and respond counted together)
samples with seed ``derive_seed(seed, k)``, so the same model, inputs and call order give
the same run. One policy object serves a whole benchmark run; give each task a fresh user
(``users=lambda task: ModelUser(...)``) so a task's user draws do not depend on the tasks
played before it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from spade_jax.envs.tools import parse_reply
from spade_jax.evaluation.tool_benchmarks.common import Message, normalize_reply
from spade_jax.evaluation.tool_benchmarks.tau2 import STOP
from spade_jax.seeding import derive_seed

if TYPE_CHECKING:
    from spade_jax.rollout.sampler import SamplerConfig

# sample(model, prompts, config, *, stop_tokens=..., mesh=...) -> an object with .tokens
# (one token-id list per prompt): `spade_jax.rollout.sampler.sample` or a stand-in.
SampleFn = Callable[..., Any]

USER_SYSTEM_PROMPT = (
    "You are role-playing a user who is talking to an AI assistant. Write only the user's "
    "next message, in plain conversational words, one message at a time; never act as the "
    "assistant and never call tools.\n\n"
    "Your goal and everything you know are in the instructions below. Follow them and do "
    "not invent details they do not give. Do not state the whole request at once: give a "
    "detail when the assistant asks for it or when it is needed to move on.\n\n"
    "When your goal has been reached, or it clearly cannot be reached, reply with {stop} "
    "alone.\n\n"
    "Instructions:\n{instructions}"
)
# What the agent says before the user's first line (tau2's default greeting): the user
# model's prompt then opens with a turn to answer, like every later one.
USER_OPENING = "Hi! How can I help you today?"

_THINK = re.compile(r"<think>.*?</think>", re.S)
_ERROR_INDEX = re.compile(r"tool call (\d+)\b")


def strip_thinking(text: str) -> str:
    """The visible reply: ``<think>...</think>`` blocks removed, and everything up to a
    ``</think>`` whose opening tag was in the prompt; an unclosed ``<think>`` leaves no
    visible reply (""), as in the agent loop's action parser."""
    visible = _THINK.sub("", text)
    if "<think>" in visible:
        return ""
    if "</think>" in visible:
        visible = visible.rsplit("</think>", 1)[1]
    return visible.strip()


def function_tools(tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Benchmark schemas ``{"name", "description", "parameters"}`` in the chat-template
    form ``{"type": "function", "function": {...}}`` (ones already in it are kept)."""
    out = []
    for tool in tools:
        if tool.get("type") == "function" and isinstance(tool.get("function"), Mapping):
            out.append(dict(tool))
        else:
            out.append({"type": "function", "function": dict(tool)})
    return out


def _invalid_call(reason: str) -> dict[str, Any]:
    # No string "name": `common.normalize_reply` makes this an invalid call, which the
    # scorers record as INVALID (nothing runs) and answer with an error observation.
    return {"name": None, "arguments": None, "error": reason}


def parse_model_reply(text: str) -> dict[str, Any]:
    """A sampled reply -> the reply dict the scorers accept.

    ``{"content": text outside the calls, "tool_calls": [{"name", "arguments"} or an
    invalid entry, in the order the blocks were written], "errors": the parser's messages,
    "text": the visible reply, "raw": the decoded sample}`` (the scorers read the first
    two). Calls are read by `spade_jax.envs.tools.parse_reply` on the
    reply without its reasoning; each of its errors becomes one invalid entry."""
    visible = strip_thinking(text)
    calls, errors, content = parse_reply(visible)
    indexed: dict[int, str] = {}
    rest: list[str] = []
    for error in errors:
        match = _ERROR_INDEX.match(error)
        if match and int(match.group(1)) not in indexed:
            indexed[int(match.group(1))] = error
        else:
            rest.append(error)  # "an unclosed <tool_call>" (after every closed block)
    total = len(calls) + len(indexed)
    if all(i < total for i in indexed):
        pending = iter(calls)
        ordered = [_invalid_call(indexed[i]) if i in indexed else dict(next(pending))
                   for i in range(total)]
    else:  # an error message this reader does not know: keep them after the calls
        ordered = [dict(c) for c in calls] + [_invalid_call(e) for e in indexed.values()]
    ordered += [_invalid_call(e) for e in rest]
    return {"content": content, "tool_calls": ordered, "errors": list(errors), "text": visible,
            "raw": text}


def _reply_key(content: Any, calls: Any) -> str:
    return json.dumps(["" if content is None else content, calls], sort_keys=True, default=str)


class _Drawer:
    """Chat-template rendering and one seeded draw per call (shared by policy and user)."""

    def __init__(self, model: Any, tokenizer: Any, sampler: SamplerConfig, seed: int,
                 enable_thinking: bool, mesh: Any, sample_fn: SampleFn | None) -> None:
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TypeError(f"seed must be an int, got {seed!r}")
        if not hasattr(sampler, "max_new_tokens"):
            raise TypeError(f"sampler must be a spade_jax.rollout.SamplerConfig, got {sampler!r}")
        self.model, self.tokenizer, self.sampler = model, tokenizer, sampler
        self.seed, self.enable_thinking = seed, bool(enable_thinking)
        self.mesh, self.sample_fn = mesh, sample_fn
        self.calls = 0
        self.generated_tokens: list[int] = []  # per draw, the stop token included

    def prompt(self, messages: Sequence[Message],
               tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        kwargs = {"tools": function_tools(tools)} if tools else {}
        return [int(t) for t in self.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, enable_thinking=self.enable_thinking,
            **kwargs)]

    def draw(self, prompt: list[int]) -> str:
        sample = self.sample_fn
        if sample is None:
            from spade_jax.rollout import sampler as sampler_module

            sample = sampler_module.sample  # looked up per call (tests may patch it)
        config = dataclasses.replace(self.sampler, seed=derive_seed(self.seed, self.calls))
        self.calls += 1
        result = sample(self.model, [prompt], config,
                        stop_tokens=sorted(self.tokenizer.eos_ids), mesh=self.mesh)
        tokens = [int(t) for t in result.tokens[0]]
        self.generated_tokens.append(len(tokens))
        return self.tokenizer.decode(tokens, skip_special_tokens=True)


class ModelToolPolicy:
    """A `common.Policy` sampling a model (build it with `model_tool_policy`).

    ``calls``: replies sampled so far (call k used ``derive_seed(seed, k)``);
    ``generated_tokens``: tokens generated per call."""

    def __init__(self, model: Any, tokenizer: Any, *, sampler: SamplerConfig, seed: int,
                 enable_thinking: bool = False, mesh: Any = None,
                 sample_fn: SampleFn | None = None) -> None:
        self._drawer = _Drawer(model, tokenizer, sampler, seed, enable_thinking, mesh,
                               sample_fn)
        # (content, calls) of a reply this policy returned -> the text the model wrote.
        self._written: dict[str, str] = {}

    @property
    def calls(self) -> int:
        return self._drawer.calls

    @property
    def generated_tokens(self) -> list[int]:
        return self._drawer.generated_tokens

    def chat_messages(self, messages: Sequence[Message]) -> list[dict[str, Any]]:
        """The scorer's conversation in the form the chat template renders."""
        out = []
        for message in messages:
            message = dict(message)
            calls = message.get("tool_calls")
            if message.get("role") == "assistant" and calls:
                written = self._written.get(_reply_key(message.get("content"), calls))
                if written is not None:
                    out.append({"role": "assistant", "content": written})
                    continue
                valid = []
                for call in calls:
                    inner = call.get("function", call) if isinstance(call, Mapping) else None
                    if (isinstance(inner, Mapping) and "invalid" not in call
                            and isinstance(inner.get("name"), str)
                            and isinstance(inner.get("arguments", {}), Mapping | str)):
                        valid.append({"name": inner["name"],
                                      "arguments": inner.get("arguments", {})})
                message["tool_calls"] = valid
                if not valid:
                    del message["tool_calls"]
            if message.get("content") is None:
                message["content"] = ""
            out.append(message)
        return out

    def prompt(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]]
               ) -> list[int]:
        """The token ids the next call would sample from."""
        return self._drawer.prompt(self.chat_messages(messages), tools)

    def __call__(self, messages: list[Message], tools: list[dict[str, Any]]) -> dict[str, Any]:
        reply = parse_model_reply(self._drawer.draw(self.prompt(messages, tools)))
        seen = normalize_reply(reply)  # what the scorer will store in the conversation
        if seen.calls:
            self._written[_reply_key(seen.content, [dict(c) for c in seen.calls])] = reply["text"]
        return reply


def model_tool_policy(model: Any, tokenizer: Any, *, sampler: SamplerConfig, seed: int,
                      enable_thinking: bool = False, mesh: Any = None,
                      sample_fn: SampleFn | None = None) -> ModelToolPolicy:
    """A benchmark policy (``policy(messages, tools) -> reply``) backed by ``model``.

    ``sampler``: the `SamplerConfig` of every draw (its ``seed`` is replaced by
    ``derive_seed(seed, k)`` on call k); ``enable_thinking``: passed to the chat template's
    generation prompt (the reasoning is dropped from the reply either way); ``mesh``: run
    sharded (params already placed); ``sample_fn``: a stand-in for
    `spade_jax.rollout.sampler.sample` (tests, or another engine with that signature)."""
    return ModelToolPolicy(model, tokenizer, sampler=sampler, seed=seed,
                           enable_thinking=enable_thinking, mesh=mesh, sample_fn=sample_fn)


class ModelUser:
    """A `common.UserSimulator` played by a model (see the module docstring).

    ``system_prompt``: the user's instructions template; ``{instructions}`` (required) is
    replaced by the task's instructions and ``{stop}`` by ``stop_marker`` (tau2's
    ``###STOP###`` by default; ``acebench.FINISH`` for ACEBench). ``opening``: the agent
    greeting the prompt starts from. A reply is cut after the stop marker."""

    def __init__(self, model: Any, tokenizer: Any, *, sampler: SamplerConfig, seed: int,
                 system_prompt: str = USER_SYSTEM_PROMPT, stop_marker: str = STOP,
                 opening: str = USER_OPENING, enable_thinking: bool = False, mesh: Any = None,
                 sample_fn: SampleFn | None = None) -> None:
        if "{instructions}" not in system_prompt:
            raise ValueError("system_prompt must contain '{instructions}'")
        if not stop_marker:
            raise ValueError("stop_marker must be a non-empty string")
        self._drawer = _Drawer(model, tokenizer, sampler, seed, enable_thinking, mesh,
                               sample_fn)
        self.system_prompt, self.stop_marker, self.opening = system_prompt, stop_marker, opening
        self.instructions = ""

    @property
    def calls(self) -> int:
        return self._drawer.calls

    def chat_messages(self, history: Sequence[Message]) -> list[dict[str, str]]:
        """The user model's conversation: system prompt, the opening, then ``history`` (the
        user's view: its own lines as "user", the agent's replies as "assistant") with the
        roles swapped."""
        system = self.system_prompt.replace("{stop}", self.stop_marker).replace(
            "{instructions}", self.instructions)
        out = [{"role": "system", "content": system}, {"role": "user", "content": self.opening}]
        swap = {"user": "assistant", "assistant": "user"}
        for message in history:
            role = swap.get(message.get("role", ""))
            if role is not None:
                content = message.get("content")
                out.append({"role": role, "content": "" if content is None else str(content)})
        return out

    def _say(self, history: Sequence[Message]) -> str:
        text = strip_thinking(self._drawer.draw(self._drawer.prompt(self.chat_messages(history))))
        at = text.lower().find(self.stop_marker.lower())
        if at >= 0:
            text = text[:at] + self.stop_marker
        return text

    def first_message(self, instructions: str) -> str | None:
        self.instructions = str(instructions)
        return self._say([])

    def respond(self, history: list[Message]) -> str | None:
        return self._say(history)
