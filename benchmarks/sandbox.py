"""Sandbox overhead: per-step round trip (p50/p99) and steps/s, sandboxed vs in-process.

    python benchmarks/sandbox.py [--steps 5000] [--workers 2,8] [--seconds 3]

Targets (issue 4): overhead <= 0.2 ms/step at p50; >= 5,000 steps/s on 2 cores.
The environment is trivial on purpose: what is measured is the sandbox, not the program.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from spade_jax.envs import EnvPool, SandboxConfig

TRIVIAL = """
class Environment:
    def reset(self, seed=None):
        self.t = 0
        return "start", {}
    def step(self, action):
        self.t += 1
        return "ok", 0.0, False, self.t >= 500, {}
"""
EPISODE = 400  # steps per episode in the timed loops (resets are not timed)


def _percentiles(samples_s: list[float]) -> tuple[float, float]:
    ordered = sorted(samples_s)
    p50 = statistics.median(ordered)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return p50 * 1e3, p99 * 1e3


def in_process(steps: int) -> tuple[list[float], float]:
    namespace: dict = {}
    exec(TRIVIAL, namespace)  # noqa: S102 - our own trivial program
    env = namespace["Environment"]()
    samples = []
    begin = time.perf_counter()
    for i in range(steps):
        if i % EPISODE == 0:
            env.reset(seed=i)
        start = time.perf_counter()
        env.step("a")
        samples.append(time.perf_counter() - start)
    return samples, steps / (time.perf_counter() - begin)


def sandboxed(pool: EnvPool, steps: int) -> list[float]:
    handle = pool.open(TRIVIAL)
    samples = []
    for i in range(steps):
        if i % EPISODE == 0:
            handle.reset(seed=i)
        start = time.perf_counter()
        result = handle.step("a")
        samples.append(time.perf_counter() - start)
        assert result.ok, result.error
    handle.close()
    return samples


def throughput(pool: EnvPool, workers: int, seconds: float) -> float:
    handles = pool.open_many([TRIVIAL] * workers)
    done = 0
    begin = time.perf_counter()
    while time.perf_counter() - begin < seconds:
        pool.reset_many([(h, done) for h in handles])
        for _ in range(EPISODE):
            results = pool.step_many([(h, "a") for h in handles])
            done += len(results)
    rate = done / (time.perf_counter() - begin)
    for h in handles:
        h.close()
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--workers", default="1,2,8")
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    with EnvPool(SandboxConfig()) as pool:
        layers = pool.isolation_report()
        local, local_rate = in_process(args.steps)
        remote = sandboxed(pool, args.steps)
        rates = {int(w): throughput(pool, int(w), args.seconds) for w in args.workers.split(",")}
    l50, l99 = _percentiles(local)
    s50, s99 = _percentiles(remote)
    rows = [("in-process", l50, l99, local_rate, "-")]
    rows.append(("sandboxed, 1 handle", s50, s99, 1e3 / s50, f"{s50 - l50:.3f}"))
    for workers, rate in rates.items():
        rows.append((f"sandboxed, step_many x{workers}", float("nan"), float("nan"), rate, "-"))
    print(f"cores: {os.cpu_count()}, missing layers: {layers.missing or 'none'}")
    print("| setup | p50 ms/step | p99 ms/step | steps/s | overhead p50 ms |")
    print("|---|---|---|---|---|")
    for name, p50, p99, rate, overhead in rows:
        p50s = "-" if p50 != p50 else f"{p50:.4f}"
        p99s = "-" if p99 != p99 else f"{p99:.4f}"
        print(f"| {name} | {p50s} | {p99s} | {rate:,.0f} | {overhead} |")
    overhead = s50 - l50
    best = max(rates.values())
    print(
        f"targets: overhead p50 {overhead:.3f} ms (<= 0.2: {'met' if overhead <= 0.2 else 'MISSED'}),"
        f" best {best:,.0f} steps/s (>= 5,000: {'met' if best >= 5000 else 'MISSED'})"
    )
    print(json.dumps({"overhead_p50_ms": overhead, "p99_ms": s99, "steps_per_s": rates}))


if __name__ == "__main__":
    main()
