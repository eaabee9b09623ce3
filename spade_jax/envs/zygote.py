"""The zygote: a small clean process that forks sandbox workers on request (stdlib only).

The trainer never forks itself (forking a process that initialised JAX is unsafe); it
starts this module in a fresh interpreter, inside bubblewrap's namespaces when available,
through a boot snippet that loads only this package's sandbox modules (see launcher.py).
Before serving, the zygote imports every allow-listed module, so workers, which drop to an
unprivileged uid that may not read the interpreter's files, find them already loaded.

Control channel: an AF_UNIX SOCK_SEQPACKET socket, one JSON object per packet.
  {"op": "spawn", "limits": {...}} + one passed fd  -> forks a worker on that fd, replies
                                                       {"pid": ...}
  {"op": "kill", "pid": P}                          -> SIGKILLs P's process group, no reply
  {"op": "usage", "pids": [P, ...]}                 -> {"usage": {"P": {"cpu_s", "max_rss_kb",
                                                        "rss_anon_kb"} or null}}: read from
                                                       /proc by the zygote, outside the
                                                       worker's interpreter
  {"op": "why", "pid": P}                           -> {"code", "reason"}: why the zygote
                                                       killed P (a memory budget) or nulls
  {"op": "check", "pids": [P, ...]}                 -> {"over": {"P": [code, reason]}}: the
                                                       per-worker memory budget checked now
                                                       (at the end of a call, which the
                                                       0.1 s poll can miss); those over it
                                                       are killed
  {"op": "ping"}                                    -> {"pong": true, "pid": ...}
End of file on the control channel (the trainer died or closed) ends the zygote.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import socket
import sys

from spade_jax.envs import contract, worker


def _preload(modules: list[str]) -> list[str]:
    loaded = []
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            if name not in contract.REFERENCE_IMPORTS:
                raise
            continue  # optional: reference programs that use it then fail to load
        loaded.append(name)
    import collections.abc  # noqa: F401 - submodules programs commonly use
    import json.decoder  # noqa: F401

    _warm_up(loaded)

    try:  # loads libseccomp now: workers cannot read it once they dropped their uid
        import pyseccomp  # noqa: F401
    except (ImportError, RuntimeError, OSError):
        pass  # the worker reports the seccomp layer missing
    return loaded


def _warm_up(modules: list[str]) -> None:
    """Runs what loads lazily on first use, so workers (which can no longer read the
    interpreter's files) find it loaded: math_verify's parsers, numpy's random module."""
    if "math_verify" in modules:
        import math_verify

        for text in ("$\\frac{1}{2}$", "0.5", "\\boxed{x^2+1}", "[1, 2]"):
            math_verify.verify(math_verify.parse(text), math_verify.parse("0.5"))
    if "numpy" in modules:
        import numpy

        numpy.random.default_rng(0).random(2)
        numpy.random.seed(0)
        numpy.linalg.solve(numpy.eye(2), numpy.ones(2))


def _reap(live: dict[int, int]) -> None:
    while live:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            live.clear()
            return
        if pid == 0:
            return
        live.pop(pid, None)


def _pick_uid(limits: dict, live: dict[int, int]) -> None:
    """Gives the worker about to be forked its own uid/gid: a random id of the configured
    range that no live worker has (random, so the id does not reveal the load order)."""
    if not limits.get("uid_range"):
        return
    base, count = (int(x) for x in limits["uid_range"])
    taken = set(live.values())
    while True:
        uid = base + int.from_bytes(os.urandom(4), "little") % count
        if uid not in taken:
            limits["uid"] = limits["gid"] = uid
            return


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def proc_usage(pid: int) -> dict | None:
    """CPU seconds (user + system), peak and current anonymous RSS (KiB) of a process, as
    the kernel counts them in /proc; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        with open(f"/proc/{pid}/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
    except (OSError, ValueError):
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state is field 3
    kib = {key: int(status.get(key, "0 kB").split()[0]) for key in ("VmHWM", "RssAnon")}
    return {
        "cpu_s": (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS,
        "max_rss_kb": kib["VmHWM"],
        "rss_anon_kb": kib["RssAnon"],
    }


def _held_kb(pid: int) -> int | None:
    """Memory a process holds (KiB): its anonymous pages plus its shared memory pages
    (RssShmem: MAP_SHARED|MAP_ANONYMOUS, shared mappings of /dev/zero), from
    /proc/<pid>/status (counters, cheap to read every MEMORY_POLL_S). File-backed pages
    (the interpreter, shared libraries) are left out: the kernel can drop them."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            text = f.read()
        held = 0
        for key in (b"RssAnon:", b"RssShmem:"):
            start = text.index(key) + len(key)
            held += int(text[start : text.index(b"kB", start)])
        return held
    except (OSError, ValueError):
        return None


def _kill(pid: int, live: dict[int, int]) -> None:
    if pid not in live:
        return  # already reaped: its pid may have been reused
    for kill in (os.killpg, os.kill):  # the group exists once the worker called setsid()
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


# How often the zygote checks the pool-wide memory budget while workers are alive.
MEMORY_POLL_S = 0.1


class _Workers:
    """The zygote's live workers, their uids, and why the zygote killed any of them."""

    def __init__(self) -> None:
        self.live: dict[int, int] = {}  # worker pid -> its uid
        # pid -> (reason code, detail) of a worker the zygote killed, until asked.
        self.reasons: dict[int, tuple[str, str]] = {}
        self.budget_kb = 0  # pool-wide budget of the workers' own memory; 0 = none
        self.worker_kb = 0  # budget of one worker's own memory; 0 = none
        self.proc_hidden = False  # /proc remounted so workers see only themselves
        # Memory every worker inherits from the zygote (copy-on-write, shared): not
        # counted against the budgets, only what a worker allocated itself.
        self.baseline_kb = _held_kb(os.getpid()) or 0

    def spawned(self, pid: int, uid: int) -> None:
        self.live[pid] = uid
        self.reasons.pop(pid, None)  # a reused pid: an old reason is not this worker's

    def _stop(self, pid: int, code: str, detail: str) -> None:
        self.reasons[pid] = (code, detail)
        _kill(pid, self.live)

    def over_worker_budget(self, pid: int, used: int | None = None) -> tuple[str, str] | None:
        """Kills worker `pid` if it holds more than its own budget (`used`: KiB it holds
        above the zygote's baseline, read now if None); returns (code, detail) then."""
        if not self.worker_kb or pid not in self.live:
            return None
        if used is None:
            held = _held_kb(pid)
            if held is None:
                return None
            used = max(0, held - self.baseline_kb)
        if used <= self.worker_kb:
            return None
        self._stop(pid, "memory_limit", (
            f"the worker held {used >> 10} MiB (anonymous and shared memory), over its "
            f"budget of {self.worker_kb >> 10} MiB"))
        return self.reasons[pid]

    def enforce_budget(self) -> None:
        """Kills every worker over its own memory budget, then, while the workers together
        use more than the pool budget, the largest; records why (the supervisor asks when
        it sees the death)."""
        if not (self.budget_kb or self.worker_kb):
            return
        own = {}
        for pid in list(self.live):
            held = _held_kb(pid)
            if held is not None:
                own[pid] = max(0, held - self.baseline_kb)
        for pid, used in list(own.items()):
            if self.over_worker_budget(pid, used):
                del own[pid]
        total = sum(own.values())
        while self.budget_kb and own and total > self.budget_kb:
            pid = max(own, key=own.__getitem__)
            self._stop(pid, "pool_memory_limit", (
                f"the pool's workers used {total >> 10} MiB together, over the pool memory "
                f"budget of {self.budget_kb >> 10} MiB; this worker, the largest, used "
                f"{own[pid] >> 10} MiB"))
            total -= own.pop(pid)


_CAP_SYS_ADMIN = 21


def _hide_processes() -> bool:
    """Remounts this namespace's /proc with hidepid=2,gid=0, so a worker (its own uid and
    gid, no groups) sees only itself there while the zygote (gid 0) still sees every
    worker; then drops CAP_SYS_ADMIN, which only this needed. False if not possible (not
    root, or bubblewrap did not grant the capability)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    ms_remount, ms_nosuid, ms_nodev, ms_noexec = 32, 2, 4, 8
    flags = ms_remount | ms_nosuid | ms_nodev | ms_noexec
    hidden = libc.mount(b"proc", b"/proc", b"proc", flags, b"hidepid=2,gid=0") == 0

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [(name, ctypes.c_uint32) for name in ("effective", "permitted", "inheritable")]

    header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3
    if libc.capget(ctypes.byref(header), data) == 0:
        for field in ("effective", "permitted", "inheritable"):
            setattr(data[0], field, getattr(data[0], field) & ~(1 << _CAP_SYS_ADMIN))
        libc.capset(ctypes.byref(header), data)
    libc.prctl(47, 3, _CAP_SYS_ADMIN, 0, 0)  # PR_CAP_AMBIENT, PR_CAP_AMBIENT_LOWER
    libc.prctl(24, _CAP_SYS_ADMIN, 0, 0, 0)  # PR_CAPBSET_DROP
    return hidden


def serve(control_fd: int, preload: list[str]) -> None:
    sys.dont_write_bytecode = True
    _preload(preload)
    hidden = _hide_processes()
    control = socket.socket(fileno=control_fd)
    workers = _Workers()
    workers.proc_hidden = hidden
    live = workers.live
    while True:
        if live and (workers.budget_kb or workers.worker_kb):
            ready, _, _ = select.select([control], [], [], MEMORY_POLL_S)
            if not ready:
                _reap(live)
                workers.enforce_budget()
                continue
        try:
            packet, fds, _, _ = socket.recv_fds(control, 1 << 16, 4)
        except InterruptedError:
            continue
        if not packet:
            os._exit(0)
        _reap(live)
        request = json.loads(packet)
        reply = _serve_one(control, request, fds, workers)
        if reply is not None:
            control.send(json.dumps({"n": request["n"], **reply}).encode())
        for fd in fds[1:]:
            os.close(fd)


def _serve_one(control: socket.socket, request: dict, fds: list[int], workers: _Workers):
    """Handles one control request; returns the reply's fields, or None for no reply."""
    op = request.get("op")
    live = workers.live
    if op == "spawn":
        channel_fd = fds[0]
        limits = request["limits"]
        workers.budget_kb = int(limits.get("pool_memory_bytes") or 0) >> 10
        workers.worker_kb = int(limits.get("worker_memory_bytes") or 0) >> 10
        _pick_uid(limits, live)
        pid = os.fork()
        if pid == 0:
            try:
                control.close()
                worker.serve(channel_fd, limits)
            finally:
                os._exit(1)
        os.close(channel_fd)
        workers.spawned(pid, int(limits.get("uid", 0)))
        return {"pid": pid}
    if op == "kill":
        _kill(int(request["pid"]), live)
        return None
    if op == "usage":
        pids = [int(p) for p in request["pids"]]
        return {"usage": {str(p): proc_usage(p) if p in live else None for p in pids}}
    if op == "check":
        over = {}
        for pid in (int(p) for p in request["pids"]):
            reason = workers.over_worker_budget(pid)
            if reason is not None:
                workers.reasons.pop(pid, None)  # told now: the caller marks it dead
                over[str(pid)] = list(reason)
        return {"over": over}
    if op == "why":
        code, detail = workers.reasons.pop(int(request["pid"]), (None, None))
        return {"code": code, "reason": detail}
    if op == "ping":
        return {"pong": True, "pid": os.getpid(), "proc_hidden": workers.proc_hidden}
    return {"error": f"unknown op {op!r}"}
