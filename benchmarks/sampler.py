"""Sampler throughput vs transformers ``generate`` and vs a matmul roofline, one table.

    python benchmarks/sampler.py                      # B = 16, 64; 32-token prompts, 128 new
    python benchmarks/sampler.py --batches=1,4 --new_tokens=16 --skip_hf   # quick smoke run

Both sides run the same random weights: the 17.5M-parameter Qwen3-MoE preset
``bench_moe_17m`` (vocab 8192, hidden 256, 4 layers, 8/2 heads, head_dim 32, 16 experts
top-4), exported with ``save_hf`` and loaded by ``transformers`` (torch, CPU). Decoding is
greedy with EOS disabled, so both generate exactly ``new_tokens`` per row.

Roofline: the FLOP/s of a large fp32 matmul measured in this run (JAX, same devices). The
sampler's achieved FLOP/s counts the model FLOPs of the timed ``generate`` call: 2 x the
matmul parameters (attention projections, router, k experts) per token *fed to the model*
(the B x P prompt tokens in prefill, then the N - 1 generated tokens fed back in decode:
the last one is never fed), 2 x the LM-head parameters per *generated* token, plus the
attention score/value FLOPs over the causal context of every fed token. (Until this
version only generated tokens were counted, each with the whole model and the mean decode
context: the prefill the call also runs and times was left out, ~14% of its FLOPs here.)

Two ceilings, measured in the same run, say how far the roofline fraction can go:
  * memory: bytes a decode step must read (every weight it uses: attention, norms,
    router, the experts the batch selects, LM head, plus the KV cache over the attended
    context) / the read bandwidth of a ``jnp.sum`` over an array of that size; a step can
    be no faster.
  * shapes: the step's matmuls at their decode shapes (M = B rows; per expert B * k / E
    rows, perfectly balanced), each timed alone with hot caches, summed: what XLA:CPU's
    kernels give those shapes with no other work at all.
Each is printed as the tokens/s it allows at the largest batch and as a roofline fraction.
"""

from __future__ import annotations

import argparse
import os
import statistics
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


def _matmul_params(cfg: ModelConfig) -> tuple[int, int]:
    """(matmul parameters a fed token uses in the decoder layers, LM-head parameters)."""
    d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    attn_proj = d * n * h * 2 + d * k * h * 2
    experts = cfg.num_experts_per_tok * 3 * d * cfg.moe_intermediate_size
    return cfg.num_layers * (attn_proj + d * cfg.num_experts + experts), d * cfg.vocab_size


def flops_per_row(cfg: ModelConfig, prompt_len: int, new_tokens: int) -> float:
    """Model FLOPs of one row of a ``generate`` call: prefill of ``prompt_len`` tokens, then
    ``new_tokens - 1`` decode steps; the LM head runs once per generated token."""
    body, head = _matmul_params(cfg)
    fed = prompt_len + new_tokens - 1
    contexts = np.arange(1, fed + 1)  # token i attends to itself and the i - 1 before it
    attention = cfg.num_layers * 2 * 2 * cfg.num_heads * cfg.head_dim * contexts.sum()
    return 2 * body * fed + 2 * head * new_tokens + attention


def decode_step_bytes(cfg: ModelConfig, batch: int, context: float, cache_bytes: int) -> float:
    """Bytes one decode step must read at least: the weights it uses (the embedding rows
    are negligible; an expert is read if any of the B x k assignments selects it: expected
    E (1 - (1 - k / E) ^ B) per layer with uniform routing) and the KV cache over
    ``context`` slots per row."""
    d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    used = e * (1 - (1 - cfg.num_experts_per_tok / e) ** batch)
    per_layer = (d * n * h * 2 + d * k * h * 2) + d * e + used * 3 * d * f + 2 * d + 2 * h
    weights = 4 * (cfg.num_layers * per_layer + d * cfg.vocab_size + d)
    cache = batch * context * cfg.num_layers * 2 * k * h * cache_bytes
    return weights + cache


def read_bandwidth(num_bytes: float, reps: int = 5) -> float:
    """Best-of-``reps`` bytes/s of a jitted ``jnp.sum`` over an fp32 array of ``num_bytes``."""
    x = jnp.ones((max(1, int(num_bytes) // 4096), 1024), jnp.float32)
    return x.nbytes / _best_time(jax.jit(jnp.sum), (x,), reps)


def _best_time(fn, args, reps: int) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def decode_matmul_seconds(cfg: ModelConfig, batch: int, context: int, reps: int = 5) -> float:
    """Sum of the best times of one decode step's matmuls at their shapes, each run alone:
    per layer q, k, v, o projections, router, the experts as balanced batched matmuls
    ([E, B k / E, D] x [E, D, F], twice, and back), attention scores and values over
    ``context`` slots; then the LM head."""
    d, e, f, v = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.vocab_size
    n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    rows = max(1, batch * cfg.num_experts_per_tok // e)
    per_layer = [((batch, d), (d, n * h), 2), ((batch, d), (d, k * h), 2),
                 ((batch, d), (d, e), 1), ((e, rows, d), (e, d, f), 2), ((e, rows, f), (e, f, d), 1),
                 ((batch * k, n // k, h), (batch * k, h, context), 1),
                 ((batch * k, n // k, context), (batch * k, context, h), 1)]
    mm = jax.jit(jnp.matmul)
    seconds = 0.0
    for a, b, count in per_layer:
        seconds += count * cfg.num_layers * _best_time(mm, (jnp.ones(a), jnp.ones(b)), reps)
    return seconds + _best_time(mm, (jnp.ones((batch, d)), jnp.ones((d, v))), reps)


def sampler_run(model, prompts, new_tokens: int, config: SamplerConfig):
    """A timed-call closure of this sampler (compiled on the first, untimed call)."""
    def run() -> float:
        t0 = time.perf_counter()
        out = generate(model, prompts, new_tokens, config=config)
        assert all(len(t) == new_tokens for t in out.tokens)
        return time.perf_counter() - t0

    run()  # compile
    return run


def hf_run(hf_model, prompts, new_tokens: int, temperature: float = 0.0):
    """A timed-call closure of ``transformers`` ``generate`` (warmed up once); sampling from
    the whole temperature-scaled distribution when ``temperature > 0``, as the sampler."""
    import torch

    ids = torch.tensor(np.asarray(prompts, np.int64))
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                  min_new_tokens=new_tokens, do_sample=temperature > 0, pad_token_id=0,
                  eos_token_id=None)
    if temperature > 0:
        kwargs.update(temperature=temperature, top_k=0, top_p=1.0)

    def run() -> float:
        with torch.no_grad():
            t0 = time.perf_counter()
            out = hf_model.generate(ids, **kwargs)
        assert out.shape[1] == ids.shape[1] + new_tokens
        return time.perf_counter() - t0

    run()  # warm up
    return run


def interleaved_medians(runs: dict[str, object], reps: int) -> dict[str, list[float]]:
    """Each side's seconds per repeat, the sides alternating, so that a load swing on the
    shared box hits both alike (torch's CPU threads slow down far more under contention
    than XLA's: one busy neighbour has cost ``generate`` 20x)."""
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(reps):
        for name, run in runs.items():
            seconds[name].append(run())
    return seconds


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="16,64")
    parser.add_argument("--prompt_len", type=int, default=32)
    parser.add_argument("--new_tokens", type=int, default=128)
    parser.add_argument("--moe_impl", default="auto",
                        choices=["auto", "blocked", "ragged", "dense"])
    parser.add_argument("--cache_dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy (the default). On random weights greedy decoding "
                             "repeats one token in every row, so every row routes to the "
                             "same k experts; T > 0 gives rows their own tokens and routing")
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
    per_row = flops_per_row(cfg, args.prompt_len, args.new_tokens)
    sampler_cfg = SamplerConfig(max_new_tokens=args.new_tokens, cache_dtype=args.cache_dtype,
                                chunk_steps=0, compact_batch=False,
                                temperature=args.temperature)
    print(f"model bench_moe_17m: {cfg.param_count() / 1e6:.1f}M params, "
          f"{cfg.param_count(active=True) / 1e6:.1f}M active; "
          f"{per_row / args.new_tokens / 1e6:.1f} MFLOP per generated token (prefill included); "
          f"matmul roofline {roofline / 1e9:.1f} GFLOP/s; devices {jax.devices()[0].platform} "
          f"x{jax.device_count()}; moe_impl={args.moe_impl}, cache={args.cache_dtype}; "
          f"temperature {args.temperature}; "
          f"load average {os.getloadavg()[0]:.1f} (2 cores)")
    print(f"{'B':>4} {'sampler tok/s':>14} {'HF tok/s':>10} {'ratio':>7} {'GFLOP/s':>9} "
          f"{'% roofline':>10}  (medians of {args.reps} interleaved repeats)")
    rs = np.random.RandomState(0)
    for b in batches:
        prompts = rs.randint(0, cfg.vocab_size, (b, args.prompt_len)).tolist()
        runs = {"sampler": sampler_run(model, prompts, args.new_tokens, sampler_cfg)}
        if hf_model is not None:
            runs["hf"] = hf_run(hf_model, prompts, args.new_tokens, args.temperature)
        seconds = interleaved_medians(runs, args.reps)
        ours = b * args.new_tokens / statistics.median(seconds["sampler"])
        theirs = (b * args.new_tokens / statistics.median(seconds["hf"])
                  if "hf" in seconds else float("nan"))
        achieved = b * per_row / statistics.median(seconds["sampler"])
        print(f"{b:>4} {ours:>14.1f} {theirs:>10.1f} {ours / theirs:>7.2f} "
              f"{achieved / 1e9:>9.2f} {100 * achieved / roofline:>9.1f}%  seconds per repeat "
              f"{ {k: [round(x, 3) for x in v] for k, v in seconds.items()} }; load average "
              f"{os.getloadavg()[0]:.1f}", flush=True)
    print_ceilings(cfg, batches, args, roofline)


def print_ceilings(cfg: ModelConfig, batches: list[int], args, roofline: float) -> None:
    """The memory and matmul-shape ceilings of one decode step (module docstring)."""
    context = args.prompt_len + args.new_tokens // 2  # mean attended slots in decode
    cache_bytes = np.dtype(args.cache_dtype).itemsize
    body, head = _matmul_params(cfg)
    print(f"decode-step ceilings (mean context {context} slots; fraction of the roofline "
          f"at the ceiling's rate):")
    print(f"{'B':>4} {'MB/step':>8} {'read GB/s':>10} {'memory tok/s':>13} {'%':>6} "
          f"{'shapes tok/s':>13} {'%':>6}")
    for b in batches:
        step_flops = b * (2 * body + 2 * head
                          + cfg.num_layers * 4 * cfg.num_heads * cfg.head_dim * context)
        step_bytes = decode_step_bytes(cfg, b, context, cache_bytes)
        bandwidth = read_bandwidth(step_bytes)
        memory_s, shapes_s = step_bytes / bandwidth, decode_matmul_seconds(cfg, b, context)
        print(f"{b:>4} {step_bytes / 1e6:>8.1f} {bandwidth / 1e9:>10.1f} {b / memory_s:>13.0f} "
              f"{100 * step_flops / memory_s / roofline:>5.0f}% {b / shapes_s:>13.0f} "
              f"{100 * step_flops / shapes_s / roofline:>5.0f}%", flush=True)

if __name__ == "__main__":
    main()
