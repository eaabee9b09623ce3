"""A default corpus that exists offline on a fresh install: text shipped in installed packages.

No text is invented here. Sources, each document tagged with its `source`:

- "sympy-docs"  (math): docstrings of sympy's public functions and classes (number theory,
  combinatorics, solvers, series, ...), plus scipy.special's special functions.
- "scipy-docs"  (science): docstrings of scipy's statistics, integration, optimisation,
  signal, spatial, interpolation and constants.
- "numpy-docs"  (code): docstrings of numpy's public API.
- "reasoning_gym-codeio" : reasoning-gym's bundled CodeIO problems (`data/codeio.jsonl.gz`):
  the task description and I/O spec (game domain), or those plus the reference code
  (tool-calling domain).

Domains mirror the paper's corpora: "game" (DCLM math + MegaScience science stand-in) =
sympy-docs + scipy-docs + codeio problems; "tool" (Nemotron code stand-in) = numpy-docs +
codeio problems with code. sympy comes with reasoning-gym and scipy with jax, so all are
present after `pip install -e .`.

Extraction is deterministic (modules in a fixed order, members sorted by name, docstrings
de-duplicated by content) and cached as JSONL under `$SPADE_JAX_CACHE` (default
`~/.cache/spade_jax`), keyed by the installed package versions.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import importlib
import importlib.metadata
import inspect
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Literal

from etils import epath

from spade_jax.spade.corpus import Document, InMemoryCorpus, MixtureCorpus

Domain = Literal["game", "tool"]

MATH_MODULES: tuple[str, ...] = (
    "sympy",
    "sympy.ntheory",
    "sympy.combinatorics",
    "sympy.functions.combinatorial.numbers",
    "sympy.solvers",
    "sympy.polys",
    "sympy.series",
    "sympy.integrals",
    "sympy.matrices",
    "sympy.geometry",
    "sympy.discrete",
    "sympy.logic",
    "sympy.sets",
    "sympy.stats",
    "scipy.special",
)
SCIENCE_MODULES: tuple[str, ...] = (
    "scipy.stats",
    "scipy.integrate",
    "scipy.constants",
    "scipy.optimize",
    "scipy.signal",
    "scipy.spatial",
    "scipy.interpolate",
    "scipy.linalg",
    "scipy.fft",
    "scipy.ndimage",
)
CODE_MODULES: tuple[str, ...] = (
    "numpy",
    "numpy.linalg",
    "numpy.fft",
    "numpy.random",
    "numpy.polynomial",
    "numpy.ma",
)


@dataclasses.dataclass(frozen=True)
class DefaultCorpusConfig:
    """What goes into the offline default corpus.

    Attributes:
      domain: "game" (math + science) or "tool" (code).
      min_chars: docstrings shorter than this are skipped (one-line aliases say nothing).
      include_codeio: add reasoning-gym's bundled CodeIO problems.
      cache_dir: where the built JSONL is cached; None -> $SPADE_JAX_CACHE or
        ~/.cache/spade_jax.
    """

    domain: Domain = "game"
    min_chars: int = 300
    include_codeio: bool = True
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        if self.domain not in ("game", "tool"):
            raise ValueError(
                f"DefaultCorpusConfig.domain must be 'game' or 'tool', got {self.domain!r}"
            )
        if self.min_chars < 1:
            raise ValueError(f"DefaultCorpusConfig.min_chars must be >= 1, got {self.min_chars}")


def docstring_documents(
    module_names: Sequence[str], source: str, min_chars: int = 300
) -> Iterator[Document]:
    """Docstrings of the public callables of `module_names`, one document each.

    A docstring reachable under several names (re-exports, aliases) is kept once, under the
    first module/name visited. Text = "<module>.<name>\\n\\n<docstring>".
    """
    seen_texts: set[str] = set()
    for module_name in module_names:
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise ImportError(f"default corpus source {module_name!r} is not importable") from error
        for name in sorted(dir(module)):
            if name.startswith("_"):
                continue
            member = getattr(module, name, None)
            if member is None or inspect.ismodule(member) or not callable(member):
                continue
            docstring = inspect.getdoc(member)
            if not docstring or len(docstring) < min_chars:
                continue
            digest = hashlib.sha1(docstring.encode("utf-8")).hexdigest()
            if digest in seen_texts:
                continue
            seen_texts.add(digest)
            qualified = f"{module_name}.{name}"
            yield Document(
                doc_id=f"{source}:{qualified}", text=f"{qualified}\n\n{docstring}", source=source
            )


def codeio_documents(with_code: bool, source: str = "reasoning_gym-codeio") -> Iterator[Document]:
    """reasoning-gym's bundled CodeIO problems (task, I/O spec, optionally reference code)."""
    from reasoning_gym.data import get_data_file_path

    with gzip.open(get_data_file_path("codeio.jsonl.gz"), "rt", encoding="utf-8") as handle:
        for index, line in enumerate(handle):
            record = json.loads(line)
            parts = [record["task_description"].strip(), record["input_output_spec"].strip()]
            if with_code:
                parts.append(record["code_sample"].strip())
            kind = "code" if with_code else "task"
            yield Document(
                doc_id=f"{source}-{kind}:{index}", text="\n\n".join(parts), source=source
            )


def _source_plan(config: DefaultCorpusConfig) -> list[tuple[str, Iterable[Document]]]:
    if config.domain == "game":
        plan = [
            ("sympy-docs", docstring_documents(MATH_MODULES, "sympy-docs", config.min_chars)),
            ("scipy-docs", docstring_documents(SCIENCE_MODULES, "scipy-docs", config.min_chars)),
        ]
    else:
        plan = [("numpy-docs", docstring_documents(CODE_MODULES, "numpy-docs", config.min_chars))]
    if config.include_codeio:
        plan.append(("reasoning_gym-codeio", codeio_documents(with_code=config.domain == "tool")))
    return plan


def _installed_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cache_key(config: DefaultCorpusConfig) -> str:
    packages = ("numpy", "scipy", "sympy") + (("reasoning_gym",) if config.include_codeio else ())
    versions = {package: _installed_version(package) for package in packages}
    if config.include_codeio and versions["reasoning_gym"] is None:
        raise ModuleNotFoundError(
            "the default corpus includes reasoning-gym's CodeIO problems, but reasoning_gym "
            "is not installed: install the project's dependencies (scripts/install.sh), or "
            "build the corpus with DefaultCorpusConfig(include_codeio=False)")
    payload = json.dumps(
        {
            "versions": versions,
            "config": dataclasses.asdict(config) | {"cache_dir": None},
            "modules": [MATH_MODULES, SCIENCE_MODULES, CODE_MODULES],
            "format": 1,
        },
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _cache_dir(config: DefaultCorpusConfig) -> epath.Path:
    if config.cache_dir is not None:
        return epath.Path(config.cache_dir)
    root = os.environ.get(
        "SPADE_JAX_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "spade_jax")
    )
    return epath.Path(root) / "corpus"


def _read_cache(path: epath.Path) -> dict[str, list[Document]]:
    by_source: dict[str, list[Document]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        document = Document(doc_id=record["id"], text=record["text"], source=record["source"])
        by_source.setdefault(document.source, []).append(document)
    return by_source


def default_corpus(config: DefaultCorpusConfig | None = None) -> MixtureCorpus:
    """The offline default corpus of `config.domain`, one mixture component per source.

    Built once per set of installed package versions and then read from the cache.
    """
    config = config or DefaultCorpusConfig()
    cache_path = _cache_dir(config) / f"default-{config.domain}-{_cache_key(config)}.jsonl"
    if cache_path.exists():
        by_source = _read_cache(cache_path)
    else:
        by_source = {source: list(documents) for source, documents in _source_plan(config)}
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        lines = [
            json.dumps({"id": d.doc_id, "text": d.text, "source": d.source}, ensure_ascii=False)
            for documents in by_source.values()
            for d in documents
        ]
        # Write then replace so a concurrent reader never sees a half-written cache; two
        # processes on one machine (a multi-process job) may build it at once, with equal text.
        partial = cache_path.parent / f"{cache_path.name}.{os.getpid()}.partial"
        partial.write_text("\n".join(lines) + "\n", encoding="utf-8")
        partial.replace(cache_path)  # another host process may have written it first
    components = [(InMemoryCorpus(docs, name=source), None) for source, docs in by_source.items()]
    return MixtureCorpus(components, name=f"default-{config.domain}")
