"""Before a run starts: can this host's sandbox isolate designer programs?

A pool whose isolation is incomplete refuses every untrusted program (reason
``weak_isolation``), so a run started there would go on for hours and learn nothing: no
program validates, no agent episode runs. :func:`require_isolation` turns that into an
error at start-up that names each missing layer and how to provide it. Passing
``allow_weak=True`` (``SandboxConfig.allow_weak_isolation``, ``--allow_weak_sandbox``)
runs the untrusted programs with the layers that exist, and says so in the log.
"""

from __future__ import annotations

import logging
import os
import shutil

from spade_jax.envs.isolation import IsolationReport

log = logging.getLogger(__name__)

# Layer name -> how to provide it on a Debian / Ubuntu host (a TPU VM image).
_FIXES = {
    "unprivileged_uid": (
        "the trainer must run as root so that the sandbox can give every worker its own "
        "unprivileged uid (it runs as uid {uid} now): start it with sudo, as `launch/tpu.py "
        "run` does"),
    "namespaces": (
        "bubblewrap gives each worker its own pid / network / ipc / mount namespaces: "
        "{bwrap}"),
    "seccomp": (
        "the worker could not load its seccomp filter: pyseccomp must be installed in the "
        "trainer's own environment (a virtual environment; not ~/.local, which the sandbox's "
        "`python -s` does not read) and libseccomp2 on the host (`apt-get install "
        "libseccomp2`); scripts/install.sh installs both"),
    "rlimits": "the kernel did not apply the worker's resource limits (RLIMIT_AS/CPU/NOFILE)",
    "no_new_privs": "the kernel did not set PR_SET_NO_NEW_PRIVS on the worker (Linux >= 3.5)",
    "hidden_processes": (
        "the worker sees other processes in /proc: the sandbox needs root to mount /proc "
        "with hidepid inside bubblewrap"),
}
_BWRAP_MISSING = ("`bwrap` is not on PATH: `sudo apt-get install -y bubblewrap` (scripts/"
                  "install.sh does, and stops if it cannot)")
_BWRAP_FAILS = ("`bwrap` is installed ({path}) but could not create the namespaces: run the "
                "trainer as root, or allow unprivileged user namespaces "
                "(`sysctl kernel.unprivileged_userns_clone=1`; on Ubuntu 24.04 also "
                "`kernel.apparmor_restrict_unprivileged_userns=0`)")


class SandboxUnavailable(RuntimeError):
    """The sandbox lacks isolation layers and weak isolation was not allowed."""


def bwrap_unusable(bwrap: str | None, error: Exception) -> SandboxUnavailable:
    """The error for a host where the sandbox's zygote never started under bubblewrap
    (seen in a Firecracker VM: "bwrap: Can't remount readonly on /newroot/usr/lib/python3/
    dist-packages ... Invalid argument"): what happened, and the two ways on."""
    return SandboxUnavailable(
        f"the sandbox could not start under bubblewrap ({bwrap}) on this host: {error}\n"
        "Fix the host (a root filesystem bwrap can bind read-only, user namespaces), or "
        "run without the namespaces layer: --set sandbox.use_namespaces=false plus "
        "--allow_weak_sandbox (seccomp, rlimits, no-new-privs and per-worker uids stay).")


def missing_layers(report: IsolationReport) -> list[tuple[str, str]]:
    """(layer, how to provide it) for every required layer the probe found missing."""
    bwrap = shutil.which("bwrap")
    fill = {"uid": os.getuid(),
            "bwrap": _BWRAP_FAILS.format(path=bwrap) if bwrap else _BWRAP_MISSING}
    return [(name, _FIXES.get(name, "see its detail in the isolation report").format(**fill))
            for name in report.missing]


def require_isolation(report: IsolationReport, *, allow_weak: bool) -> None:
    """Raises :class:`SandboxUnavailable` naming each missing layer and its fix, unless
    none is missing or ``allow_weak`` (then it logs a warning naming them)."""
    missing = missing_layers(report)
    if not missing:
        return
    lines = "\n".join(f"  - {name}: {fix}" for name, fix in missing)
    if allow_weak:
        log.warning("the sandbox runs designer programs WITHOUT these isolation layers "
                    "(allowed by --allow_weak_sandbox / sandbox.allow_weak_isolation):\n%s",
                    lines)
        return
    raise SandboxUnavailable(
        "the sandbox cannot isolate designer programs on this host; every program would be "
        "refused (weak_isolation) and the run would learn nothing. Missing:\n"
        f"{lines}\nFix the above, or pass --allow_weak_sandbox (--set "
        "sandbox.allow_weak_isolation=True) to run untrusted programs with weaker isolation.")
