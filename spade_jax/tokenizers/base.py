"""The tokenizer protocol every backend satisfies, and the chat half they share."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from spade_jax.tokenizers.chat_template import ChatTemplate, Message

# Qwen3's turn markers. The first three are "special" (dropped by skip_special_tokens); the
# think tags are ordinary added tokens in Qwen3, so decoding keeps them.
SPECIAL_CHAT_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
THINK_TOKENS: tuple[str, ...] = ("<think>", "</think>")
# Sampling stops at either: <|im_end|> closes a chat turn, <|endoftext|> closes a document.
END_OF_TURN_TOKENS: tuple[str, ...] = ("<|im_end|>", "<|endoftext|>")
PAD_TOKEN = "<|endoftext|>"


@runtime_checkable
class Tokenizer(Protocol):
    """What the sampler, the agent loop and the trainer need from a tokenizer."""

    @property
    def vocab_size(self) -> int:
        """Number of ids ``encode`` can produce (base vocabulary plus added tokens)."""
        ...

    @property
    def eos_ids(self) -> frozenset[int]:
        """Ids that end a turn: ``<|im_end|>`` and ``<|endoftext|>``."""
        ...

    @property
    def pad_id(self) -> int: ...

    def encode(self, text: str) -> list[int]:
        """Text to ids; chat tokens written in the text become their single ids. No BOS/EOS."""
        ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...

    def render_chat(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = False,
        enable_thinking: bool = True,
        tools: Sequence[Message] | None = None,
    ) -> str: ...

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = False,
        enable_thinking: bool = True,
        tools: Sequence[Message] | None = None,
    ) -> list[int]: ...


class ChatTokenizerBase(abc.ABC):
    """Shared chat-template half of both backends: render with the template, then encode."""

    chat_template: ChatTemplate

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]: ...

    def render_chat(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = False,
        enable_thinking: bool = True,
        tools: Sequence[Message] | None = None,
    ) -> str:
        """The conversation as prompt text, exactly as ``apply_chat_template(tokenize=False)``
        (``tools``: the functions' JSON schemas, passed to the template)."""
        return self.chat_template.render(messages, add_generation_prompt, enable_thinking,
                                         tools=tools)

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = False,
        enable_thinking: bool = True,
        tools: Sequence[Message] | None = None,
    ) -> list[int]:
        """The conversation as token ids: render, then encode (chat markers become single ids)."""
        return self.encode(self.render_chat(messages, add_generation_prompt, enable_thinking,
                                            tools=tools))

    def _check_ids(self, ids: Sequence[int], vocab_size: int) -> list[int]:
        checked = [int(i) for i in ids]
        bad = [i for i in checked if not 0 <= i < vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
        return checked


def check_text(text: object) -> str:
    if not isinstance(text, str):
        raise TypeError(f"encode expects a str, got {type(text).__name__}")
    return text
