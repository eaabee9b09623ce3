"""Two real JAX processes on this CPU host forming one distributed system (gloo
collectives): the SPADE loop's corpus draws and memory selections are process 0's on
both hosts even when the hosts' local RNGs disagree; validation verdicts and episode
returns are process 0's even when a host's own differ (a flaky deadline is retried, a
persistent one stops both hosts with a clear error); each host opens only the environment
copies whose episodes it steps, and a copy's load verdict is that of the host opening the
program's first copy (a batch re-laid out after a drop moves copies between hosts); the
trained tokenizer is
process 0's; host seeds (and so the sandbox pools' seeds) differ; agree() round-trips
ints, strings, lists of strings and bytes; only process 0 writes metrics and INFO logs.

The same file is the worker: ``python tests/multihost/test_multihost.py OUT_DIR`` with
JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID set, as a TPU-pod launch
would set them, so ``distributed.maybe_initialize()`` is exercised too.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import gymnasium
import pytest

NUM_HOSTS = 2
# Every test reads the one two-process JAX run of the `hosts` fixture.
pytestmark = pytest.mark.slow


# ---- the worker (runs in each subprocess) --------------------------------------------------
class _CharTokenizer:
    """Characters as token ids: all the designer-prompt path needs."""

    eos_ids = frozenset({0})
    pad_id = 0

    def apply_chat_template(self, messages, add_generation_prompt=False, enable_thinking=True):
        return [ord(c) + 1 for c in "".join(f"<{m['role']}>{m['content']}" for m in messages)]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(t - 1) for t in ids)


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
                         docs_per_prompt=3, memory_examples=2, memory_train_envs=3, eval_every=0,
                         contract="paper")
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

    def generate(batch, *, seed, purpose):
        return [[] for _ in batch], [[] for _ in batch]

    loop = SpadeLoop(
        config, tokenizer=_CharTokenizer(), pool=None, generate=generate,
        run_episodes=lambda specs, *, seed: [], update=lambda seqs: {},
        corpus_sampler=CorpusSampler(corpus, CorpusSamplerConfig(seed=100 + host)),
        memory=memory, reward_rule=make_designer_reward("hint_regret"), seed=0)
    if not agreed:  # what each host would use on its own: its local draws
        distributed.agree_json, saved = (lambda value: value), distributed.agree_json
    try:
        rounds = []
        for round_index in range(2):
            slots = loop.designer.prompts(round_index)
            prompts.extend("".join(chr(t - 1) for t in slot.prompt_ids) for slot in slots)
            rounds.append({"doc_ids": [list(slot.doc_ids) for slot in slots],
                           "replay": [r.env_id for r in loop.replay_picks()]})
    finally:
        if not agreed:
            distributed.agree_json = saved
    return {"rounds": rounds, "prompts": prompts}


class _FakeEnv(gymnasium.Env):
    """Stands in for a sandboxed program: the scripted rounds never step it."""

    def __init__(self, program: str):
        self.program = program


def _scripted_rounds(host: int, rounds: int) -> dict[str, Any]:
    """Runs SPADE rounds with scripted sampling, validation, loading and episodes whose
    outcomes depend on ``host`` the way wall-clock deadlines would make them:

    round 0: PROGRAM 1 fails host 1's validation once (then passes a retry); PROGRAM 2
    fails process 0's validation only; PROGRAM 3 fails everywhere; PROGRAM 5 fails its
    first load on host 1 (which opens its last 2 of 5 copies: process 0 opens the first
    3); PROGRAM 1 fails its second load on process 0 (which opens all its copies); host 1's
    episode returns are half of process 0's. Round 1: PROGRAM 6 always fails host 1's
    validation. (The paper text's round: one window per round, one attempt per sample, -1
    for invalid.)
    """
    from types import SimpleNamespace

    from spade_jax.rollout.records import EpisodeRecord
    from spade_jax.spade import design as design_module
    from spade_jax.spade.config import SpadeConfig
    from spade_jax.spade.loop import SpadeLoop
    from spade_jax.spade.memory import EnvironmentMemory, EnvironmentRecord, MemoryConfig
    from spade_jax.spade.prompts import format_designer_output
    from spade_jax.spade.reward import make_designer_reward

    config = SpadeConfig(skills="two_skill", envs_per_round=8, designer_group_size=2,
                         hint_plays=2, plays_per_game=3, use_corpus=False, memory_examples=0,
                         memory_train_envs=2, eval_every=0, regeneration_interval=1,
                         designer_delay=0, max_design_attempts=1, invalid_penalty=-1.0,
                         hint_mode="designer", designer_reward="hint_regret",
                         designer_groups="prompt", contract="paper")
    memory = EnvironmentMemory(MemoryConfig(seed=5))
    for i in range(3):
        memory.add(EnvironmentRecord(
            env_id=f"m{i}", program_source=f"MEMORY {i}", hint="h", skill="math",
            round_index=0, regime="frontier", regret=0.1, win_rate_hint=0.5,
            win_rate_no_hint=0.25, mean_return_hint=0.5, mean_return_no_hint=0.25,
            designer_reward=0.0))
    calls: dict[str, int] = {}
    local_verdicts: dict[str, str] = {}  # each program's first validation outcome here

    def count(key: str) -> int:
        calls[key] = calls.get(key, 0) + 1
        return calls[key]

    def fake_validate(source, hint=None, pool=None, **contract):
        n = count("validate " + source)
        fail = {"PROGRAM r0 1": host == 1 and n == 1, "PROGRAM r0 2": host == 0,
                "PROGRAM r0 3": True, "PROGRAM r1 6": host == 1}.get(source, False)
        local_verdicts.setdefault(source, "timeout" if fail else "")
        reason = "static_gate: no" if source == "PROGRAM r0 3" else "timeout: deadline"
        return SimpleNamespace(ok=not fail, reason=reason if fail else "")

    def fake_make_env(source, pool=None, **contract):
        n = count("load " + source)
        if (source, host, n) in {("PROGRAM r0 5", 1, 1), ("PROGRAM r0 1", 0, 2)}:
            raise TimeoutError(source)
        return _FakeEnv(source)

    local_returns: list[float] = []
    local_envs: list[list[Any]] = []  # per episode: env id, and whether this host opened it

    def run_episodes(specs, *, seed):
        records = []
        local_envs.extend([spec.env_id, spec.env is not None] for spec in specs)
        for spec in specs:
            ret = (spec.seed % 5) / 4 * (1.0 if host == 0 else 0.5)
            local_returns.append(ret)
            records.append(EpisodeRecord(
                env_id=spec.env_id, seed=spec.seed, token_ids=[1, 2, 3, spec.seed % 97],
                loss_mask=[0, 1, 1, 1], logprobs=[0.0, -1.0, -1.0, -1.0],
                observations=["obs"], return_=ret))
        return records

    design_calls: list[int] = []

    def generate(batch, *, seed, purpose):
        round_index = len(design_calls)  # one designer call per round (one attempt)
        design_calls.append(round_index)
        texts = [format_designer_output(f"PROGRAM r{round_index} {i}", f"hint {i}")
                 for i in range(len(batch))]
        tokens = [[ord(c) + 1 for c in t] for t in texts]
        return tokens, [[-0.5] * len(t) for t in tokens]

    batches: list[list[list[Any]]] = []

    def update(seqs):
        batches.append([[q.token_ids, q.advantage, q.role] for q in seqs])
        return {}

    loop = SpadeLoop(config, tokenizer=_CharTokenizer(), pool=None, generate=generate,
                     run_episodes=run_episodes, update=update, corpus_sampler=None,
                     memory=memory, reward_rule=make_designer_reward("hint_regret"), seed=3)
    outcomes: list[dict[str, Any]] = []  # per round: the attempts' and games' verdicts
    play = loop.play

    def recording_play(window, step):
        records = play(window, step)
        outcomes.append({"kept": [g.env_id for g in window.games if g.verdict.ok],
                         "games": {g.env_id: g.verdict.label for g in window.games}})
        return records

    loop.play = recording_play
    def fake_validate_programs(sources, hints=None, **kwargs):
        return [fake_validate(source) for source in sources]

    saved = design_module.validate_programs, design_module.make_env
    design_module.validate_programs, design_module.make_env = fake_validate_programs, fake_make_env
    out: dict[str, Any] = {"errors": []}
    try:
        for round_index in range(rounds):
            try:
                loop.run_step(round_index)
            except RuntimeError as e:
                out["errors"].append([round_index, str(e)])
    finally:
        design_module.validate_programs, design_module.make_env = saved
    out.update(
        local_verdicts=local_verdicts, local_returns=local_returns, batches=batches,
        local_envs=local_envs,
        kept=[o["kept"] for o in outcomes], games=[o["games"] for o in outcomes],
        loads={k: v for k, v in calls.items() if k.startswith("load PROGRAM")})
    return out


def _tokenizer(host: int, out_dir: Path) -> dict[str, Any]:
    """build_tokenizer with no path, on a corpus that differs per host (as locally
    installed files can): host 1 must end up with process 0's model, untrained here."""
    import hashlib

    import spade_jax.tokenizers as tokenizers
    from spade_jax.experiment import TokenizerSpec
    from spade_jax.run import _seed_program_text, build_tokenizer

    words = ("alpha beta gamma delta", "rouge vert bleu jaune")[host]
    corpus = out_dir / f"corpus{host}.txt"
    corpus.write_text("\n".join(f"{words} {i} {words[::-1]}" for i in range(300)))
    trained: list[str] = []
    saved = tokenizers.project_text_files, tokenizers.train_sentencepiece

    def counting_train(files, prefix, **kwargs):
        trained.append(str(prefix))
        return saved[1](files, prefix, **kwargs)

    tokenizers.project_text_files = lambda root=None: [corpus]
    tokenizers.train_sentencepiece = counting_train
    try:
        workdir = out_dir / f"work{host}"  # per host: host 1 cannot read process 0's file
        tok = build_tokenizer(TokenizerSpec(vocab_size=400), workdir)
        # What this host would have trained on its own (so the test can tell).
        own_dir = out_dir / f"own{host}"
        own_dir.mkdir()
        own = saved[1]([corpus, _seed_program_text(own_dir)], str(own_dir / "spm"),
                       vocab_size=400)
    finally:
        tokenizers.project_text_files, tokenizers.train_sentencepiece = saved
    sample = "rouge alpha 12 <think>"
    return {"sha": hashlib.sha256(tok.model_file.read_bytes()).hexdigest(),
            "own_sha": hashlib.sha256(own.model_file.read_bytes()).hexdigest(),
            "encode": tok.encode(sample), "vocab_size": tok.vocab_size,
            "chat": tok.apply_chat_template([{"role": "user", "content": sample}],
                                            add_generation_prompt=True),
            "trained": len(trained),
            "workdir_files": sorted(str(p.relative_to(workdir)) for p in workdir.rglob("*"))
            if workdir.exists() else []}


def _pool_seeds() -> dict[str, Any]:
    """run.build_pool's pool, and the seeds it draws for resets that give none."""
    from spade_jax.envs import SandboxConfig
    from spade_jax.experiment import ExperimentConfig
    from spade_jax.run import build_pool
    from spade_jax.spade import seed_programs

    config = ExperimentConfig(name="t", seed=11, sandbox=SandboxConfig(allow_weak_isolation=True))
    with build_pool(config) as pool:
        handle = pool.open(seed_programs.SEED_PROGRAMS[0].source)
        assert handle.ok, handle.error
        seeds = []
        for _ in range(2):
            assert handle.reset().ok
            seeds.append(handle.seed)
        handle.close()
        return {"pool_seed": pool.seed, "reset_seeds": seeds}


def _logging(out_dir: Path) -> dict[str, Any]:
    import logging

    from spade_jax.train import _setup_logging

    logs = out_dir / "logs"  # shared by both hosts, like a workdir on a shared disk
    logs.mkdir(exist_ok=True)
    _setup_logging(logs)
    probe = logging.getLogger("spade_jax.run")
    return {"info": probe.isEnabledFor(logging.INFO),
            "warning": probe.isEnabledFor(logging.WARNING)}


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
    result["agree"]["bytes"] = distributed.agree_bytes(bytes(range(host, 256))).hex()
    result["local"] = _loop(host, agreed=False)
    result["agreed"] = _loop(host, agreed=True)
    result["scripted"] = _scripted_rounds(host, rounds=2)
    result["tokenizer"] = _tokenizer(host, out_dir)
    result["pool"] = _pool_seeds()
    with MetricsWriter(out_dir / "run") as writer:  # the same directory for both hosts
        writer.write(0, {"host": host})
    result["logging"] = _logging(out_dir)
    (out_dir / f"host{host}.json").write_text(json.dumps(result, sort_keys=True))


# ---- the test (runs under pytest) ----------------------------------------------------------
def _run_hosts(out_dir: Path) -> list[dict[str, Any]]:
    import multiproc

    multiproc.run_processes([[sys.executable, __file__, str(out_dir)]] * NUM_HOSTS,
                            multiproc.host_envs(NUM_HOSTS),
                            [f"host {h}" for h in range(NUM_HOSTS)], timeout=120)
    return [json.loads((out_dir / f"host{h}.json").read_text()) for h in range(NUM_HOSTS)]


@pytest.fixture(scope="module")
def hosts(tmp_path_factory) -> tuple[Path, list[dict[str, Any]]]:
    """One two-process run (~40 s) shared by the tests below."""
    out_dir = tmp_path_factory.mktemp("multihost")
    return out_dir, _run_hosts(out_dir)


def test_two_hosts_agree_on_corpus_and_memory_draws(hosts):
    from spade_jax import distributed

    tmp_path, (h0, h1) = hosts
    assert (h0["host"], h1["host"], h0["process_count"]) == (0, 1, NUM_HOSTS)
    assert (h0["primary"], h1["primary"]) == (True, False)

    # Host seeds: host 0 keeps the seed, host 1 gets its own, reproducibly.
    assert h0["host_seed"] == 7
    assert h1["host_seed"] == distributed.host_seed(7, 1) != 7

    # agree(): process 0's value on both hosts, whatever host 1 passed in.
    expected = {"int": 10, "str": "hôte ", "list": [f"élément {i} " for i in range(3)],
                "json": {"host": 0, "xs": [1.5, 0], "s": ""}, "bytes": bytes(range(256)).hex()}
    assert h0["agree"] == h1["agree"] == expected

    # Without agreement the hosts' draws differ (so this test can fail) ...
    for key in ("doc_ids", "replay"):
        assert [r[key] for r in h0["local"]["rounds"]] != [r[key] for r in h1["local"]["rounds"]]
    assert h0["local"]["prompts"] != h1["local"]["prompts"]  # the memory examples differ too
    # ... with it, both hosts hold process 0's draws and build the same designer prompts.
    assert h0["agreed"] == h1["agreed"] == h0["local"]
    doc_ids = [d for r in h0["agreed"]["rounds"] for slot in r["doc_ids"] for d in slot]
    assert len(doc_ids) == 2 * 4 * 3  # rounds x slots x docs per prompt
    assert all(len(r["replay"]) == 3 for r in h0["agreed"]["rounds"])

    # Only process 0 wrote metrics, and only it logs INFO (to stderr and train.log).
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["host"] for line in lines] == [0]
    assert h0["logging"] == {"info": True, "warning": True}
    assert h1["logging"] == {"info": False, "warning": True}
    assert [p.name for p in (tmp_path / "logs").iterdir()] == ["train.log"]


def test_two_hosts_keep_process_0s_environments_and_returns(hosts):
    _, (h0, h1) = hosts
    s0, s1 = h0["scripted"], h1["scripted"]
    # The hosts' own verdicts and returns differ (so agreement has something to do) ...
    v0, v1 = s0["local_verdicts"], s1["local_verdicts"]
    assert (v0["PROGRAM r0 1"], v1["PROGRAM r0 1"]) == ("", "timeout")
    assert (v0["PROGRAM r0 2"], v1["PROGRAM r0 2"]) == ("timeout", "")
    assert s0["local_returns"] != s1["local_returns"]
    # ... yet both hosts kept the same environments, with process 0's reasons, and built the
    # same training batch (agent advantages from the returns, designer advantages from the
    # designer rewards) as process 0 run alone: the single-host path as the reference.
    reference = _scripted_rounds(0, rounds=1)  # this pytest process is a single host
    for key in ("kept", "games", "batches"):
        assert s0[key][:1] == s1[key][:1] == reference[key], key
    # sample i of the round = slot i // 2, member i % 2; programs 2 and 3 never became
    # games (validation), program 1 failed to load on process 0.
    assert reference["kept"] == [["r0_s0_m0", "r0_s2_m0", "r0_s2_m1", "r0_s3_m0", "r0_s3_m1"]]
    assert "r0_s1_m0" not in reference["games"][0]
    assert reference["games"][0]["r0_s0_m1"] == "load_error/TimeoutError"
    roles = [row[2] for row in reference["batches"][0]]
    # 5 valid games x 3 no-hint plays + 2 replayed memory games x 3, then 8 designer rows
    # (the 2 invalid and the unloadable one with the -1 penalty)
    assert roles == ["agent"] * (5 * 3 + 2 * 3) + ["designer"] * 8
    # Owner-only opening. The first layout (6 games x 5 copies, then 2 x 3 replays: 36
    # episodes, host 0 the first 18) gives host 0 programs 0, 1, 4 and 5's copies 0-2, host
    # 1 program 5's copies 3-4, programs 6, 7 and the replays. Program 1 fails on host 0
    # (its first copy's host): dropped everywhere. Program 5 fails on host 1 only, where
    # host 0 passed: host 1 opens its two copies again. The new layout (31 episodes, host 0
    # the first 16) moves program 5's copies 3-4 and program 6's copy 0 to host 0.
    assert s0["loads"] == {"load PROGRAM r0 0": 5, "load PROGRAM r0 1": 2,
                           "load PROGRAM r0 4": 5, "load PROGRAM r0 5": 3 + 2,
                           "load PROGRAM r0 6": 1}
    assert s1["loads"] == {"load PROGRAM r0 5": 1 + 2, "load PROGRAM r0 6": 5,
                           "load PROGRAM r0 7": 5}
    # Every episode of the batch has its environment on exactly its owner's host.
    from spade_jax.rollout.agent_loop import episode_owner

    envs0, envs1 = s0["local_envs"], s1["local_envs"]
    assert [e[0] for e in envs0] == [e[0] for e in envs1] and len(envs0) == 31
    for i, ((_, here0), (_, here1)) in enumerate(zip(envs0, envs1, strict=True)):
        assert (here0, here1) == ((True, False) if episode_owner(i, 31, 2) == 0
                                  else (False, True)), i
    assert [e[0] for e in reference["local_envs"]] == [e[0] for e in envs0]
    assert all(here for _, here in reference["local_envs"])
    # Round 1: PROGRAM 6 fails on host 1 even on the retry, so both hosts stop, together
    # (no host left waiting in a collective), naming the program and the host.
    (r0, e0), (r1, e1) = s0["errors"][0], s1["errors"][0]
    assert (r0, r1, len(s0["errors"]), len(s1["errors"])) == (1, 1, 1, 1)
    assert "validation" in e0 and "host(s) [1]" in e0 and "host(s) [1]" in e1
    assert "this host (1) rejects r1_s3_m0_a0 ('timeout', then 'timeout' on a retry)" in e1


def test_two_hosts_share_process_0s_tokenizer_and_seed_pools_per_host(hosts):
    import random

    from spade_jax import distributed

    _, (h0, h1) = hosts
    t0, t1 = h0["tokenizer"], h1["tokenizer"]
    assert t0["own_sha"] != t1["own_sha"]  # trained on its own corpus, host 1's would differ
    assert t1["sha"] == t0["sha"] == t0["own_sha"]
    assert (t0["encode"], t0["chat"], t0["vocab_size"]) == (t1["encode"], t1["chat"],
                                                            t1["vocab_size"])
    assert (t0["trained"], t1["trained"]) == (1, 0)
    assert "tokenizer/spm.model" in t0["workdir_files"] and t1["workdir_files"] == []
    # Pools: host 0 keeps the experiment seed, host 1 its own; a reset without a seed
    # draws from the pool's seeded stream.
    for host, h in enumerate((h0, h1)):
        seed = distributed.host_seed(11, host)
        rng = random.Random(seed)
        assert h["pool"] == {"pool_seed": seed,
                             "reset_seeds": [rng.randrange(2**31), rng.randrange(2**31)]}
    assert h0["pool"]["pool_seed"] == 11 != h1["pool"]["pool_seed"]


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
