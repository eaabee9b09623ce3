"""Tokenizers: ``from spade_jax.tokenizer import load_tokenizer`` (alias of ``spade_jax.tokenizers``).

The implementation lives in the :mod:`spade_jax.tokenizers` package; this module re-exports its
public API so either import path works.
"""

from spade_jax.tokenizers import (
    CHAT_ROLES,
    END_OF_TURN_TOKENS,
    PAD_TOKEN,
    QWEN3_CHAT_TEMPLATE,
    SPECIAL_CHAT_TOKENS,
    THINK_TOKENS,
    ChatTemplate,
    HFTokenizer,
    SentencePieceTokenizer,
    SentencePieceTrainConfig,
    Tokenizer,
    load_tokenizer,
    project_text_files,
    train_sentencepiece,
)

__all__ = [
    "CHAT_ROLES",
    "END_OF_TURN_TOKENS",
    "PAD_TOKEN",
    "QWEN3_CHAT_TEMPLATE",
    "SPECIAL_CHAT_TOKENS",
    "THINK_TOKENS",
    "ChatTemplate",
    "HFTokenizer",
    "SentencePieceTokenizer",
    "SentencePieceTrainConfig",
    "Tokenizer",
    "load_tokenizer",
    "project_text_files",
    "train_sentencepiece",
]
