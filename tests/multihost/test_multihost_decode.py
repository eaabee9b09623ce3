"""The per-step reshard to the decode layout across two JAX processes (issue 18 item 5).

Two CPU processes with four devices each form one distributed system over gloo. Each
builds a tiny random Qwen3-MoE (a transformers checkpoint) with the recipes' options (bf16
compute, fp32 master weights, the expert-parallel dispatch) on the trainer's mesh, FSDP 4
x expert 2 spanning both processes; ``rl.trainer.DecodeCopy`` reshards the parameters
(``sharding.resharder``: one SPMD program over the global arrays, cast to the compute
dtype) onto the decode mesh (data 2 x tensor 2 x expert 2, no FSDP) and the sampler draws
from that copy. A third, single process with eight devices runs the same script: the
reference. Checked: the copy's shards span both processes, and both processes sample the
reference's tokens (log-probs to float rounding).

The same file is the worker: ``python tests/multihost/test_multihost_decode.py CKPT OUT``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

NUM_HOSTS, DEVICES_PER_HOST = 2, 4
PROMPTS = [[5, 17, 3], [9, 1, 44, 2, 70, 8, 31], [60, 61, 62, 63, 64], [2] * 11]


# ---- the worker ----------------------------------------------------------------------------
def _worker(checkpoint: Path, out_dir: Path) -> None:
    from spade_jax import distributed

    multi = distributed.maybe_initialize()
    import jax
    from flax import nnx

    from spade_jax import sharding
    from spade_jax.models import ModelOptions, abstract_model, load_hf
    from spade_jax.rl.trainer import DecodeCopy
    from spade_jax.rollout import SamplerConfig
    from spade_jax.rollout.sampler import sample

    assert jax.device_count() == NUM_HOSTS * DEVICES_PER_HOST
    train = sharding.MeshConfig(data=1, fsdp=4, tensor=1, expert=2)
    train_mesh = sharding.make_mesh(train)
    options = ModelOptions(dtype="bfloat16", param_dtype="float32", moe_impl="expert_parallel")
    model, cfg = load_hf(checkpoint, mesh=train_mesh, options=options)  # fp32 weights
    graphdef = nnx.graphdef(abstract_model(cfg, options))
    params = nnx.split(model)[1]
    decode = DecodeCopy(train, train_mesh, graphdef, params, cfg)
    mesh = decode.mesh

    def policy():
        return decode.policy(params)

    copy = nnx.split(policy())[1]
    leaves = jax.tree.leaves(copy)
    out = {
        "multi": multi, "host": jax.process_index(),
        "decode_mesh": {k: int(v) for k, v in mesh.shape.items()},
        "dtypes": sorted({str(x.dtype) for x in leaves}),
        "spanning": int(sum(not x.is_fully_addressable for x in leaves)),
        "leaves": len(leaves),
        "on_decode_mesh": all(x.sharding.mesh.shape == mesh.shape for x in leaves),
    }
    config = SamplerConfig(max_new_tokens=10, temperature=1.0, seed=7, chunk_steps=0,
                           compact_batch=False)
    result = sample(policy(), PROMPTS, config, mesh=mesh)
    out["tokens"], out["logprobs"] = result.tokens, [list(map(float, lp))
                                                     for lp in result.logprobs]
    name = f"host{out['host']}.json" if multi else "reference.json"
    (out_dir / name).write_text(json.dumps(out))


# ---- the test ------------------------------------------------------------------------------
@pytest.mark.slow  # three JAX processes compiling the sampler (~1-2 min)
def test_reshard_to_the_decode_mesh_across_two_processes(tmp_path):
    import multiproc
    from tiny_hf import make_hf_model

    make_hf_model("moe", tmp_path / "ckpt", seed=5, eos_token_id=None, num_hidden_layers=2)
    command = [sys.executable, __file__, str(tmp_path / "ckpt"), str(tmp_path)]
    multiproc.run_processes(
        [command] * (1 + NUM_HOSTS),
        [multiproc.jax_env(NUM_HOSTS * DEVICES_PER_HOST),
         *multiproc.host_envs(NUM_HOSTS, DEVICES_PER_HOST)],
        ["reference", *(f"host {h}" for h in range(NUM_HOSTS))], timeout=600)
    ref, *hosts = (json.loads((tmp_path / name).read_text())
                   for name in ("reference.json", "host0.json", "host1.json"))
    assert (ref["multi"], hosts[0]["multi"], hosts[1]["multi"]) == (False, True, True)
    for got in (ref, *hosts):
        assert got["decode_mesh"] == {"data": 2, "fsdp": 1, "tensor": 2, "expert": 2}
        assert got["dtypes"] == ["bfloat16", "float32"] and got["on_decode_mesh"]
    assert ref["spanning"] == 0  # one process holds everything
    assert hosts[0]["spanning"] == hosts[1]["spanning"] == hosts[0]["leaves"]
    assert [len(t) for t in ref["tokens"]] == [10] * len(PROMPTS)
    for got in hosts:
        assert got["tokens"] == ref["tokens"]
        for a, b in zip(got["logprobs"], ref["logprobs"], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


if __name__ == "__main__":
    _worker(Path(sys.argv[1]), Path(sys.argv[2]))
