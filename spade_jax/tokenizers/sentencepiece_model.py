"""Sentencepiece backend: train a small model on project text for CPU-sized experiments."""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Iterable, Sequence
from typing import Literal

import sentencepiece

from spade_jax.tokenizers.base import (
    END_OF_TURN_TOKENS,
    PAD_TOKEN,
    SPECIAL_CHAT_TOKENS,
    THINK_TOKENS,
    ChatTokenizerBase,
    check_text,
)
from spade_jax.tokenizers.chat_template import ChatTemplate

# Sentencepiece writes a space as U+2581 and decodes every U+2581 back to a space, so a literal
# U+2581 in the input is encoded as its UTF-8 bytes instead, which decode to U+2581 again.
_SPACE_MARK = "\u2581"


@dataclasses.dataclass(frozen=True)
class SentencePieceTrainConfig:
    """Settings for :func:`train_sentencepiece` (validated on construction).

    Attributes:
      vocab_size: pieces in the model, including 256 byte pieces, ``<unk>`` and the symbols.
      model_type: sentencepiece algorithm, "bpe" or "unigram".
      character_coverage: share of corpus characters given their own piece; rarer ones are
        spelled as UTF-8 byte pieces (byte fallback), so nothing becomes ``<unk>``.
      max_sentence_length: longest corpus line in bytes; longer lines are skipped by training.
      num_threads: trainer threads.
      user_defined_symbols: strings that always encode to one id; must include the chat
        markers and think tags. "\\n" is one too, as code is full of newlines.
    """

    vocab_size: int = 4000
    model_type: Literal["bpe", "unigram"] = "bpe"
    character_coverage: float = 0.9995
    max_sentence_length: int = 16384
    num_threads: int = 2
    user_defined_symbols: tuple[str, ...] = SPECIAL_CHAT_TOKENS + THINK_TOKENS + ("\n",)

    def __post_init__(self) -> None:
        minimum = 256 + 1 + len(self.user_defined_symbols) + 1
        if not isinstance(self.vocab_size, int) or self.vocab_size < minimum:
            raise ValueError(f"vocab_size must be an int >= {minimum} (256 byte pieces, <unk>, "
                             f"{len(self.user_defined_symbols)} symbols), got {self.vocab_size!r}")
        if self.model_type not in ("bpe", "unigram"):
            raise ValueError(f"model_type must be 'bpe' or 'unigram', got {self.model_type!r}")
        if not 0.0 < self.character_coverage <= 1.0:
            raise ValueError(f"character_coverage must be in (0, 1], got {self.character_coverage}")
        if self.max_sentence_length < 1 or self.num_threads < 1:
            raise ValueError("max_sentence_length and num_threads must be positive")
        missing = [t for t in SPECIAL_CHAT_TOKENS + THINK_TOKENS if t not in self.user_defined_symbols]
        if missing:
            raise ValueError(f"user_defined_symbols must include the chat tokens; missing {missing}")
        if len(set(self.user_defined_symbols)) != len(self.user_defined_symbols):
            raise ValueError("user_defined_symbols has duplicates")


class SentencePieceTokenizer(ChatTokenizerBase):
    """A sentencepiece model (from :func:`train_sentencepiece`) behind the same protocol.

    Text is kept verbatim (identity normalization, no dummy prefix, whitespace preserved) and
    unseen characters fall back to bytes, so ``decode(encode(text)) == text`` for any string.
    """

    def __init__(self, model_file: str | os.PathLike, chat_template: ChatTemplate | None = None) -> None:
        model_file = pathlib.Path(model_file)
        if not model_file.is_file():
            raise FileNotFoundError(f"sentencepiece model {model_file} does not exist")
        self.model_file = model_file
        self.processor = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
        self.chat_template = chat_template if chat_template is not None else ChatTemplate()

        missing = [t for t in SPECIAL_CHAT_TOKENS + THINK_TOKENS if self.token_to_id(t) is None]
        if missing:
            raise ValueError(f"{model_file} lacks chat tokens {missing} as single pieces; "
                             "train it with train_sentencepiece")
        self._byte_ids = [self.processor.piece_to_id(f"<0x{b:02X}>") for b in range(256)]
        if not all(self.processor.is_byte(i) for i in self._byte_ids):
            raise ValueError(f"{model_file} has no byte-fallback pieces, so some text cannot be "
                             "encoded; train it with train_sentencepiece (byte_fallback=True)")
        self._space_mark_ids = [self._byte_ids[b] for b in _SPACE_MARK.encode("utf-8")]
        self._eos_ids = frozenset(self.token_to_id(t) for t in END_OF_TURN_TOKENS)
        self._pad_id = self.token_to_id(PAD_TOKEN)
        self._skipped_ids = frozenset(
            [self.token_to_id(t) for t in SPECIAL_CHAT_TOKENS] + [self.processor.unk_id()]
        )

    @property
    def vocab_size(self) -> int:
        return self.processor.get_piece_size()

    @property
    def eos_ids(self) -> frozenset[int]:
        return self._eos_ids

    @property
    def pad_id(self) -> int:
        return self._pad_id

    def token_to_id(self, token: str) -> int | None:
        token_id = self.processor.piece_to_id(token)
        return token_id if self.processor.id_to_piece(token_id) == token else None

    def encode(self, text: str) -> list[int]:
        segments = check_text(text).split(_SPACE_MARK)
        ids = self.processor.encode(segments[0]) if segments[0] else []
        for segment in segments[1:]:
            ids += self._space_mark_ids
            ids += self.processor.encode(segment) if segment else []
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        checked = self._check_ids(ids, self.vocab_size)
        if skip_special_tokens:
            checked = [i for i in checked if i not in self._skipped_ids]
        return self.processor.decode(checked)


def project_text_files(root: str | os.PathLike | None = None,
                       suffixes: tuple[str, ...] = (".py", ".md", ".txt")) -> list[pathlib.Path]:
    """Project text to train a tokenizer on: source, docs and example environment programs.

    Without ``root``: the spade_jax package, plus ``docs/``, ``experiments/`` and ``tests/``
    when the package sits in a source checkout (a ``pyproject.toml`` next to it).
    """
    if root is not None:
        roots = [pathlib.Path(root)]
        if not roots[0].is_dir():
            raise FileNotFoundError(f"corpus root {roots[0]} is not a directory")
    else:
        package = pathlib.Path(__file__).resolve().parents[1]  # spade_jax/, above tokenizers/
        roots = [package]
        if (package.parent / "pyproject.toml").is_file():
            roots += [package.parent / name for name in ("docs", "experiments", "tests")]
    files = {path for r in roots if r.is_dir() for path in r.rglob("*")
             if path.is_file() and path.name.endswith(suffixes) and "__pycache__" not in path.parts}
    return sorted(files)


def _corpus_lines(texts_or_files: Iterable[str | os.PathLike]) -> Iterable[str]:
    # Sentencepiece trains on lines; "\n" itself is a user-defined symbol.
    for item in texts_or_files:
        if isinstance(item, os.PathLike):
            text = pathlib.Path(item).read_text(encoding="utf-8", errors="replace")
        elif isinstance(item, str):
            text = item
        else:
            raise TypeError(f"corpus items must be str (text) or pathlib.Path (file), got {item!r:.80}")
        yield from (line for line in text.split("\n") if line)


def train_sentencepiece(
    texts_or_files: Iterable[str | os.PathLike],
    model_prefix: str | os.PathLike,
    vocab_size: int = 4000,
    *,
    model_type: Literal["bpe", "unigram"] = "bpe",
    character_coverage: float = 0.9995,
    num_threads: int = 2,
    extra_symbols: Sequence[str] = (),
) -> SentencePieceTokenizer:
    """Trains a small sentencepiece model and writes ``{model_prefix}.model``.

    Args:
      texts_or_files: corpus items; a ``str`` is text, an ``os.PathLike`` a UTF-8 file
        (e.g. ``project_text_files()``).
      model_prefix: output path without the ``.model`` suffix; parent directories are made.
      vocab_size: target pieces; a small corpus may yield fewer (no hard limit).
      model_type, character_coverage, num_threads: see :class:`SentencePieceTrainConfig`.
      extra_symbols: strings kept as one id each, beside the chat markers (appended to
        ``SentencePieceTrainConfig.user_defined_symbols``).

    Returns:
      The trained model as a :class:`SentencePieceTokenizer` with the Qwen3 chat template.
    """
    config = SentencePieceTrainConfig(vocab_size=vocab_size, model_type=model_type,
                                      character_coverage=character_coverage,
                                      num_threads=num_threads,
                                      user_defined_symbols=SentencePieceTrainConfig
                                      .user_defined_symbols + tuple(extra_symbols))
    lines = list(_corpus_lines(texts_or_files))
    if not lines:
        raise ValueError("training corpus is empty")
    model_file = pathlib.Path(f"{os.fspath(model_prefix)}.model")
    model_file.parent.mkdir(parents=True, exist_ok=True)
    with open(model_file, "wb") as writer:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_writer=writer,
            vocab_size=config.vocab_size,
            model_type=config.model_type,
            character_coverage=config.character_coverage,
            max_sentence_length=config.max_sentence_length,
            num_threads=config.num_threads,
            user_defined_symbols=list(config.user_defined_symbols),
            byte_fallback=True,
            # Keep text verbatim so decode(encode(x)) == x: no NFKC, no dummy leading space,
            # whitespace runs kept (and learnable as pieces, e.g. code indentation).
            normalization_rule_name="identity",
            add_dummy_prefix=False,
            remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            hard_vocab_limit=False,
            unk_id=0, bos_id=-1, eos_id=-1, pad_id=-1,  # pad/eos are the chat tokens
            minloglevel=2,
        )
    return SentencePieceTokenizer(model_file)
