"""Where a decode step's time goes on an accelerator: the sampler's decode profiled kernel by
kernel, and the KV-cache attention of one step in the layouts it could use.

    python3 benchmarks/decode_profile.py --out DIR            # an accelerator machine
    python3 benchmarks/decode_profile.py --out DIR --tiny     # smoke test, any host

``benchmarks/device_check.py`` measures how far the decode is from the HBM roofline; this
script says why. For each batch it prints:
  kernels     the device's busy time in one ``generate`` call of N tokens (one device call,
              ``chunk_steps = N``), by kernel, from a profiler trace (written under --out as
              a Perfetto trace), with each kernel's share of the busy time;
  one step    the model's decode step alone (one token, the cache donated), jitted once,
              against the step time inside the sampler's loop (loop and sampling overhead);
  attention   28 layers' KV-cache attention of one step ([B, 1] queries against S slots)
              in three forms (four on a GPU), with the bytes they must read (the caches)
              over the time, as a share of the read bandwidth measured in the same run:
                ours          ``qwen3._attention`` on the [B, S, K, H] cache
                heads-major   the same contraction on a [B, K, S, H] cache (no transpose)
                jax.nn        ``jax.nn.dot_product_attention`` (XLA) on [B, S, K, H]
                pallas gqa    on a GPU only: Pallas's decode-attention kernel, which
                              reads each row's filled slots only
Nothing is asserted; the tiny shapes only show the script runs.
"""

from __future__ import annotations

import argparse
import collections
import functools
import gzip
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from device_check import QWEN3_1_7B, best_seconds, hbm_bandwidth, tiny_config  # noqa: E402
from flax import nnx  # noqa: E402

from spade_jax.models import ModelOptions, Qwen3  # noqa: E402
from spade_jax.models.qwen3 import _attention  # noqa: E402
from spade_jax.rollout import SamplerConfig, generate  # noqa: E402


def kernel_table(trace_dir: Path, top: int) -> list[str]:
    """Device events of the newest Perfetto trace under ``trace_dir``, summed by name, per
    device thread (a stream, or a derived line such as "XLA Ops")."""
    (path,) = sorted(trace_dir.rglob("perfetto_trace.json.gz"))[-1:]
    events = json.loads(gzip.open(path).read())
    events = events["traceEvents"] if isinstance(events, dict) else events
    process, thread = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            process[e["pid"]] = e["args"]["name"]
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            thread[(e["pid"], e["tid"])] = e["args"]["name"]
    lines: dict[tuple[str, str], collections.Counter] = collections.defaultdict(collections.Counter)
    counts: dict[tuple[str, str], collections.Counter] = collections.defaultdict(collections.Counter)
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        where = (process.get(e["pid"], str(e["pid"])), thread.get((e["pid"], e.get("tid")), ""))
        on_host = "host" in where[0].lower() or "cpu" in where[0].lower()
        if on_host and jax.default_backend() != "cpu":  # the CPU backend's "device" is the host
            continue
        lines[where][e["name"]] += e["dur"]
        counts[where][e["name"]] += 1
    out = []
    for where, by_name in sorted(lines.items(), key=lambda kv: -sum(kv[1].values())):
        total = sum(by_name.values())
        out.append(f"  [{where[0]} / {where[1]}] busy {total / 1e3:,.1f} ms, {len(by_name)} names")
        for name, dur in by_name.most_common(top):
            out.append(f"    {dur / 1e3:9.2f} ms {100 * dur / total:5.1f}% x{counts[where][name]:<6d}"
                       f" {name[:110]}")
    return out[: 6 * (top + 1)]


def attention_rows(cfg: Any, batch: int, slots: int, context: int, bandwidth: float,
                   reps: int) -> list[str]:
    k, h, n, layers = cfg.num_kv_heads, cfg.head_dim, cfg.num_heads, cfg.num_layers
    key = jax.random.key(batch)
    q_b1nh = jax.random.normal(key, (batch, 1, n, h), jnp.bfloat16)
    mask_b1s = jnp.broadcast_to(jnp.arange(slots) < context, (batch, 1, slots))
    caches = [jax.random.normal(jax.random.fold_in(key, i), (batch, slots, k, h), jnp.bfloat16)
              for i in range(2 * layers)]
    heads_major = [c.transpose(0, 2, 1, 3) for c in caches]
    cache_bytes = sum(c.nbytes for c in caches)

    @jax.jit
    def ours(caches):
        return sum(_attention(q_b1nh, caches[2 * i], caches[2 * i + 1], mask_b1s).astype(jnp.float32)
                   for i in range(layers))

    @jax.jit
    def heads_major_fn(caches):
        q = q_b1nh.reshape(batch, k, n // k, h)  # t = 1
        total = 0.0
        for i in range(layers):
            kc, vc = caches[2 * i], caches[2 * i + 1]
            s = jnp.einsum("bkgh,bksh->bkgs", q, kc, preferred_element_type=jnp.float32) * h ** -0.5
            s = jnp.where(mask_b1s[:, :, None, :], s, -1e30)
            p = jax.nn.softmax(s, axis=-1).astype(jnp.bfloat16)
            total = total + jnp.einsum("bkgs,bksh->bkgh", p, vc).astype(jnp.float32)
        return total

    @jax.jit
    def jax_nn(caches):
        return sum(jax.nn.dot_product_attention(
            q_b1nh, caches[2 * i], caches[2 * i + 1], mask=mask_b1s[:, None],
            implementation="xla").astype(jnp.float32) for i in range(layers))

    def pallas_gqa(caches):  # Pallas's GPU decode kernel: reads each row's valid slots only
        from jax.experimental.pallas.ops.gpu import decode_attention
        length_b = jnp.full((batch,), context, jnp.int32)
        return sum(decode_attention.gqa(
            q_b1nh[:, 0], caches[2 * i], caches[2 * i + 1], kv_seq_len=length_b,
            sm_scale=h ** -0.5).astype(jnp.float32) for i in range(layers))

    variants = [("ours", ours, caches), ("heads-major", heads_major_fn, heads_major),
                ("jax.nn (xla)", jax_nn, caches)]
    if jax.default_backend() == "gpu":
        pallas_jit = jax.jit(pallas_gqa)
        variants.append(("pallas gqa", pallas_jit, caches))
        try:
            error = jnp.max(jnp.abs(pallas_jit(caches)[:, None] - ours(caches)))
            print(f"  pallas gqa vs ours: max |diff| {float(error):.3g} (sum of {layers} layers)")
        except Exception as err:  # noqa: BLE001
            print(f"  pallas gqa failed: {type(err).__name__}: {str(err)[:300]}")
    rows = []
    for name, fn, arg in variants:
        try:
            seconds = best_seconds(lambda fn=fn, arg=arg: fn(arg), reps)
            rows.append(f"  {name:14s} {1e3 * seconds:8.3f} ms  {cache_bytes / seconds / 1e9:8.0f} GB/s"
                        f"  {100 * cache_bytes / seconds / bandwidth:5.1f}% of read bandwidth")
        except Exception as err:  # noqa: BLE001 - one form failing must not lose the others
            rows.append(f"  {name:14s} failed: {type(err).__name__}: {str(err)[:200]}")
    return rows


def one_step_ms(model: Qwen3, batch: int, slots: int, context: int, reps: int) -> float:
    """The model's decode step alone: one token per row against a cache of ``context``
    filled slots, the cache donated, as the decode loop runs it (per-row cache index)."""
    cache = model.init_cache(batch, slots, jnp.bfloat16, per_row=True)
    cache = cache.replace(valid_bs=jnp.broadcast_to(jnp.arange(slots) < context, (batch, slots)),
                          index=jnp.full((batch,), context, jnp.int32))
    graphdef, params = nnx.split(model)

    @functools.partial(jax.jit, donate_argnums=1)
    def step(params, cache, token_b1, position_b1):
        out = nnx.merge(graphdef, params)(token_b1, position_b1, cache=cache)
        return jnp.argmax(out.logits[:, -1], -1), out.cache

    token = jnp.ones((batch, 1), jnp.int32)
    position = jnp.full((batch, 1), context, jnp.int32)
    holder = {"cache": cache}

    def run():
        token_b, holder["cache"] = step(params, holder["cache"], token, position)
        return token_b

    return 1e3 * best_seconds(run, reps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", default="decode_profile")
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--prompt_len", type=int, default=128)
    parser.add_argument("--new_tokens", type=int, default=128)
    parser.add_argument("--top", type=int, default=18)
    parser.add_argument("--parts", default="sampler,step,attention,kernels",
                        help="what to run of: sampler, step, attention, kernels")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    cfg = tiny_config(QWEN3_1_7B) if args.tiny else QWEN3_1_7B
    batches = (2,) if args.tiny else tuple(int(b) for b in args.batches.split(","))
    p, n = (8, 8) if args.tiny else (args.prompt_len, args.new_tokens)
    reps = 2 if args.tiny else 3
    bandwidth = hbm_bandwidth((16 << 20) if args.tiny else (2 << 30), reps)
    print(f"{jax.devices()[0].device_kind}: read {bandwidth / 1e9:,.0f} GB/s", flush=True)
    model = Qwen3(cfg, ModelOptions(dtype="bfloat16", param_dtype="bfloat16"), rngs=nnx.Rngs(0))
    for batch in batches:
        prompts = np.random.RandomState(batch).randint(1, cfg.vocab_size, (batch, p)).tolist()
        config = SamplerConfig(max_new_tokens=n, temperature=0.0, cache_dtype="bfloat16",
                               compact_batch=False, chunk_steps=n)

        def call(new_tokens: int, prompts=prompts, config=config):
            return generate(model, prompts, new_tokens, config=config).tokens

        first = best_seconds(lambda: call(1), reps)
        full = best_seconds(lambda: call(n), reps)
        loop_ms = 1e3 * (full - first) / (n - 1)
        print(f"\n== B = {batch}, P = {p}, N = {n} [{time.perf_counter() - started:.0f} s]", flush=True)
        print(f"sampler: whole call {1e3 * full:.1f} ms, prefill call {1e3 * first:.1f} ms,"
              f" decode step in the loop {loop_ms:.3f} ms", flush=True)
        if "step" in args.parts:
            step_ms = one_step_ms(model, batch, p + n, p + n // 2, reps)
            print(f"one step: the model's step alone {step_ms:.3f} ms (cache {p + n} slots, "
                  f"{p + n // 2} filled)", flush=True)
        if "attention" in args.parts:
            print(f"attention, {cfg.num_layers} layers, one step:")
            for line in attention_rows(cfg, batch, p + n, p + n // 2, bandwidth, reps):
                print(line, flush=True)
        if "kernels" not in args.parts:
            continue
        trace_dir = out / f"trace_b{batch}"
        with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
            jax.block_until_ready(call(n))
        print("kernels of one call (prefill + decode):")
        for line in kernel_table(trace_dir, args.top):
            print(line, flush=True)
    print(f"\ndone in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
