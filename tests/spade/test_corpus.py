"""Corpus readers, mixture, the no-reuse resumable sampler, and the offline default corpus."""

import gzip
import inspect
import json
import os
import subprocess
import sys

import pytest

from spade_jax.spade import (
    CorpusExhaustedError,
    CorpusSampler,
    CorpusSamplerConfig,
    DefaultCorpusConfig,
    Document,
    InMemoryCorpus,
    JsonlCorpus,
    MixtureCorpus,
    ParquetCorpus,
    TextShardConfig,
    default_corpus,
)
from spade_jax.spade.default_corpus import docstring_documents


def _write_jsonl(path, records, compress=False):
    payload = "".join(json.dumps(r) + "\n" for r in records)
    if compress:
        with gzip.open(path, "wt", encoding="utf-8") as handle:
            handle.write(payload)
    else:
        path.write_text(payload, encoding="utf-8")
    return path


def _corpus(n, name="pool"):
    return InMemoryCorpus([Document(f"{name}:{i}", f"text {i}", name) for i in range(n)], name)


def test_jsonl_reads_plain_gz_and_globs_in_sorted_order(tmp_path):
    _write_jsonl(tmp_path / "b.jsonl.gz", [{"text": "beta"}, {"text": "gamma"}], compress=True)
    _write_jsonl(tmp_path / "a.jsonl", [{"text": "alpha", "url": "u"}, {"text": "  "}])
    corpus = JsonlCorpus(str(tmp_path / "*.jsonl*"), name="dclm")
    assert [corpus[i].text for i in range(len(corpus))] == ["alpha", "beta", "gamma"]
    assert corpus[0].doc_id == "a.jsonl:0" and corpus[1].doc_id == "b.jsonl.gz:0"
    assert {corpus[i].source for i in range(len(corpus))} == {"dclm"}


def test_jsonl_shards_with_the_same_base_name_get_distinct_ids(tmp_path):
    # DCLM: global-shard_XX/local-shard_Y/shard_00000000_processed.jsonl.zst in every folder.
    for folder in ("global-01", "global-02"):
        (tmp_path / folder).mkdir()
        _write_jsonl(tmp_path / folder / "shard_0.jsonl", [{"text": f"from {folder}"}])
    corpus = JsonlCorpus(str(tmp_path / "global-*" / "shard_0.jsonl"), name="dclm")
    assert [corpus[i].doc_id for i in range(2)] == [
        "global-01/shard_0.jsonl:0",
        "global-02/shard_0.jsonl:0",
    ]


def test_jsonl_budget_id_field_and_min_chars(tmp_path):
    records = [{"text": f"document number {i}", "id": f"d{i}"} for i in range(10)]
    records.insert(3, {"text": "tiny", "id": "short"})
    path = _write_jsonl(tmp_path / "shard.jsonl", records)
    config = TextShardConfig(id_field="id", max_documents=4, min_chars=8)
    corpus = JsonlCorpus([path], name="math", config=config)
    assert [corpus[i].doc_id for i in range(len(corpus))] == ["d0", "d1", "d2", "d3"]


def test_jsonl_errors_name_the_file_and_line(tmp_path):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"text": "ok"}, {"content": "no text"}])
    with pytest.raises(ValueError, match=r"bad.jsonl:2: record has no 'text' field"):
        JsonlCorpus(path, name="x")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(ValueError, match=r"broken.jsonl:2: not valid JSON"):
        JsonlCorpus(broken, name="x")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        JsonlCorpus(tmp_path / "missing.jsonl", name="x")
    with pytest.raises(FileNotFoundError, match="matched no files"):
        JsonlCorpus(str(tmp_path / "*.parquet"), name="x")
    with pytest.raises(ValueError, match="no documents"):
        JsonlCorpus(_write_jsonl(tmp_path / "empty.jsonl", [{"text": ""}]), name="x")


def test_parquet_reads_text_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"text": [f"science doc {i}" for i in range(5)], "meta": list(range(5))})
    pq.write_table(table, tmp_path / "part-0.parquet", row_group_size=2)
    corpus = ParquetCorpus(
        tmp_path / "part-0.parquet", "megascience", TextShardConfig(max_documents=4)
    )
    assert [corpus[i].text for i in range(len(corpus))] == [f"science doc {i}" for i in range(4)]
    assert corpus[3].doc_id == "part-0.parquet:3"
    with pytest.raises(ValueError, match="columns \\['body'\\] missing"):
        ParquetCorpus(tmp_path / "part-0.parquet", "x", TextShardConfig(text_field="body"))


def test_parquet_without_pyarrow_says_how_to_fix(tmp_path, monkeypatch):
    path = tmp_path / "part-0.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match="pip install pyarrow"):
        ParquetCorpus(path, "x")


def test_mixture_budgets_and_indexing():
    math, science = _corpus(10, "math"), _corpus(8, "science")
    mixture = MixtureCorpus([(math, 6), (science, 3)], name="game")
    assert len(mixture) == 9 and mixture.budgets == {"math": 6, "science": 3}
    assert [mixture[i].doc_id for i in range(9)] == [f"math:{i}" for i in range(6)] + [
        f"science:{i}" for i in range(3)
    ]
    with pytest.raises(IndexError):
        mixture[9]
    with pytest.raises(ValueError, match="asks 11 documents of 'math', which has 10"):
        MixtureCorpus([(math, 11)])
    with pytest.raises(ValueError, match="share document ids"):
        MixtureCorpus([(math, None), (_corpus(3, "math"), None)])


def test_sampler_never_reuses_a_document_within_a_run():
    corpus = MixtureCorpus([(_corpus(40, "math"), None), (_corpus(20, "science"), None)])
    sampler = CorpusSampler(corpus, CorpusSamplerConfig(seed=3, documents_per_round=7))
    drawn = []
    for _ in range(8):  # 56 of 60 documents
        drawn += [d.doc_id for d in sampler.sample()]
    assert len(drawn) == len(set(drawn)) == 56
    assert sampler.remaining == 4
    state_before = sampler.state_dict()
    with pytest.raises(CorpusExhaustedError, match="4 unseen documents left, asked for 7"):
        sampler.sample()
    assert sampler.state_dict() == state_before  # a refused draw consumes nothing
    last = [d.doc_id for d in sampler.sample(4)]
    assert set(drawn) | set(last) == {corpus[i].doc_id for i in range(len(corpus))}


def test_sampler_draws_are_seeded_and_not_in_corpus_order():
    corpus = _corpus(50)
    order_a = [d.doc_id for d in CorpusSampler(corpus, CorpusSamplerConfig(seed=0)).sample(50)]
    order_b = [d.doc_id for d in CorpusSampler(corpus, CorpusSamplerConfig(seed=0)).sample(50)]
    order_c = [d.doc_id for d in CorpusSampler(corpus, CorpusSamplerConfig(seed=1)).sample(50)]
    assert order_a == order_b != order_c
    assert order_a != [corpus[i].doc_id for i in range(50)]


def test_sampler_new_epoch_mode_never_repeats_inside_a_round():
    config = CorpusSamplerConfig(seed=0, documents_per_round=4, on_exhausted="new_epoch")
    sampler = CorpusSampler(_corpus(10), config)
    rounds = [[d.doc_id for d in sampler.sample()] for _ in range(6)]
    assert all(len(set(r)) == 4 for r in rounds)
    assert sampler.epoch == 2  # 10 docs -> two rounds per epoch, tail of 2 dropped
    assert len(set(rounds[0] + rounds[1])) == 8


def test_sampler_resume_continues_with_identical_samples():
    corpus = MixtureCorpus([(_corpus(30, "math"), None), (_corpus(15, "science"), None)])
    config = CorpusSamplerConfig(seed=11, documents_per_round=5, on_exhausted="new_epoch")
    uninterrupted = CorpusSampler(corpus, config)
    expected = [[d.doc_id for d in uninterrupted.sample()] for _ in range(14)]

    first = CorpusSampler(corpus, config)
    for _ in range(5):
        first.sample()
    saved = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores
    resumed = CorpusSampler(corpus, config)
    resumed.load_state_dict(saved)
    assert [[d.doc_id for d in resumed.sample()] for _ in range(9)] == expected[5:]


def test_sampler_refuses_state_of_another_corpus_or_seed():
    sampler = CorpusSampler(_corpus(20), CorpusSamplerConfig(seed=0, documents_per_round=2))
    sampler.sample()
    state = sampler.state_dict()
    with pytest.raises(ValueError, match="different corpus"):
        CorpusSampler(_corpus(21), CorpusSamplerConfig(seed=0)).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        CorpusSampler(_corpus(20), CorpusSamplerConfig(seed=5)).load_state_dict(state)
    with pytest.raises(ValueError, match="missing 'cursor'"):
        sampler.load_state_dict({k: v for k, v in state.items() if k != "cursor"})
    with pytest.raises(ValueError, match="on_exhausted"):
        CorpusSamplerConfig(on_exhausted="wrap")


def test_default_game_corpus_is_real_package_text_and_cached(tmp_path):
    import sympy

    config = DefaultCorpusConfig(domain="game", cache_dir=str(tmp_path))
    corpus = default_corpus(config)
    sizes = corpus.budgets
    assert set(sizes) == {"sympy-docs", "scipy-docs", "reasoning_gym-codeio"}
    assert min(sizes.values()) > 100
    by_id = {corpus[i].doc_id: corpus[i] for i in range(len(corpus))}
    assert len(by_id) == len(corpus)
    factorint = by_id["sympy-docs:sympy.factorint"]
    assert inspect.getdoc(sympy.factorint) in factorint.text  # shipped text, not invented
    assert factorint.source == "sympy-docs"
    cache_files = list(tmp_path.glob("corpus/default-game-*.jsonl")) + list(
        tmp_path.glob("default-game-*.jsonl")
    )
    assert len(cache_files) == 1
    cached = default_corpus(config)  # second call reads the cache
    assert [cached[i] for i in range(len(cached))] == [corpus[i] for i in range(len(corpus))]
    sampler = CorpusSampler(cached, CorpusSamplerConfig(documents_per_round=24))
    assert len({d.doc_id for d in sampler.sample()}) == 24


@pytest.mark.slow
def test_docstring_extraction_is_deterministic_across_processes():
    script = (
        "import json; from spade_jax.spade.default_corpus import docstring_documents as d;"
        "print(json.dumps([[x.doc_id, x.text] for x in d(['numpy.linalg'], 'numpy-docs')]))"
    )
    env = dict(os.environ, PYTHONHASHSEED="123")
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    ).stdout
    here = [[x.doc_id, x.text] for x in docstring_documents(["numpy.linalg"], "numpy-docs")]
    assert json.loads(out) == here and len(here) > 10


def test_zstd_shards_without_zstandard_say_how_to_fix(tmp_path, monkeypatch):
    path = tmp_path / "shard.jsonl.zst"
    path.write_bytes(b"\x28\xb5\x2f\xfd")
    monkeypatch.setitem(sys.modules, "zstandard", None)
    with pytest.raises(ImportError, match="pip install zstandard"):
        JsonlCorpus(path, name="dclm")


def test_default_corpus_names_a_missing_reasoning_gym_and_builds_without_codeio(monkeypatch):
    """A host without reasoning_gym (e.g. an accelerator image with the project's own
    packages only) gets an error naming the package and the way around it, and a corpus
    without CodeIO does not need the package at all."""
    import importlib
    import importlib.metadata

    dc = importlib.import_module("spade_jax.spade.default_corpus")  # the package re-exports

    real = importlib.metadata.version

    def version(package):
        if package == "reasoning_gym":
            raise importlib.metadata.PackageNotFoundError(package)
        return real(package)

    monkeypatch.setattr(importlib.metadata, "version", version)
    with pytest.raises(ModuleNotFoundError, match="reasoning_gym.*include_codeio=False"):
        dc._cache_key(dc.DefaultCorpusConfig())
    key = dc._cache_key(dc.DefaultCorpusConfig(include_codeio=False))
    assert len(key) == 16
