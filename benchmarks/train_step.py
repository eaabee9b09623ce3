"""Train-step throughput for the benchmark MoE, dense vs ragged expert dispatch, against a
matmul roofline measured in the same run on the same device.

    python benchmarks/train_step.py [--preset bench_moe_17m] [--batch 8] [--seq 256]
                                    [--impls dense,ragged] [--dtype float32] [--json out.json]
    python benchmarks/train_step.py --impls ragged,invariant --batch 2 --seq 128
    python benchmarks/train_step.py --tiny     # seconds-long smoke run (used by the tests)

``invariant`` is ``ModelOptions(batch_invariant=True)`` (fixed-order numerics, every
expert run): the price of a bit-exact sampler/trainer match, as a ratio to the others.

Per dispatch it reports:
  tokens/s            batch x seq / median step time (full GRPO step: forward, log-probs,
                      loss, backward, clip, AdamW).
  model TFLOP/s       useful FLOPs / time: 6 x (active params per token: projections, the
                      k routed experts, router, LM head) x tokens + causal attention
                      (3 x 2 x 2 x B x T^2/2 x N x H per layer).
  XLA TFLOP/s         what XLA's cost analysis says the compiled step executes (dense
                      dispatch runs every expert, so it is larger than the useful FLOPs).
  roofline_fraction   model TFLOP/s / the measured roofline.
The roofline is the best FLOP/s of a square jnp.dot of the same dtype (size --roofline-n),
i.e. what this device reaches on pure matmuls.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from spade_jax.models import ModelConfig, ModelOptions, Qwen3, preset
from spade_jax.rl.batch import TrainBatch
from spade_jax.rl.optim import OptimizerConfig
from spade_jax.rl.train_step import TrainConfig, init_train_state, make_train_step


def matmul_roofline(n: int, dtype, repeats: int = 5) -> float:
    """Best achieved FLOP/s of an [n, n] @ [n, n] matmul (4 chained, to amortise dispatch)."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype) / n**0.5

    @jax.jit
    def chain(a):
        for _ in range(4):
            a = a @ b
        return a

    chain(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        chain(a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 4 * 2 * n**3 / best


def useful_flops_per_step(cfg: ModelConfig, batch: int, seq: int) -> float:
    """Forward + backward (x3) FLOPs of the matmuls one token really needs."""
    d, h = cfg.hidden_size, cfg.head_dim
    per_token = d * cfg.vocab_size  # LM head (the embedding is a gather)
    for layer in range(cfg.num_layers):
        per_token += d * h * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
        if cfg.is_moe_layer(layer):
            per_token += d * cfg.num_experts
            per_token += cfg.num_experts_per_tok * 3 * d * cfg.moe_intermediate_size
        else:
            per_token += 3 * d * cfg.intermediate_size
    tokens = batch * seq
    attention = cfg.num_layers * 2 * 2 * batch * seq * seq / 2 * cfg.num_heads * h
    return 3 * (2 * per_token * tokens + attention)


def random_batch(cfg: ModelConfig, batch: int, seq: int) -> TrainBatch:
    rng = np.random.RandomState(0)
    loss_mask = np.zeros((batch, seq), np.float32)
    loss_mask[:, seq // 4 :] = 1.0  # a prompt quarter, then policy tokens
    return TrainBatch(
        input_ids=rng.randint(0, cfg.vocab_size, (batch, seq)).astype(np.int32),
        loss_mask=loss_mask,
        old_logp=np.full((batch, seq), -np.log(cfg.vocab_size), np.float32) * loss_mask,
        advantages=rng.randn(batch).astype(np.float32),
        role_id=(np.arange(batch) % 2).astype(np.int32),
    )


def bench_one(cfg: ModelConfig, impl: str, args: argparse.Namespace) -> dict:
    invariant = impl == "invariant"
    options = ModelOptions(dtype=args.dtype, param_dtype="float32",
                           moe_impl="dense" if invariant else impl, remat=args.remat,
                           batch_invariant=invariant)
    config = TrainConfig(optimizer=OptimizerConfig(learning_rate=1e-5), compute_dtype=args.dtype,
                         microbatches=args.microbatches, logit_chunk=args.logit_chunk)
    graphdef, state = init_train_state(Qwen3(cfg, options, rngs=nnx.Rngs(0)), config)
    step = make_train_step(graphdef, config)
    batch = jax.device_put(random_batch(cfg, args.batch, args.seq))
    compiled = step.lower(state, batch).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    xla_flops = float((cost or {}).get("flops", float("nan")))
    state, metrics = step(state, batch)  # first call (compile cache hit) and warm-up
    jax.block_until_ready(metrics)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    useful = useful_flops_per_step(cfg, args.batch, args.seq)
    return dict(
        moe_impl=impl,
        step_seconds=seconds,
        tokens_per_s=args.batch * args.seq / seconds,
        model_tflops=useful / seconds / 1e12,
        xla_tflops=xla_flops / seconds / 1e12,
        loss=float(metrics["loss"]),
        skipped=int(metrics["skipped"]),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="bench_moe_17m")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--impls", default="dense,ragged")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument("--logit-chunk", type=int, default=0)
    parser.add_argument("--remat", action="store_true")
    parser.add_argument("--roofline-n", type=int, default=2048)
    parser.add_argument("--tiny", action="store_true", help="shrink everything for a smoke run")
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    args = parser.parse_args()

    cfg = preset(args.preset)
    if args.tiny:
        cfg = cfg.replace(num_layers=1, vocab_size=256, hidden_size=64, num_heads=2,
                          num_kv_heads=1, head_dim=32, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=32)
        args.batch, args.seq, args.steps, args.roofline_n = 2, 32, 2, 256
    dtype = jnp.dtype(args.dtype)
    roofline = matmul_roofline(args.roofline_n, dtype)
    device = jax.devices()[0]
    print(f"device: {device.platform} {device.device_kind} x{jax.device_count()}; "
          f"model {args.preset}{' (tiny)' if args.tiny else ''}: {cfg.param_count() / 1e6:.1f}M "
          f"params, {cfg.param_count(active=True) / 1e6:.1f}M active; batch {args.batch} x "
          f"seq {args.seq}, {args.dtype}")
    print(f"matmul roofline ({args.roofline_n}^2 {args.dtype} dot): {roofline / 1e12:.3f} TFLOP/s")
    header = (f"{'dispatch':>9} {'step ms':>9} {'tokens/s':>10} {'model TFLOP/s':>14} "
              f"{'XLA TFLOP/s':>12} {'of roofline':>12}")
    print(header)
    print("-" * len(header))
    results = []
    for impl in args.impls.split(","):
        row = bench_one(cfg, impl, args)
        row["roofline_fraction"] = row["model_tflops"] * 1e12 / roofline
        results.append(row)
        print(f"{impl:>9} {row['step_seconds'] * 1e3:9.1f} {row['tokens_per_s']:10.0f} "
              f"{row['model_tflops']:14.4f} {row['xla_tflops']:12.4f} "
              f"{row['roofline_fraction']:12.1%}")
    if args.json:
        args.json.write_text(json.dumps(dict(
            device=f"{device.platform} {device.device_kind}", preset=args.preset,
            tiny=args.tiny, batch=args.batch, seq=args.seq, dtype=args.dtype,
            roofline_tflops=roofline / 1e12, results=results,
        ), indent=2))


if __name__ == "__main__":
    main()
