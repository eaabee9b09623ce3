"""Multi-turn agent loop: many gymnasium text environments driven by one batched policy.

    records = run_episodes(model, tokenizer, [EpisodeSpec(env, "maze", seed=3), ...],
                           AgentLoopConfig(max_turns=6))

Per turn: the episode's token stream (chat-template rendered) is the prompt; the jitted
sampler generates the assistant turn; the parser turns its text into an action;
``env.step(action)`` runs; the observation becomes the next user turn. Episodes end when the
env terminates/truncates or a turn / token budget is hit. Different episodes may run
different environment programs in one batch.

Engine (``rollout.engine``): a fixed number of decode slots; an episode takes a slot for its
life, and its KV cache stays there from turn to turn, so a turn prefills only the tokens
added since the last one (the end of the previous turn, the observation, the template
pieces). There is no per-turn barrier: a row whose turn ends hands its action to an env
thread at once (sandboxed envs wait on worker processes; in-process envs run Python while
JAX releases the GIL during compute) while the other slots keep decoding, and its next turn
is prefilled into its slot as soon as the env result is in. A new episode takes the slot of
one that ended. Turn t of episode i draws with ``derive_seed(seed, i, t)``, so records do
not depend on the slot count, arrival order or batch composition.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import heapq
import json
import re
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx

from spade_jax import distributed, preemption
from spade_jax.envs import tools
from spade_jax.rollout.engine import Finished, Request, SlotEngine
from spade_jax.rollout.records import EndReason, EpisodeRecord
from spade_jax.rollout.sampler import SamplerConfig
from spade_jax.seeding import derive_seed

_PROBE_USER, _PROBE_ASSISTANT = "x", "y"
ACTION_FORMATS = ("text", "boxed", "tool_call")
# The role an observation is fed back in: a user turn, or a tool response (tool calling).
OBSERVATION_ROLES = ("user", "tool")
_BOX = "\\boxed"


@dataclasses.dataclass(frozen=True)
class AgentLoopConfig:
    """Settings of a batch of multi-turn episodes.

    Attributes:
      max_turns: policy turns per episode at most (then end_reason "max_turns").
      max_turn_tokens: new tokens per policy turn at most.
      max_episode_tokens: length of an episode's token stream at most (then "max_tokens"):
        a turn is cut at the budget, and an observation that would leave no room for a
        policy token ends the episode before it is appended, so a record with a policy
        token never exceeds it (a budget equal to the largest pack bucket packs).
      system_prompt: optional system turn before the first observation.
      enable_thinking: passed to the chat template's generation prompt.
      sampler: temperature / top-p / top-k / buckets; its max_new_tokens is replaced by the
        per-turn budget, and its seed is the base of the batch's sampler calls when
        ``run_episodes`` gets no ``seed`` (call i draws with ``derive_seed(base, i)``).
      env_threads: host threads stepping environments.
      decode_slots: decode slots of the engine (0 = one per episode). Fewer slots bound
        the KV cache; an episode waits for a free slot (one whose episode ended).
      action_format: how the default `ActionParser` reads a reply: "text" (the visible
        reply) or "boxed" (the content of the last ``\\boxed{...}``, sent re-wrapped as
        ``\\boxed{...}``, as the recipe's games expect).
      first_turn_template: the first user turn; "{observation}" is replaced by the first
        observation (hint included), literally, so braces elsewhere need no escaping. Later
        turns are the bare observation.
      observation_role: "user" (an observation is the next user turn) or "tool" (a tool
        response, as Qwen3's native tool calling expects; use with action_format
        "tool_call" and EpisodeSpec.tools).
      end_on_cut_reply: a reply cut at ``max_turn_tokens`` (no end of turn) ends the
        episode (end_reason "cut_reply", truncated, return 0) without stepping the env, as
        the recipe does; False: the cut reply is parsed and played like any other.
    """

    max_turns: int = 8
    max_turn_tokens: int = 256
    max_episode_tokens: int = 4096
    system_prompt: str | None = None
    enable_thinking: bool = False
    sampler: SamplerConfig = dataclasses.field(
        default_factory=lambda: SamplerConfig(max_new_tokens=256, temperature=1.0))
    env_threads: int = 8
    action_format: str = "text"
    first_turn_template: str = "{observation}"
    decode_slots: int = 0
    end_on_cut_reply: bool = False
    observation_role: str = "user"

    def __post_init__(self):
        if self.observation_role not in OBSERVATION_ROLES:
            raise ValueError(f"observation_role must be one of {OBSERVATION_ROLES}, got "
                             f"{self.observation_role!r}")
        if self.decode_slots < 0:
            raise ValueError(f"decode_slots must be >= 0 (0 = one per episode), "
                             f"got {self.decode_slots}")
        for name in ("max_turns", "max_turn_tokens", "max_episode_tokens", "env_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.action_format not in ACTION_FORMATS:
            raise ValueError(
                f"action_format must be one of {ACTION_FORMATS}, got {self.action_format!r}"
            )
        if "{observation}" not in self.first_turn_template:
            raise ValueError("first_turn_template must contain the placeholder {observation}")


@dataclasses.dataclass(frozen=True)
class EpisodeSpec:
    """One episode to run: a gymnasium text env (``reset(seed=)``, ``step(str)``).
    ``tools``: the JSON schemas of the functions the env exposes (tool calling), rendered
    into the first prompt by the chat template; None for a plain text env."""

    env: Any
    env_id: str
    seed: int
    tools: tuple[dict[str, Any], ...] | None = None


@dataclasses.dataclass(frozen=True)
class ActionParser:
    """Default action parser: the assistant text with ``<think>...</think>`` removed
    (an unclosed ``<think>`` means no visible answer), then, by ``action_format``:

    - "text": the visible text, or with ``answer_tag`` the content of the last
      ``<answer>...</answer>`` block;
    - "tool_call": every ``<tool_call>{json}</tool_call>`` of the visible text
      (:func:`parse_tool_calls`), sent as one JSON object ``{"content": the text outside the
      calls, "tool_calls": [{"name", "arguments"}, ...], "errors": [...]}`` (a malformed
      call is an error the environment sees, and a parse failure);
    - "boxed": the content of the last complete ``\\boxed{...}`` of the visible text
      (braces nest; one redundant pair of outer braces, as in ``\\boxed{{42}}``, is
      dropped, twice at most), re-wrapped as ``\\boxed{content}``. The recipe takes the
      first box, which loses when a reply quotes the format before answering.

    Returns (action, ok). Not ok counts a parse failure, and the env is stepped with the
    visible text anyway (stripped; for "boxed" this is what the recipe sends when a reply
    has no box or an empty one), so the game can answer with a format reminder.
    """

    answer_tag: str | None = None
    action_format: str = "text"

    def __post_init__(self):
        if self.action_format not in ACTION_FORMATS:
            raise ValueError(
                f"action_format must be one of {ACTION_FORMATS}, got {self.action_format!r}"
            )

    def __call__(self, text: str) -> tuple[str, bool]:
        visible = re.sub(r"<think>.*?</think>", "", text, flags=re.S)
        if "<think>" in visible:
            return "", False
        visible = visible.strip()
        if self.action_format == "tool_call":
            calls, errors, content = parse_tool_calls(visible)
            action = json.dumps({"content": content, "tool_calls": calls, "errors": errors},
                                ensure_ascii=False)
            return action, not errors
        if self.action_format == "boxed":
            content = last_boxed(visible)
            return (f"{_BOX}{{{content}}}", True) if content else (visible, False)
        if self.answer_tag is None:
            return visible, bool(visible)
        tag = re.escape(self.answer_tag)
        found = re.findall(rf"<{tag}>(.*?)</{tag}>", visible, flags=re.S)
        return (found[-1].strip(), True) if found else (visible, False)


def parse_tool_calls(text: str) -> tuple[list[dict[str, Any]], list[str], str]:
    """Qwen3's native tool calls in a reply: (calls, errors, the text outside them). Each
    ``<tool_call>...</tool_call>`` must hold one JSON object with a string "name" and an
    object "arguments" (absent = {}; a JSON string holding an object is accepted); one that
    does not is an error naming the call and the problem, not a call. An unclosed
    ``<tool_call>`` is an error too. The sandbox's tool contract reads replies with the
    same function (`spade_jax.envs.tools.parse_reply`)."""
    return tools.parse_reply(text)


def last_boxed(text: str) -> str | None:
    """The stripped content of the last complete ``\\boxed{...}`` in `text`, or None.

    One linear pass with a brace stack: a box nested in a complete box belongs to the
    outer one's content; an unclosed box is ignored (a complete box inside it still
    counts). Up to two redundant outer brace pairs of the content are dropped.
    """
    stack: list[bool] = []  # one entry per open brace: does it open a box?
    starts: list[int] = []  # content start of each open brace
    best: tuple[int, int] | None = None  # (content start, closing brace) of the last box
    i, n = 0, len(text)
    while i < n:
        if text.startswith(_BOX, i):
            j = i + len(_BOX)
            while j < n and text[j] in " \t":
                j += 1
            if j < n and text[j] == "{":
                stack.append(True)
                starts.append(j + 1)
                i = j + 1
                continue
        char = text[i]
        if char == "{":
            stack.append(False)
            starts.append(i + 1)
        elif char == "}" and stack:
            is_box, start = stack.pop(), starts.pop()
            if is_box:  # closes after every earlier box: a later one, or one enclosing them
                best = (start, i)
        i += 1
    if best is None:
        return None
    return _unwrap(text[best[0]:best[1]].strip())


def _unwrap(content: str) -> str:
    for _ in range(2):
        if len(content) < 2 or content[0] != "{" or _closing_brace(content) != len(content) - 1:
            break  # no outer pair, or "{a}{b}": the first brace closes before the end
        content = content[1:-1].strip()
    return content


def _closing_brace(text: str) -> int:
    """Index of the brace that closes the one at text[0] (-1 if it never closes)."""
    depth = 0
    for index, char in enumerate(text):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth == 0:
            return index
    return -1


class ChatTurns:
    """Token pieces of a chat-templated conversation, derived from the template itself.

    ``first_prompt(obs)`` is the rendered opening (system?, user obs, generation prompt).
    ``after_policy(obs, closed)`` is what follows a policy turn: the assistant turn's end
    (its end-of-turn token only if the policy did not emit it, ``closed=False``), the user
    turn holding ``obs`` and the next generation prompt. It is read off the template's
    rendering of a probe conversation, so the stream equals what the template produces
    for the same turns (up to the policy's own tokens).
    """

    def __init__(self, tokenizer, system_prompt: str | None, enable_thinking: bool,
                 first_turn_template: str = "{observation}", observation_role: str = "user"):
        self.tokenizer, self.enable_thinking = tokenizer, enable_thinking
        self.first_turn_template = first_turn_template
        self.observation_role = observation_role
        self.head = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
        self.eos_ids = set(tokenizer.eos_ids)

    def _render(self, messages, generation_prompt: bool, tools=None) -> list[int]:
        kwargs = {} if tools is None else {"tools": list(tools)}  # plain tokenizers too
        return list(self.tokenizer.apply_chat_template(
            self.head + messages, add_generation_prompt=generation_prompt,
            enable_thinking=self.enable_thinking, **kwargs))

    def first_prompt(self, observation: str, tools=None) -> list[int]:
        """The opening; with ``tools`` (the env's function schemas) the template renders
        them first (a tools system turn)."""
        content = self.first_turn_template.replace("{observation}", observation)
        return self._render([{"role": "user", "content": content}], True, tools)

    def after_policy(self, observation: str, closed: bool) -> list[int]:
        """After a policy turn: its end, ``observation`` as a user turn (or, with
        ``observation_role="tool"``, a tool response), the next generation prompt."""
        probe = [{"role": "user", "content": _PROBE_USER}]
        base = self._render(probe, False)
        full = self._render(probe + [{"role": "assistant", "content": _PROBE_ASSISTANT},
                                     {"role": self.observation_role, "content": observation}],
                            True)
        if full[: len(base)] != base:
            raise ValueError("chat template is not prefix-stable; cannot build turn pieces")
        tail = full[len(base):]
        close = next((i for i, t in enumerate(tail) if t in self.eos_ids), None)
        if close is None:
            raise ValueError("chat template closes assistant turns without an eos token")
        return tail[close + 1:] if closed else tail[close:]


@dataclasses.dataclass
class _Episode:
    spec: EpisodeSpec
    record: EpisodeRecord
    active: bool = True
    pending_action: str | None = None


class EnvReply(NamedTuple):
    """What one env call produced, as plain JSON values, so the host that stepped an
    episode can send it to the others (a list on the wire, rebuilt with `from_wire`)."""

    observation: str | None  # None when the call failed
    reward: float
    terminated: bool
    truncated: bool
    end_reason: EndReason | None  # the failed call's (or PROGRAM_ERROR's) end, else None
    seconds: float

    @classmethod
    def from_wire(cls, values: Sequence[Any]) -> EnvReply:
        observation, reward, terminated, truncated, reason, seconds = values
        return cls(observation, reward, terminated, truncated,
                   None if reason is None else EndReason(reason), seconds)


# The end of an episode the sandbox's play wrapper ended on the game's own error, and the
# info key the wrapper marks that step with (envs.worker.PROGRAM_ERROR_KEY).
PROGRAM_ERROR = EndReason.PROGRAM_ERROR
_PROGRAM_ERROR_KEY = "program_error"


def _failure(err: Exception) -> EndReason:
    """The end reason of an episode whose env call raised: the exception's own
    ``end_reason`` when it names one (the sandbox's "env_limit": the program broke a
    run-time limit and is blocklisted), else ENV_ERROR."""
    reason = getattr(err, "end_reason", None)
    return EndReason.ENV_LIMIT if reason == EndReason.ENV_LIMIT else EndReason.ENV_ERROR


def _reset(ep: _Episode) -> EnvReply:
    t0 = time.perf_counter()
    try:
        observation, _ = ep.spec.env.reset(seed=ep.spec.seed)
        return EnvReply(str(observation), 0.0, False, False, None, time.perf_counter() - t0)
    except Exception as err:  # an env program may fail anywhere; the episode ends
        return EnvReply(None, 0.0, False, False, _failure(err), time.perf_counter() - t0)


def _step(ep: _Episode) -> EnvReply:
    t0 = time.perf_counter()
    try:
        observation, reward, terminated, truncated, info = ep.spec.env.step(ep.pending_action)
        # The sandbox's play wrapper answered a game's own error (SandboxConfig.
        # lenient_play_steps): a played step, which ends the episode as PROGRAM_ERROR.
        ended = PROGRAM_ERROR if isinstance(info, dict) and info.get(_PROGRAM_ERROR_KEY) else None
        return EnvReply(str(observation), float(reward), bool(terminated), bool(truncated),
                        ended, time.perf_counter() - t0)
    except Exception as err:  # recorded as env_error (or env_limit) when absorbed
        return EnvReply(None, 0.0, False, False, _failure(err), time.perf_counter() - t0)


def episode_owner(index: int, count: int, processes: int) -> int:
    """The process that steps episode ``index`` of a batch of ``count`` on a job of
    ``processes`` hosts: contiguous blocks in batch order (host 0 the first
    ``count / processes``), the way the sampler's first batch rows lie over the hosts."""
    if not 0 <= index < count:
        raise ValueError(f"episode index {index} outside a batch of {count}")
    return index * processes // count


def owns_episode(index: int, count: int) -> bool:
    """Whether this process steps episode ``index`` of a batch of ``count`` (always, on
    one host). A caller that opens environments itself can open only these and pass
    ``env=None`` for the rest: :func:`run_episodes` never touches another host's envs."""
    return episode_owner(index, count, jax.process_count()) == jax.process_index()


class _EnvShard:
    """Which episodes this host steps, and the exchange that gives every host the outcome
    of every episode. One process: all of them, no communication. Several: each episode
    is reset and stepped by its owner only (on that host's CPUs and sandbox pool), and
    each turn's outcomes are all-gathered, so all hosts absorb the same observations,
    rewards and endings (an env deadline hit on one host cannot make token streams drift:
    that host's outcome is everyone's) and build the same records."""

    def __init__(self, count: int):
        self.processes, self.count = jax.process_count(), count

    def mine(self, indexed: Sequence[tuple[int, _Episode]]) -> list[tuple[int, _Episode]]:
        return [(i, ep) for i, ep in indexed if owns_episode(i, self.count)]

    def exchange(self, outcomes: dict[int, EnvReply]) -> dict[int, EnvReply]:
        """Every host's outcomes merged (a collective: every host calls it at the same
        point of the loop, with its own, possibly empty, share)."""
        if self.processes == 1:
            return outcomes
        merged: dict[int, EnvReply] = {}
        for part in distributed.all_gather_json({str(i): list(o) for i, o in outcomes.items()}):
            merged.update({int(i): EnvReply.from_wire(o) for i, o in part.items()})
        return merged


def _run_envs(pool, fn, indexed, shard: _EnvShard) -> dict[int, concurrent.futures.Future]:
    """Submits ``fn`` for each of this host's share of ``indexed`` episodes (one thread-pool
    task per episode, so a half's environments step concurrently)."""
    return {i: pool.submit(fn, ep) for i, ep in shard.mine(indexed)}


def _outcomes(futures: dict[int, concurrent.futures.Future], shard: _EnvShard
              ) -> dict[int, EnvReply]:
    return shard.exchange({i: f.result() for i, f in futures.items()})


def run_episodes(
    model: nnx.Module,
    tokenizer: Any,
    episodes: Sequence[EpisodeSpec],
    config: AgentLoopConfig | None = None,
    *,
    parser: Callable[[str], tuple[str, bool]] | None = None,
    router_hook: Callable | None = None,
    mesh: Any = None,
    seed: int | None = None,
    stats: dict | None = None,
) -> list[EpisodeRecord]:
    """Runs every episode to its end; returns their records in input order.

    seed: base of this batch's sampling noise: turn t of episode i draws with
      ``derive_seed(seed, i, t)`` (recorded per turn in ``sampler_seeds``), whatever slot it
      runs in and whoever shares the batch. Pass a different seed per batch, e.g.
      ``derive_seed(experiment_seed, step, Phase.AGENT, k)``: two batches with one seed draw
      the same noise. None = ``config.sampler.seed``.
    stats: if given, filled with the engine's counters (prefill tokens, decode steps, busy
      slot-steps, slots, cache length, ticks) for cost accounting and benchmarks.

    Multi-host: every host passes the same global ``episodes`` (and makes the same engine
    calls on the same global batch), but steps only its share (:func:`episode_owner`); the
    env of an episode another host owns is never touched and may be None. The records
    returned are the same on every host.
    """
    config = config or AgentLoopConfig()
    parser = parser or ActionParser(action_format=config.action_format)
    turns = ChatTurns(tokenizer, config.system_prompt, config.enable_thinking,
                      config.first_turn_template, config.observation_role)
    eps = [_Episode(s, EpisodeRecord(env_id=s.env_id, seed=s.seed)) for s in episodes]
    shard = _EnvShard(len(eps))
    with concurrent.futures.ThreadPoolExecutor(config.env_threads) as pool:
        resets = _outcomes(_run_envs(pool, _reset, list(enumerate(eps)), shard), shard)
        for i, ep in enumerate(eps):
            _absorb_reset(ep, resets[i], turns)
        engine = None
        if any(ep.active for ep in eps):
            slots = min(len(eps), config.decode_slots or len(eps))
            longest = max(len(ep.record.token_ids) for ep in eps)
            engine = SlotEngine(
                model, slots, dataclasses.replace(config.sampler,
                                                  max_new_tokens=config.max_turn_tokens),
                stop_tokens=sorted(turns.eos_ids), router_hook=router_hook, mesh=mesh,
                cache_len=longest + config.max_turn_tokens,
                max_prefill_tokens=config.sampler.max_prefill_tokens)
            _Scheduler(eps, engine, pool, shard, turns, config, parser, tokenizer,
                       config.sampler.seed if seed is None else seed).run()
    for ep in eps:
        ep.record.cost.context_tokens = len(ep.record.token_ids)
    if stats is not None and engine is not None:
        stats.update(engine.stats, slots=engine.num_slots)
    return [ep.record for ep in eps]


class _Scheduler:
    """Drives the slot engine in ticks: admit waiting turns into slots, decode a chunk, end
    the turns that finished (their env steps start at once on the thread pool), then take
    the env results that have arrived. Each episode keeps its slot, and so its KV cache,
    from its first turn to its end; the next turn prefills only what was added.

    Every decision depends only on values all hosts share (the gathered env outcomes and
    device state), taken in episode order, so every host makes the same engine calls."""

    def __init__(self, eps, engine: SlotEngine, pool, shard: _EnvShard, turns: ChatTurns,
                 config: AgentLoopConfig, parser, tokenizer, base_seed: int):
        self.eps, self.engine, self.pool, self.shard = eps, engine, pool, shard
        self.turns, self.config, self.parser, self.tokenizer = turns, config, parser, tokenizer
        self.base_seed = base_seed
        self.ready = collections.deque(i for i, ep in enumerate(eps) if ep.active)
        self.free = list(range(engine.num_slots))  # a heap: lowest slot first
        self.slot_of: dict[int, int] = {}
        self.episode_in: dict[int, int] = {}  # slot -> episode generating there
        self.cached: dict[int, int] = {}  # episode -> stream tokens in its slot's cache
        self.turn_seed: dict[int, int] = {}
        self.stepping: set[int] = set()  # episodes whose env step is out (on some host)
        self.launched: dict[int, int] = {}  # episode -> tick its env step started
        self.futures: dict[int, concurrent.futures.Future] = {}  # this host's env steps
        self.chunk = config.sampler.chunk_steps or 32
        self.ticks = 0

    def run(self) -> None:
        while self.ready or self.engine.generating or self.stepping:
            preemption.check_safe_point()  # a stop requested mid-step: drop the step here
            self.ticks += 1
            self._admit()
            if self.engine.generating:
                self.engine.decode(self.chunk)
                for done in self.engine.finished():
                    self._end_turn(done)
            self._take_env_results()
        self.engine.stats["ticks"] = self.ticks

    def _release(self, i: int) -> None:
        heapq.heappush(self.free, self.slot_of.pop(i))

    def _admit(self) -> None:
        config, requests, waiting = self.config, [], collections.deque()
        for i in self.ready:
            rec = self.eps[i].record
            if len(rec.token_ids) >= config.max_episode_tokens:
                self._end(i, EndReason.MAX_TOKENS, truncated=True)
                continue
            fresh = i not in self.slot_of
            if fresh and not self.free:
                waiting.append(i)
                continue
            if fresh:
                self.slot_of[i], self.cached[i] = heapq.heappop(self.free), 0
            budget = min(config.max_turn_tokens, config.max_episode_tokens - len(rec.token_ids))
            self.turn_seed[i] = derive_seed(self.base_seed, i, rec.cost.turns)
            slot = self.slot_of[i]
            self.episode_in[slot] = i
            self.engine.ensure_cache(len(rec.token_ids) + budget)
            requests.append(Request(slot, rec.token_ids[self.cached[i]:], fresh, budget,
                                    self.turn_seed[i]))
        self.ready = waiting
        self.engine.admit(requests)

    def _end(self, i: int, reason: EndReason, truncated: bool = False) -> None:
        ep = self.eps[i]
        ep.active, ep.record.end_reason = False, reason
        ep.record.truncated = ep.record.truncated or truncated
        if i in self.slot_of:
            self._release(i)

    def _end_turn(self, done: Finished) -> None:
        i = self.episode_in.pop(done.slot)
        ep, config = self.eps[i], self.config
        rec = ep.record
        start = len(rec.token_ids)
        if done.routing is not None:  # router replay: the turn fed positions cached .. end-1
            rec.routing = (done.routing if rec.routing is None
                           else np.concatenate([rec.routing, done.routing]))
        rec.append(done.tokens, policy=True, logprobs=done.logprobs)
        self.cached[i] = len(rec.token_ids) - 1  # the last token drawn was never fed
        rec.turn_spans.append((start, len(rec.token_ids)))
        rec.turn_done_reasons.append(done.reason)
        rec.sampler_seeds.append(self.turn_seed[i])
        rec.cost.turns += 1
        rec.cost.tokens_generated += len(done.tokens)
        action, ok = self.parser(self.tokenizer.decode(done.tokens, skip_special_tokens=True))
        rec.cost.parse_failures += 0 if ok else 1
        rec.actions.append(action)
        ep.pending_action = action
        if done.reason != "eos" and len(rec.token_ids) >= config.max_episode_tokens:
            self._end(i, EndReason.MAX_TOKENS, truncated=True)
            return
        if config.end_on_cut_reply and done.reason == "max_tokens":
            rec.return_ = 0.0  # the recipe scores a cut reply's episode 0
            self._end(i, EndReason.CUT_REPLY, truncated=True)
            return
        self.stepping.add(i)
        self.launched[i] = self.ticks
        self.futures.update(_run_envs(self.pool, _step, [(i, ep)], self.shard))

    def _take_env_results(self) -> None:
        """Absorbs env steps on a schedule that depends on no timing, so the same episodes
        form the same batches every run (with default numerics a row's log-probs depend on
        who shares its batch): a step is due once a decode chunk has run since it started
        (it was launched in an earlier tick); when nothing is generating and none is due,
        the lowest-numbered step is, not whichever finishes first. This host waits for its
        due steps, then the hosts exchange them (every host computes the same due set)."""
        stepping = sorted(self.stepping)
        due = [i for i in stepping if self.launched[i] < self.ticks]
        if not due and not self.engine.generating:
            due = stepping[:1]
        if not due:
            return
        outcomes = _outcomes({i: self.futures.pop(i) for i in due if i in self.futures},
                             self.shard)
        for i in sorted(outcomes):
            self.stepping.discard(i)
            _absorb_step(self.eps[i], outcomes[i], self.turns, self.config)
            if self.eps[i].active:
                self.ready.append(i)
            elif i in self.slot_of:
                self._release(i)


def _absorb_reset(ep: _Episode, reply: EnvReply, turns: ChatTurns) -> None:
    ep.record.cost.env_seconds += reply.seconds
    if reply.end_reason is not None:
        ep.active, ep.record.end_reason = False, reply.end_reason
        return
    ep.record.observations.append(reply.observation)
    ep.record.append(turns.first_prompt(reply.observation, ep.spec.tools), policy=False)


def _absorb_step(ep: _Episode, reply: EnvReply, turns: ChatTurns,
                 config: AgentLoopConfig) -> None:
    rec = ep.record
    rec.cost.env_seconds += reply.seconds
    if reply.end_reason is not None and reply.end_reason != PROGRAM_ERROR:
        ep.active, rec.end_reason = False, reply.end_reason
        return
    observation = reply.observation
    rec.step_rewards.append(reply.reward)
    rec.return_ = float(sum(rec.step_rewards))
    rec.observations.append(observation)
    rec.terminated, rec.truncated = reply.terminated, reply.truncated
    if reply.end_reason == PROGRAM_ERROR:  # the game failed: the agent saw it, scored -1
        ep.active, rec.end_reason = False, PROGRAM_ERROR
        return
    if reply.terminated or reply.truncated:
        ep.active = False
        rec.end_reason = EndReason.TERMINATED if reply.terminated else EndReason.TRUNCATED
        return
    if rec.cost.turns >= config.max_turns:
        ep.active, rec.end_reason, rec.truncated = False, EndReason.MAX_TURNS, True
        return
    closed = bool(rec.token_ids) and rec.token_ids[-1] in turns.eos_ids
    piece = turns.after_policy(observation, closed)
    # An observation that leaves no room for a policy token ends the episode before it is
    # appended: the record stays within the budget (which may equal the largest pack
    # bucket), and router replay keeps one routing row per fed token (it was never fed).
    if len(rec.token_ids) + len(piece) >= config.max_episode_tokens:
        ep.active, rec.end_reason, rec.truncated = False, EndReason.MAX_TOKENS, True
        return
    rec.append(piece, policy=False)
