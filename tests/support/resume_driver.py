"""A tiny but real GRPO training run for the kill -9 resume test (test_train_resume_kill.py).

    python tests/support/resume_driver.py RUN_DIR TOTAL_STEPS [--kill-after N] [--forget-data-rng]

RUN_DIR may be local or gs:// (test_gcs_paths.py runs it against a GCS emulator).

Everything but the weight initialisation is the production path: a Qwen3-MoE from ``spade_jax.models`` (one dense and one
MoE layer), ``make_train_step`` with router replay, two microbatches, both roles (GRPO with
a KL term and GSPO), the load-balancing loss, and a warmup + cosine AdamW schedule from
``spade_jax.rl.optim``; checkpoints go through ``spade_jax.checkpoint.CheckpointManager``
(asynchronous Orbax saves, one every step).

Each step's batch is a synthetic rollout: token ids, lengths, loss masks, roles and
advantages come from a NumPy Generator whose exact state is checkpointed in ``run_state``;
the routing and the behaviour log-probs come from a forward pass of the *current* policy
(what a sampler records), so a resume that restored the wrong parameters would also feed
the next step a different batch.

``--kill-after N`` waits until step N's checkpoint is committed (Orbax finalised and the
manifest written), prints ``CHECKPOINTED N`` and SIGKILLs its own process. At the end the
final TrainState (params, optimizer state, step, rng) and the data RNG state go to
``RUN_DIR/final.npz``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import sys

import jax
import jax.numpy as jnp
import numpy as np
import rng_json
from etils import epath
from flax import nnx

from spade_jax import checkpoint as ckpt_lib
from spade_jax.models import ModelConfig, ModelOptions, Qwen3
from spade_jax.rl.batch import PackConfig, TrainBatch, TrainSequence, pack_sequences
from spade_jax.rl.optim import OptimizerConfig
from spade_jax.rl.train_step import (
    RoleConfig,
    TrainConfig,
    TrainState,
    init_train_state,
    make_train_step,
)

VOCAB, ROWS, BUCKET, DATA_SEED = 32, 8, 12, 1234

TRAIN_CONFIG = TrainConfig(
    optimizer=OptimizerConfig(learning_rate=3e-2, warmup_steps=2, schedule="cosine",
                              total_steps=8, weight_decay=0.1, clip_norm=1.0),
    agent=RoleConfig(policy_loss="grpo", loss=dict(clip_eps=0.2, kl_coef=0.05)),
    designer=RoleConfig(policy_loss="gspo",
                        loss=dict(clip_eps_low=0.1, clip_eps_high=0.1), weight=0.5),
    microbatches=2,
    router_replay=True,
    aux_loss_coef=0.01,
)


def tiny_moe() -> Qwen3:
    """The model with N(0, 0.02) weights (ones for norms) drawn by NumPy: the model's own
    initialiser runs op by op and costs seconds of dispatch in every process of the test."""
    config = ModelConfig(
        architecture="Qwen3MoeForCausalLM", vocab_size=VOCAB, hidden_size=16, num_layers=2,
        num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=24, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=8, norm_topk_prob=True,
        mlp_only_layers=(0,),  # layer 0 dense, layer 1 MoE: replay has a None entry
    )
    abstract = nnx.eval_shape(
        lambda: Qwen3(config, ModelOptions(moe_impl="ragged"), rngs=nnx.Rngs(0)))
    graphdef, shapes = nnx.split(abstract)
    rng = np.random.default_rng(0)

    def draw(path, x):
        if "weight" in jax.tree_util.keystr(path):  # RMSNorm scales
            return jnp.ones(x.shape, x.dtype)
        return jnp.asarray(rng.normal(scale=0.02, size=x.shape), x.dtype)

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(draw, shapes))


def make_behaviour_fn(graphdef: nnx.GraphDef):
    """jit(params, ids [B, T]) -> (log-probs of each token [B, T], experts per MoE layer):
    what the sampler records for a rollout (own top-k routing, no replay)."""

    @jax.jit
    def behaviour(params, ids_bt):
        out = nnx.merge(graphdef, params)(ids_bt)
        logp_btv = jax.nn.log_softmax(out.logits[:, :-1], axis=-1)
        logp_bt = jnp.take_along_axis(logp_btv, ids_bt[:, 1:, None], axis=-1)[..., 0]
        return jnp.pad(logp_bt, ((0, 0), (1, 0))), out.selected_experts

    return behaviour


def next_batch(data_rng: np.random.Generator, behaviour, params) -> TrainBatch:
    """One synthetic rollout batch; consumes ``data_rng``."""
    lengths = data_rng.integers(5, BUCKET + 1, ROWS)
    ids = data_rng.integers(0, VOCAB, (ROWS, BUCKET)).astype(np.int32)
    roles = data_rng.integers(0, 2, ROWS)
    advantages = data_rng.normal(size=ROWS)
    staleness = data_rng.normal(scale=0.05, size=(ROWS, BUCKET))  # off-policy by a little
    ref_shift = data_rng.normal(scale=0.1, size=(ROWS, BUCKET))
    logp, experts = jax.device_get(behaviour(params, jnp.asarray(ids)))
    seqs = []
    for i, n in enumerate(lengths):
        prompt = int(data_rng.integers(1, 4))
        seqs.append(TrainSequence(
            token_ids=ids[i, :n].tolist(),
            loss_mask=np.r_[np.zeros(prompt), np.ones(n - prompt)],
            logprobs=logp[i, :n] + staleness[i, :n],
            advantage=float(advantages[i]),
            role=int(roles[i]),
            ref_logprobs=logp[i, :n] + ref_shift[i, :n],
            routing=[None if e is None else e[i, :n] for e in experts],
        ))
    return pack_sequences(seqs, PackConfig(buckets=(BUCKET,)))


def flat_leaves(tree) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=epath.Path)
    parser.add_argument("total_steps", type=int)
    parser.add_argument("--kill-after", type=int, default=None,
                        help="SIGKILL this process once step N's checkpoint is committed")
    parser.add_argument("--forget-data-rng", action="store_true",
                        help="on resume, re-seed the data RNG instead of restoring it "
                             "(a deliberately broken resume, the test's control)")
    args = parser.parse_args(argv)

    graphdef, state = init_train_state(tiny_moe(), TRAIN_CONFIG, seed=5)
    # Committed to the device like the arrays a restore returns: otherwise the resumed run
    # would lower (and compile) the step a second time, with explicit shardings.
    state = jax.device_put(state, jax.devices()[0])
    step_fn = make_train_step(graphdef, TRAIN_CONFIG)
    behaviour = make_behaviour_fn(graphdef)
    data_rng = np.random.default_rng(DATA_SEED)

    ckpt = ckpt_lib.CheckpointManager(
        ckpt_lib.CheckpointConfig(args.run_dir / "ckpt", save_every_steps=1, keep=3),
        config_hash="resume-driver-v1",
    )
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    restored = ckpt.restore_latest(abstract)
    start = 0
    if restored is not None:
        start, state = restored.step, restored.state
        if not isinstance(state, TrainState) or int(state.step) != start:
            raise RuntimeError(f"checkpoint {start} restored a {type(state).__name__} "
                               f"at step {getattr(state, 'step', None)}")
        if not args.forget_data_rng:
            data_rng = rng_json.numpy_rng_from_json(restored.run_state["data_rng"])
        print(f"RESUMED {start}", flush=True)

    for step in range(start + 1, args.total_steps + 1):
        batch = next_batch(data_rng, behaviour, state.params)
        state, metrics = step_fn(state, batch)
        if int(metrics["skipped"]):
            raise RuntimeError(f"step {step} was skipped (non-finite loss or gradient)")
        print(f"STEP {step} loss={float(metrics['loss']).hex()}", flush=True)
        ckpt.save(step, state, {"data_rng": rng_json.numpy_rng_to_json(data_rng)})
        if step == args.kill_after:
            ckpt.wait()  # Orbax finalised the step directory and the manifest is written
            problem = ckpt_lib.manifest_problem(args.run_dir / "ckpt" / str(step), step)
            if problem is not None:
                raise RuntimeError(f"step {step} not committed before the kill: {problem}")
            print(f"CHECKPOINTED {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    ckpt.close()
    final = io.BytesIO()
    np.savez(final, **flat_leaves(state))
    (args.run_dir / "final.npz").write_bytes(final.getvalue())
    (args.run_dir / "final_data_rng.json").write_text(
        json.dumps(rng_json.numpy_rng_to_json(data_rng)))


if __name__ == "__main__":
    main(sys.argv[1:])
