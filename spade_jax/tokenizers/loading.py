"""``load_tokenizer``: pick the backend from what a path holds."""

from __future__ import annotations

import os

from spade_jax.tokenizers.chat_template import (
    ChatTemplate,
    find_chat_template,
    read_tokenizer_config,
)
from spade_jax.tokenizers.hf import HFTokenizer
from spade_jax.tokenizers.sentencepiece_model import SentencePieceTokenizer


def load_tokenizer(path: str | os.PathLike) -> HFTokenizer | SentencePieceTokenizer:
    """Picks the backend from what ``path`` holds.

    A directory with ``tokenizer.json`` (or that file itself) -> :class:`HFTokenizer`; a
    directory with ``tokenizer.model`` or exactly one ``*.model`` (or that file) ->
    :class:`SentencePieceTokenizer`. A ``chat_template.jinja`` or ``tokenizer_config.json``
    ``chat_template`` next to it is used; otherwise the built-in Qwen3 template. ``path``
    may be remote (``gs://...``): its tokenizer files are read from a local copy.
    """
    from spade_jax import storage

    path = storage.tokenizer_copy(path)
    if not path.exists():
        raise FileNotFoundError(f"tokenizer path {path} does not exist")
    if path.is_file():
        directory = path.parent
        if path.name == "tokenizer.json":
            return HFTokenizer.from_directory(directory)
        if path.suffix != ".model":
            raise ValueError(f"{path}: expected tokenizer.json or a sentencepiece .model file")
        model_file = path
    elif (path / "tokenizer.json").is_file():
        return HFTokenizer.from_directory(path)
    else:
        directory = path
        models = sorted(path.glob("*.model"))
        if (path / "tokenizer.model").is_file():
            models = [path / "tokenizer.model"]
        if len(models) != 1:
            found = sorted(p.name for p in path.iterdir())[:20]
            raise FileNotFoundError(
                f"{path}: need tokenizer.json or one sentencepiece .model file, found {found}")
        model_file = models[0]
    template = find_chat_template(directory, read_tokenizer_config(directory))
    return SentencePieceTokenizer(model_file, ChatTemplate(template))
