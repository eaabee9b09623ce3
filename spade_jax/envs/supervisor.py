"""Trainer-side supervision of sandbox workers: deadlines, size caps, checks, kills.

Nothing here trusts a worker. A reply is accepted only if it is a well-formed frame under
the byte cap, echoes the request's nonce, and every field has the exact JSON type the
contract says; the reward is re-checked for finiteness here, in the trainer's own
interpreter, whatever the worker claimed. Any violation, timeout or death becomes a
`SandboxError` and the worker is killed; it is never reused.
"""

from __future__ import annotations

import collections
import itertools
import json
import math
import os
import select
import socket
import time
from collections.abc import Sequence
from typing import Any

from spade_jax.envs import protocol
from spade_jax.envs.config import SandboxConfig
from spade_jax.envs.launcher import Zygote, ZygoteError
from spade_jax.envs.results import (
    ResetResult,
    SandboxError,
    StepResult,
    failed_reset,
    failed_step,
)

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class WorkerProcess:
    """One sandboxed worker: its pid inside the zygote's namespace and our socket end."""

    def __init__(self, zygote: Zygote, pid: int, channel: socket.socket, max_bytes: int) -> None:
        self.zygote = zygote
        self.pid = pid
        self.channel = channel
        self.channel.setblocking(False)
        self.fd = channel.fileno()
        self.reader = protocol.FrameReader(max_bytes)
        self.hello: dict | None = None
        self.dead: SandboxError | None = None
        self._stat_fd = zygote.stat_fd(pid)
        # The worker's CPU seconds when its last call ended: a call's CPU time is what
        # it used since (an honest worker uses none between calls).
        self.cpu_mark: float | None = None

    def cpu_seconds(self) -> float | None:
        """CPU seconds (user + system) the worker used so far, as the kernel counts them:
        read from its /proc stat by the trainer (or asked of the zygote), never from the
        worker; None if it is gone."""
        if self._stat_fd is not None:
            try:
                stat = os.pread(self._stat_fd, 4096, 0)
                fields = stat[stat.rindex(b")") + 2 :].split()  # field 3 (state) first
                return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
            except (OSError, ValueError, IndexError):
                return None
        try:
            usage = self.zygote.usage([self.pid]).get(self.pid)
        except ZygoteError:
            return None
        return None if usage is None else float(usage["cpu_s"])

    def kill(self, error: SandboxError) -> None:
        """Kills the worker's process group; later calls fail with `error`."""
        if self.dead is None:
            self.dead = error
            self.zygote.kill(self.pid)
            self.channel.close()
            if self._stat_fd is not None:
                os.close(self._stat_fd)
                self._stat_fd = None

    def died(self, detail: str) -> SandboxError:
        """The worker is gone unasked: marks it dead with the reason the zygote gives (it
        kills a worker over its memory budget, and the largest when the pool goes over
        its budget), else crash."""
        reason = self.zygote.death_reason(self.pid)
        if reason is not None:
            self.kill(SandboxError(*reason))
        else:
            self.kill(SandboxError("crash", detail))
        return self.dead  # type: ignore[return-value]

    def close(self) -> None:
        """Normal end of life: closing our end makes the worker read EOF and exit; the
        kill is there in case a program is still computing."""
        self.kill(SandboxError("closed", "handle closed"))


def exchange(
    calls: list[tuple[WorkerProcess, dict, float]],
    cpu_budget_s: float | None | Sequence[float | None] = None,
) -> list[dict | SandboxError]:
    """Sends each (worker, request, deadline_s) and waits for all replies concurrently.

    Returns, per call, the reply dict (nonce checked, 'n' removed) or a SandboxError; a
    worker that misses its deadline or misbehaves is killed. With `cpu_budget_s` (one for
    every call, or one per call), a call that uses more CPU time than its budget (read from
    /proc, outside the worker) is stopped with "slow_call", as soon as it passes the
    budget or when it replies.
    """
    budgets = (list(cpu_budget_s) if isinstance(cpu_budget_s, Sequence)
               else [cpu_budget_s] * len(calls))
    results: list[dict | SandboxError | None] = [None] * len(calls)
    pending: dict[int, tuple[int, WorkerProcess, str, float]] = {}
    checks: dict[int, float] = {}  # fd -> when its CPU time could first pass the budget
    start = time.monotonic()
    for index, (worker, request, deadline_s) in enumerate(calls):
        if worker.dead is not None:
            results[index] = worker.dead
            continue
        nonce = protocol.new_nonce()
        request["n"] = nonce
        try:
            worker.channel.send(protocol.encode(request))  # small; socket buffer holds it
        except BlockingIOError:
            _send_slow(worker, protocol.encode(request), start + deadline_s)
        except OSError as err:
            results[index] = worker.died(f"worker channel closed: {err}")
            continue
        if worker.dead is not None:
            results[index] = worker.dead
            continue
        pending[worker.fd] = (index, worker, nonce, start + deadline_s)
        if budgets[index] is not None:
            checks[worker.fd] = start + budgets[index]

    poller = select.poll()
    for fd in pending:
        poller.register(fd, select.POLLIN)
    while pending:
        now = time.monotonic()
        for fd, (index, worker, _, deadline) in list(pending.items()):
            error = None
            if now >= deadline:
                error = SandboxError("timeout", f"no reply within {deadline - start:.3g}s")
            elif fd in checks and now >= checks[fd]:
                error, checks[fd] = _cpu_check(worker, budgets[index], now)
            if error is not None:
                worker.kill(error)
                results[index] = worker.dead
                poller.unregister(fd)
                del pending[fd]
        if not pending:
            break
        wake = min(min(d for _, _, _, d in pending.values()), *checks.values(), float("inf"))
        for fd, _ in poller.poll(math.ceil(max(0.0, wake - now) * 1000)):
            index, worker, nonce, _ = pending[fd]
            reply = _receive(worker, nonce)
            if reply is None:
                continue  # partial frame
            if not isinstance(reply, SandboxError):
                error, _ = _cpu_check(worker, budgets[index], None)
                if error is not None:
                    worker.kill(error)
                    reply = error
            results[index] = reply
            poller.unregister(fd)
            del pending[fd]
    _memory_check(calls, results)
    return results  # type: ignore[return-value]


def _memory_check(calls: list[tuple[WorkerProcess, dict, float]],
                  results: list[dict | SandboxError | None]) -> None:
    """Fails the calls whose worker holds more than its memory budget when it replied
    (checked by the zygote from /proc, outside the worker): memory taken in a call shorter
    than the zygote's 0.1 s poll is caught at its end, not left to chance."""
    by_zygote: dict[int, list[int]] = {}
    for index, (worker, _, _) in enumerate(calls):
        if isinstance(results[index], dict) and worker.dead is None:
            by_zygote.setdefault(id(worker.zygote), []).append(index)
    for indices in by_zygote.values():
        zygote = calls[indices[0]][0].zygote
        try:
            over = zygote.check_memory([calls[i][0].pid for i in indices])
        except ZygoteError:
            continue  # the zygote is gone: the workers' next calls say so
        for i in indices:
            worker = calls[i][0]
            if worker.pid in over:
                worker.kill(SandboxError(*over[worker.pid]))
                results[i] = worker.dead


def _cpu_check(
    worker: WorkerProcess, budget_s: float | None, now: float | None
) -> tuple[SandboxError | None, float]:
    """(slow_call error or None, when to look again) for a call in flight (`now`) or one
    that just replied (`now` None: the worker's CPU mark moves to the call's end)."""
    used_total = worker.cpu_seconds()
    if used_total is None or worker.cpu_mark is None:
        if now is None and used_total is not None:
            worker.cpu_mark = used_total
        return None, math.inf
    used = used_total - worker.cpu_mark
    if budget_s is not None and used > budget_s:
        return SandboxError("slow_call", f"the call used {used:.2f} s of CPU time, over the "
                                         f"per-call budget of {budget_s:g} s"), math.inf
    if now is None:
        worker.cpu_mark = used_total
        return None, math.inf
    # CPU time grows at most as fast as the clock: nothing can change before then.
    return None, now + max(0.01, budget_s - used)  # type: ignore[operator]


def _send_slow(worker: WorkerProcess, data: bytes, deadline: float) -> None:
    view = memoryview(data)
    while view:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            worker.kill(SandboxError("timeout", "worker stopped reading its requests"))
            return
        select.select([], [worker.fd], [], remaining)
        try:
            view = view[worker.channel.send(view) :]
        except BlockingIOError:
            continue
        except OSError as err:
            worker.died(f"worker channel closed: {err}")
            return


def _receive(worker: WorkerProcess, nonce: str) -> dict | SandboxError | None:
    try:
        chunk = worker.channel.recv(1 << 16)
    except BlockingIOError:
        return None
    except OSError as err:
        chunk = b""
        del err
    if not chunk:
        return worker.died("worker died during the call")
    try:
        messages = worker.reader.feed(chunk)
    except protocol.ProtocolError as err:
        worker.kill(SandboxError(err.code, err.detail))
        return worker.dead
    if not messages:
        return None
    if len(messages) > 1 or worker.reader.pending or messages[0].get("n") != nonce:
        worker.kill(SandboxError("protocol_violation", "reply with a wrong nonce or extra data"))
        return worker.dead
    reply = messages[0]
    del reply["n"]
    return reply


def still_alive(worker: WorkerProcess) -> bool:
    """True if an idle worker (hello read, no request in flight) is still there: its end of
    the channel is open and it sent nothing unasked. A worker killed while it waited as a
    spare shows end of file here; one that sent unsolicited bytes is killed."""
    if worker.dead is not None:
        return False
    try:
        data = worker.channel.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return True
    except OSError as err:
        worker.kill(SandboxError("crash", f"worker channel failed: {err}"))
        return False
    if not data:
        worker.kill(SandboxError("crash", "worker died while waiting"))
    else:
        worker.kill(SandboxError("protocol_violation", "worker sent data unasked"))
    return False


def await_hello(worker: WorkerProcess, deadline_s: float) -> dict | SandboxError:
    """Reads the worker's first message: what isolation it applied, as the kernel reports."""
    if worker.hello is not None:
        return worker.hello
    deadline = time.monotonic() + deadline_s
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            worker.kill(SandboxError("timeout", "worker did not start"))
            return worker.dead  # type: ignore[return-value]
        readable, _, _ = select.select([worker.fd], [], [], remaining)
        if not readable:
            continue
        reply = _receive(worker, "hello")
        if reply is None:
            continue
        if isinstance(reply, SandboxError):
            return reply
        if not reply.get("ok"):
            worker.kill(SandboxError("crash", str(reply.get("detail", "worker setup failed"))))
            return worker.dead  # type: ignore[return-value]
        worker.hello = reply
        worker.cpu_mark = worker.cpu_seconds()
        return reply


# ----------------------------------------------------------------------------- checks


def _error_of(reply: dict | SandboxError) -> SandboxError | None:
    if isinstance(reply, SandboxError):
        return reply
    if reply.get("ok") is True:
        return None
    code = reply.get("code")
    detail = reply.get("detail", "")
    try:
        return SandboxError(code if type(code) is str else "protocol_violation", str(detail)[:2000])
    except ValueError:  # a code we never defined: the worker was subverted
        return SandboxError("protocol_violation", f"unknown reason code {str(code)[:50]!r}")


def _check_observation(value: Any, config: SandboxConfig) -> SandboxError | None:
    if type(value) is not str:
        return SandboxError("bad_type", f"observation is {type(value).__name__}")
    if len(value) > config.max_observation_chars:
        return SandboxError(
            "observation_too_large", f"{len(value)} chars > cap {config.max_observation_chars}"
        )
    return None


# What an info dict may carry into the trainer: nested dicts are flattened to dotted keys
# down to this depth, at most this many keys, text values cut to this length.
MAX_INFO_DEPTH = 4
MAX_INFO_KEYS = 64
MAX_INFO_TEXT = 1000
MAX_INFO_LIST = 64


def bounded_info(info: dict) -> dict[str, Any]:
    """A flat, bounded copy of a program's info dict (already plain JSON): nested dicts
    become dotted keys ("a.b.c") down to MAX_INFO_DEPTH (a nested dict contributes at most
    MAX_INFO_KEYS // 4 keys), deeper values and long or nested
    lists become JSON text cut to MAX_INFO_TEXT characters, non-finite floats their repr;
    at most MAX_INFO_KEYS keys. Nothing nested or unbounded reaches the trainer."""
    out: dict[str, Any] = {}
    queue = collections.deque([("", info, 0)])  # breadth first: top-level keys come first
    while queue and len(out) < MAX_INFO_KEYS:
        prefix, value, depth = queue.popleft()
        if type(value) is dict and depth < MAX_INFO_DEPTH:
            fanout = MAX_INFO_KEYS if depth == 0 else MAX_INFO_KEYS // 4  # one wide dict
            for key, item in itertools.islice(value.items(), fanout):  # cannot take all
                queue.append((f"{prefix}.{key}" if prefix else str(key), item, depth + 1))
        else:
            out[prefix[:MAX_INFO_TEXT] or "_"] = _bounded_value(value)
    return out


def _bounded_value(value: Any) -> Any:
    kind = type(value)
    if value is None or kind is bool:
        return value
    if kind is int:
        return value if abs(value) < 2**63 else f"<int of {value.bit_length()} bits>"
    if kind is float:
        return value if math.isfinite(value) else repr(value)
    if kind is str:
        return value[:MAX_INFO_TEXT]
    if kind is list and len(value) <= MAX_INFO_LIST and all(
        item is None or type(item) in (bool, int, float, str) for item in value
    ):
        return [_bounded_value(item) for item in value]
    try:
        return json.dumps(value)[:MAX_INFO_TEXT]
    except (RecursionError, ValueError, TypeError):
        return "<nested too deep>"


def check_reset(reply: dict | SandboxError, config: SandboxConfig) -> ResetResult:
    error = _error_of(reply)
    if error is not None:
        return failed_reset(error)
    observation, info = reply.get("obs"), reply.get("info")
    error = _check_observation(observation, config)
    if error is None and type(info) is not dict:
        error = SandboxError("bad_type", f"info is {type(info).__name__}")
    return failed_reset(error) if error else ResetResult(observation, bounded_info(info))


def check_step(reply: dict | SandboxError, config: SandboxConfig) -> StepResult:
    error = _error_of(reply)
    if error is not None:
        return failed_step(error)
    observation, reward = reply.get("obs"), reply.get("reward")
    terminated, truncated, info = reply.get("terminated"), reply.get("truncated"), reply.get("info")
    error = _check_observation(observation, config)
    if error is None:
        if type(reward) not in (int, float):
            error = SandboxError("bad_type", f"reward is {type(reward).__name__}")
        elif type(terminated) is not bool or type(truncated) is not bool:
            error = SandboxError("bad_type", "terminated/truncated are not bool")
        elif type(info) is not dict:
            error = SandboxError("bad_type", f"info is {type(info).__name__}")
    if error is None:
        try:
            reward = float(reward)
        except OverflowError:
            reward = math.inf
        if not math.isfinite(reward):
            error = SandboxError("nonfinite_reward", f"reward {reward!r}")
    if error is not None:
        return failed_step(error)
    return StepResult(observation, reward, terminated, truncated, bounded_info(info))
