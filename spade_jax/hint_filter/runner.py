"""Hint-regret filter: each task is played with and without its hint; the gap sorts it.

    stats = run_filter(policy, tasks, out_dir, FilterConfig(samples_hint=16))

Per task, `samples_hint` episodes see the hint and `samples_no_hint` do not; the arms'
returns go to `spade_jax.spade.designer_reward` (the SPADE designer reward: the one
implementation of regret, win rate and regime), so a task lands in frontier (regret above
`frontier_regret`), mastered or intractable exactly as in training.

Streaming and resume: tasks are processed in fixed chunks of `chunk_size` (chunk c = the
selected tasks [c * size, (c + 1) * size)), each chunk sampled with a seed derived from
(seed, c). A finished chunk is appended to `progress.jsonl` with one write + fsync. On
restart, complete chunks are kept (a chunk with missing or torn lines is dropped and redone)
and sampling resumes at the first unfinished chunk with the same seed and batch, so the
final outputs equal those of an uninterrupted run. `run.json` holds a fingerprint of the
tasks and settings; resuming with different ones is refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from spade_jax import storage
from spade_jax.envs import SandboxConfig
from spade_jax.evaluation.checkers import get_checker
from spade_jax.evaluation.episodes import run_task_episodes
from spade_jax.evaluation.policy import TextPolicy
from spade_jax.hint_filter.tasks import FilterTask
from spade_jax.spade import DesignerRewardConfig, designer_reward
from spade_jax.spade.prompts import agent_first_observation

PROGRESS, RUN = "progress.jsonl", "run.json"


@dataclasses.dataclass(frozen=True)
class FilterConfig:
    """Settings of the hint-regret filter.

    Attributes:
      samples_hint: episodes per task with the hint (paper: 16).
      samples_no_hint: episodes per task without it (paper: 16 * k).
      success_threshold: a return at or above this counts as a win (win rate).
      reward: regime thresholds (frontier_regret, mastered_return) and reward weights.
      max_tasks: sub-sample this many tasks (uniformly, kept in file order); None = all.
      subsample_seed: seed of that sub-sample.
      chunk_size: tasks per sampling batch and per progress commit.
      seed: sampling seed.
      max_new_tokens: per completion / per turn of a program task.
      max_turns: turns per program-task episode (a task's own max_turns wins).
      validate_programs: run `validate_program` on program tasks first; a failing program
        is recorded as broken (regime intractable) without sampling.
      sandbox: sandbox settings for program tasks.
    """

    samples_hint: int = 16
    samples_no_hint: int = 16
    success_threshold: float = 1.0
    reward: DesignerRewardConfig = dataclasses.field(default_factory=DesignerRewardConfig)
    max_tasks: int | None = None
    subsample_seed: int = 0
    chunk_size: int = 8
    seed: int = 0
    max_new_tokens: int = 1024
    max_turns: int = 8
    validate_programs: bool = True
    sandbox: SandboxConfig = dataclasses.field(default_factory=SandboxConfig)

    def __post_init__(self) -> None:
        for name in ("samples_hint", "samples_no_hint", "chunk_size", "max_new_tokens",
                     "max_turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"FilterConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 < self.success_threshold <= 1.0:
            raise ValueError(f"FilterConfig.success_threshold must be in (0, 1], "
                             f"got {self.success_threshold}")
        if self.max_tasks is not None and self.max_tasks < 1:
            raise ValueError(f"FilterConfig.max_tasks must be >= 1 or None, got {self.max_tasks}")

    def fingerprint_fields(self) -> dict[str, Any]:
        """What the outputs depend on (resuming under other values is refused)."""
        fields = dataclasses.asdict(self)
        fields.pop("sandbox")
        return fields


def select_tasks(tasks: Sequence[FilterTask], config: FilterConfig) -> list[FilterTask]:
    """All tasks, or a seeded uniform sub-sample of `max_tasks` in file order."""
    if config.max_tasks is None or config.max_tasks >= len(tasks):
        return list(tasks)
    rng = np.random.default_rng(config.subsample_seed)
    keep = np.sort(rng.choice(len(tasks), size=config.max_tasks, replace=False))
    return [tasks[i] for i in keep]


def _fingerprint(tasks: Sequence[FilterTask], config: FilterConfig) -> str:
    digest = hashlib.sha256()
    digest.update(json.dumps(config.fingerprint_fields(), sort_keys=True, default=str).encode())
    for task in tasks:
        digest.update(json.dumps(task.record, sort_keys=True).encode())
    return digest.hexdigest()


def _chunk_seed(seed: int, chunk: int) -> int:
    return int(np.random.SeedSequence([seed, chunk]).generate_state(1)[0] & 0x7FFFFFFF)


def _stderr(values: np.ndarray) -> float:
    return float(values.std(ddof=1) / math.sqrt(values.size)) if values.size > 1 else math.nan


def task_statistics(returns_hint: Sequence[float], returns_no_hint: Sequence[float],
                    config: FilterConfig) -> dict[str, Any]:
    """Per-task statistics: designer_reward's parts plus standard errors and raw returns."""
    hint = np.clip(np.asarray(returns_hint, dtype=np.float64), 0.0, 1.0)
    no_hint = np.clip(np.asarray(returns_no_hint, dtype=np.float64), 0.0, 1.0)
    reward = designer_reward(hint, no_hint, config.success_threshold, config.reward)
    se_hint, se_no_hint = _stderr(hint), _stderr(no_hint)
    win = reward.win_rate
    return {
        "regime": str(reward.regime),
        "regret": reward.regret,
        "regret_stderr": math.sqrt(se_hint**2 + se_no_hint**2),
        "clipped_regret": reward.clipped,
        "mean_hint": reward.mean_hint,
        "mean_hint_stderr": se_hint,
        "mean_no_hint": reward.mean_no_hint,
        "mean_no_hint_stderr": se_no_hint,
        "win_rate": win,
        "win_rate_stderr": math.sqrt(win * (1 - win) / no_hint.size),
        "win_rate_hint": reward.win_rate_hint,
        "anchor": reward.anchor,
        "designer_reward": reward.total,
        "returns_hint": hint.tolist(),
        "returns_no_hint": no_hint.tolist(),
    }


def _hinted_prompt(task: FilterTask) -> str:
    return agent_first_observation(task.prompt, task.hint)


def _answer_returns(policy: TextPolicy, tasks: list[FilterTask], n: int, hinted: bool,
                    seed: int, max_new_tokens: int) -> list[list[float]]:
    prompts = [_hinted_prompt(t) if hinted else t.prompt for t in tasks]
    texts = policy.complete([[{"role": "user", "content": p}] for p in prompts], n=n, seed=seed,
                            max_new_tokens=max_new_tokens)
    return [[get_checker(t.checker)(text, t.answer).score for text in row]
            for t, row in zip(tasks, texts, strict=True)]


def _program_returns(policy: TextPolicy, tasks: list[FilterTask], n: int, hinted: bool,
                     seed: int, config: FilterConfig, pool: Any) -> list[list[float]]:
    from spade_jax.envs import make_env

    prefix = [t.prompt for t in tasks]
    hints = [t.hint if hinted else None for t in tasks]
    max_turns = max(t.max_turns or config.max_turns for t in tasks)
    return run_task_episodes(
        policy, [lambda t=t: make_env(t.program, pool) for t in tasks], n=n,
        seeds=[t.seed for t in tasks], seed=seed, max_turns=max_turns,
        max_new_tokens=config.max_new_tokens, prefix=prefix, hints=hints)


def score_chunk(policy: TextPolicy, tasks: list[FilterTask], config: FilterConfig, seed: int,
                pool: Any = None) -> list[dict[str, Any]]:
    """Statistics of each task of one chunk (both arms sampled in one batch per kind)."""
    from spade_jax.envs import validate_program

    stats: dict[str, dict[str, Any]] = {}
    answer = [t for t in tasks if not t.is_program]
    programs = []
    for task in (t for t in tasks if t.is_program):
        report = validate_program(task.program, hint=task.hint) if config.validate_programs \
            else None
        if report is not None and not report.ok:
            stats[task.id] = {"regime": "intractable", "broken": str(report.reason)}
        else:
            programs.append(task)
    arms = ((True, config.samples_hint, seed), (False, config.samples_no_hint, seed + 1))
    returns: dict[bool, list[list[float]]] = {}
    for hinted, n, arm_seed in arms:
        returns[hinted] = []
        if answer:
            returns[hinted] += _answer_returns(policy, answer, n, hinted, arm_seed,
                                               config.max_new_tokens)
        if programs:
            returns[hinted] += _program_returns(policy, programs, n, hinted, arm_seed + 2,
                                                config, pool)
    for k, task in enumerate(answer + programs):
        stats[task.id] = task_statistics(returns[True][k], returns[False][k], config)
    return [dict(stats[t.id], id=t.id, line=t.line) for t in tasks]


# ----------------------------------------------------------------------------- progress


def _read_progress(path: Path, chunks: list[list[FilterTask]]) -> dict[str, dict[str, Any]]:
    """Finished tasks of complete chunks; rewrites the file without torn or partial chunks."""
    if not path.exists():
        return {}
    entries: dict[str, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            break  # a torn last line: the chunk it belongs to is redone
        if isinstance(entry, dict) and "id" in entry:
            entries[entry["id"]] = entry
    kept = {t.id: entries[t.id] for chunk in chunks if all(t.id in entries for t in chunk)
            for t in chunk}
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(kept[t.id]) + "\n" for c in chunks for t in c
                           if t.id in kept))
    os.replace(tmp, path)
    return kept


def _append(path: Path, entries: list[dict[str, Any]]) -> None:
    with path.open("a") as handle:
        handle.write("".join(json.dumps(e) + "\n" for e in entries))
        handle.flush()
        os.fsync(handle.fileno())


def run_filter(
    policy: TextPolicy,
    tasks: Sequence[FilterTask],
    out_dir: storage.PathLike,
    config: FilterConfig | None = None,
    *,
    restart: bool = False,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Scores every selected task (resuming from ``out_dir``); returns stats in task order.
    ``out_dir`` may be ``gs://...``: the progress file is uploaded after every chunk, so a
    killed run on another machine resumes from it."""
    config = config or FilterConfig()
    selected = select_tasks(tasks, config)
    with storage.MirroredDir(out_dir, resume=(RUN,) if restart else (RUN, PROGRESS)) as mirror:
        chunks, done = _open_run(mirror.local, str(out_dir), selected, config, restart)
        _score_chunks(policy, chunks, done, config, mirror, progress)
    return [done[t.id] for t in selected]


def _open_run(out: Path, name: str, selected: list[FilterTask], config: FilterConfig,
              restart: bool) -> tuple[list[list[FilterTask]], dict[str, dict[str, Any]]]:
    """The run's chunks and the tasks already finished in ``out`` (named ``name``)."""
    fingerprint = _fingerprint(selected, config)
    run_file, progress_file = out / RUN, out / PROGRESS
    if restart:
        progress_file.write_text("")  # emptied, not deleted: a remote copy is overwritten too
    elif run_file.exists():
        previous = json.loads(run_file.read_text()).get("fingerprint")
        if previous != fingerprint and progress_file.exists():
            raise ValueError(f"{name} holds a run with other tasks or settings; use another "
                             "--out or --restart to start over")
    run_file.write_text(json.dumps({"fingerprint": fingerprint,
                                    "config": config.fingerprint_fields(),
                                    "num_tasks": len(selected)}, indent=1, default=str))
    size = config.chunk_size
    chunks = [selected[i : i + size] for i in range(0, len(selected), size)]
    return chunks, _read_progress(progress_file, chunks)


def _score_chunks(policy: TextPolicy, chunks: list[list[FilterTask]],
                  done: dict[str, dict[str, Any]], config: FilterConfig,
                  mirror: storage.MirroredDir, progress: bool) -> None:
    """Scores the unfinished chunks, appending each to the progress file and syncing it."""
    from tqdm import tqdm

    pool = None
    bar = tqdm(total=sum(map(len, chunks)), initial=len(done), unit="task",
               disable=not progress, file=sys.stderr, desc="hint filter")
    try:
        for index, chunk in enumerate(chunks):
            if all(t.id in done for t in chunk):
                continue
            if pool is None and any(t.is_program for t in chunk):
                from spade_jax.envs import EnvPool

                pool = EnvPool(config.sandbox)
            entries = score_chunk(policy, chunk, config, _chunk_seed(config.seed, index), pool)
            _append(mirror.local / PROGRESS, entries)
            mirror.sync()
            done.update((e["id"], e) for e in entries)
            bar.update(len(chunk))
    finally:
        bar.close()
        if pool is not None:
            pool.close()
