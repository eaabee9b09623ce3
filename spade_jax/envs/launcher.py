"""Starts and talks to the zygote from the trainer process (the parent side of zygote.py).

The zygote is a fresh interpreter (`python -s -B -c BOOT`), never a fork of the trainer, so
it cannot inherit JAX state. BOOT registers bare `spade_jax` / `spade_jax.envs` package
objects pointing at this directory, so importing the sandbox modules runs neither package
`__init__` (which could import JAX or gymnasium). With bubblewrap the zygote runs in new
pid, network, ipc and uts namespaces, on a read-only view of `/` with its own `/proc`,
with a cleared environment (no trainer secrets) and only the capabilities it needs to
drop workers to the sandbox uid and kill them.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading

from spade_jax.envs.config import SandboxConfig

log = logging.getLogger(__name__)

_BOOT = """\
import ctypes, sys, types
ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG=SIGKILL: die with the trainer
root = sys.argv[1]
for name, path in (("spade_jax", root), ("spade_jax.envs", root + "/envs")):
    module = types.ModuleType(name)
    module.__path__ = [path]
    sys.modules[name] = module
from spade_jax.envs import zygote
zygote.serve(int(sys.argv[2]), [m for m in sys.argv[3].split(",") if m])
"""

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CLEAN_ENV = {
    "PATH": "/usr/bin:/bin",
    "PYTHONHASHSEED": "0",  # string hashing identical across zygote restarts: determinism
    "LANG": "C.UTF-8",
    # numpy's BLAS must not start threads: workers may not clone() (seccomp), and threads
    # started in the zygote would not survive its forks anyway.
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


class ZygoteError(RuntimeError):
    """The zygote could not be started or stopped answering."""


def find_bwrap(config: SandboxConfig) -> str | None:
    return config.bwrap_path or shutil.which("bwrap")


def _bwrap_prefix(bwrap: str) -> list[str]:
    args = [
        bwrap,
        "--ro-bind", "/", "/",
        "--dev", "/dev",
        "--proc", "/proc",
        "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
        "--unshare-cgroup-try",
        "--die-with-parent", "--new-session", "--clearenv",
    ]  # fmt: skip
    for key, value in _CLEAN_ENV.items():
        args += ["--setenv", key, value]
    if os.geteuid() == 0:
        # Kept so the zygote can setuid() workers to the sandbox uid and SIGKILL them.
        for cap in ("CAP_SETUID", "CAP_SETGID", "CAP_KILL"):
            args += ["--cap-add", cap]
    else:
        args += ["--unshare-user"]
    return args + ["--"]


class Zygote:
    """One running zygote process and its control channel."""

    def __init__(self, config: SandboxConfig, use_namespaces: bool) -> None:
        self.config = config
        self.use_namespaces = use_namespaces
        self._lock = threading.Lock()
        self._counter = 0
        control, remote = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        command = [sys.executable, "-s", "-B", "-c", _BOOT, _PACKAGE_ROOT, str(remote.fileno())]
        command.append(",".join(sorted(config.allowed_imports | config.reference_imports)))
        if use_namespaces:
            bwrap = find_bwrap(config)
            if bwrap is None:
                raise ZygoteError("bubblewrap (bwrap) not found")
            command = _bwrap_prefix(bwrap) + command
        try:
            self._process = subprocess.Popen(
                command,
                pass_fds=(remote.fileno(),),
                env=_CLEAN_ENV,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        finally:
            remote.close()
        self._control = control
        self._control.settimeout(60.0)
        try:
            self.pid_inside = self._request({"op": "ping"})["pid"]
        except ZygoteError:
            self.close()
            raise

    def _request(self, message: dict, fds: tuple[int, ...] = ()) -> dict:
        self._counter += 1
        message["n"] = self._counter
        try:
            socket.send_fds(self._control, [json.dumps(message).encode()], list(fds))
            reply = self._control.recv(1 << 16)
        except OSError as err:
            raise ZygoteError(f"zygote control channel failed: {err}; {self._stderr()}") from None
        if not reply:
            raise ZygoteError(f"zygote exited; {self._stderr()}")
        answer = json.loads(reply)
        if answer.get("n") != self._counter:
            raise ZygoteError(f"zygote answered out of order: {answer!r}")
        return answer

    def _stderr(self) -> str:
        if self._process.poll() is None:
            return "zygote still running"
        err = self._process.stderr.read().decode(errors="replace") if self._process.stderr else ""
        return f"exit code {self._process.returncode}, stderr: {err[-2000:]}"

    def spawn(self, limits: dict) -> tuple[int, socket.socket]:
        """Forks a worker; returns its pid (inside the zygote's namespace) and our socket end."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with self._lock:
                reply = self._request({"op": "spawn", "limits": limits}, (theirs.fileno(),))
        except ZygoteError:
            ours.close()
            raise
        finally:
            theirs.close()
        return int(reply["pid"]), ours

    def kill(self, pid: int) -> None:
        """SIGKILLs a worker's process group (fire and forget)."""
        with self._lock:
            try:
                self._control.send(json.dumps({"op": "kill", "pid": pid, "n": 0}).encode())
            except OSError:
                pass  # the zygote is gone, and its workers with it

    def alive(self) -> bool:
        return self._process.poll() is None

    def close(self) -> None:
        try:
            self._control.close()
        finally:
            if self._process.poll() is None:
                try:
                    os.killpg(self._process.pid, 9)
                except ProcessLookupError:
                    pass
            self._process.wait(timeout=10)
            if self._process.stderr:
                self._process.stderr.close()
