"""Corpus grounding: documents from JSONL / parquet shards and a resumable sampler.

SPADE (§4.3) resamples documents from an external corpus every round and gives them to the
designer as conditioning: never reused within a run, no trend-based selection. Game domain:
10k DCLM math documents + 5k MegaScience science documents; tool-calling domain: 15k
Nemotron pretraining code documents. Without it the generator collapses (Vendi/n 0.68 ->
0.04). Here:

- `JsonlCorpus` / `ParquetCorpus` read the first `max_documents` records with a `text`
  field from shards as a user has them (local paths, globs, or `gs://` through
  `etils.epath`; `.gz` and, with `zstandard` installed, `.zst` JSONL).
- `MixtureCorpus` unions corpora with a document budget each (10k math + 5k science).
- `CorpusSampler` walks a seeded permutation with a cursor, so no document repeats within
  a run, and its JSON state resumes a run with identical subsequent samples.

The default offline corpus (documentation shipped in installed packages) is in
`default_corpus.py`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gzip
import hashlib
import io
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal, Protocol

import numpy as np
from etils import epath

PathLike = str | os.PathLike


@dataclasses.dataclass(frozen=True)
class Document:
    """One conditioning document: a run-unique id, its text and the source it came from."""

    doc_id: str
    text: str
    source: str


class Corpus(Protocol):
    """A fixed, indexable pool of documents."""

    name: str

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Document: ...


def corpus_fingerprint(corpus: Corpus) -> str:
    """Hash of the corpus' document ids in order; a resumed sampler checks it matches."""
    digest = hashlib.sha256()
    for index in range(len(corpus)):
        digest.update(corpus[index].doc_id.encode("utf-8"))
        digest.update(b"\0")
    return digest.hexdigest()[:32]


class InMemoryCorpus:
    """A list of documents; the base of the file readers. Document ids must be unique."""

    def __init__(self, documents: Sequence[Document], name: str) -> None:
        if not documents:
            raise ValueError(f"corpus {name!r} has no documents")
        seen: set[str] = set()
        for document in documents:
            if document.doc_id in seen:
                raise ValueError(f"corpus {name!r} has duplicate document id {document.doc_id!r}")
            seen.add(document.doc_id)
        self.name = name
        self._documents = list(documents)

    def __len__(self) -> int:
        return len(self._documents)

    def __getitem__(self, index: int) -> Document:
        return self._documents[index]


@dataclasses.dataclass(frozen=True)
class TextShardConfig:
    """How to read text records from shards.

    Attributes:
      text_field: record field holding the document text (DCLM, MegaScience, Nemotron:
        "text").
      id_field: optional field with a stable document id; without it the id is
        "<path below the shards' common folder>:<record index>".
      max_documents: stop after this many documents (files read in the given order,
        globs sorted); None reads everything.
      min_chars: skip records whose stripped text is shorter than this.
    """

    text_field: str = "text"
    id_field: str | None = None
    max_documents: int | None = None
    min_chars: int = 1

    def __post_init__(self) -> None:
        if not self.text_field:
            raise ValueError("TextShardConfig.text_field must be non-empty")
        if self.max_documents is not None and self.max_documents < 1:
            raise ValueError(
                f"TextShardConfig.max_documents must be >= 1 or None, got {self.max_documents}"
            )
        if self.min_chars < 1:
            raise ValueError(f"TextShardConfig.min_chars must be >= 1, got {self.min_chars}")


def expand_paths(paths: PathLike | Sequence[PathLike]) -> list[epath.Path]:
    """Paths or glob patterns (local or gs://) -> existing files; globs expand sorted."""
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    files: list[epath.Path] = []
    for raw in paths:
        text = os.fspath(raw)
        first_wild = min((text.find(c) for c in "*?[" if c in text), default=-1)
        if first_wild >= 0:
            # Glob from the last wildcard-free directory so gs:// patterns work too.
            split = text.rfind("/", 0, first_wild)
            base = epath.Path(text[:split] if split > 0 else ("/" if split == 0 else "."))
            matches = sorted(base.glob(text[split + 1 :]), key=os.fspath)
            if not matches:
                raise FileNotFoundError(f"corpus glob {text!r} matched no files")
            files.extend(matches)
        else:
            path = epath.Path(text)
            if not path.exists():
                raise FileNotFoundError(f"corpus file {text!r} does not exist")
            files.append(path)
    if not files:
        raise ValueError("no corpus paths given")
    return files


@contextlib.contextmanager
def _open_text(path: epath.Path) -> Iterator[io.TextIOBase]:
    """Text lines of a plain, .gz or .zst file; closes the raw handle too."""
    with path.open("rb") as raw:
        if path.name.endswith(".gz"):
            stream = gzip.GzipFile(fileobj=raw)
        elif path.name.endswith(".zst"):
            try:
                import zstandard
            except ImportError as error:
                raise ImportError(
                    f"{path} is zstd-compressed; `pip install zstandard` to read it"
                ) from error
            stream = zstandard.ZstdDecompressor().stream_reader(raw)
        else:
            stream = raw
        yield io.TextIOWrapper(stream, encoding="utf-8")


def _record_to_document(
    record: Mapping[str, Any], where: str, default_id: str, source: str, config: TextShardConfig
) -> Document | None:
    if config.text_field not in record:
        raise ValueError(
            f"{where}: record has no {config.text_field!r} field (fields: {sorted(record)[:10]})"
        )
    text = record[config.text_field]
    if not isinstance(text, str):
        raise ValueError(f"{where}: field {config.text_field!r} is {type(text).__name__}, not str")
    if len(text.strip()) < config.min_chars:
        return None
    doc_id = default_id
    if config.id_field is not None:
        if record.get(config.id_field) is None:
            raise ValueError(f"{where}: record has no id field {config.id_field!r}")
        doc_id = str(record[config.id_field])
    return Document(doc_id=doc_id, text=text, source=source)


def shard_names(files: Sequence[epath.Path]) -> list[str]:
    """Each file's path below the files' common directory: a default document id prefix
    that stays unique when shards in different folders share a base name (DCLM does)."""
    texts = [os.fspath(path) for path in files]
    if len(texts) == 1:
        return [files[0].name]
    cut = os.path.commonprefix(texts).rfind("/") + 1
    return [text[cut:] for text in texts]


def iter_jsonl_documents(
    files: Sequence[epath.Path], source: str, config: TextShardConfig
) -> Iterator[Document]:
    """Documents of JSONL shards in order, one JSON object per line."""
    for path, shard in zip(files, shard_names(files), strict=True):
        with _open_text(path) as handle:
            for line_number, line in enumerate(handle):
                if not line.strip():
                    continue
                where = f"{path}:{line_number + 1}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(f"{where}: not valid JSON ({error})") from error
                if not isinstance(record, dict):
                    raise ValueError(
                        f"{where}: expected a JSON object, got {type(record).__name__}"
                    )
                document = _record_to_document(
                    record, where, f"{shard}:{line_number}", source, config
                )
                if document is not None:
                    yield document


def iter_parquet_documents(
    files: Sequence[epath.Path], source: str, config: TextShardConfig
) -> Iterator[Document]:
    """Documents of parquet shards in order (needs pyarrow)."""
    try:
        import pyarrow.parquet as parquet
    except ImportError as error:
        raise ImportError("reading parquet corpora needs pyarrow: `pip install pyarrow`") from error
    columns = [config.text_field] + ([config.id_field] if config.id_field else [])
    for path, shard in zip(files, shard_names(files), strict=True):
        with path.open("rb") as handle:
            table = parquet.ParquetFile(handle)
            missing = [c for c in columns if c not in table.schema_arrow.names]
            if missing:
                raise ValueError(
                    f"{path}: parquet columns {missing} missing (has {table.schema_arrow.names[:10]})"
                )
            row = 0
            for batch in table.iter_batches(columns=columns, batch_size=1024):
                for record in batch.to_pylist():
                    document = _record_to_document(
                        record, f"{path}:row {row}", f"{shard}:{row}", source, config
                    )
                    row += 1
                    if document is not None:
                        yield document


def _take(documents: Iterator[Document], limit: int | None) -> list[Document]:
    taken = []
    for document in documents:
        taken.append(document)
        if limit is not None and len(taken) >= limit:
            break
    return taken


class JsonlCorpus(InMemoryCorpus):
    """The first `max_documents` documents of JSONL shards (local, glob or gs://)."""

    def __init__(
        self,
        paths: PathLike | Sequence[PathLike],
        name: str,
        config: TextShardConfig | None = None,
    ) -> None:
        self.config = config or TextShardConfig()
        documents = _take(
            iter_jsonl_documents(expand_paths(paths), name, self.config), self.config.max_documents
        )
        super().__init__(documents, name)


class ParquetCorpus(InMemoryCorpus):
    """The first `max_documents` documents of parquet shards (needs pyarrow)."""

    def __init__(
        self,
        paths: PathLike | Sequence[PathLike],
        name: str,
        config: TextShardConfig | None = None,
    ) -> None:
        self.config = config or TextShardConfig()
        documents = _take(
            iter_parquet_documents(expand_paths(paths), name, self.config),
            self.config.max_documents,
        )
        super().__init__(documents, name)


class MixtureCorpus:
    """Union of corpora, each contributing its first `budget` documents (None: all).

    E.g. the game domain: `MixtureCorpus([(dclm_math, 10_000), (megascience, 5_000)])`.
    A uniform draw over the union then takes the components in their budget ratio.
    """

    def __init__(self, components: Sequence[tuple[Corpus, int | None]], name: str = "mixture"):
        if not components:
            raise ValueError("MixtureCorpus needs at least one component")
        self.name = name
        self._components: list[tuple[Corpus, int]] = []
        for corpus, budget in components:
            size = len(corpus) if budget is None else budget
            if size < 1:
                raise ValueError(
                    f"MixtureCorpus budget for {corpus.name!r} must be >= 1, got {size}"
                )
            if size > len(corpus):
                raise ValueError(
                    f"MixtureCorpus asks {size} documents of {corpus.name!r}, which has {len(corpus)}"
                )
            self._components.append((corpus, size))
        self._offsets = np.cumsum([0] + [size for _, size in self._components])
        ids = [self[i].doc_id for i in range(len(self))]
        if len(set(ids)) != len(ids):
            duplicates = sorted(i for i, n in collections.Counter(ids).items() if n > 1)[:5]
            raise ValueError(f"MixtureCorpus components share document ids, e.g. {duplicates}")

    @property
    def budgets(self) -> dict[str, int]:
        return {corpus.name: size for corpus, size in self._components}

    def __len__(self) -> int:
        return int(self._offsets[-1])

    def __getitem__(self, index: int) -> Document:
        if not 0 <= index < len(self):
            raise IndexError(f"document index {index} out of range for {len(self)} documents")
        component = int(np.searchsorted(self._offsets, index, side="right")) - 1
        corpus, _ = self._components[component]
        return corpus[index - int(self._offsets[component])]


class CorpusExhaustedError(RuntimeError):
    """Raised when a run asks for more unseen documents than the corpus has left."""


# How documents are drawn (CorpusSamplerConfig.draws, SpadeConfig.corpus_draws).
CORPUS_DRAWS = ("without_replacement", "uniform")


@dataclasses.dataclass(frozen=True)
class CorpusSamplerConfig:
    """Per-round corpus resampling.

    Attributes:
      seed: seeds the permutation of each epoch (numpy PCG64 on [seed, epoch]).
      documents_per_round: documents handed to the designer prompts per round.
      on_exhausted: "error" raises `CorpusExhaustedError` once fewer unseen documents
        remain than asked for (the paper's no-reuse rule); "new_epoch" drops the tail of
        the epoch and reshuffles, so documents repeat across epochs but never in a round.
      draws: one of CORPUS_DRAWS: "without_replacement" (the permutation above) or
        "uniform" (the published recipe: every document drawn independently and uniformly,
        repeats allowed; draw number k is seeded from (seed, k), so a resumed run draws
        the same documents).
    """

    seed: int = 0
    documents_per_round: int = 24
    on_exhausted: Literal["error", "new_epoch"] = "error"
    draws: Literal["without_replacement", "uniform"] = "without_replacement"

    def __post_init__(self) -> None:
        if self.documents_per_round < 1:
            raise ValueError(
                f"CorpusSamplerConfig.documents_per_round must be >= 1, got {self.documents_per_round}"
            )
        if self.draws not in CORPUS_DRAWS:
            raise ValueError(f"CorpusSamplerConfig.draws must be one of {CORPUS_DRAWS}, "
                             f"got {self.draws!r}")
        if self.on_exhausted not in ("error", "new_epoch"):
            raise ValueError(
                f"CorpusSamplerConfig.on_exhausted must be 'error' or 'new_epoch', "
                f"got {self.on_exhausted!r}"
            )


# Seed stream of uniform draws, apart from the permutations' [seed, epoch].
UNIFORM_STREAM = 1


class CorpusSampler:
    """Draws documents without replacement from a seeded permutation, or uniformly with
    repeats (``draws``); resumable via JSON."""

    def __init__(self, corpus: Corpus, config: CorpusSamplerConfig | None = None) -> None:
        self.corpus = corpus
        self.config = config or CorpusSamplerConfig()
        self.fingerprint = corpus_fingerprint(corpus)
        self.epoch = 0
        self.cursor = 0
        self.documents_drawn = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        rng = np.random.Generator(np.random.PCG64([self.config.seed, epoch]))
        return rng.permutation(len(self.corpus))

    @property
    def remaining(self) -> int:
        """Unseen documents left in the current epoch."""
        return len(self.corpus) - self.cursor

    def sample(self, num_documents: int | None = None) -> list[Document]:
        """The next `num_documents` (default: documents_per_round) unseen documents."""
        count = self.config.documents_per_round if num_documents is None else num_documents
        if count < 1:
            raise ValueError(f"num_documents must be >= 1, got {count}")
        if self.config.draws == "uniform":
            if not len(self.corpus):
                raise ValueError(f"corpus {self.corpus.name!r} is empty: nothing to draw")
            indices = [int(np.random.Generator(np.random.PCG64(
                [self.config.seed, UNIFORM_STREAM, self.documents_drawn + k])).integers(
                len(self.corpus))) for k in range(count)]
            self.documents_drawn += count
            return [self.corpus[i] for i in indices]
        if count > len(self.corpus):
            raise ValueError(f"asked {count} documents of a corpus with {len(self.corpus)}")
        if count > self.remaining:
            if self.config.on_exhausted == "error":
                raise CorpusExhaustedError(
                    f"corpus {self.corpus.name!r} has {self.remaining} unseen documents left, "
                    f"asked for {count} ({self.documents_drawn} drawn so far); documents are "
                    "never reused within a run: give a larger corpus or on_exhausted='new_epoch'"
                )
            self.epoch += 1
            self.cursor = 0
            self._order = self._permutation(self.epoch)
        indices = self._order[self.cursor : self.cursor + count]
        self.cursor += count
        self.documents_drawn += count
        return [self.corpus[int(i)] for i in indices]

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state; `load_state_dict` on a sampler over the same corpus resumes."""
        return {
            "seed": self.config.seed,
            "epoch": self.epoch,
            "cursor": self.cursor,
            "documents_drawn": self.documents_drawn,
            "corpus_size": len(self.corpus),
            "corpus_fingerprint": self.fingerprint,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for key in ("seed", "epoch", "cursor", "documents_drawn", "corpus_fingerprint"):
            if key not in state:
                raise ValueError(f"CorpusSampler state is missing {key!r}")
        if state["corpus_fingerprint"] != self.fingerprint:
            raise ValueError(
                "CorpusSampler state was saved over a different corpus (fingerprint "
                f"{state['corpus_fingerprint']} != {self.fingerprint}); resuming would reuse "
                "or skip documents"
            )
        if int(state["seed"]) != self.config.seed:
            raise ValueError(
                f"CorpusSampler state has seed {state['seed']}, config has {self.config.seed}"
            )
        cursor = int(state["cursor"])
        if not 0 <= cursor <= len(self.corpus):
            raise ValueError(f"CorpusSampler state cursor {cursor} out of range")
        self.epoch = int(state["epoch"])
        self.cursor = cursor
        self.documents_drawn = int(state["documents_drawn"])
        self._order = self._permutation(self.epoch)
