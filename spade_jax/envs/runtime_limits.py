"""Run-time enforcement of what validation checks: the blocklist and the replay audit.

Validation can be told apart from an agent's play (a program sees its inputs), so it can
narrow what reaches training but cannot be the only guard. While programs are played, the
pool enforces the same limits: per-call CPU time and deadline (supervisor), memory held
(zygote), determinism (a seeded share of finished episodes is replayed in a fresh worker
and must reproduce its transcript: `replay_audit`). A program that breaks one is
blocklisted (`Blocklist`): the pool refuses it for further episodes.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any

from spade_jax.envs.results import RUNTIME_LIMIT_CODES, SandboxError

# Failures of a replay that say nothing about the program (the replay could not run).
_INCONCLUSIVE = frozenset({"crash", "pool_memory_limit", "weak_isolation", "blocklisted",
                           "closed"})


def program_id(source: str) -> str:
    """A stable id of a program's text (hex digest), the blocklist's key."""
    return hashlib.blake2b(source.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


class Blocklist:
    """Programs refused for further episodes, by `program_id`, with why (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._why: dict[str, SandboxError] = {}

    def add(self, program: str, why: SandboxError) -> None:
        with self._lock:
            self._why.setdefault(program, why)  # the first reason stays

    def get(self, program: str) -> SandboxError | None:
        return self._why.get(program)

    def items(self) -> dict[str, SandboxError]:
        with self._lock:
            return dict(self._why)


def breaks_limit(error: SandboxError) -> bool:
    """Whether a failed call of a played episode means the program broke a run-time limit."""
    return error.code in RUNTIME_LIMIT_CODES


def replay_audit(pool: Any, handles: list[Any]) -> list[SandboxError | None]:
    """Replays each handle's finished episode (its seed and actions) in a fresh worker, all
    concurrently; per handle None if the transcript was reproduced (or the replay could
    not run), else a "nondeterministic_replay" error saying what differed."""
    snapshots = [handle.snapshot() for handle in handles]
    twins: list[Any] = [None] * len(handles)
    groups: dict[tuple[str, int, bool, bool], list[int]] = {}
    for i, snap in enumerate(snapshots):
        groups.setdefault((snap.contract, snap.max_turns, snap.lenient, snap.play_limits),
                          []).append(i)
    # The twins play as the originals did (the play wrapper, the play-time limits).
    for (contract, max_turns, lenient, play_limits), members in groups.items():
        opened = pool.open_many([snapshots[i].source for i in members], contract=contract,
                                max_turns=max_turns, trial=True, lenient=lenient,
                                play_limits=play_limits)
        for i, twin in zip(members, opened, strict=True):
            twins[i] = twin
    failed: list[SandboxError | None] = [twin.error for twin in twins]
    live = [i for i in range(len(twins)) if failed[i] is None]
    for i, first in zip(live, pool.reset_many([(twins[i], snapshots[i].seed) for i in live]),
                        strict=True):
        failed[i] = first.error
    turn = 0
    while live := [i for i in live if failed[i] is None and turn < len(snapshots[i].actions)]:
        calls = [(twins[i], snapshots[i].actions[turn]) for i in live]
        for i, result in zip(live, pool.step_many(calls), strict=True):
            failed[i] = result.error
        turn += 1
    verdicts: list[SandboxError | None] = []
    for twin, snap, error in zip(twins, snapshots, failed, strict=True):
        digest = twin.transcript_digest
        twin.close()
        if error is not None and error.code in _INCONCLUSIVE:
            verdicts.append(None)
        elif error is not None:
            verdicts.append(SandboxError(
                "nondeterministic_replay", f"the replay in a fresh worker failed: {error}"))
        elif digest != snap.digest:
            verdicts.append(SandboxError(
                "nondeterministic_replay",
                f"the same seed and {len(snap.actions)} actions gave another transcript"))
        else:
            verdicts.append(None)
    return verdicts
