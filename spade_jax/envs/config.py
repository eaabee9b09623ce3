"""Settings of the environment sandbox (one frozen dataclass, validated on construction)."""

from __future__ import annotations

import dataclasses
import os

from spade_jax.envs.contract import (
    CALL_CPU_BUDGET_S,
    DEFAULT_ALLOWED_IMPORTS,
    REFERENCE_IMPORTS,
    WORKER_MEMORY_MB,
)


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
    """Limits and layers of the sandbox that runs environment programs.

    Every limit below is enforced by the kernel in the worker or by the supervisor in the
    trainer process; none relies on the program's cooperation.
    """

    # Wall-clock deadline of one reset()/step() call; past it the worker's process group is
    # SIGKILLed and the call returns reason "timeout".
    call_deadline_s: float = 5.0
    # CPU seconds one reset()/step() call may use (the contracts' "1 second of CPU time"),
    # read from /proc by the trainer while the call runs and when it replies: over it the
    # worker is killed and the call returns "slow_call". CPU time, unlike wall-clock time,
    # does not grow with the host's load. None: no budget (only the deadline).
    call_cpu_budget_s: float | None = CALL_CPU_BUDGET_S
    # Play-time limits of one reset()/step() call of a game the agent plays (not a
    # validation's): wall clock and CPU seconds. An honest game can be slowed by what the
    # agent answers (a huge number to parse), so play may allow more than validation does;
    # over them the call fails as above and the game is blocklisted. None: the limits above.
    # The recipe drops a play whose step() takes over 30 s.
    play_call_deadline_s: float | None = None
    play_call_cpu_budget_s: float | None = None
    # The recipe's play wrapper: a reference game whose step() raises, or returns something
    # that is not a 5-tuple, answers the agent with an error observation, reward -1 and
    # terminated, instead of ending the episode as an env_error; the tuple's parts are
    # coerced (str observation, float reward, bool flags, dict info). Played episodes only:
    # validation stays strict.
    lenient_play_steps: bool = False
    # Deadline for loading a program (module-level code + Environment()).
    load_deadline_s: float = 10.0
    # RLIMIT_AS of a worker (address space, MiB).
    memory_limit_mb: int = 1024
    # Memory one worker may hold (MiB of anonymous and shared pages, memfd and
    # MAP_SHARED|MAP_ANONYMOUS included, above what it inherits from the zygote), checked
    # by the zygote every 0.1 s from /proc: over it the worker is killed and its call
    # fails with "memory_limit". The contracts' "512 MiB". None: only RLIMIT_AS.
    worker_memory_mb: int | None = WORKER_MEMORY_MB
    # Budget of the memory all workers of the pool hold together (MiB of anonymous and
    # shared pages above what they inherit from the zygote), checked by the zygote every 0.1 s from
    # /proc: over it, the largest worker is killed and its call fails with
    # "pool_memory_limit". None = 3/4 of the host's physical memory.
    pool_memory_mb: int | None = None
    # RLIMIT_CPU of a worker (CPU seconds over its whole life; one worker = one handle).
    cpu_limit_s: int = 120
    # RLIMIT_NOFILE of a worker.
    max_open_files: int = 32
    # Static-gate caps on the program source.
    max_source_bytes: int = 64 * 1024
    max_ast_nodes: int = 50_000
    # Caps the supervisor enforces on what comes back and what goes in.
    max_observation_chars: int = 16_384
    max_action_chars: int = 16_384
    max_message_bytes: int = 1 << 20
    # The supervisor truncates an episode that runs this many steps (gymnasium TimeLimit).
    max_episode_steps: int = 1_000
    # Share of finished episodes replayed in a fresh worker (same seed, same actions) to
    # check that the transcript is reproduced: a program that plays deterministically for
    # the validator and not for the agent is caught at run time ("nondeterministic_replay").
    # Which episodes: a seeded draw per (pool seed, program, episode seed). 0 turns it off.
    replay_audit_rate: float = 0.125
    # A program that breaks a run-time limit (results.RUNTIME_LIMIT_CODES) in a played
    # episode is blocklisted by the pool: refused for further episodes (`EnvPool.blocked`).
    blocklist_on_limits: bool = True
    # Workers forked ahead of demand, so open() does not wait for a fork + seccomp load.
    spare_workers: int = 2
    # Layers. Turning one off makes the runtime refuse untrusted code unless
    # allow_weak_isolation is set (tests switch the static gate off to show the runtime
    # contains what the gate would have filtered).
    static_gate: bool = True
    use_namespaces: bool = True
    use_seccomp: bool = True
    drop_privileges: bool = True
    sandbox_uid: int = 65534
    sandbox_gid: int = 65534
    # Each worker runs under its own uid and gid, drawn at random from
    # [worker_uid_base, worker_uid_base + worker_uid_count) among those not in use: the
    # kernel lets a process signal (kill, async-I/O owner) or inspect (/proc, ptrace) only
    # processes of its own uid, so co-tenants cannot reach each other, and a random draw
    # says nothing about the load order. False: every worker runs as sandbox_uid/gid.
    per_worker_uid: bool = True
    worker_uid_base: int = 200_000
    worker_uid_count: int = 100_000
    allow_weak_isolation: bool = False
    allowed_imports: frozenset[str] = DEFAULT_ALLOWED_IMPORTS
    # Extra modules of the reference (recipe) contract, importable only by programs loaded
    # under it: numpy and math_verify. The zygote imports them before forking, so every
    # worker starts with them mapped (about 130 MiB of address space, counted by
    # RLIMIT_AS); an empty set leaves them out and reference programs that use them fail
    # to load.
    reference_imports: frozenset[str] = REFERENCE_IMPORTS
    # Path of the bubblewrap binary; None = look it up on PATH.
    bwrap_path: str | None = None

    def __post_init__(self) -> None:
        positive = {
            "call_deadline_s": self.call_deadline_s,
            "load_deadline_s": self.load_deadline_s,
            "memory_limit_mb": self.memory_limit_mb,
            "cpu_limit_s": self.cpu_limit_s,
            "max_source_bytes": self.max_source_bytes,
            "max_ast_nodes": self.max_ast_nodes,
            "max_observation_chars": self.max_observation_chars,
            "max_action_chars": self.max_action_chars,
            "max_message_bytes": self.max_message_bytes,
            "max_episode_steps": self.max_episode_steps,
        }
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"SandboxConfig.{name} must be > 0, got {value!r}")
        # A worker inherits the zygote's mappings: ~128 MiB for Python, ~256 MiB once numpy
        # and math_verify are preloaded (below ~200 MiB a numpy call already crashes).
        floor = 256 if self.reference_imports else 128
        if self.memory_limit_mb < floor:
            raise ValueError(
                f"SandboxConfig.memory_limit_mb={self.memory_limit_mb} is below the ~{floor} "
                "MiB a Python worker needs"
                + (" with reference_imports preloaded (set reference_imports=frozenset() "
                   "to run paper-contract programs in less)" if self.reference_imports else "")
            )
        for name in ("call_cpu_budget_s", "play_call_deadline_s", "play_call_cpu_budget_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"SandboxConfig.{name} must be None or > 0, got {value!r}")
        if self.worker_memory_mb is not None and not (
            type(self.worker_memory_mb) is int and self.worker_memory_mb >= 16
        ):
            raise ValueError("SandboxConfig.worker_memory_mb must be None or an int >= 16, "
                             f"got {self.worker_memory_mb!r}")
        if not 0.0 <= self.replay_audit_rate <= 1.0:
            raise ValueError("SandboxConfig.replay_audit_rate must lie in [0, 1], got "
                             f"{self.replay_audit_rate!r}")
        if self.pool_memory_mb is not None and not (
            type(self.pool_memory_mb) is int and self.pool_memory_mb >= self.memory_limit_mb // 4
        ):
            raise ValueError(
                "SandboxConfig.pool_memory_mb must be None or an int >= memory_limit_mb / 4 "
                f"(one worker must fit), got {self.pool_memory_mb!r}"
            )
        if self.max_open_files < 8:
            raise ValueError(
                f"SandboxConfig.max_open_files must be >= 8, got {self.max_open_files}"
            )
        if self.spare_workers < 0:
            raise ValueError(f"SandboxConfig.spare_workers must be >= 0, got {self.spare_workers}")
        # An observation of N chars is at most 6N bytes of ASCII-escaped JSON.
        if self.max_message_bytes < 6 * self.max_observation_chars + 4096:
            raise ValueError(
                "SandboxConfig.max_message_bytes must hold a maximal observation: need >= "
                f"{6 * self.max_observation_chars + 4096}, got {self.max_message_bytes}"
            )
        if not (0 < self.sandbox_uid < 2**31 and 0 < self.sandbox_gid < 2**31):
            raise ValueError("SandboxConfig.sandbox_uid/gid must be non-root ids")
        if not (0 < self.worker_uid_base and self.worker_uid_count >= 64
                and self.worker_uid_base + self.worker_uid_count < 2**31):
            raise ValueError(
                "SandboxConfig.worker_uid_base must be > 0 and worker_uid_count >= 64 with "
                f"base + count < 2**31, got {self.worker_uid_base}, {self.worker_uid_count}"
            )
        for name in ("allowed_imports", "reference_imports"):
            if not isinstance(getattr(self, name), frozenset):
                raise TypeError(f"SandboxConfig.{name} must be a frozenset of module names")
        unknown = self.reference_imports - REFERENCE_IMPORTS
        if unknown:
            raise ValueError(
                f"SandboxConfig.reference_imports: {sorted(unknown)} not in {sorted(REFERENCE_IMPORTS)}"
            )

    def pool_memory_bytes(self) -> int:
        """The pool-wide memory budget in bytes (default: 3/4 of physical memory)."""
        if self.pool_memory_mb is not None:
            return self.pool_memory_mb << 20
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 3 // 4

    def worker_limits(self) -> dict[str, object]:
        """The plain-JSON subset a worker needs (sent to the zygote with each spawn)."""
        return {
            "memory_limit_bytes": self.memory_limit_mb << 20,
            "cpu_limit_s": self.cpu_limit_s,
            "max_open_files": self.max_open_files,
            "max_observation_chars": self.max_observation_chars,
            "max_message_bytes": self.max_message_bytes,
            "use_seccomp": self.use_seccomp,
            "pool_memory_bytes": self.pool_memory_bytes(),
            "worker_memory_bytes": (self.worker_memory_mb or 0) << 20,
            "drop_privileges": self.drop_privileges,
            "uid": self.sandbox_uid,
            "gid": self.sandbox_gid,
            # The zygote replaces uid/gid by a fresh id from this range for each worker.
            "uid_range": (
                [self.worker_uid_base, self.worker_uid_count] if self.per_worker_uid else None
            ),
        }
