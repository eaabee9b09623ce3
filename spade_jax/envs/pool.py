"""EnvPool: the public face of the sandbox. Opens programs in fresh workers, steps them.

    pool = EnvPool(SandboxConfig())
    handle = pool.open(source)                 # fresh worker; handle.error if it failed
    first = handle.reset(seed=3)               # ResetResult
    result = handle.step("answer")             # StepResult, reward checked here
    results = pool.step_many([(h, a), ...])    # concurrent across workers
    snap = handle.snapshot(); twin = pool.fork(snap)   # counterfactual branch
    handle.close(); pool.close()

One handle = one worker process for its whole life, and a worker never serves a second
handle: hint and no-hint rollouts of the same program share no process and no state.
Every call returns a result object; untrusted behaviour never raises.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
import os
import random
import threading
import warnings
from collections.abc import Sequence
from typing import Any

from spade_jax import seeding
from spade_jax.envs import supervisor, tools
from spade_jax.envs.config import SandboxConfig
from spade_jax.envs.contract import (
    AUTO_CONTRACT,
    RECIPE_SCORED,
    REFERENCE_MAX_TURNS,
    REFERENCE_REWARD_BOUND,
    TOOL_CONTRACTS,
    resolve_contract,
)
from spade_jax.envs.isolation import IsolationReport, measure_layers
from spade_jax.envs.launcher import Zygote, ZygoteError, find_bwrap
from spade_jax.envs.preflight import bwrap_unusable
from spade_jax.envs.results import (
    ResetResult,
    SandboxError,
    StepResult,
    failed_reset,
    failed_step,
)
from spade_jax.envs.runtime_limits import Blocklist, breaks_limit, program_id, replay_audit
from spade_jax.envs.static_gate import check_source
from spade_jax.envs.worker import PROGRAM_ERROR_KEY

log = logging.getLogger(__name__)

# Tolerance on the [0, 1] episode-return bound (sums of partial rewards like 0.1 * 10).
RETURN_TOLERANCE = 1e-6
# Paper contract: bound on every step reward and on the running return during an episode.
PAPER_STEP_REWARD_BOUND = 1.0


def _reward_bound_error(
    reward: float, episode_return: float, reference: bool
) -> SandboxError | None:
    """Why a (finite) step reward may not reach the agent, or None. Paper contract: every
    step reward in [-1, 1] and the running return in [-1, 1] (so +1e300 then -1e300 does
    not cancel into a valid return); the final return is checked in [0, 1] at episode end.
    Reference contract: the game's raw step reward in [-10, 10] (the reported reward is
    clipped to [-1, 1] and only on the terminating step)."""
    if reference:
        if abs(reward) <= REFERENCE_REWARD_BOUND:
            return None
        return SandboxError("reward_out_of_range", f"step reward {reward!r} outside [-10, 10]")
    if not abs(reward) <= PAPER_STEP_REWARD_BOUND + RETURN_TOLERANCE:
        return SandboxError("reward_out_of_range", f"step reward {reward!r} outside [-1, 1]")
    total = episode_return + reward
    if not -PAPER_STEP_REWARD_BOUND - RETURN_TOLERANCE <= total <= 1 + RETURN_TOLERANCE:
        return SandboxError("return_out_of_range", f"running return {total!r} outside [-1, 1]")
    return None


def arm_order(n_hint: int, n_no_hint: int, seed: int) -> list[tuple[str, int]]:
    """A seeded random interleaving of the copies of one program: ("hint", i) and
    ("no_hint", j) items, each once, in the order to open (and start) them, so that neither
    arm is opened first. Pass `seed=derive_seed(experiment_seed, step, Phase.ARM_ORDER,
    index)`. `EnvPool.open_many` also shuffles which worker each copy gets."""
    for name, value in (("n_hint", n_hint), ("n_no_hint", n_no_hint)):
        if type(value) is not int or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    items = [("hint", i) for i in range(n_hint)] + [("no_hint", i) for i in range(n_no_hint)]
    permutation = seeding.rng(seed, seeding.Phase.ARM_ORDER).permutation(len(items))
    return [items[int(k)] for k in permutation]


def reference_step_reward(raw_reward: float, terminated: bool) -> float:
    """What a step reports under the reference contract, so that an episode's rewards sum
    to the recipe's score: the last reward if the episode terminated, clipped to [-1, 1],
    else 0. Only a terminating step carries a reward; intermediate rewards and truncated
    episodes count 0 (the raw reward stays in info["raw_reward"])."""
    return max(-1.0, min(1.0, raw_reward)) if terminated else 0.0


def paper_step_reward(raw_return_before: float, raw_reward: float) -> float:
    """What a step reports under the paper contract, so that the rewards reported so far
    always sum to the running return clipped to [0, 1]: an episode cut anywhere (by the
    agent's turn or token budget, or an error) returns a value in [0, 1], and one that
    ends normally (its return checked in [0, 1]) returns exactly its return. A penalty is
    reported when reward earned earlier pays for it; the raw reward stays in
    info["raw_reward"]. Inside [0, 1] the program's own reward is reported unchanged."""
    after = raw_return_before + raw_reward
    if 0.0 <= raw_return_before <= 1.0 and 0.0 <= after <= 1.0:
        return raw_reward

    def clip(value: float) -> float:
        return max(0.0, min(1.0, value))

    return clip(after) - clip(raw_return_before)


def _checked_tools(value: Any) -> tuple[dict[str, Any], ...] | SandboxError:
    """A worker's reported tool list, checked here by the trainer (the worker checked it
    too, but a program can patch its own worker)."""
    try:
        return tuple(tools.check_tool_schemas(value))
    except tools.ToolSchemaError as err:
        return SandboxError("bad_tools", str(err))


def _tool_turn(handle: EnvHandle, action: str,
               result: StepResult) -> tuple[StepResult, SandboxError | None]:
    """The trainer's checks of a tool environment's turn, from the action itself and the
    tool list it checked at load, whatever the worker says: whether the turn ends the
    episode ("tool": a final answer; "reference_tool_use": a turn of tool calls never
    does, nor pays), the reward bounds ("tool": the state check in [0, 1]), and its own
    count of the turn's calls in info (`tools.audit_calls`)."""
    by_name = {tool["function"]["name"]: tool for tool in handle.tools or ()}
    calls, errors, content = tools.parse_action(action)
    info = dict(result.info, **tools.audit_calls(by_name, action))
    result = dataclasses.replace(result, info=info)
    if handle.contract == "tool":
        final = tools.final_answer(calls, errors, content) is not None
        if not 0.0 <= result.reward <= 1.0:
            return result, SandboxError(
                "reward_out_of_range", f"state check {result.reward!r} outside [0, 1]")
        if result.terminated != final or result.truncated:
            return result, SandboxError(
                "protocol_violation", f"the worker reported terminated={result.terminated}, "
                f"truncated={result.truncated} for a turn that {'gives' if final else 'does not give'} "
                "a final answer")
        return result, None
    tool_turn = bool(calls) and tools.answer_tag(content) is None
    if tool_turn and (result.terminated or result.truncated or result.reward != 0.0):
        return result, SandboxError(
            "protocol_violation", "a turn of tool calls ended the episode or paid a reward")
    return result, _reward_bound_error(result.reward, handle.raw_return, True)


# ----------------------------------------------------------------------------- snapshots


@dataclasses.dataclass(frozen=True)
class EpisodeSnapshot:
    """A mid-episode state, restorable in a fresh worker by replaying its actions.

    Restoring = load the program, reset(seed), step through `actions`, and check that the
    transcript digest matches: validated programs are deterministic in (seed, actions), so
    this reproduces the state exactly without pickling anything across processes.
    """

    source: str
    seed: int
    actions: tuple[str, ...]
    digest: str
    observation: str
    episode_return: float
    contract: str = "paper"
    max_turns: int = REFERENCE_MAX_TURNS
    lenient: bool = False  # the handle's step() answers program errors (play wrapper)
    play_limits: bool = False  # the handle ran under the play-time per-call limits


# ----------------------------------------------------------------------------- handles


class EnvHandle:
    """One program instance in its own worker. Methods return result objects."""

    def __init__(
        self,
        pool: EnvPool,
        source: str,
        worker: supervisor.WorkerProcess | None,
        error: SandboxError | None,
        contract: str = "paper",
        max_turns: int = REFERENCE_MAX_TURNS,
        trial: bool = False,
        lenient: bool = False,
        play_limits: bool = False,
    ) -> None:
        self.pool = pool
        self.source = source
        self.program_id = program_id(source)
        # A validation's handle: a broken limit fails the call but neither blocklists the
        # program nor is an episode of it replay-audited.
        self.trial = trial
        # A played game's handle: program errors in step() answered as the recipe's play
        # wrapper does (SandboxConfig.lenient_play_steps), and the play-time call limits.
        self.lenient = lenient
        self.play_limits = play_limits
        # "paper" or "reference" (resolved; never "auto"), and the reference turn budget.
        self.contract = contract
        self.max_turns = max_turns
        self.worker = worker
        self.error = error  # set if the program failed to load or was refused
        self.seed: int | None = None
        self.actions: list[str] = []
        self.episode_return = 0.0  # the sum of the rewards reported so far
        self.raw_return = 0.0  # the sum of the program's own rewards (paper bounds)
        self.done = True
        self.last_observation = ""
        self._digest = hashlib.blake2b(digest_size=16)
        # Tool contracts: the program's tool list as the trainer checked it at load
        # (function schemas, plain JSON), fixed for the handle's life; None otherwise.
        self.tools: tuple[dict[str, Any], ...] | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def transcript_digest(self) -> str:
        """Hash of (seed, every observation, reward and flag) of the current episode."""
        return self._digest.hexdigest()

    def reset(self, seed: int | None = None, *, deadline_s: float | None = None) -> ResetResult:
        return self.pool.reset_many([(self, seed)], deadline_s=deadline_s)[0]

    def step(self, action: str, *, deadline_s: float | None = None) -> StepResult:
        return self.pool.step_many([(self, action)], deadline_s=deadline_s)[0]

    def snapshot(self) -> EpisodeSnapshot:
        if self.seed is None:
            raise RuntimeError("snapshot() needs an episode: call reset() first")
        return EpisodeSnapshot(
            self.source,
            self.seed,
            tuple(self.actions),
            self.transcript_digest,
            self.last_observation,
            self.episode_return,
            self.contract,
            self.max_turns,
            self.lenient,
            self.play_limits,
        )

    def usage(self) -> dict[str, float] | SandboxError:
        """CPU seconds and peak RSS (KiB) of this handle's worker, as the kernel counts
        them (/proc, read by the zygote): nothing the program can patch or forge."""
        if self.worker is None:
            return self.error or SandboxError("closed")
        try:
            usage = self.worker.zygote.usage([self.worker.pid]).get(self.worker.pid)
        except ZygoteError as err:
            return SandboxError("crash", f"zygote: {err}")
        if usage is None:
            return SandboxError("crash", "worker is gone")
        return {"cpu_s": float(usage["cpu_s"]), "max_rss_kb": float(usage["max_rss_kb"])}

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None
        if self.error is None:
            self.error = SandboxError("closed")

    def _fail(self, error: SandboxError) -> None:
        """A call failed: the episode is over; a dead worker makes the handle unusable; a
        broken run-time limit blocklists the program (played handles only)."""
        self.done = True
        if self.worker is not None and self.worker.dead is not None:
            self.error = self.worker.dead
            self.worker = None
        if not self.trial and self.pool.config.blocklist_on_limits and breaks_limit(error):
            self.pool.block(self.source, error)

    def __enter__(self) -> EnvHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ----------------------------------------------------------------------------- pool


class EnvPool:
    """Sandboxed execution of environment programs (see the module docstring)."""

    def __init__(self, config: SandboxConfig | None = None, *, seed: int | None = None) -> None:
        """Starts the zygote and probes the isolation layers.

        Args:
          config: sandbox limits and layers (defaults: ``SandboxConfig()``).
          seed: seeds the episode seed drawn for a ``reset(seed=None)``, so a run's pool
            is reproducible (multi-host: ``distributed.host_seed`` gives each host its own
            stream); None seeds from the OS. Resets given a seed are unaffected.
        """
        if seed is not None and type(seed) is not int:
            raise TypeError(f"pool seed must be an int or None, got {seed!r}")
        self.config = config if config is not None else SandboxConfig()
        self.seed = seed
        self._rng = random.Random(seed)
        self._order_rng = random.Random(
            None if seed is None else seeding.derive_seed(seed, seeding.Phase.ARM_ORDER)
        )
        self._lock = threading.RLock()
        self._blocklist = Blocklist()
        # Which finished episodes the replay audit picks: a draw per (this, program, seed).
        self._audit_seed = seed if seed is not None else int.from_bytes(os.urandom(4), "little")
        self._spares: collections.deque[supervisor.WorkerProcess] = collections.deque()
        self._namespaced = self.config.use_namespaces and find_bwrap(self.config) is not None
        self._zygote, self._isolation = self._start_and_probe()
        if self._isolation.missing:
            message = (
                f"SANDBOX WEAK: layers missing: {', '.join(self._isolation.missing)}. "
                + (
                    "Running untrusted programs anyway (allow_weak_isolation=True)."
                    if self.config.allow_weak_isolation
                    else "Untrusted programs will be REFUSED (reason weak_isolation); set "
                    "SandboxConfig(allow_weak_isolation=True) to run them regardless."
                )
                + f" Details: {self._isolation.as_dict()}"
            )
            log.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=2)
        self._refill()

    # -- lifecycle ---------------------------------------------------------------------

    def _start_zygote(self) -> Zygote:
        if self.config.use_namespaces and not self._namespaced:
            log.warning("bubblewrap not found: the sandbox runs without namespaces")
        return Zygote(self.config, use_namespaces=self._namespaced)

    def _start_and_probe(self, attempts: int = 3) -> tuple[Zygote, IsolationReport]:
        """Starts the zygote and measures the layers; a zygote (or probe worker) that dies
        during start-up, e.g. killed by a loaded host, is replaced (up to `attempts`)."""
        for attempt in range(1, attempts + 1):
            zygote = None
            try:
                zygote = self._zygote = self._start_zygote()
                return zygote, self._probe()
            except ZygoteError as err:
                if zygote is not None:
                    zygote.close()
                if attempt == attempts:
                    if self._namespaced:
                        raise bwrap_unusable(find_bwrap(self.config), err) from err
                    raise
                log.error("sandbox zygote failed to start (%s); retrying (%d/%d)",
                          err, attempt, attempts)
        raise AssertionError("unreachable")

    def _probe(self) -> IsolationReport:
        limits = dict(self.config.worker_limits(), probe=True)
        pid, channel = self._zygote.spawn(limits)
        worker = supervisor.WorkerProcess(self._zygote, pid, channel, self.config.max_message_bytes)
        hello = supervisor.await_hello(worker, self.config.load_deadline_s)
        worker.close()
        if isinstance(hello, SandboxError):
            raise ZygoteError(f"the isolation probe worker failed: {hello}")
        return measure_layers(self.config, hello, self._namespaced)

    def isolation_report(self) -> IsolationReport:
        return self._isolation

    # -- blocklist -----------------------------------------------------------------------

    def block(self, source: str, why: SandboxError) -> None:
        """Refuses `source` for further episodes: opening it, and resetting a handle of it,
        fail with "blocklisted" (naming `why`); episodes already running may finish. The
        pool calls this itself when a played episode breaks a run-time limit
        (`results.RUNTIME_LIMIT_CODES`); a training loop calls it for rules of its own
        (e.g. the recipe's: a play over 300 s)."""
        if not isinstance(why, SandboxError):
            raise TypeError(f"why must be a SandboxError, got {type(why).__name__}")
        if self._blocklist.get(program_id(source)) is None:
            log.warning("blocklisting program %s: %s", program_id(source), why)
        self._blocklist.add(program_id(source), why)

    def blocked(self, source: str) -> SandboxError | None:
        """Why `source` is blocklisted (the first limit it broke), or None."""
        return self._blocklist.get(program_id(source))

    def blocklist(self) -> dict[str, SandboxError]:
        """Every blocklisted program: `program_id(source)` -> why (a copy)."""
        return self._blocklist.items()

    def _refused(self, handle_or_source: EnvHandle | str) -> SandboxError | None:
        source = getattr(handle_or_source, "source", handle_or_source)
        key = getattr(handle_or_source, "program_id", None) or program_id(source)
        why = self._blocklist.get(key)
        return None if why is None else SandboxError("blocklisted", str(why))

    def close(self) -> None:
        with self._lock:
            while self._spares:
                self._spares.popleft().close()
            self._zygote.close()

    def __enter__(self) -> EnvPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- workers -----------------------------------------------------------------------

    def _spawn(self) -> supervisor.WorkerProcess:
        try:
            pid, channel = self._zygote.spawn(self.config.worker_limits())
        except ZygoteError as err:
            log.error("zygote failed (%s); restarting it", err)
            self._zygote.close()
            self._zygote = self._start_zygote()
            pid, channel = self._zygote.spawn(self.config.worker_limits())
        return supervisor.WorkerProcess(self._zygote, pid, channel, self.config.max_message_bytes)

    def _refill(self) -> None:
        while len(self._spares) < self.config.spare_workers:
            self._spares.append(self._spawn())

    def _take_worker(self) -> supervisor.WorkerProcess | SandboxError:
        """A live worker: a spare if one is alive (a dead spare, e.g. one a co-tenant
        managed to kill, is dropped and replaced), else a fresh one (three tries)."""
        failures = 0
        while failures < 3:
            fresh = not self._spares
            worker = self._spawn() if fresh else self._spares.popleft()
            hello = supervisor.await_hello(worker, self.config.load_deadline_s)
            if not isinstance(hello, SandboxError) and supervisor.still_alive(worker):
                return worker
            log.error("discarding a sandbox worker that failed to start or died waiting: %s",
                      hello if isinstance(hello, SandboxError) else worker.dead)
            failures += fresh
        return SandboxError("crash", "three workers in a row failed to start")

    # -- programs ----------------------------------------------------------------------

    def open(
        self, source: str, *, contract: str = AUTO_CONTRACT, max_turns: int = REFERENCE_MAX_TURNS,
        trial: bool = False, lenient: bool | None = None, play_limits: bool | None = None,
    ) -> EnvHandle:
        """Loads `source` into a fresh worker. Failures are in `handle.error`."""
        return self.open_many([source], contract=contract, max_turns=max_turns, trial=trial,
                              lenient=lenient, play_limits=play_limits)[0]

    def open_many(
        self,
        sources: Sequence[str],
        *,
        contract: str = AUTO_CONTRACT,
        max_turns: int = REFERENCE_MAX_TURNS,
        order_seed: int | None = None,
        trial: bool = False,
        lenient: bool | None = None,
        play_limits: bool | None = None,
    ) -> list[EnvHandle]:
        """Loads several programs (or copies of one) concurrently, one worker each.

        Workers are handed to the sources in a random order (seeded by `order_seed`, else
        by the pool's seed), so a copy's worker, pid and uid say nothing about its position
        in `sources` (e.g. whether it is a hint-arm copy). Handles come back in input order.

        Args:
          sources: program texts.
          contract: "paper", "reference" or "auto" (per source: "paper" if it defines a
            top-level `class Environment`); see `spade_jax.envs.contract`.
          max_turns: the reference contract's turn budget: the game is built with its
            own defaults (`cls()`; `cls(max_turns=max_turns)` if that raises TypeError),
            its `max_turns` capped at this, and its episode truncated after this many
            steps.
          trial: validation's runs: a run-time limit these handles break fails the call
            but does not blocklist the program, and their episodes are not replay-audited.
          lenient: step() answers a reference game's program errors as the recipe's play
            wrapper does (error observation, reward -1, terminated). None: for the played
            (non-trial) reference games when `SandboxConfig.lenient_play_steps` is set.
          play_limits: the calls run under the play-time limits
            (`SandboxConfig.play_call_deadline_s` / `play_call_cpu_budget_s`). None: for
            non-trial handles. (A replay or a fork passes the original's.)
        """
        for source in sources:
            if not isinstance(source, str):
                raise TypeError(f"program source must be str, got {type(source).__name__}")
        if type(max_turns) is not int or max_turns < 1:
            raise ValueError(f"max_turns must be an int >= 1, got {max_turns!r}")
        contracts = [resolve_contract(contract, source) for source in sources]
        handles: list[EnvHandle | None] = [None] * len(sources)
        calls = []
        with self._lock:
            shuffle = (self._order_rng if order_seed is None
                       else random.Random(seeding.derive_seed(order_seed, seeding.Phase.ARM_ORDER)))
            order = list(range(len(sources)))
            shuffle.shuffle(order)
            for index in order:
                source, kind = sources[index], contracts[index]
                error = None
                if self._isolation.missing and not self.config.allow_weak_isolation:
                    error = SandboxError(
                        "weak_isolation", f"missing layers: {', '.join(self._isolation.missing)}"
                    )
                elif (refused := self._refused(source)) is not None:
                    error = refused
                elif self.config.static_gate:
                    error = check_source(source, self.config, kind).error
                worker = None
                if error is None:
                    taken = self._take_worker()
                    if isinstance(taken, SandboxError):
                        error = taken
                    else:
                        worker = taken
                        load = {"op": "load", "source": source, "contract": kind,
                                "max_turns": max_turns}  # fmt: skip
                        calls.append((index, worker, load))
                handles[index] = EnvHandle(
                    self, source, worker, error, kind, max_turns, trial,
                    lenient=(self.config.lenient_play_steps and kind == "reference" and not trial)
                    if lenient is None else lenient,
                    play_limits=not trial if play_limits is None else play_limits)
            self._refill()
        replies = supervisor.exchange(
            [(w, load, self.config.load_deadline_s) for _, w, load in calls]
        )
        for (index, worker, _), reply in zip(calls, replies, strict=True):
            error = reply if isinstance(reply, SandboxError) else None
            if error is None and reply.get("ok") is not True:
                error = supervisor.check_reset(reply, self.config).error
            if error is None and contracts[index] in TOOL_CONTRACTS:
                checked = _checked_tools(reply.get("tools"))
                if isinstance(checked, SandboxError):
                    error = checked
                else:
                    handles[index].tools = checked
            if error is not None:
                worker.kill(error)
                handles[index].worker = None
                handles[index].error = error
        return handles  # type: ignore[return-value]

    def _call_deadline(self, deadline_s: float | None, handle: EnvHandle) -> float:
        """The handle's per-call deadline (validation's, or the play-time one), cut to
        `deadline_s` when a caller has less time left."""
        limit = self.config.call_deadline_s
        if handle.play_limits and self.config.play_call_deadline_s is not None:
            limit = self.config.play_call_deadline_s
        if deadline_s is None:
            return limit
        return max(0.0, min(limit, deadline_s))

    def _cpu_budget(self, handle: EnvHandle) -> float | None:
        """The handle's per-call CPU budget (validation's, or the play-time one)."""
        if handle.play_limits and self.config.play_call_cpu_budget_s is not None:
            return self.config.play_call_cpu_budget_s
        return self.config.call_cpu_budget_s

    def reset_many(
        self, calls: Sequence[tuple[EnvHandle, int | None]], *, deadline_s: float | None = None
    ) -> list[ResetResult]:
        """Resets many handles concurrently; `deadline_s` cuts the per-call deadline."""
        results: list[ResetResult | None] = [None] * len(calls)
        live = []
        for index, (handle, seed) in enumerate(calls):
            if seed is not None and (type(seed) is not int or not 0 <= seed < 2**63):
                raise ValueError(f"seed must be a non-negative int or None, got {seed!r}")
            if handle.worker is None or handle.error is not None:
                results[index] = failed_reset(handle.error or SandboxError("closed"))
                continue
            if (refused := self._refused(handle)) is not None:
                handle.done = True
                results[index] = failed_reset(refused)
                continue
            seed = self._rng.randrange(2**31) if seed is None else seed
            live.append((index, handle, seed))
        replies = supervisor.exchange(
            [
                (h.worker, {"op": "reset", "seed": s}, self._call_deadline(deadline_s, h))
                for _, h, s in live
            ],
            [self._cpu_budget(h) for _, h, _ in live],
        )
        for (index, handle, seed), reply in zip(live, replies, strict=True):
            result = supervisor.check_reset(reply, self.config)
            if result.ok and handle.contract in TOOL_CONTRACTS:
                checked = _checked_tools(reply.get("tools"))
                if checked != handle.tools:
                    result = failed_reset(checked if isinstance(checked, SandboxError) else
                                          SandboxError("bad_tools", "the tool list reset() "
                                                       "left differs from the one at load"))
            handle.seed, handle.actions, handle.episode_return = seed, [], 0.0
            handle.raw_return = 0.0
            handle._digest = hashlib.blake2b(repr(seed).encode(), digest_size=16)
            if result.ok:
                handle.done = False
                handle.last_observation = result.observation
                handle._digest.update(result.observation.encode("utf-8", "surrogatepass"))
            else:
                handle._fail(result.error)
            results[index] = result
        return results  # type: ignore[return-value]

    def step_many(
        self, calls: Sequence[tuple[EnvHandle, str]], *, deadline_s: float | None = None
    ) -> list[StepResult]:
        """Steps many handles concurrently (each in its own worker); one result per call.
        `deadline_s` cuts the per-call deadline (validation's overall budget)."""
        results: list[StepResult | None] = [None] * len(calls)
        live = []
        for index, (handle, action) in enumerate(calls):
            if not isinstance(action, str):
                raise TypeError(f"action must be str, got {type(action).__name__}")
            if handle.worker is None or handle.error is not None:
                results[index] = failed_step(handle.error or SandboxError("closed"))
            elif handle.done:
                results[index] = failed_step(SandboxError("episode_over", "call reset() first"))
            else:
                live.append((index, handle, action[: self.config.max_action_chars]))
        replies = supervisor.exchange(
            [
                (h.worker, {"op": "step", "action": a, "lenient": h.lenient},
                 self._call_deadline(deadline_s, h))
                for _, h, a in live
            ],
            [self._cpu_budget(h) for _, h, _ in live],
        )
        for (index, handle, action), reply in zip(live, replies, strict=True):
            results[index] = self._account(handle, action, calls[index][1], reply)
        self._audit_finished(
            [(i, h) for i, h, _ in live if h.done and results[i].ok and self._audited(h)], results
        )
        return results  # type: ignore[return-value]

    def _audited(self, handle: EnvHandle) -> bool:
        """Whether this finished episode is replayed: a seeded draw at
        `replay_audit_rate` per (pool seed, program, episode seed); never a trial's."""
        rate = self.config.replay_audit_rate
        if handle.trial or rate <= 0 or handle.seed is None:
            return False
        draw = seeding.derive_seed(self._audit_seed, seeding.Phase.REPLAY_AUDIT,
                                   int(handle.program_id[:8], 16), handle.seed)
        return rate >= 1 or draw < rate * 2**31

    def _audit_finished(self, ended: list[tuple[int, EnvHandle]], results: list) -> None:
        """Replay-audits episodes that just ended; a transcript the replay does not
        reproduce turns the last step into a "nondeterministic_replay" failure (reward 0)
        and blocklists the program."""
        if not ended:
            return
        verdicts = replay_audit(self, [handle for _, handle in ended])
        for (index, handle), error in zip(ended, verdicts, strict=True):
            if error is not None:
                handle.episode_return -= results[index].reward
                results[index] = dataclasses.replace(results[index], reward=0.0, error=error)
                handle._fail(error)

    def _account(self, handle: EnvHandle, action: str, raw_action: str, reply: Any) -> StepResult:
        """Checks one step reply and updates the handle's episode bookkeeping."""
        result = supervisor.check_step(reply, self.config)
        if not result.ok:
            handle._fail(result.error)
            return result
        if PROGRAM_ERROR_KEY in result.info and not (
            handle.lenient and result.terminated and result.reward == -1.0
        ):  # only the play wrapper's answer for a failed game carries the marker
            result = dataclasses.replace(
                result, info={k: v for k, v in result.info.items() if k != PROGRAM_ERROR_KEY})
        reference = handle.contract in RECIPE_SCORED
        if handle.contract in TOOL_CONTRACTS:
            result, error = _tool_turn(handle, action, result)
        else:
            error = _reward_bound_error(result.reward, handle.raw_return, reference)
        if error is not None:  # the episode ends here, as an env error, with nothing paid
            handle.done = True
            return dataclasses.replace(result, reward=0.0, terminated=True, error=error)
        handle.actions.append(action)
        budget = self.config.max_episode_steps
        if reference or handle.contract in TOOL_CONTRACTS:
            budget = min(budget, handle.max_turns)
        truncated = result.truncated or (
            not result.terminated and len(handle.actions) >= budget
        )
        step_record = (result.observation, result.reward, result.terminated, truncated, result.info)
        handle._digest.update(json.dumps(step_record, sort_keys=True).encode())
        reward, info = result.reward, result.info
        if reference:
            reward, info = reference_step_reward(result.reward, result.terminated), dict(
                info, raw_reward=result.reward
            )
        elif handle.contract == "tool":  # paid: the change of the state check
            reward = result.reward - handle.raw_return
            info = dict(info, progress=result.reward)
        else:
            reward = paper_step_reward(handle.raw_return, result.reward)
            if reward != result.reward:
                info = dict(info, raw_reward=result.reward)
        if handle.contract == "tool":
            handle.raw_return = result.reward  # the state check is a level, not an increment
        else:
            handle.raw_return += result.reward
        handle.episode_return += reward
        handle.last_observation = result.observation
        if len(action) != len(raw_action):
            info = dict(info, action_truncated=True)
        error = None
        if result.terminated or truncated:
            handle.done = True
            total = handle.raw_return
            if not reference and not -RETURN_TOLERANCE <= total <= 1 + RETURN_TOLERANCE:
                error = SandboxError("return_out_of_range", f"episode return {total!r}")
        return dataclasses.replace(
            result, reward=reward, truncated=truncated, info=info, error=error
        )

    def fork(self, snapshot: EpisodeSnapshot) -> EnvHandle:
        """A new handle, in a fresh worker, at the snapshot's state (by verified replay)."""
        if not isinstance(snapshot, EpisodeSnapshot):
            raise TypeError(f"fork() takes an EpisodeSnapshot, got {type(snapshot).__name__}")
        handle = self.open(
            snapshot.source, contract=snapshot.contract, max_turns=snapshot.max_turns,
            lenient=snapshot.lenient, play_limits=snapshot.play_limits,
        )
        if not handle.ok:
            return handle
        first = handle.reset(snapshot.seed)
        if not first.ok:
            return handle
        for action in snapshot.actions:
            if not handle.step(action).ok:
                break
        if handle.ok and handle.transcript_digest != snapshot.digest:
            handle.close()
            handle.error = SandboxError("nondeterministic_replay", "transcript digest differs")
        return handle
