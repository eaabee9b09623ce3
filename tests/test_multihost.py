"""Two real JAX processes on this CPU host forming one distributed system (gloo
collectives): the SPADE loop's corpus draws and memory selections are process 0's on
both hosts even when the hosts' local RNGs disagree; host seeds differ; agree() round-trips
ints, strings and lists of strings; only process 0 writes metrics.

The same file is the worker: ``python tests/test_multihost.py OUT_DIR`` with
JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID set, as a TPU-pod launch
would set them, so ``distributed.maybe_initialize()`` is exercised too.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
NUM_HOSTS = 2


# ---- the worker (runs in each subprocess) --------------------------------------------------
class _CharTokenizer:
    """Characters as token ids: all the designer-prompt path needs."""

    eos_ids = frozenset({0})
    pad_id = 0

    def apply_chat_template(self, messages, add_generation_prompt=False, enable_thinking=True):
        return [ord(c) + 1 for c in "".join(f"<{m['role']}>{m['content']}" for m in messages)]


def _loop(host: int, agreed: bool):
    """A SpadeLoop whose corpus sampler and memory are seeded per host (the divergence a
    multi-host run must not let through), with the same 12 memory records on both hosts."""
    from spade_jax import distributed
    from spade_jax.spade.config import SpadeConfig
    from spade_jax.spade.corpus import CorpusSampler, CorpusSamplerConfig, Document, InMemoryCorpus
    from spade_jax.spade.loop import SpadeLoop
    from spade_jax.spade.memory import EnvironmentMemory, EnvironmentRecord, MemoryConfig
    from spade_jax.spade.reward import make_designer_reward
    from spade_jax.spade.skills import get_skill_set

    config = SpadeConfig(skills="two_skill", envs_per_round=8, designer_group_size=2,
                         docs_per_prompt=3, memory_examples=2, memory_train_envs=3, eval_every=0)
    corpus = InMemoryCorpus([Document(f"doc{i}", f"text {i} " * 3, "test") for i in range(200)],
                            "test")
    memory = EnvironmentMemory(MemoryConfig(seed=200 + host))
    skills = [s.name for s in get_skill_set(config.skills)]
    for i in range(12):
        memory.add(EnvironmentRecord(
            env_id=f"env{i}", program_source=f"program {i}", hint=f"hint {i}",
            skill=skills[i % len(skills)], round_index=0,
            regime=("frontier", "mastered", "intractable")[i % 3], regret=0.1 * i,
            win_rate_hint=0.5, win_rate_no_hint=0.25, mean_return_hint=0.5,
            mean_return_no_hint=0.25, designer_reward=0.0))
    prompts: list[str] = []

    def generate(batch, round_index):
        prompts.extend("".join(chr(t - 1) for t in p) for p in batch)
        return [[] for _ in batch], [[] for _ in batch]

    loop = SpadeLoop(
        config, tokenizer=_CharTokenizer(), pool=None, generate=generate,
        run_episodes=lambda specs: [], update=lambda seqs: {},
        corpus_sampler=CorpusSampler(corpus, CorpusSamplerConfig(seed=100 + host)),
        memory=memory, reward_rule=make_designer_reward("hint_regret"), seed=0)
    if not agreed:  # what each host would use on its own: its local draws
        distributed.agree_json, saved = (lambda value: value), distributed.agree_json
    try:
        rounds = []
        for round_index in range(2):
            candidates = loop.design(round_index)
            rounds.append({"doc_ids": [list(c.doc_ids) for c in candidates],
                           "replay": [r.env_id for r in loop._replay_picks()]})
    finally:
        if not agreed:
            distributed.agree_json = saved
    return {"rounds": rounds, "prompts": prompts}


def _worker(out_dir: Path) -> None:
    from spade_jax import distributed

    assert distributed.maybe_initialize(), "the JAX_* variables should make this a multi-host job"
    import jax

    from spade_jax.metrics import MetricsWriter

    host = jax.process_index()
    result: dict[str, Any] = {"host": host, "process_count": jax.process_count(),
                              "primary": distributed.is_primary(),
                              "host_seed": distributed.host_seed(7)}
    # Host-dependent inputs, so a broadcast that did nothing would show.
    result["agree"] = {
        "int": int(distributed.agree(10 + host)),
        "str": distributed.agree("hôte " * (host + 1)),
        "list": distributed.agree([f"élément {i} " * (host + 1) for i in range(3 + 2 * host)]),
        "json": distributed.agree_json({"host": host, "xs": [1.5, host], "s": "ok" * host}),
    }
    result["local"] = _loop(host, agreed=False)
    result["agreed"] = _loop(host, agreed=True)
    with MetricsWriter(out_dir / "run") as writer:  # the same directory for both hosts
        writer.write(0, {"host": host})
    (out_dir / f"host{host}.json").write_text(json.dumps(result, sort_keys=True))


# ---- the test (runs under pytest) ----------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_hosts(out_dir: Path) -> list[dict[str, Any]]:
    port = _free_port()
    procs = []
    for host in range(NUM_HOSTS):
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", PYTHONPATH=str(REPO),
                   JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                   JAX_NUM_PROCESSES=str(NUM_HOSTS), JAX_PROCESS_ID=str(host))
        procs.append(subprocess.Popen([sys.executable, __file__, str(out_dir)], cwd=REPO, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=120)[0])
    finally:
        for proc in procs:  # one host failing leaves the other waiting in a collective
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for host, (proc, log) in enumerate(zip(procs, logs, strict=True)):
        assert proc.returncode == 0, f"host {host} exited {proc.returncode}:\n{log[-3000:]}"
    return [json.loads((out_dir / f"host{h}.json").read_text()) for h in range(NUM_HOSTS)]


def test_two_hosts_agree_on_corpus_and_memory_draws(tmp_path):
    from spade_jax import distributed

    h0, h1 = _run_hosts(tmp_path)
    assert (h0["host"], h1["host"], h0["process_count"]) == (0, 1, NUM_HOSTS)
    assert (h0["primary"], h1["primary"]) == (True, False)

    # Host seeds: host 0 keeps the seed, host 1 gets its own, reproducibly.
    assert h0["host_seed"] == 7
    assert h1["host_seed"] == distributed.host_seed(7, 1) != 7

    # agree(): process 0's value on both hosts, whatever host 1 passed in.
    expected = {"int": 10, "str": "hôte ", "list": [f"élément {i} " for i in range(3)],
                "json": {"host": 0, "xs": [1.5, 0], "s": ""}}
    assert h0["agree"] == h1["agree"] == expected

    # Without agreement the hosts' draws differ (so this test can fail) ...
    for key in ("doc_ids", "replay"):
        assert [r[key] for r in h0["local"]["rounds"]] != [r[key] for r in h1["local"]["rounds"]]
    assert h0["local"]["prompts"] != h1["local"]["prompts"]  # the memory examples differ too
    # ... with it, both hosts hold process 0's draws and build the same designer prompts.
    assert h0["agreed"] == h1["agreed"] == h0["local"]
    doc_ids = [d for r in h0["agreed"]["rounds"] for slot in r["doc_ids"] for d in slot]
    assert len(doc_ids) == 2 * 4 * 2 * 3  # rounds x slots x group x docs per prompt
    assert all(len(r["replay"]) == 3 for r in h0["agreed"]["rounds"])

    # Only process 0 wrote metrics.
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["host"] for line in lines] == [0]


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
