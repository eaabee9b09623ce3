"""The real model across two JAX processes (issue 15 items 2 and 3).

Two CPU processes with two devices each form one distributed system over gloo; the mesh
puts FSDP across all four devices, so parameter shards and batch rows live on both
processes. Each process runs a tiny random Qwen3-MoE (a transformers checkpoint, loaded
with ``load_hf``) through the REAL sampler (``generate``, with chunked decoding, batch
compaction, router recording and stop strings), the REAL multi-turn ``run_episodes`` on in-process
scripted text environments, and the REAL jitted train step on those episodes. A third,
single process with four devices runs the same script: the reference.

Checked: both processes get the same tokens, log-probs, episode records and updated
parameters as the single process; each episode was reset and stepped on exactly one host
(its owner), the hosts' shares cover the batch; an env deadline that fires on its owner
only is everyone's outcome (both hosts end that episode the same way, the streams agree).

The same file is the worker: ``python tests/multihost/test_multihost_model.py CKPT OUT_DIR``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

NUM_HOSTS, DEVICES_PER_HOST = 2, 2
EOS = 0


# ---- the worker ----------------------------------------------------------------------------
class _AsciiTokenizer:
    """Printable ASCII as ids 1..95 (the tiny model's vocabulary is 96); id 0 is the end of
    a turn. A prefix-stable chat template, as ``ChatTurns`` needs."""

    eos_ids = frozenset({EOS})
    pad_id = EOS

    def encode(self, text: str) -> list[int]:
        return [min(95, max(1, ord(c) - 31)) for c in text]

    def decode(self, ids, skip_special_tokens=False) -> str:
        return "".join(chr(int(t) + 31) for t in ids if t != EOS)

    def apply_chat_template(self, messages, add_generation_prompt=False, enable_thinking=False):
        ids = []
        for m in messages:
            ids += self.encode(f"<{m['role'][0]}>{m['content']}") + [EOS]
        return ids + (self.encode("<a>") if add_generation_prompt else [])


class _WordGame:
    """A scripted text env: the observation names the turn and the action's length, the
    reward is the action's length mod 3 / 2; ends after ``turns`` steps. Records which
    process reset / stepped it. ``deadline_on`` = a process on which step 1 times out, as a
    wall-clock deadline can on one host only."""

    def __init__(self, name: str, turns: int, log: list, deadline_on: int | None = None):
        self.name, self.turns, self.log, self.deadline_on = name, turns, log, deadline_on

    def reset(self, *, seed=None, options=None):
        import jax

        self.t = 0
        self.log.append(["reset", self.name, jax.process_index()])
        return f"{self.name} seed {seed}", {}

    def step(self, action: str):
        import jax

        self.t += 1
        self.log.append(["step", self.name, jax.process_index()])
        if self.deadline_on == jax.process_index() and self.t == 1:
            raise TimeoutError("deadline")
        return (f"{self.name} t{self.t} n{len(action)}", (len(action) % 3) / 2,
                self.t >= self.turns, False, {})


def _record_json(rec) -> dict[str, Any]:
    return {"tokens": rec.token_ids, "mask": rec.loss_mask, "logprobs": rec.logprobs,
            "observations": rec.observations, "rewards": rec.step_rewards,
            "end": rec.end_reason, "seeds": rec.sampler_seeds}


def _worker(checkpoint: Path, out_dir: Path) -> None:
    from spade_jax import distributed

    multi = distributed.maybe_initialize()
    import jax
    from jax.experimental import multihost_utils

    from spade_jax import sharding
    from spade_jax.models import load_hf
    from spade_jax.rl.batch import PackConfig, TrainSequence, pack_sequences
    from spade_jax.rl.optim import OptimizerConfig
    from spade_jax.rl.train_step import TrainConfig, init_train_state, make_train_step
    from spade_jax.rollout import SamplerConfig, generate
    from spade_jax.rollout.agent_loop import AgentLoopConfig, EpisodeSpec, run_episodes

    assert jax.device_count() == NUM_HOSTS * DEVICES_PER_HOST
    mesh = sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=-1))
    model, _ = load_hf(checkpoint, mesh=mesh)
    tok = _AsciiTokenizer()
    out: dict[str, Any] = {"host": jax.process_index(), "multi": multi}

    # 1. generate: ragged prompts, chunked decode with compaction, router recorded.
    prompts = [tok.encode("hello " * (1 + i % 3) + str(i)) for i in range(6)]
    result = generate(model, prompts, 12, temperature=1.0, seed=11, mesh=mesh,
                      stop_tokens=[EOS], return_router=True,
                      config=SamplerConfig(12, chunk_steps=3, compact_batch=True))
    out["generate"] = {"tokens": result.tokens, "logprobs": result.logprobs,
                       "reasons": result.done_reasons,
                       "experts": [e.tolist() for e in result.selected_experts]}

    # Stop strings: the host cuts rows and puts done flags back on the global mesh. The
    # prefill runs in row groups (4 rows x 16 tokens a call), written into the global state.
    result = generate(model, prompts, 12, temperature=1.0, seed=12, mesh=mesh,
                      stop_tokens=[EOS], stop_strings=list("aeiou123"), tokenizer=tok,
                      config=SamplerConfig(12, chunk_steps=3, compact_batch=True,
                                           max_prefill_tokens=4 * 16))
    out["stop_strings"] = {"tokens": result.tokens, "logprobs": result.logprobs,
                           "reasons": result.done_reasons,
                           "prefill_calls": result.stats["prefill_calls"]}

    # 2. multi-turn episodes; each host must step only its share.
    log: list = []
    config = AgentLoopConfig(max_turns=3, max_turn_tokens=6, max_episode_tokens=256,
                             sampler=SamplerConfig(6, temperature=1.0, chunk_steps=2,
                                                   prompt_bucket_min=64))
    specs = [EpisodeSpec(_WordGame(f"g{i}", 2 + i % 2, log), f"g{i}", 100 + i) for i in range(6)]
    records = run_episodes(model, tok, specs, config, mesh=mesh, seed=5)
    out["episodes"] = [_record_json(r) for r in records]
    out["env_calls"] = log

    # 3. the train step on those episodes. Fixed, nonzero advantages: centred returns are all
    # zero whenever the sampled actions happen to score alike, and what is checked here is
    # the step across processes, not the returns.
    advantages = np.linspace(-1.0, 1.0, len(records))
    seqs = [TrainSequence(r.token_ids, r.loss_mask, r.logprobs, float(a), "agent")
            for r, a in zip(records, advantages, strict=True)]
    # Adam's eps well above rounding-level gradients: its first step is lr * g / (|g| + eps),
    # which with eps=1e-8 turns a gradient entry at the rounding level into a step of up to
    # lr whose size depends on that rounding (the reference reduces in another order).
    train = TrainConfig(optimizer=OptimizerConfig(learning_rate=1e-2, warmup_steps=0,
                                                  total_steps=10, eps=1e-3))
    graphdef, state = init_train_state(model, train, mesh=mesh)
    step = make_train_step(graphdef, train, mesh)
    batch = pack_sequences(seqs, PackConfig(pad_id=EOS, batch_multiple=jax.device_count()))

    def host_params(state):
        leaves = jax.tree.leaves(state.params)
        out["sharded_across_hosts"] = int(sum(not x.is_fully_addressable for x in leaves))
        return [np.asarray(multihost_utils.process_allgather(x, tiled=True)) if multi
                else np.asarray(x) for x in leaves]

    if not multi:
        np.savez(out_dir / "params_init.npz", *host_params(state))
    state, metrics = step(state, batch)
    out["metrics"] = {k: float(v) for k, v in jax.device_get(metrics).items() if np.ndim(v) == 0}
    np.savez(out_dir / (f"params{out['host']}.npz" if multi else "params_ref.npz"),
             *host_params(state))

    # 4. a deadline on host 1 only (episode d1 is host 1's): its outcome is everyone's.
    if multi:
        log2: list = []
        specs = [EpisodeSpec(_WordGame(f"d{i}", 2, log2, deadline_on=1), f"d{i}", i)
                 for i in range(2)]
        records = run_episodes(model, tok, specs, config, mesh=mesh, seed=6)
        out["deadline"] = {"episodes": [_record_json(r) for r in records], "env_calls": log2}
    name = f"host{out['host']}.json" if multi else "reference.json"
    (out_dir / name).write_text(json.dumps(out))


# ---- the test ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import multiproc
    from tiny_hf import make_hf_model

    root = tmp_path_factory.mktemp("multihost_model")
    make_hf_model("moe", root / "ckpt", seed=3)
    command = [sys.executable, __file__, str(root / "ckpt"), str(root)]
    multiproc.run_processes(
        [command] * (1 + NUM_HOSTS),
        [multiproc.jax_env(NUM_HOSTS * DEVICES_PER_HOST),
         *multiproc.host_envs(NUM_HOSTS, DEVICES_PER_HOST)],
        ["reference", *(f"host {h}" for h in range(NUM_HOSTS))], timeout=600)
    read = lambda name: json.loads((root / name).read_text())  # noqa: E731
    return root, read("reference.json"), [read(f"host{h}.json") for h in range(NUM_HOSTS)]


def _assert_like(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Equal, but log-probs only to float rounding: the reference reduces over four devices
    of one process, the pair over two processes (gloo), in another order. The tokens, and
    so everything downstream of them, must be identical."""
    assert got.keys() == want.keys()
    for key, value in want.items():
        if key == "logprobs":
            for a, b in zip(got[key], value, strict=True):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
        else:
            assert got[key] == value, key


@pytest.mark.slow
def test_two_processes_sample_like_one(runs):
    _, ref, (h0, h1) = runs
    assert (h0["multi"], h1["multi"], ref["multi"]) == (True, True, False)
    assert h0["generate"] == h1["generate"] and h0["episodes"] == h1["episodes"]
    _assert_like(h0["generate"], ref["generate"])
    assert h0["stop_strings"] == h1["stop_strings"]
    _assert_like(h0["stop_strings"], ref["stop_strings"])
    assert "stop_string" in ref["stop_strings"]["reasons"]
    assert ref["stop_strings"]["prefill_calls"] == 2  # 8 rows in groups of 4
    for got, want in zip(h0["episodes"], ref["episodes"], strict=True):
        _assert_like(got, want)
    # The runs did something: tokens drawn, episodes of 2 and 3 turns, rewards scored.
    assert all(len(t) >= 1 for t in ref["generate"]["tokens"])
    assert [len(e["rewards"]) for e in ref["episodes"]] == [2, 3, 2, 3, 2, 3]
    assert all(e["end"] == "terminated" for e in ref["episodes"])


@pytest.mark.slow
def test_two_processes_train_like_one(runs):
    root, ref, (h0, h1) = runs
    assert h0["sharded_across_hosts"] > 0  # FSDP put parameter shards on the other process
    assert ref["sharded_across_hosts"] == 0
    assert h0["metrics"] == h1["metrics"]
    assert ref["metrics"]["agent/sequences"] == 6 and ref["metrics"]["grad_norm"] > 0
    for key, value in ref["metrics"].items():
        np.testing.assert_allclose(h0["metrics"][key], value, rtol=1e-5, atol=1e-5, err_msg=key)
    p0, p1, pr, init = (np.load(root / n) for n in
                        ("params0.npz", "params1.npz", "params_ref.npz", "params_init.npz"))
    assert len(pr.files) > 10
    moved = 0
    for key in pr.files:
        np.testing.assert_array_equal(p0[key], p1[key])
        np.testing.assert_allclose(p0[key], pr[key], rtol=1e-5, atol=1e-6, err_msg=key)
        moved += not np.array_equal(pr[key], init[key])
    assert moved >= len(pr.files) // 2  # the step trained the weights (not a no-op)


@pytest.mark.slow
def test_each_episode_is_stepped_by_its_owner_only(runs):
    from spade_jax.rollout.agent_loop import episode_owner

    _, ref, (h0, h1) = runs
    calls = {h: [(kind, name) for kind, name, p in hh["env_calls"] if p == h]
             for h, hh in ((0, h0), (1, h1))}
    assert all(p == h for h, hh in ((0, h0), (1, h1)) for _, _, p in hh["env_calls"])
    for h in range(NUM_HOSTS):
        names = {name for _, name in calls[h]}
        assert names == {f"g{i}" for i in range(6) if episode_owner(i, 6, NUM_HOSTS) == h}
    assert sorted(calls[0] + calls[1]) == sorted((k, n) for k, n, _ in ref["env_calls"])
    # A deadline that fires on host 1 only, on host 1's episode: both hosts end it the
    # same way (env_error after one turn), and the other episode goes on alike.
    d0, d1 = h0["deadline"], h1["deadline"]
    assert d0["episodes"] == d1["episodes"]
    assert [e["end"] for e in d0["episodes"]] == ["terminated", "env_error"]
    assert [len(e["rewards"]) for e in d0["episodes"]] == [2, 0]
    assert {name for _, name, _ in d0["env_calls"]} == {"d0"}
    assert {name for _, name, _ in d1["env_calls"]} == {"d1"}


def test_episode_owner_splits_a_batch_into_contiguous_blocks():
    from spade_jax.rollout.agent_loop import episode_owner, owns_episode

    # The 30B recipe on v5p-64 (8 hosts): 192 plays a step, 576 at a regeneration step.
    for episodes, share in ((192, 24), (576, 72)):
        owners = [episode_owner(i, episodes, 8) for i in range(episodes)]
        assert owners == sorted(owners) and [owners.count(h) for h in range(8)] == [share] * 8
    assert [episode_owner(i, 5, 2) for i in range(5)] == [0, 0, 0, 1, 1]
    assert [episode_owner(i, 3, 8) for i in range(3)] == [0, 2, 5]  # fewer episodes than hosts
    assert all(owns_episode(i, 7) for i in range(7))  # this pytest process is one host
    with pytest.raises(ValueError, match="outside a batch of 4"):
        episode_owner(4, 4, 2)


if __name__ == "__main__":
    _worker(Path(sys.argv[1]), Path(sys.argv[2]))
