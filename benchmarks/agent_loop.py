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
measured in this run. Also printed: prefill tokens per generated token (KV reuse makes this
the added tokens only) and slot utilisation (busy slot-steps / slot-steps decoded).
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
        t0 = time.perf_counter()
        records = run_episodes(model, tokenizer, specs, config, seed=1, stats=stats)
        return time.perf_counter() - t0, records, stats

    for _ in range(2):  # compiles the shapes the loop uses (arrival order varies them)
        _, records, stats = episodes()
    turns = ChatTurns(tokenizer, None, False)
    firsts = [turns.first_prompt(r.observations[0]) for r in records]
    budgets = [r.cost.tokens_generated for r in records]
    one_call = dataclasses.replace(sampler, max_new_tokens=max(budgets), chunk_steps=0)

    def single():
        t0 = time.perf_counter()
        out = sample(model, firsts, one_call, stop_tokens=[], max_new_per_seq=budgets)
        assert [len(t) for t in out.tokens] == budgets
        return time.perf_counter() - t0

    single()  # compile
    loop_s, single_s, loads = [], [], []
    for _ in range(args.reps):  # interleaved, so load swings hit both sides alike
        loads.append(os.getloadavg()[0])
        seconds, records, stats = episodes()
        loop_s.append(seconds)
        single_s.append(single())
    generated = sum(budgets)
    slots = stats["slots"]
    print(f"model bench_moe_17m ({model.options.moe_impl}); {args.episodes} episodes, "
          f"turns {sorted(t for t, _ in plan)}; {generated} policy tokens; {slots} slots; "
          f"load average at each repeat {[round(x, 1) for x in loads]} (2-core box)")
    print(f"{'':>28} {'median s':>9} {'all runs s':>24} {'tok/s':>8}")
    for name, runs in (("run_episodes", loop_s), ("one sample call", single_s)):
        print(f"{name:>28} {statistics.median(runs):>9.2f} "
              f"{str([round(x, 2) for x in runs]):>24} {generated / statistics.median(runs):>8.0f}")
    ratio = statistics.median(loop_s) / statistics.median(single_s)
    per_rep = [round(a / b, 2) for a, b in zip(loop_s, single_s, strict=True)]
    print(f"ratio run_episodes / sample: {ratio:.2f}x (per repeat {per_rep}; target <= 1.5x)")
    print(f"prefill tokens per generated token: {stats['prefill_tokens'] / generated:.2f} "
          f"({stats['prefill_tokens']} prefilled, {stats['shared_prefills']} shared openings)")
    busy = stats["busy_slot_steps"] / max(1, stats["decode_steps"] * slots)
    print(f"slot utilisation: {100 * busy:.1f}% ({stats['decode_steps']} decode steps, "
          f"{stats['ticks']} ticks, {stats['prefill_calls']} prefill calls, "
          f"cache {stats['cache_len']} slots)")


if __name__ == "__main__":
    main()
