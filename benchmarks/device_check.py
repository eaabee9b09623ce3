"""The accelerator check: one table of what spade_jax reaches on the device it runs on.

    bash benchmarks/device_check.sh            # on a GPU machine (5 minutes on an H200)
    bash benchmarks/device_check.sh --tiny     # the same script at tiny shapes, any host

Rows (every ceiling measured in the same run, on the same device):
  hbm / matmul     the device's read bandwidth (a jitted sum over a large array) and the
                   bf16 matmul FLOP/s it reaches: the two roofline terms.
  decode           tokens/s of the sampler's decode at B = 64 and 256 for a Qwen3-1.7B
                   config and a Qwen3-30B-A3B-shaped MoE with fewer layers (random bf16
                   weights, greedy, no early stop), and the fraction of the HBM roofline:
                   (bytes one decode step must read: the weights it uses and the KV cache
                   over the mean context) / bandwidth, against the measured step time;
                   and the same against a floor that counts each weight matmul at the
                   larger of its read and its FLOP time (``decode_step_floor``: at large B
                   the weight matmuls are compute-bound).
                   Decode time = a call of P + N tokens minus a call of P + 1 (its prefill).
  prefill          prompt tokens/s of that prefill (B x P tokens).
  generate (HF)    ``transformers`` ``generate`` on the same weights, prompts and device
                   (torch, bf16, greedy, N tokens), beside ours at the same batch.
  train step       the GRPO step's useful model FLOP/s (6 x active parameters per token +
                   causal attention) as a share of the measured matmul rate (MFU).
  tiny job         ``python -m spade_jax.train --experiment=tiny`` (2 rounds) end to end on
                   this device: exit status and wall seconds.

Prints the table and writes it (Markdown and JSON) under ``--out``. Nothing here is
asserted on speed; ``tests/test_device_check.py`` runs ``--tiny`` on the CPU to show the
script works. At tiny shapes the numbers are noise (the weights sit in CPU caches, so a
"roofline" share can pass 100%); only the full shapes on an accelerator mean anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from spade_jax.models import ModelConfig, ModelOptions, Qwen3, save_hf  # noqa: E402
from spade_jax.rl.batch import TrainBatch  # noqa: E402
from spade_jax.rl.optim import OptimizerConfig  # noqa: E402
from spade_jax.rl.train_step import TrainConfig, init_train_state, make_train_step  # noqa: E402
from spade_jax.rollout import SamplerConfig, generate  # noqa: E402

# Qwen3-1.7B's shape (config.json of Qwen/Qwen3-1.7B), random weights.
QWEN3_1_7B = ModelConfig(
    architecture="Qwen3ForCausalLM", vocab_size=151936, hidden_size=2048, num_layers=28,
    num_heads=16, num_kv_heads=8, head_dim=128, intermediate_size=6144,
    max_position_embeddings=40960, tie_word_embeddings=True)
# Qwen3-30B-A3B's layer shape (128 experts, top 8) with fewer layers.
QWEN3_30B_A3B_SHAPED = ModelConfig(
    architecture="Qwen3MoeForCausalLM", vocab_size=151936, hidden_size=2048, num_layers=8,
    num_heads=32, num_kv_heads=4, head_dim=128, intermediate_size=6144, num_experts=128,
    num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
    max_position_embeddings=40960)


@dataclasses.dataclass(frozen=True)
class Shapes:
    """What one check runs: batches, prompt and new tokens, the train batch."""

    batches: tuple[int, ...] = (64, 256)
    prompt_len: int = 128
    new_tokens: int = 128
    train_batch: int = 8
    train_seq: int = 1024
    hbm_bytes: int = 2 << 30
    matmul_n: int = 8192
    reps: int = 3


TINY = Shapes(batches=(2,), prompt_len=8, new_tokens=8, train_batch=2, train_seq=32,
              hbm_bytes=16 << 20, matmul_n=256, reps=2)


def tiny_config(cfg: ModelConfig) -> ModelConfig:
    """The same architecture at smoke-test size."""
    small = dict(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=16, intermediate_size=128, max_position_embeddings=256)
    if cfg.num_experts:
        small.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    return cfg.replace(**small)


def best_seconds(fn, reps: int) -> float:
    return timed(fn, reps)[0]


def timed(fn, reps: int) -> tuple[float, float]:
    """(best of ``reps`` calls, the first call: compile included) in seconds."""
    start = time.perf_counter()
    jax.block_until_ready(fn())
    first = time.perf_counter() - start
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return min(times), first


def hbm_bandwidth(num_bytes: int, reps: int) -> float:
    x = jnp.ones((max(1, num_bytes // 2048), 1024), jnp.bfloat16)
    total = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    return x.nbytes / best_seconds(lambda: total(x), reps)


def matmul_rate(n: int, reps: int) -> float:
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16) / n**0.5
    mm = jax.jit(lambda x: (x @ b) @ b)
    return 2 * 2 * n**3 / best_seconds(lambda: mm(a), reps)


def decode_step_bytes(cfg: ModelConfig, batch: int, context: float) -> float:
    """Bytes a decode step must read at least (bf16 weights and cache): the layers'
    weights (an expert only if one of the B x k assignments picks it: E (1 - (1 - k/E)^B)
    with uniform routing), the LM head, and the KV cache over ``context`` slots a row."""
    d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    attention = d * n * h * 2 + d * k * h * 2
    if cfg.num_experts:
        e, f = cfg.num_experts, cfg.moe_intermediate_size
        used = e * (1 - (1 - cfg.num_experts_per_tok / e) ** batch)
        mlp = d * e + used * 3 * d * f
    else:
        mlp = 3 * d * cfg.intermediate_size
    weights = 2 * (cfg.num_layers * (attention + mlp) + d * cfg.vocab_size)
    cache = 2 * batch * context * cfg.num_layers * 2 * k * h
    return weights + cache


def decode_step_floor(cfg: ModelConfig, batch: int, context: float, bandwidth: float,
                      peak: float) -> float:
    """Seconds a decode step takes at least, counting each weight matmul at the larger of
    its read time and its FLOP time (at B rows a bf16 weight byte does B FLOPs: past the
    device's ridge, e.g. ~220 on an H200, the matmuls are compute-bound and the bytes-only
    roofline of :func:`decode_step_bytes` understates the floor), plus the KV cache over
    ``context`` slots a row at the read bandwidth. Attention FLOPs are left out (a few per
    cache byte)."""
    layer_bytes = decode_step_bytes(cfg, batch, 0) - 2 * cfg.hidden_size * cfg.vocab_size
    layer_params = layer_bytes / 2  # the layers' weights a step uses (experts: those picked)
    if cfg.num_experts:  # each token multiplies its k experts, not every expert the batch uses
        d, f = cfg.hidden_size, cfg.moe_intermediate_size
        used = cfg.num_experts * (1 - (1 - cfg.num_experts_per_tok / cfg.num_experts) ** batch)
        per_token = layer_params - cfg.num_layers * (used - cfg.num_experts_per_tok) * 3 * d * f
    else:
        per_token = layer_params
    head = cfg.hidden_size * cfg.vocab_size
    layers = max(layer_bytes / bandwidth, 2 * batch * per_token / peak)
    lm_head = max(2 * head / bandwidth, 2 * batch * head / peak)
    cache = decode_step_bytes(cfg, batch, context) - decode_step_bytes(cfg, batch, 0)
    return layers + lm_head + cache / bandwidth


def train_flops(cfg: ModelConfig, batch: int, seq: int) -> float:
    """Useful FLOPs of one GRPO step: 3 x (2 x active matmul parameters per token + causal
    attention)."""
    d, h = cfg.hidden_size, cfg.head_dim
    per_token = d * cfg.vocab_size
    for layer in range(cfg.num_layers):
        per_token += d * h * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
        if cfg.is_moe_layer(layer):
            per_token += d * cfg.num_experts + cfg.num_experts_per_tok * 3 * d * cfg.moe_intermediate_size
        else:
            per_token += 3 * d * cfg.intermediate_size
    attention = cfg.num_layers * 2 * 2 * batch * seq * seq / 2 * cfg.num_heads * h
    return 3 * (2 * per_token * batch * seq + attention)


def decode_row(name: str, cfg: ModelConfig, model: Qwen3, shapes: Shapes, bandwidth: float,
               peak: float, batch: int, **sampler: Any) -> dict[str, Any]:
    """Prefill and decode rates at one batch size (``sampler``: SamplerConfig overrides)."""
    prompts = np.random.RandomState(batch).randint(1, cfg.vocab_size,
                                                   (batch, shapes.prompt_len)).tolist()
    config = SamplerConfig(max_new_tokens=shapes.new_tokens, temperature=0.0,
                           cache_dtype="bfloat16", compact_batch=False, **sampler)

    def call(new_tokens: int):
        return generate(model, prompts, new_tokens, config=config).tokens

    first, first_compile = timed(lambda: call(1), shapes.reps)
    full, full_compile = timed(lambda: call(shapes.new_tokens), shapes.reps)
    row = {"model": name, "B": batch, "prefill tokens/s": batch * shapes.prompt_len / first,
           "first call s": first_compile + full_compile}
    if full > first:
        step = (full - first) / (shapes.new_tokens - 1)
        context = shapes.prompt_len + shapes.new_tokens / 2
        bound = decode_step_bytes(cfg, batch, context) / bandwidth
        floor = decode_step_floor(cfg, batch, context, bandwidth, peak)
        row.update({"decode tokens/s": batch / step, "decode step ms": 1e3 * step,
                    "HBM roofline": bound / step, "bytes+FLOPs floor": floor / step})
    else:  # tiny shapes: the decode steps are below the timer's resolution
        row["note"] = "decode below timer resolution"
    if sampler:
        row["note"] = " ".join(f"{k}={v}" for k, v in sampler.items())
    return row


def hf_row(cfg: ModelConfig, model: Qwen3, batch: int, shapes: Shapes) -> dict[str, Any]:
    """transformers generate on the same weights (bf16), greedy, on the same device."""
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError as err:
        return {"model": "generate (HF)", "B": batch, "note": f"not run: {err}"}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        save_hf(model, cfg, tmp)
        hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.bfloat16).to(device)
    hf.eval()
    ids = torch.tensor(np.random.RandomState(0).randint(1, cfg.vocab_size,
                                                        (batch, shapes.prompt_len)), device=device)
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=shapes.new_tokens,
                  min_new_tokens=shapes.new_tokens, do_sample=False, pad_token_id=0,
                  eos_token_id=None)

    def run() -> float:
        with torch.no_grad():
            start = time.perf_counter()
            hf.generate(ids, **kwargs)
            if device == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - start

    run()
    seconds = min(run() for _ in range(shapes.reps))
    return {"model": f"generate (HF, torch {device})", "B": batch,
            "decode tokens/s": batch * shapes.new_tokens / seconds,
            "note": "whole call (prefill included)"}


def ours_whole_call(model: Qwen3, cfg: ModelConfig, batch: int, shapes: Shapes) -> float:
    prompts = np.random.RandomState(0).randint(1, cfg.vocab_size,
                                               (batch, shapes.prompt_len)).tolist()
    config = SamplerConfig(max_new_tokens=shapes.new_tokens, temperature=0.0,
                           cache_dtype="bfloat16", compact_batch=False)
    seconds = best_seconds(lambda: generate(model, prompts, shapes.new_tokens,
                                            config=config).tokens, shapes.reps)
    return batch * shapes.new_tokens / seconds


def train_row(cfg: ModelConfig, shapes: Shapes, peak: float) -> dict[str, Any]:
    options = ModelOptions(dtype="bfloat16", param_dtype="float32", remat="full")
    config = TrainConfig(optimizer=OptimizerConfig(learning_rate=1e-6),
                         compute_dtype="bfloat16", logit_chunk=512)
    graphdef, state = init_train_state(Qwen3(cfg, options, rngs=nnx.Rngs(0)), config)
    step = make_train_step(graphdef, config)
    rng = np.random.RandomState(0)
    b, t = shapes.train_batch, shapes.train_seq
    mask = np.zeros((b, t), np.float32)
    mask[:, t // 4:] = 1.0
    batch = jax.device_put(TrainBatch(
        input_ids=rng.randint(0, cfg.vocab_size, (b, t)).astype(np.int32), loss_mask=mask,
        old_logp=np.full((b, t), -np.log(cfg.vocab_size), np.float32) * mask,
        advantages=rng.randn(b).astype(np.float32), role_id=(np.arange(b) % 2).astype(np.int32)))
    holder = {"state": state}

    def run():
        holder["state"], metrics = step(holder["state"], batch)
        return metrics

    seconds = best_seconds(run, shapes.reps)
    return {"model": "train step (1.7B-shaped, bf16, remat)", "B": f"{b}x{t}",
            "train tokens/s": b * t / seconds, "MFU": train_flops(cfg, b, t) / seconds / peak}


def tiny_job(seconds_limit: int, *extra: str) -> dict[str, Any]:
    """The main job end to end (2 steps, no warm start) in a subprocess on this device."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory() as workdir:
        command = [sys.executable, "-m", "spade_jax.train", "--experiment=tiny",
                   f"--workdir={workdir}/run", "--set", "spade.rounds=2",
                   "--set", "warm_start.steps=0", "--set", "spade.eval_every=0", *extra]
        start = time.perf_counter()
        try:
            done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT,
                                  timeout=seconds_limit, env={**os.environ, "PYTHONPATH": path})
            status, tail = done.returncode, done.stderr[-2000:]
        except subprocess.TimeoutExpired:
            status, tail = "timeout", ""
    lines = tail.strip().splitlines()
    if status != 0:
        print("\n".join(lines[-15:]), flush=True)
    return {"model": "tiny job (2 steps)" + (f" {' '.join(extra)}" if extra else ""),
            "exit": status, "wall s": time.perf_counter() - start, "note": lines[-1:]}


def render(rows: list[dict[str, Any]]) -> str:
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys]

    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(k, row.get(k)) for k in keys) + " |")
    return "\n".join(lines)


def _fmt(key: str, value: Any) -> str:
    if value is None:
        return ""
    if key in ("HBM roofline", "bytes+FLOPs floor", "MFU") and isinstance(value, float):
        return f"{100 * value:.1f}%"
    if isinstance(value, float):
        return f"{value:,.1f}" if value < 1000 else f"{value:,.0f}"
    return " ".join(str(value).split()).replace("|", "/")  # one table cell


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="smoke-test shapes (any host)")
    parser.add_argument("--out", default="device_check")
    parser.add_argument("--skip_hf", action="store_true")
    parser.add_argument("--skip_job", action="store_true")
    parser.add_argument("--job_seconds", type=int, default=240)
    parser.add_argument("--moe_impls", default="auto,dense",
                        help="MoE dispatches to measure (ModelOptions.moe_impl values)")
    args = parser.parse_args(argv)
    shapes = TINY if args.tiny else Shapes()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = jax.devices()[0]
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []

    def log(row: dict[str, Any]) -> None:
        # Written after every row: a run cut short by its time limit still leaves a table.
        rows.append(row)
        print(f"[{time.perf_counter() - started:6.0f} s] {row}", flush=True)
        (out / "device_check.md").write_text(render(rows) + "\n")
        (out / "device_check.json").write_text(json.dumps(rows, indent=2, default=str))

    def guarded(what: str, fn) -> Any:
        # One failing row (an API the device's JAX lacks, memory) must not lose the others.
        try:
            return fn()
        except Exception as err:  # noqa: BLE001 - reported as the row's note
            log({"model": what, "note": f"failed: {type(err).__name__}: {str(err)[:300]}"})
            return None

    import flax
    versions = f"jax {jax.__version__}, flax {flax.__version__}"
    bandwidth = hbm_bandwidth(shapes.hbm_bytes, shapes.reps)
    peak = matmul_rate(shapes.matmul_n, shapes.reps)
    log({"model": "device", "B": f"{device.platform} {device.device_kind} x{jax.device_count()}",
         "note": f"read {bandwidth / 1e9:,.0f} GB/s; bf16 matmul {peak / 1e12:,.1f} TFLOP/s; "
                 f"{versions}"})
    def decode(name: str, cfg: ModelConfig, model: Qwen3, batch: int, **sampler: Any) -> None:
        row = guarded(f"{name} B={batch}", functools.partial(
            decode_row, name, cfg, model, shapes, bandwidth, peak, batch, **sampler))
        if row is not None:
            log(row)

    cfg = tiny_config(QWEN3_1_7B) if args.tiny else QWEN3_1_7B
    model = Qwen3(cfg, ModelOptions(dtype="bfloat16", param_dtype="bfloat16"), rngs=nnx.Rngs(0))
    for batch in shapes.batches:
        decode("Qwen3-1.7B", cfg, model, batch)
    # The whole decode in one device call instead of host round trips every chunk_steps.
    decode("Qwen3-1.7B", cfg, model, shapes.batches[-1], chunk_steps=shapes.new_tokens)
    moe_cfg = tiny_config(QWEN3_30B_A3B_SHAPED) if args.tiny else QWEN3_30B_A3B_SHAPED
    for impl in args.moe_impls.split(","):
        moe = Qwen3(moe_cfg, ModelOptions(dtype="bfloat16", param_dtype="bfloat16",
                                          moe_impl=impl), rngs=nnx.Rngs(0))
        for batch in shapes.batches:
            decode(f"Qwen3-30B-A3B-shaped (8 layers), moe_impl={impl}", moe_cfg, moe, batch)
        del moe
    batch = shapes.batches[0]
    rate = guarded("ours, whole call", functools.partial(ours_whole_call, model, cfg, batch, shapes))
    if rate is not None:
        log({"model": "ours, whole call (Qwen3-1.7B)", "B": batch, "decode tokens/s": rate,
             "note": "whole call (prefill included)"})
    if not args.skip_hf:
        row = guarded("generate (HF)", functools.partial(hf_row, cfg, model, batch, shapes))
        if row is not None:
            log(row)
    del model
    row = guarded("train step", functools.partial(train_row, cfg, shapes, peak))
    if row is not None:
        log(row)
    if not args.skip_job:
        row = tiny_job(args.job_seconds)
        log(row)
        if row["exit"] != 0:
            # The device machine may lack what the sandbox's layers need (bubblewrap's
            # mounts, libseccomp); the job's own path on the device is still worth knowing.
            log(tiny_job(args.job_seconds, "--set", "sandbox.use_namespaces=false",
                         "--set", "sandbox.allow_weak_isolation=true"))
    print("\n" + render(rows))
    print(f"\nwrote {out / 'device_check.md'} in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
