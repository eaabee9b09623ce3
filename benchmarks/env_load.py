"""Per-host environment CPU load of a SPADE step: what one host's share of the episodes
costs in sandbox opens, resets and steps (issue 15 item 3).

    python benchmarks/env_load.py [--hosts 8] [--turns 25] [--episodes 4] [--pool_dir DIR]

Each seed program (the project's example environments) is opened in the real sandbox
(a fresh worker per episode, as the loop does), reset and stepped for up to ``--turns``
turns with short random answers, as a weak policy would play; a program that ends sooner
is reset and played again until the turn count is reached, so every episode costs the
full turn budget (the recipe's worst case: 25 turns, never solved). Reported per program:
wall seconds of an open, a reset and a step (what the trainer waits for), and the
worker's CPU seconds per episode (from the worker's own ``getrusage``). Then the recipe's
per-host load: the 30B games recipe plays 24 games x 8 = 192 episodes per step, plus 16
hint plays per game (384) at a regeneration step; each host opens, resets and steps only
its share (``episode_owner``), ``ceil(episodes / hosts)`` of them.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time

from spade_jax.envs import EnvPool, SandboxConfig
from spade_jax.spade.seed_programs import SEED_PROGRAMS, load_program_pool

RECIPE = {"plays_per_step": 24 * 8, "hint_plays_at_regeneration": 24 * 16}


def _episode(pool: EnvPool, source: str, turns: int, rng: random.Random) -> dict[str, float]:
    t0 = time.perf_counter()
    handle = pool.open(source)
    opened = time.perf_counter() - t0
    if not handle.ok:
        raise RuntimeError(f"program failed to load: {handle.error}")
    resets, steps, done = [], [], True
    for _ in range(turns):
        if done:
            t0 = time.perf_counter()
            handle.reset(seed=rng.randrange(2**31))
            resets.append(time.perf_counter() - t0)
        action = rng.choice([str(rng.randrange(100)), "yes", "left", "3 1 2", "\\boxed{7}"])
        t0 = time.perf_counter()
        result = handle.step(action)
        steps.append(time.perf_counter() - t0)
        done = result.terminated or result.truncated or not result.ok
    usage = handle.usage()
    handle.close()
    return {"open_s": opened, "reset_s": statistics.mean(resets),
            "step_s": statistics.mean(steps),
            "cpu_s": usage["cpu_s"] if isinstance(usage, dict) else math.nan}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hosts", type=int, default=8, help="v5p-64 = 8 hosts")
    parser.add_argument("--turns", type=int, default=25)
    parser.add_argument("--episodes", type=int, default=4, help="episodes per program")
    parser.add_argument("--pool_dir", default=None,
                        help="measure these programs (e.g. a recipe games/game_*.py pool) "
                             "instead of the seed programs")
    args = parser.parse_args()
    programs = load_program_pool(args.pool_dir) if args.pool_dir else SEED_PROGRAMS
    rng = random.Random(0)
    per_program = {}
    with EnvPool(SandboxConfig(), seed=0) as pool:
        pool.open(programs[0].source).close()  # warm the zygote
        for program in programs:
            runs = [_episode(pool, program.source, args.turns, rng) for _ in range(args.episodes)]
            per_program[program.name] = {k: statistics.mean(r[k] for r in runs) for k in runs[0]}
    mean = {k: statistics.mean(p[k] for p in per_program.values()) for k in ("open_s", "reset_s",
                                                                            "step_s", "cpu_s")}
    # Wall seconds of one episode as the trainer sees it (sequential calls of one thread).
    episode_wall = mean["open_s"] + mean["reset_s"] + args.turns * mean["step_s"]
    load = {}
    for name, episodes in (("plain_step", RECIPE["plays_per_step"]),
                           ("regeneration_step", RECIPE["plays_per_step"]
                            + RECIPE["hint_plays_at_regeneration"])):
        share = math.ceil(episodes / args.hosts)
        load[name] = {"episodes_per_host": share, "env_turns_per_host": share * args.turns,
                      "worker_cpu_s_per_host": share * mean["cpu_s"],
                      "serial_wall_s_per_host": share * episode_wall}
    print(json.dumps({"hosts": args.hosts, "turns": args.turns, "per_program": per_program,
                      "mean": mean, "episode_wall_s": episode_wall, "recipe_load": load},
                     indent=2))


if __name__ == "__main__":
    main()
