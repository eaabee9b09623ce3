"""Tokenizers: one small protocol, a Hugging Face byte-level BPE backend, a sentencepiece backend.

Everything that turns text into token ids (the sampler, the multi-turn agent loop, the GRPO
trainer) talks to the :class:`Tokenizer` protocol::

    tok = load_tokenizer("path/to/dir")      # tokenizer.json -> HF backend, *.model -> sentencepiece
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False)
    text = tok.decode(ids)

Backends
  HFTokenizer            a ``tokenizer.json`` (Qwen3's byte-level BPE) through the ``tokenizers``
                         library; ids equal ``transformers.AutoTokenizer`` on the same files.
  SentencePieceTokenizer a small sentencepiece model trained on project text by
                         :func:`train_sentencepiece` for CPU-sized experiments.

Chat format: both backends render conversations with a Jinja chat template in a sandboxed
environment configured like transformers'. A directory's own template (``chat_template.jinja``,
else ``chat_template`` in ``tokenizer_config.json``) wins, as in transformers; otherwise
:data:`QWEN3_CHAT_TEMPLATE`, written for this project to reproduce Qwen3's format.

Modules: ``base`` (protocol, chat tokens), ``chat_template`` (Jinja rendering, built-in Qwen3
template), ``hf``, ``sentencepiece_model`` (backend + trainer), ``loading`` (load_tokenizer).
"""

from spade_jax.tokenizers.base import (
    END_OF_TURN_TOKENS,
    PAD_TOKEN,
    SPECIAL_CHAT_TOKENS,
    THINK_TOKENS,
    Tokenizer,
)
from spade_jax.tokenizers.chat_template import CHAT_ROLES, QWEN3_CHAT_TEMPLATE, ChatTemplate
from spade_jax.tokenizers.hf import HFTokenizer
from spade_jax.tokenizers.loading import load_tokenizer
from spade_jax.tokenizers.sentencepiece_model import (
    SentencePieceTokenizer,
    SentencePieceTrainConfig,
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
