"""Forward throughput of MoE dispatch: ragged_dot (dropless grouped matmul) vs dense (all experts).

    python benchmarks/model_forward.py [--tokens 2048] [--repeats 5]

Prints one table: for E = 16 / 64 / 128 experts with k = 8, forward tokens/s of each path,
the dense/ragged time ratio, and beside it the dense/ragged FLOP ratio (what an ideal
implementation of each would show). Same random weights for both paths in each row.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from spade_jax.models import ModelConfig, ModelOptions, Qwen3


def model_flops_per_token(cfg: ModelConfig, seq_len: int, experts_run: int) -> float:
    """2 x multiply-adds per token: projections, experts actually computed, attention."""
    d, h = cfg.hidden_size, cfg.head_dim
    attn_proj = d * h * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    attn_scores = 2 * cfg.num_heads * h * seq_len / 2  # QK^T and PV, causal half
    moe = d * cfg.num_experts + experts_run * 3 * d * cfg.moe_intermediate_size
    return 2 * (cfg.num_layers * (attn_proj + attn_scores + moe) + d * cfg.vocab_size)


def time_forward(model: Qwen3, ids: jax.Array, repeats: int) -> float:
    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x).logits)
    fwd(state, ids).block_until_ready()  # compile
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fwd(state, ids).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per forward (batch x seq)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--experts", type=int, nargs="+", default=[16, 64, 128])
    parser.add_argument("--k", type=int, default=8)
    args = parser.parse_args()

    batch = args.tokens // args.seq
    ids = jnp.asarray(np.random.RandomState(0).randint(0, 4096, (batch, args.seq)))
    print(f"device: {jax.devices()[0].device_kind}, tokens/forward: {batch * args.seq}, k={args.k}")
    header = (f"{'E':>4} {'ragged tok/s':>13} {'dense tok/s':>12} {'time dense/ragged':>18} "
              f"{'FLOP dense/ragged':>18} {'ragged GFLOP/s':>15}")
    print(header)
    print("-" * len(header))
    for num_experts in args.experts:
        cfg = ModelConfig(
            architecture="Qwen3MoeForCausalLM", vocab_size=4096, hidden_size=256, num_layers=2,
            num_heads=8, num_kv_heads=2, head_dim=32, intermediate_size=512,
            num_experts=num_experts, num_experts_per_tok=args.k, moe_intermediate_size=256,
            norm_topk_prob=True,
        )
        ragged = Qwen3(cfg, ModelOptions(moe_impl="ragged"), rngs=nnx.Rngs(0))
        dense = Qwen3(cfg, ModelOptions(moe_impl="dense"), rngs=nnx.Rngs(0))
        t_ragged = time_forward(ragged, ids, args.repeats)
        t_dense = time_forward(dense, ids, args.repeats)
        n = batch * args.seq
        flops_ragged = model_flops_per_token(cfg, args.seq, args.k) * n
        flops_dense = model_flops_per_token(cfg, args.seq, num_experts) * n
        print(f"{num_experts:>4} {n / t_ragged:>13,.0f} {n / t_dense:>12,.0f} "
              f"{t_dense / t_ragged:>18.2f} {flops_dense / flops_ragged:>18.2f} "
              f"{flops_ragged / t_ragged / 1e9:>15.1f}")


if __name__ == "__main__":
    main()
