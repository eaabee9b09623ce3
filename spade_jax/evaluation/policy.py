"""What evaluation and the hint filter sample from: a small text-in, text-out policy protocol.

    policy.complete(conversations, n=4, seed=0, max_new_tokens=512)  # n texts per conversation

Two implementations:
  SamplerPolicy   a model + tokenizer behind `spade_jax.rollout.generate` (the training
                  sampler): conversations are chat-template rendered and sampled in batches;
                  multi-turn episodes go through `spade_jax.rollout.agent_loop.run_episodes`.
                  An optional router hook (MoE steering) and first-answer detector are
                  passed to the sampler; generated tokens are counted per completion.
  ScriptedPolicy  forced outputs from a JSON script: a testing aid, so the harness can be
                  checked end to end with exactly known answers (see `ScriptedPolicy`).

`load_policy(spec)` builds either from a command-line string (`--checkpoint` / `--policy`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from spade_jax.seeding import derive_seed

Conversation = list[dict[str, str]]


@runtime_checkable
class TextPolicy(Protocol):
    """n sampled completions (assistant texts) for each conversation."""

    def complete(
        self,
        conversations: Sequence[Conversation],
        *,
        n: int,
        seed: int,
        max_new_tokens: int,
    ) -> list[list[str]]: ...


@runtime_checkable
class EpisodePolicy(Protocol):
    """A policy that runs multi-turn episodes itself (the training agent loop).

    `envs` are gymnasium text envs (reset(seed=) / step(str)); returns one episode return
    per env. Policies without this method are driven turn by turn through `complete`.
    """

    def play_episodes(
        self, envs: Sequence[Any], *, seeds: Sequence[int], max_turns: int, max_new_tokens: int,
        seed: int,
    ) -> list[float]: ...


def _check_request(conversations: Sequence[Conversation], n: int, max_new_tokens: int) -> None:
    if n < 1:
        raise ValueError(f"n (samples per conversation) must be >= 1, got {n}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    for i, conversation in enumerate(conversations):
        if not conversation or not all(
            isinstance(m, Mapping) and isinstance(m.get("content"), str) and "role" in m
            for m in conversation
        ):
            raise ValueError(f"conversation {i} must be a non-empty list of role/content dicts")


# ----------------------------------------------------------------------------- scripted


def _stable_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


@dataclasses.dataclass(frozen=True)
class ScriptRule:
    """One rule of a scripted policy (see `ScriptedPolicy`)."""

    match: str
    outputs: tuple[str | tuple[str, ...], ...] = ()
    p: float | None = None
    correct: str = ""
    wrong: str = ""

    def __post_init__(self) -> None:
        if self.p is None and not self.outputs:
            raise ValueError(f"script rule {self.match!r} needs 'outputs' or 'p'")
        if self.p is not None and not 0.0 <= self.p <= 1.0:
            raise ValueError(f"script rule {self.match!r}: p must be in [0, 1], got {self.p}")


class ScriptedPolicy:
    """Forced outputs, chosen by the first rule whose `match` occurs in the conversation head.

    The head is the text of the system and first user messages (the task; later turns hold
    tool results). Script format (JSON):

        {"rules": [
           {"match": "2 + 2", "outputs": ["\\\\boxed{4}", "\\\\boxed{5}"]},
           {"match": "book a flight", "outputs": [["<tool_call>...", "done"], ["bye"]]},
           {"match": "task-7", "p": 0.25, "correct": "\\\\boxed{7}", "wrong": "\\\\boxed{0}"}],
         "default": "I don't know.",
         "delay_s": 0.0}

    - plain `outputs`: sample j gets outputs[j % len(outputs)];
    - multi-turn scripts (lists of turns): sample j's first turn comes from script j; later
      turns continue the script whose earlier turns equal the assistant turns so far;
    - Bernoulli rules (`p`): each sample is `correct` with probability p, else `wrong`,
      drawn from a generator seeded on (seed, hash of the conversation, sample index), so
      the draws do not depend on batch composition (resumed runs match fresh ones).
    `delay_s` sleeps per call (lets tests interrupt a run mid-way).
    """

    def __init__(
        self, rules: Sequence[ScriptRule], default: str = "", delay_s: float = 0.0
    ) -> None:
        self.rules = tuple(rules)
        self.default = default
        self.delay_s = float(delay_s)
        self.calls = 0

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ScriptedPolicy:
        if not isinstance(data, Mapping) or not isinstance(data.get("rules", []), list):
            raise ValueError("a policy script must be a JSON object with a 'rules' list")
        rules = []
        for i, raw in enumerate(data.get("rules", [])):
            if not isinstance(raw, Mapping) or not isinstance(raw.get("match"), str):
                raise ValueError(f"script rule {i} needs a string 'match'")
            outputs = tuple(
                tuple(o) if isinstance(o, list) else o for o in raw.get("outputs", [])
            )
            for o in outputs:
                if not isinstance(o, str | tuple) or (
                    isinstance(o, tuple) and not all(isinstance(t, str) for t in o)
                ):
                    raise ValueError(f"script rule {i}: outputs are strings or lists of strings")
            p = raw.get("p")
            rules.append(ScriptRule(raw["match"], outputs, None if p is None else float(p),
                                    str(raw.get("correct", "")), str(raw.get("wrong", ""))))
        return cls(rules, str(data.get("default", "")), float(data.get("delay_s", 0.0)))

    @classmethod
    def from_file(cls, path: str | Path) -> ScriptedPolicy:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"cannot read policy script {path}: {err}") from err
        return cls.from_json(data)

    def _rule(self, conversation: Conversation) -> ScriptRule | None:
        head_end = next((i for i, m in enumerate(conversation) if m["role"] == "user"), 0)
        head = "\n".join(m["content"] for m in conversation[: head_end + 1])
        return next((r for r in self.rules if r.match in head), None)

    def _one(self, conversation: Conversation, sample: int, seed: int) -> str:
        rule = self._rule(conversation)
        if rule is None:
            return self.default
        if rule.p is not None:
            text = json.dumps(conversation, sort_keys=True)
            rng = np.random.default_rng([seed & 0xFFFFFFFF, _stable_hash(text), sample])
            return rule.correct if rng.random() < rule.p else rule.wrong
        taken = [m["content"] for m in conversation if m["role"] == "assistant"]
        if not taken:
            chosen = rule.outputs[sample % len(rule.outputs)]
            return chosen if isinstance(chosen, str) else (chosen[0] if chosen else "")
        for script in rule.outputs:
            if isinstance(script, tuple) and list(script[: len(taken)]) == taken:
                return script[len(taken)] if len(script) > len(taken) else ""
        return ""

    def complete(
        self, conversations: Sequence[Conversation], *, n: int, seed: int, max_new_tokens: int
    ) -> list[list[str]]:
        _check_request(conversations, n, max_new_tokens)
        self.calls += 1
        if self.delay_s:
            time.sleep(self.delay_s)
        return [[self._one(c, j, seed) for j in range(n)] for c in conversations]


# ----------------------------------------------------------------------------- sampler


@dataclasses.dataclass(frozen=True)
class SamplerPolicyConfig:
    """Settings of `SamplerPolicy`.

    Attributes:
      temperature: sampling temperature (0 = greedy; pass@1 over n > 1 samples wants > 0).
      top_p: nucleus mass in (0, 1].
      top_k: 0 = off.
      batch_size: prompts per `generate` call at most (bounds KV-cache memory).
      enable_thinking: passed to the chat template's generation prompt.
      system_prompt: optional system turn put before every conversation lacking one.
    """

    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = 0
    batch_size: int = 64
    enable_thinking: bool = False
    system_prompt: str | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"SamplerPolicyConfig.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplerPolicyConfig.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0 or self.batch_size < 1:
            raise ValueError("SamplerPolicyConfig needs top_k >= 0 and batch_size >= 1")


class SamplerPolicy:
    """A model and tokenizer sampled through the training sampler (`rollout.generate`).

    `router_hook`: ``f(logits_btE, layer)`` applied in every MoE layer before top-k (router
    steering, `spade_jax.steering`); `answer_detector`: a device-side first-answer detector
    (`rollout.sample`'s), so a hook can switch on after the first answer. Both apply to
    `complete`; `play_episodes` takes the hook only. `generated_tokens` collects, per
    completion in call order, the tokens the sampler generated (a stop token that ended the
    row counts).
    """

    def __init__(self, model: Any, tokenizer: Any, config: SamplerPolicyConfig | None = None,
                 *, mesh: Any = None, router_hook: Callable | None = None,
                 answer_detector: Any = None) -> None:
        self.model, self.tokenizer, self.mesh = model, tokenizer, mesh
        self.config = config or SamplerPolicyConfig()
        self.router_hook, self.answer_detector = router_hook, answer_detector
        self.generated_tokens: list[int] = []

    def _messages(self, conversation: Conversation) -> list[dict[str, str]]:
        messages = [dict(m) for m in conversation]
        if self.config.system_prompt is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.config.system_prompt})
        return messages

    def complete(
        self, conversations: Sequence[Conversation], *, n: int, seed: int, max_new_tokens: int
    ) -> list[list[str]]:
        from spade_jax.rollout import generate

        _check_request(conversations, n, max_new_tokens)
        prompts = [
            list(self.tokenizer.apply_chat_template(
                self._messages(c), add_generation_prompt=True,
                enable_thinking=self.config.enable_thinking))
            for c in conversations
        ]
        rows = [p for p in prompts for _ in range(n)]  # row = conversation * n + sample
        texts: list[str] = []
        size = self.config.batch_size
        for start in range(0, len(rows), size):
            result = generate(
                self.model, rows[start : start + size], max_new_tokens,
                temperature=self.config.temperature, top_p=self.config.top_p,
                top_k=self.config.top_k, seed=derive_seed(seed, start), mesh=self.mesh,
                stop_tokens=sorted(self.tokenizer.eos_ids), router_hook=self.router_hook,
                answer_detector=self.answer_detector,
            )
            self.generated_tokens.extend(len(t) for t in result.tokens)
            texts.extend(self.tokenizer.decode(t, skip_special_tokens=True) for t in result.tokens)
        return [texts[i * n : (i + 1) * n] for i in range(len(conversations))]

    def play_episodes(
        self, envs: Sequence[Any], *, seeds: Sequence[int], max_turns: int, max_new_tokens: int,
        seed: int,
    ) -> list[float]:
        from spade_jax.rollout import SamplerConfig
        from spade_jax.rollout.agent_loop import AgentLoopConfig, EpisodeSpec, run_episodes

        if self.answer_detector is not None:
            raise ValueError("SamplerPolicy.play_episodes: the answer_detector applies to "
                             "complete() only; build the policy without it for episodes")
        config = AgentLoopConfig(
            max_turns=max_turns, max_turn_tokens=max_new_tokens,
            max_episode_tokens=max(4096, max_turns * max_new_tokens * 2),
            system_prompt=self.config.system_prompt, enable_thinking=self.config.enable_thinking,
            sampler=SamplerConfig(max_new_tokens=max_new_tokens,
                                  temperature=self.config.temperature, top_p=self.config.top_p,
                                  top_k=self.config.top_k, seed=seed),
        )
        specs = [EpisodeSpec(env, f"episode-{i}", s) for i, (env, s) in
                 enumerate(zip(envs, seeds, strict=True))]
        records = run_episodes(self.model, self.tokenizer, specs, config,
                               router_hook=self.router_hook, mesh=self.mesh)
        return [r.return_ for r in records]


# ----------------------------------------------------------------------------- loading


def load_policy(
    checkpoint: str | None = None,
    *,
    tokenizer: str | None = None,
    policy: str | None = None,
    config: SamplerPolicyConfig | None = None,
) -> TextPolicy:
    """A policy from command-line values.

    `policy="scripted:FILE.json"` gives a `ScriptedPolicy` (testing aid; no model). Else
    `checkpoint` is an Orbax model dir (config.json + params/) or a Hugging Face dir
    (config.json + *.safetensors); `tokenizer` defaults to the checkpoint dir.
    """
    if policy is not None:
        kind, _, arg = policy.partition(":")
        if kind != "scripted" or not arg:
            raise ValueError(f"--policy must be 'scripted:FILE.json', got {policy!r}")
        return ScriptedPolicy.from_file(arg)
    if not checkpoint:
        raise ValueError("give --checkpoint (a model dir) or --policy=scripted:FILE.json")
    from spade_jax import storage

    path = storage.as_path(checkpoint)  # local or gs://
    if not (path / "config.json").is_file():
        raise ValueError(f"--checkpoint {path} has no config.json (need an Orbax or HF model dir)")
    if (path / "params").is_dir():
        from spade_jax.models.orbax_io import load_orbax

        model, _ = load_orbax(path)
    elif any(p.name.endswith(".safetensors") for p in path.iterdir()):
        from spade_jax.models import load_hf

        model, _ = load_hf(path)
    else:
        raise ValueError(f"--checkpoint {path} has neither params/ (Orbax) nor *.safetensors (HF)")
    from spade_jax.tokenizers import load_tokenizer

    return SamplerPolicy(model, load_tokenizer(tokenizer or path), config)
