"""Multi-turn rollout cost: ``run_episodes`` vs one ``sample`` call making the same tokens.

    python benchmarks/agent_loop.py                   # 32 episodes, 2-6 turns, 3 repeats
    python benchmarks/agent_loop.py --episodes=8 --reps=1      # quick smoke run

Episodes are scripted in-process text games with skewed turn counts (most end after 2
turns, a few run 6) and observation lengths (5 to 80 words). The policy is the random
``bench_moe_17m`` MoE (default options, so ``moe_impl="auto"``) with a small sentencepiece
chat tokenizer, sampling at temperature 1.

The reference is one ``sample`` call on the episodes' first prompts that generates, per
row, exactly the number of policy tokens that row's episode generated over all its turns
(EOS off): the same decode work with no turns, no env steps and no re-prefill. The
printed ratio is median(run_episodes) / median(sample) over interleaved repeats, both
measured in this run, in wall seconds and in process CPU seconds (steadier on a shared
box). Warm-up runs repeat until one compiles nothing new (the arrival order, and so the
shapes the engine meets, varies from run to run; a training job meets them once), and the
compiles that still happen inside measured runs are printed. Also printed: prefill tokens
per generated token (KV reuse makes this the added tokens only; admits feed them packed,
so the padding fed beside them is printed too) and slot utilisation (busy slot-steps /
slot-steps decoded).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spade_jax.models import ModelOptions, Qwen3, preset  # noqa: E402
from spade_jax.rollout import SamplerConfig, sample  # noqa: E402
from spade_jax.rollout.agent_loop import (  # noqa: E402
    AgentLoopConfig,
    ChatTurns,
    EpisodeSpec,
    run_episodes,
)
from spade_jax.tokenizers import train_sentencepiece  # noqa: E402

COMPILES = {"count": 0, "seconds": 0.0}


def _count_compiles(event: str, seconds: float, **_) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        COMPILES["count"] += 1
        COMPILES["seconds"] += seconds


def timed(fn):
    """(wall s, CPU s, new compiles, compile s, fn's result)."""
    before = dict(COMPILES)
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return (time.perf_counter() - wall, time.process_time() - cpu,
            COMPILES["count"] - before["count"], COMPILES["seconds"] - before["seconds"], out)


WORDS = "north south east west door key lamp room wall step open look take".split()


class TextGame:
    """Ends after ``turns`` steps; each observation is ``words`` words long."""

    def __init__(self, turns: int, words: int):
        self.turns, self.words = turns, words

    def _obs(self, t: int) -> str:
        return " ".join(WORDS[(t + i) % len(WORDS)] for i in range(self.words))

    def reset(self, *, seed=None, options=None):
        self.t = 0
        return self._obs(seed or 0), {}

    def step(self, action):
        self.t += 1
        return self._obs(self.t), 0.0, self.t >= self.turns, False, {}


def episode_plan(n: int, seed: int = 0) -> list[tuple[int, int]]:
    """(turns, observation words) per episode: skewed, most short, a few long."""
    rng = np.random.default_rng(seed)
    turns = np.minimum(2 + rng.geometric(0.55, n) - 1, 6)
    words = rng.integers(5, 81, n)
    return list(zip(turns.tolist(), words.tolist(), strict=True))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--turn_tokens", type=int, default=32)
    parser.add_argument("--slots", type=int, default=0, help="decode slots (0 = one each)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max_warmup", type=int, default=6, help="warm-up runs at most")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = train_sentencepiece([" ".join(WORDS) * 8, "user assistant system\n"],
                                        Path(tmp) / "tok", vocab_size=400)
    cfg = dataclasses.replace(preset("bench_moe_17m"), vocab_size=tokenizer.vocab_size)
    model = Qwen3(cfg, ModelOptions(), rngs=nnx.Rngs(0))
    plan = episode_plan(args.episodes)
    sampler = SamplerConfig(args.turn_tokens, temperature=1.0, seed=0, chunk_steps=8)
    config = AgentLoopConfig(max_turns=6, max_turn_tokens=args.turn_tokens,
                             max_episode_tokens=4096, sampler=sampler,
                             decode_slots=args.slots)

    def episodes():
        specs = [EpisodeSpec(TextGame(t, w), "game", i) for i, (t, w) in enumerate(plan)]
        stats: dict = {}
        records = run_episodes(model, tokenizer, specs, config, seed=1, stats=stats)
        return records, stats

    jax.monitoring.register_event_duration_secs_listener(_count_compiles)
    warm, compiles = 0, 1
    while compiles and warm < args.max_warmup:  # until a run meets no new shape
        *_, compiles, _, (records, stats) = timed(episodes)
        warm += 1
    turns = ChatTurns(tokenizer, None, False)
    firsts = [turns.first_prompt(r.observations[0]) for r in records]
    budgets = [r.cost.tokens_generated for r in records]
    one_call = dataclasses.replace(sampler, max_new_tokens=max(budgets), chunk_steps=0)

    def single():
        out = sample(model, firsts, one_call, stop_tokens=[], max_new_per_seq=budgets)
        assert [len(t) for t in out.tokens] == budgets
        return out

    single()  # compile
    runs: dict[str, list] = {"run_episodes": [], "one sample call": []}
    loads = []
    for _ in range(args.reps):  # interleaved, so load swings hit both sides alike
        loads.append(os.getloadavg()[0])
        *loop, (records, stats) = timed(episodes)
        runs["run_episodes"].append(loop)
        runs["one sample call"].append(timed(single)[:4])
    generated = sum(budgets)
    slots = stats["slots"]
    print(f"model bench_moe_17m ({model.options.moe_impl}); {args.episodes} episodes, "
          f"turns {sorted(t for t, _ in plan)}; {generated} policy tokens; {slots} slots; "
          f"{warm} warm-up runs; load average at each repeat {[round(x, 1) for x in loads]} "
          f"(2-core box)")
    print(f"{'':>16} {'median s':>9} {'CPU s':>7} {'wall s per run':>30} {'tok/s':>7} "
          f"{'compiles (s)':>13}")
    med = {name: [statistics.median(r[i] for r in rows) for i in range(2)]
           for name, rows in runs.items()}
    for name, rows in runs.items():
        compiled = sum(r[2] for r in rows), sum(r[3] for r in rows)
        print(f"{name:>16} {med[name][0]:>9.2f} {med[name][1]:>7.2f} "
              f"{str([round(r[0], 2) for r in rows]):>30} {generated / med[name][0]:>7.0f} "
              f"{compiled[0]:>6} ({compiled[1]:.1f})")
    ratio, cpu_ratio = (med["run_episodes"][i] / med["one sample call"][i] for i in range(2))
    per_rep = [round(a[0] / b[0], 2) for a, b in zip(*runs.values(), strict=True)]
    print(f"ratio run_episodes / sample: {ratio:.2f}x wall (per repeat {per_rep}), "
          f"{cpu_ratio:.2f}x CPU; target <= 1.5x")
    print(f"prefill tokens per generated token: {stats['prefill_tokens'] / generated:.2f} "
          f"({stats['prefill_tokens']} prefilled, {stats['prefill_fed_tokens']} fed with the "
          f"packing's padding, {stats['shared_prefills']} shared openings)")
    busy = stats["busy_slot_steps"] / max(1, stats["decode_steps"] * slots)
    print(f"slot utilisation: {100 * busy:.1f}% ({stats['decode_steps']} decode steps, "
          f"{stats['ticks']} ticks, {stats['prefill_calls']} prefill calls, "
          f"cache {stats['cache_len']} slots); rows decoded per busy row "
          f"{stats['decode_row_steps'] / max(1, stats['busy_slot_steps']):.2f}")


if __name__ == "__main__":
    main()
