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


def _reap(live: set[int]) -> None:
    while live:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            live.clear()
            return
        if pid == 0:
            return
        live.discard(pid)


def _kill(pid: int, live: set[int]) -> None:
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
    live: set[int] = set()
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
            pid = os.fork()
            if pid == 0:
                try:
                    control.close()
                    worker.serve(channel_fd, request["limits"])
                finally:
                    os._exit(1)
            os.close(channel_fd)
            live.add(pid)
            control.send(json.dumps({"n": request["n"], "pid": pid}).encode())
        elif op == "kill":
            _kill(int(request["pid"]), live)
        elif op == "ping":
            control.send(json.dumps({"n": request["n"], "pong": True, "pid": os.getpid()}).encode())
        for fd in fds[1:]:
            os.close(fd)
