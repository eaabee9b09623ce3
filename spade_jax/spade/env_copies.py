"""Sandboxed copies of a round's programs, opened only on the host that steps them.

A round plays groups of episodes: ``count`` copies of each program (a game's hint and
no-hint plays, a memory replay's plays), laid out in one batch in group order. On a
multi-host job :func:`spade_jax.rollout.agent_loop.run_episodes` steps episode i on its
owner only (:func:`~spade_jax.rollout.agent_loop.episode_owner`: contiguous blocks of the
batch), so a copy is opened, as a sandbox worker, only on the host that owns its episode;
the other hosts hold None in its place and never touch it.

Which copies a host owns depends on the batch layout, and the layout on which programs
load: a group that fails to load is dropped and every later episode moves. So the copies
are opened in passes: open the copies this host owns under the current layout, agree the
load verdicts (each group's verdict is that of the host owning its first copy; a host
that failed where that host passed opens its missing copies once more), drop the failed
groups, and repeat with the new layout (closing copies this host no longer owns, opening
those it now owns) until no group fails. Each pass but the last drops a group, so there
is at most one pass more than there are groups (one host: one pass, two if a load failed).
Records do not change: the batch, its order and every episode's seed are what they were
when every host opened every copy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax

from spade_jax.rollout.agent_loop import episode_owner
from spade_jax.spade import agreement
from spade_jax.spade.window import VALID, Verdict

OpenEnvs = Callable[[str, int], tuple[list[Any], Verdict]]


@dataclasses.dataclass(frozen=True)
class CopyGroup:
    """``count`` consecutive episodes of one program.

    Attributes:
      name: the environment id (for messages).
      program: the program's source.
      count: copies (episodes) in the batch.
    """

    name: str
    program: str
    count: int


def layout_owners(counts: Sequence[int], live: Sequence[bool], processes: int
                  ) -> list[list[int]]:
    """Per group, the process that steps each of its copies in a batch of the live groups'
    copies in group order (a dropped group: no copies)."""
    total = sum(c for c, ok in zip(counts, live, strict=True) if ok)
    owners, start = [], 0
    for count, ok in zip(counts, live, strict=True):
        owners.append([episode_owner(start + j, total, processes) for j in range(count)]
                      if ok else [])
        start += count if ok else 0
    return owners


def open_owned_copies(groups: Sequence[CopyGroup], open_envs: OpenEnvs, *,
                      processes: int | None = None, process: int | None = None
                      ) -> list[tuple[list[Any], Verdict]]:
    """Per group: its copies in order (None for those another host steps) and the agreed
    verdict, or ``([], failed verdict)`` for a group that did not load (its copies
    closed). ``open_envs(program, n)`` opens n copies, stopping at the first failure.
    ``processes`` / ``process`` default to JAX's (tests may pass others)."""
    processes = jax.process_count() if processes is None else processes
    process = jax.process_index() if process is None else process
    opened: list[dict[int, Any]] = [{} for _ in groups]
    local: list[Verdict] = [VALID] * len(groups)
    dropped: dict[int, Verdict] = {}
    mine: list[set[int]] = []

    def fill(g: int) -> Verdict:
        """Opens this host's copies of group g that are not open yet."""
        missing = sorted(mine[g] - opened[g].keys())
        if not missing:
            return VALID
        envs, verdict = open_envs(groups[g].program, len(missing))
        opened[g].update(zip(missing, envs, strict=False))
        return verdict

    def recheck(g: int) -> Verdict:
        local[g] = fill(g)
        return local[g]

    while True:
        owners = layout_owners([g.count for g in groups],
                               [g not in dropped for g in range(len(groups))], processes)
        mine = [{j for j, p in enumerate(o) if p == process} for o in owners]
        for g in range(len(groups)):
            for j in sorted(opened[g].keys() - mine[g]):  # another host steps it now
                opened[g].pop(j).close()
            if local[g].ok:
                local[g] = fill(g)
        live = [g for g in range(len(groups)) if g not in dropped]
        verdicts = agreement.agree_verdicts(
            "environment loading", [groups[g].name for g in live], [local[g] for g in live],
            lambda i, live=live: recheck(live[i]), primaries=[owners[g][0] for g in live])
        failed = [(g, v) for g, v in zip(live, verdicts, strict=True) if not v.ok]
        if not failed:
            break
        for g, verdict in failed:
            dropped[g] = verdict
            for env in opened[g].values():
                env.close()
            opened[g] = {}
    return [([], dropped[g]) if g in dropped
            else ([opened[g].get(j) for j in range(group.count)], VALID)
            for g, group in enumerate(groups)]
