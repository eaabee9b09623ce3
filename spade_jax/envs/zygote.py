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
  {"op": "ping"}                                    -> {"pong": true, "pid": ...}
End of file on the control channel (the trainer died or closed) ends the zygote.
"""

from __future__ import annotations

import importlib
import json
import os
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


def _kill(pid: int, live: dict[int, int]) -> None:
    if pid not in live:
        return  # already reaped: its pid may have been reused
    for kill in (os.killpg, os.kill):  # the group exists once the worker called setsid()
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def serve(control_fd: int, preload: list[str]) -> None:
    sys.dont_write_bytecode = True
    _preload(preload)
    control = socket.socket(fileno=control_fd)
    live: dict[int, int] = {}  # worker pid -> its uid
    while True:
        try:
            packet, fds, _, _ = socket.recv_fds(control, 1 << 16, 4)
        except InterruptedError:
            continue
        if not packet:
            os._exit(0)
        _reap(live)
        request = json.loads(packet)
        op = request.get("op")
        if op == "spawn":
            channel_fd = fds[0]
            limits = request["limits"]
            _pick_uid(limits, live)
            pid = os.fork()
            if pid == 0:
                try:
                    control.close()
                    worker.serve(channel_fd, limits)
                finally:
                    os._exit(1)
            os.close(channel_fd)
            live[pid] = int(limits.get("uid", 0))
            control.send(json.dumps({"n": request["n"], "pid": pid}).encode())
        elif op == "kill":
            _kill(int(request["pid"]), live)
        elif op == "usage":
            usage = {str(p): proc_usage(int(p)) if int(p) in live else None
                     for p in request["pids"]}  # fmt: skip
            control.send(json.dumps({"n": request["n"], "usage": usage}).encode())
        elif op == "ping":
            control.send(json.dumps({"n": request["n"], "pong": True, "pid": os.getpid()}).encode())
        for fd in fds[1:]:
            os.close(fd)
