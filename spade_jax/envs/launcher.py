"""Starts and talks to the zygote from the trainer process (the parent side of zygote.py).

The zygote is a fresh interpreter (`python -s -B -c BOOT`), never a fork of the trainer, so
it cannot inherit JAX state. BOOT registers bare `spade_jax` / `spade_jax.envs` package
objects pointing at this directory, so importing the sandbox modules runs neither package
`__init__` (which could import JAX or gymnasium). With bubblewrap the zygote runs in new
pid, network, ipc and uts namespaces, on a read-only filesystem that holds only what it
needs (the Python installation with only the allowed packages, this package's sandbox
modules, shared libraries; see `_filesystem_args`) with its own `/proc`, with a cleared
environment (no trainer secrets) and only the capabilities it needs to drop workers to
the sandbox uid and kill them.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import sysconfig
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


# Host paths the sandbox sees besides the Python installation: shared libraries, and what
# ctypes.util.find_library (pyseccomp, at zygote start) runs to locate libseccomp.
_SYSTEM_LIBS = ("/usr/lib", "/usr/lib64", "/usr/lib32", "/usr/libx32")
_SYSTEM_FILES = ("/etc/ld.so.cache", "/usr/sbin/ldconfig")
_TOP_LINKS = ("/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin")


@functools.lru_cache(maxsize=8)
def package_paths(modules: tuple[str, ...]) -> tuple[str, ...]:
    """The installed files and folders (site-packages entries) of the distributions that
    provide `modules`, and of their dependencies (extras left out): what the zygote must
    read to import them. Standard-library modules have no distribution and add nothing."""
    from importlib import metadata

    providers = metadata.packages_distributions()
    todo = [dist for module in modules for dist in providers.get(module, ())]
    seen: set[str] = set()
    paths: set[str] = set()
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-").replace(".", "-")
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        for file in dist.files or ():
            top = file.parts[0]
            if top not in ("..", "__pycache__"):
                paths.add(os.path.realpath(dist.locate_file(top)))
        for text in dist.requires or ():
            # "name[extras] (>=1) ; marker": a requirement of an extra is left out; other
            # markers (python version, platform) are kept, which can only expose more.
            requirement, _, marker = text.partition(";")
            name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
            if name and "extra" not in marker:
                todo.append(name.group(1))
    return tuple(sorted(p for p in paths if os.path.exists(p)))


class _View:
    """bwrap arguments that build a filesystem from nothing, one mount at a time. Every
    folder that leads to a mount point is made first, with mode 0755 (bubblewrap would
    create missing parents with mode 0700, which an unprivileged worker cannot walk
    through: modules that were not imported at warm-up would then be unreadable)."""

    def __init__(self) -> None:
        self.args: list[str] = []
        self.mounted: list[str] = []  # folders whose contents the mounts provide
        self.made: set[str] = {"/"}

    def _parents(self, path: str) -> None:
        parts = path.strip("/").split("/")[:-1]
        for depth in range(1, len(parts) + 1):
            parent = "/" + "/".join(parts[:depth])
            inside = any(parent == m or parent.startswith(m + os.sep) for m in self.mounted)
            if parent not in self.made and not inside:
                self.args += ["--perms", "0755", "--dir", parent]
                self.made.add(parent)

    def mount(self, kind: str, source: str | None, path: str) -> None:
        self._parents(path)
        self.args += [kind, *([source] if source else []), path]
        self.mounted.append(path)


def _site_dirs(prefix: str) -> list[str]:
    """The site-packages folders inside the interpreter's installation (`prefix`): the
    running environment's and the base interpreter's (a venv's base has its own)."""
    import glob
    import site

    found = {os.path.realpath(p) for key in ("purelib", "platlib")
             if (p := sysconfig.get_paths().get(key))}  # fmt: skip
    found.update(os.path.realpath(p) for p in site.getsitepackages([sys.base_prefix]))
    for name in ("site-packages", "dist-packages"):
        found.update(os.path.realpath(p) for p in glob.glob(f"{prefix}/lib*/python3*/{name}"))
    return sorted(p for p in found if p.startswith(prefix + os.sep) and os.path.isdir(p))


# Device nodes a worker gets: no /dev/pts or /dev/ptmx (a pty is a channel between workers
# that shows its owner's uid), no /dev/tty, no /dev/shm.
_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
# /proc files that name other processes of the namespace: the newest pid.
_PROC_MASKED = ("/proc/loadavg", "/proc/sys/kernel/ns_last_pid")


def _filesystem_args(modules: tuple[str, ...]) -> list[str]:
    """bwrap arguments that build the sandbox's view of the filesystem: an empty read-only
    root with the Python installation (every site-packages inside it emptied, then only
    the distributions of `modules` put back), this package's sandbox modules, the system's
    shared libraries, five device nodes and an own /proc. Not /etc, /home, /root's other
    files, /tmp, /work or anything else; no pty."""
    view = _View()
    prefix = os.path.realpath(sys.base_prefix)
    view.mount("--ro-bind", prefix, prefix)
    executable = os.path.realpath(sys.executable)
    if not executable.startswith(prefix + os.sep):
        view.mount("--ro-bind", executable, executable)
    if not os.path.abspath(sys.executable).startswith(prefix + os.sep):  # a venv's python
        view.mount("--ro-bind", sys.executable, os.path.abspath(sys.executable))
        venv_config = os.path.join(sys.prefix, "pyvenv.cfg")
        if os.path.exists(venv_config):
            view.mount("--ro-bind", venv_config, venv_config)
    masked = _site_dirs(prefix)
    for site in masked:
        view.args += ["--perms", "0755"]
        view.mount("--tmpfs", None, site)
    for path in package_paths(modules):
        view.mount("--ro-bind", path, path)
    envs = os.path.join(_PACKAGE_ROOT, "envs")
    view.mount("--ro-bind", envs, envs)
    for path in (*_SYSTEM_LIBS, *_SYSTEM_FILES):
        if os.path.exists(path):
            view.mount("--ro-bind", path, path)
    for path in _TOP_LINKS:
        if os.path.islink(path):
            view.args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path) and path not in ("/bin", "/sbin"):
            view.mount("--ro-bind", path, path)
    view.args += ["--perms", "0755"]
    view.mount("--tmpfs", None, "/dev")
    for device in _DEVICES:
        if os.path.exists(device):
            view.mount("--dev-bind", device, device)
    view.mount("--proc", None, "/proc")
    for path in _PROC_MASKED:
        if os.path.exists(path):
            view.args += ["--ro-bind", "/dev/null", path]
    args = view.args + [item for site in (*masked, "/dev") for item in ("--remount-ro", site)]
    return args + ["--remount-ro", "/"]


def _bwrap_prefix(bwrap: str, modules: tuple[str, ...]) -> list[str]:
    args = [bwrap, *_filesystem_args(modules)]
    args += [
        "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
        "--unshare-cgroup-try",
        "--die-with-parent", "--new-session", "--clearenv",
    ]  # fmt: skip
    for key, value in _CLEAN_ENV.items():
        args += ["--setenv", key, value]
    if os.geteuid() == 0:
        # Kept so the zygote can setuid() workers to the sandbox uid and SIGKILL them;
        # CAP_SYS_ADMIN only to remount /proc with hidepid at start, then dropped.
        for cap in ("CAP_SETUID", "CAP_SETGID", "CAP_KILL", "CAP_SYS_ADMIN"):
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
        modules = sorted(config.allowed_imports | config.reference_imports)
        command.append(",".join(modules))
        if use_namespaces:
            bwrap = find_bwrap(config)
            if bwrap is None:
                raise ZygoteError("bubblewrap (bwrap) not found")
            command = _bwrap_prefix(bwrap, (*modules, "pyseccomp")) + command
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
        self._proc_root = self._find_proc_root()

    def _find_proc_root(self) -> str:
        """Where the trainer reads the sandbox's /proc: its own /proc without namespaces,
        else the zygote's /proc through /proc/<zygote's host pid>/root (the zygote is a
        descendant of the bwrap process whose innermost pid is `pid_inside`)."""
        if not self.use_namespaces:
            return "/proc"
        todo = [self._process.pid]
        while todo:
            pid = todo.pop()
            try:
                with open(f"/proc/{pid}/status") as f:
                    nspid = next((line.split()[1:] for line in f if line.startswith("NSpid:")), [])
                children = []
                for task in os.listdir(f"/proc/{pid}/task"):
                    with open(f"/proc/{pid}/task/{task}/children") as f:
                        children += [int(c) for c in f.read().split()]
            except OSError:
                continue
            if len(nspid) > 1 and int(nspid[-1]) == self.pid_inside:
                return f"/proc/{pid}/root/proc"
            todo += children
        return ""  # not found: CPU time is then asked of the zygote

    def stat_fd(self, pid: int) -> int | None:
        """A read-only fd on /proc/<pid>/stat of a worker (pid inside the zygote's
        namespace), for the trainer to read its CPU time without a round trip; the fd
        stays bound to that process (a reused pid cannot answer for it). None if the
        sandbox's /proc cannot be reached from here."""
        if not self._proc_root:
            return None
        try:
            return os.open(f"{self._proc_root}/{int(pid)}/stat", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None

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
        try:  # a broken channel usually means it is exiting: its stderr says why
            self._process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
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

    def usage(self, pids: list[int]) -> dict[int, dict | None]:
        """Per worker pid: {"cpu_s", "max_rss_kb", "rss_anon_kb"} as /proc reports them,
        read by the zygote (never by the worker's own interpreter); None for a gone pid."""
        with self._lock:
            reply = self._request({"op": "usage", "pids": [int(p) for p in pids]})
        return {int(p): u for p, u in reply["usage"].items()}

    def check_memory(self, pids: list[int]) -> dict[int, tuple[str, str]]:
        """Checks the per-worker memory budget of `pids` now, from /proc in the zygote:
        per worker over it (killed), its (reason code, detail). The zygote's 0.1 s poll
        can miss memory taken in a short call; this runs when a call ends."""
        if not pids:
            return {}
        with self._lock:
            reply = self._request({"op": "check", "pids": [int(p) for p in pids]})
        return {int(p): (str(code), str(detail)) for p, (code, detail) in reply["over"].items()}

    def death_reason(self, pid: int) -> tuple[str, str] | None:
        """Why the zygote itself killed worker `pid` (a memory budget): (reason code,
        detail), or None."""
        try:
            with self._lock:
                answer = self._request({"op": "why", "pid": int(pid)})
        except ZygoteError:
            return None
        if answer.get("code") is None:
            return None
        return str(answer["code"]), str(answer.get("reason", ""))

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
