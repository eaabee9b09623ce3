"""Hugging Face ``tokenizer.json`` backend (e.g. Qwen3's byte-level BPE)."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Sequence

import tokenizers

from spade_jax.tokenizers.base import (
    END_OF_TURN_TOKENS,
    PAD_TOKEN,
    ChatTokenizerBase,
    check_text,
)
from spade_jax.tokenizers.chat_template import (
    ChatTemplate,
    find_chat_template,
    read_tokenizer_config,
)


class HFTokenizer(ChatTokenizerBase):
    """A ``tokenizer.json`` (e.g. Qwen3's byte-level BPE) run by the ``tokenizers`` library.

    ``encode`` matches ``AutoTokenizer(...)(text, add_special_tokens=False)`` and, for Qwen
    tokenizers (which add no BOS/EOS), ``AutoTokenizer.encode(text)`` too.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        chat_template: ChatTemplate,
        eos_ids: frozenset[int],
        pad_id: int,
    ) -> None:
        if not eos_ids:
            raise ValueError("tokenizer has no end-of-turn token (<|im_end|>, <|endoftext|> "
                             "or an eos_token in tokenizer_config.json)")
        self.backend = backend
        self.chat_template = chat_template
        self._eos_ids = frozenset(eos_ids)
        self._pad_id = pad_id

    @classmethod
    def from_directory(cls, path: str | os.PathLike) -> HFTokenizer:
        """Loads ``tokenizer.json``, plus eos/pad/chat template from ``tokenizer_config.json``."""
        directory = pathlib.Path(path)
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {directory}")
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        config = read_tokenizer_config(directory)
        special = {name: token for name in ("bos_token", "eos_token", "pad_token", "unk_token")
                   if (token := _token_string(config.get(name))) is not None}
        for name, token in special.items():
            if backend.token_to_id(token) is None:
                raise ValueError(f"{name} {token!r} in tokenizer_config.json is not in tokenizer.json")

        eos_tokens = [t for t in END_OF_TURN_TOKENS if backend.token_to_id(t) is not None]
        eos_tokens += [special["eos_token"]] if "eos_token" in special else []
        eos_ids = frozenset(backend.token_to_id(t) for t in eos_tokens)
        pad_token = special.get("pad_token", PAD_TOKEN)
        pad_id = backend.token_to_id(pad_token)
        if pad_id is None:
            if not eos_ids:
                raise ValueError(f"{directory}: no pad token and no end-of-turn token")
            pad_id = min(eos_ids)
        template = ChatTemplate(find_chat_template(directory, config), tuple(special.items()))
        return cls(backend, template, eos_ids, pad_id)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_ids(self) -> frozenset[int]:
        return self._eos_ids

    @property
    def pad_id(self) -> int:
        return self._pad_id

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(check_text(text), add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(self._check_ids(ids, self.vocab_size),
                                   skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)


def _token_string(value: object) -> str | None:
    """A special token as written in tokenizer_config.json: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None
