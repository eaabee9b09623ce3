"""Sampler throughput vs transformers ``generate`` and vs a matmul roofline, one table.

    python benchmarks/sampler.py                      # B = 16, 64; 32-token prompts, 128 new
    python benchmarks/sampler.py --batches=1,4 --new_tokens=16 --skip_hf   # quick smoke run

Both sides run the same random weights: the 17.5M-parameter Qwen3-MoE preset
``bench_moe_17m`` (vocab 8192, hidden 256, 4 layers, 8/2 heads, head_dim 32, 16 experts
top-4), exported with ``save_hf`` and loaded by ``transformers`` (torch, CPU). Decoding is
greedy with EOS disabled, so both generate exactly ``new_tokens`` per row.

Roofline: the FLOP/s of a large fp32 matmul measured in this run (JAX, same devices). The
sampler's achieved FLOP/s counts model FLOPs of the tokens it generated: 2 x the active
matmul parameters (attention projections, router, k experts, LM head) per token plus the
attention score/value FLOPs over the cached context (prompt bucket + tokens so far).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spade_jax.models import ModelConfig, ModelOptions, Qwen3, preset, save_hf  # noqa: E402
from spade_jax.rollout import SamplerConfig, generate  # noqa: E402


def matmul_roofline(n: int = 2048, reps: int = 5) -> float:
    """Best-of-``reps`` FLOP/s of an n x n x n fp32 matmul under jit."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    mm = jax.jit(jnp.matmul)
    mm(a, b).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        mm(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def flops_per_token(cfg: ModelConfig, context: float) -> float:
    """Model FLOPs to generate one token attending over ``context`` cached slots."""
    d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    attn_proj = d * n * h * 2 + d * k * h * 2
    experts = cfg.num_experts_per_tok * 3 * d * cfg.moe_intermediate_size
    per_layer = attn_proj + d * cfg.num_experts + experts
    matmul_params = cfg.num_layers * per_layer + d * cfg.vocab_size
    attention = cfg.num_layers * 2 * 2 * n * h * context
    return 2 * matmul_params + attention


def time_sampler(model, prompts, new_tokens: int, config: SamplerConfig, reps: int) -> float:
    generate(model, prompts, new_tokens, config=config)  # compile
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        out = generate(model, prompts, new_tokens, config=config)
        best = min(best, time.perf_counter() - t0)
    assert all(len(t) == new_tokens for t in out.tokens)
    return best


def time_hf(hf_model, prompts, new_tokens: int) -> float:
    import torch

    ids = torch.tensor(np.asarray(prompts, np.int64))
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                  min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        hf_model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0,
                          eos_token_id=None)  # warm up
        t0 = time.perf_counter()
        out = hf_model.generate(ids, **kwargs)
    assert out.shape[1] == ids.shape[1] + new_tokens
    return time.perf_counter() - t0


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="16,64")
    parser.add_argument("--prompt_len", type=int, default=32)
    parser.add_argument("--new_tokens", type=int, default=128)
    parser.add_argument("--moe_impl", default="auto",
                        choices=["auto", "blocked", "ragged", "dense"])
    parser.add_argument("--cache_dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--skip_hf", action="store_true")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]

    cfg = preset("bench_moe_17m")
    model = Qwen3(cfg, ModelOptions(moe_impl=args.moe_impl), rngs=nnx.Rngs(0))
    args.moe_impl = model.options.moe_impl  # "auto" resolved for this backend
    hf_model = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        with tempfile.TemporaryDirectory() as tmp:
            save_hf(model, cfg, tmp)
            hf_model = AutoModelForCausalLM.from_pretrained(tmp, dtype="float32").eval()
    roofline = matmul_roofline()
    context = 32 + args.new_tokens / 2  # average attended slots (prompt bucket >= 32)
    per_token = flops_per_token(cfg, context)
    sampler_cfg = SamplerConfig(max_new_tokens=args.new_tokens, cache_dtype=args.cache_dtype,
                                chunk_steps=0, compact_batch=False)
    print(f"model bench_moe_17m: {cfg.param_count() / 1e6:.1f}M params, "
          f"{cfg.param_count(active=True) / 1e6:.1f}M active; {per_token / 1e6:.1f} MFLOP/token; "
          f"matmul roofline {roofline / 1e9:.1f} GFLOP/s; devices {jax.devices()[0].platform} "
          f"x{jax.device_count()}; moe_impl={args.moe_impl}, cache={args.cache_dtype}; "
          f"load average {os.getloadavg()[0]:.1f} (2 cores)")
    print(f"{'B':>4} {'sampler tok/s':>14} {'HF tok/s':>10} {'ratio':>7} {'GFLOP/s':>9} "
          f"{'% roofline':>10}")
    rs = np.random.RandomState(0)
    for b in batches:
        prompts = rs.randint(0, cfg.vocab_size, (b, args.prompt_len)).tolist()
        ours = b * args.new_tokens / time_sampler(model, prompts, args.new_tokens, sampler_cfg,
                                                  args.reps)
        theirs = (b * args.new_tokens / time_hf(hf_model, prompts, args.new_tokens)
                  if hf_model is not None else float("nan"))
        achieved = ours * per_token
        print(f"{b:>4} {ours:>14.1f} {theirs:>10.1f} {ours / theirs:>7.2f} "
              f"{achieved / 1e9:>9.2f} {100 * achieved / roofline:>9.1f}%", flush=True)


if __name__ == "__main__":
    main()
