"""The main command as a two-host slice would start it (issue 15 item 6).

``python -m spade_jax.train --experiment=tiny`` twice, with JAX_COORDINATOR_ADDRESS /
JAX_NUM_PROCESSES / JAX_PROCESS_ID set: both must exit 0, process 0 writes the run's
files (metrics, checkpoint, report) and process 1 none. Shortened with ``--set`` to the
fewest phases that still run every part of a round across the processes: one round on the
fixed pool of seed programs (valid programs, so validation, sandboxed episodes sharded
over the hosts, memory and a train step on agent sequences all run), no warm start, no
evaluation. Before the fix the run died in the sampler's first read of a row-sharded
array (``np.asarray`` on an array spanning both processes).
"""

from __future__ import annotations

import json
import sys

import multiproc
import pytest


@pytest.mark.slow
def test_train_command_on_two_processes(tmp_path):
    workdir = tmp_path / "run"
    overrides = ["spade.rounds=1", "warm_start.steps=0", "spade.eval_every=0",
                 "spade.designer_mode='fixed_pool'", "agent.max_turns=1",
                 "agent.max_turn_tokens=8"]
    command = [sys.executable, "-m", "spade_jax.train", "--experiment=tiny",
               f"--workdir={workdir}"] + [f"--set={o}" for o in overrides]
    logs = multiproc.run_processes(
        [command] * 2, multiproc.host_envs(2, SPADE_JAX_CACHE=str(tmp_path / "cache")),
        ["host 0", "host 1"], timeout=900)
    # Process 0's report and metrics; the round really ran on both hosts' episodes.
    assert (workdir / "report.md").read_text().startswith("# SPADE run: tiny")
    (line,) = (workdir / "metrics.jsonl").read_text().splitlines()
    metrics = json.loads(line)
    assert metrics["validity_rate"] > 0 and metrics["train/agent/sequences"] > 0
    assert "done in" in logs[0] and "done in" not in logs[1]  # process 1 logs warnings only
    assert (workdir / "checkpoints").is_dir()


def test_default_corpus_cache_written_concurrently(tmp_path, monkeypatch):
    """Two processes of one job on one machine build the default corpus cache at once; the
    one that finishes second found the file already there and died (FileExistsError from
    a rename onto an existing path). It now replaces the equal file."""
    import importlib

    dc = importlib.import_module("spade_jax.spade.default_corpus")  # the package re-exports

    monkeypatch.setenv("SPADE_JAX_CACHE", str(tmp_path))
    config = dc.DefaultCorpusConfig()
    real_plan = dc._source_plan
    cache = dc._cache_dir(config) / f"default-{config.domain}-{dc._cache_key(config)}.jsonl"

    def racing_plan(cfg):  # the other process renames its copy in while this one builds
        plan = [(source, list(docs)) for source, docs in real_plan(cfg)]
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text("".join(json.dumps({"id": d.doc_id, "text": d.text, "source": d.source})
                                 + "\n" for _, docs in plan for d in docs))
        return plan

    monkeypatch.setattr(dc, "_source_plan", racing_plan)
    corpus = dc.default_corpus(config)
    monkeypatch.setattr(dc, "_source_plan", real_plan)
    again = dc.default_corpus(config)  # now read from the cache
    assert len(corpus) == len(again) > 0
    assert not list(tmp_path.rglob("*.partial"))
