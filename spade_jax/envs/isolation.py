"""Which sandbox layers are in force, as measured by a probe worker at pool start.

The probe worker reports what the kernel says about it (uid, capabilities, seccomp mode,
rlimits, namespaces, visible pids) and the errno of each attack it tried; the trainer
compares that with the config and with its own namespaces. A missing required layer makes
the pool refuse untrusted programs unless weak isolation is allowed.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from spade_jax.envs.config import SandboxConfig


@dataclasses.dataclass(frozen=True)
class IsolationLayer:
    name: str
    active: bool
    detail: str
    # A missing required layer makes the pool refuse untrusted code; the static gate is a
    # filter in front of the boundary, not part of it, so it is not required.
    required: bool = True


@dataclasses.dataclass(frozen=True)
class IsolationReport:
    """Which sandbox layers are in force, measured by a probe worker at pool start."""

    layers: tuple[IsolationLayer, ...]

    @property
    def missing(self) -> list[str]:
        return [layer.name for layer in self.layers if layer.required and not layer.active]

    @property
    def complete(self) -> bool:
        return not self.missing

    def as_dict(self) -> dict[str, dict[str, Any]]:
        return {
            x.name: {"active": x.active, "required": x.required, "detail": x.detail}
            for x in self.layers
        }


def measure_layers(config: SandboxConfig, hello: dict, namespaced: bool) -> IsolationReport:
    iso = hello.get("isolation", {})
    attacks = hello.get("attacks", {})
    limits = config.worker_limits()
    rl = iso.get("rlimits", {})
    rlimits_ok = (
        rl.get("RLIMIT_AS") == limits["memory_limit_bytes"]
        and rl.get("RLIMIT_FSIZE") == 0
        and rl.get("RLIMIT_CORE") == 0
        and rl.get("RLIMIT_NOFILE") == config.max_open_files
        and rl.get("RLIMIT_CPU") == config.cpu_limit_s + 1
    )
    own_ns = {ns: os.readlink(f"/proc/self/ns/{ns}") for ns in ("pid", "net", "ipc", "mnt")}
    theirs = iso.get("namespaces", {})
    separate = [ns for ns in own_ns if theirs.get(ns) not in (None, own_ns[ns])]
    ns_ok = namespaced and len(separate) == 4 and iso.get("root_read_only") is True
    seccomp_ok = iso.get("seccomp_mode") == 2 and all(
        attacks.get(k) == 1
        for k in ("fork", "socket", "write_file", "signal_owner", "flock", "pid_oracle")
        # 1 = EPERM
    )
    uid = iso.get("uid")
    no_caps = iso.get("cap_eff") is not None and int(str(iso.get("cap_eff")), 16) == 0
    hides = namespaced and config.drop_privileges and os.geteuid() == 0
    layers = (
        IsolationLayer(
            "static_gate", config.static_gate, "parse, caps, import allow-list", required=False
        ),
        IsolationLayer("process", True, "separate worker process per handle, forked by zygote"),
        IsolationLayer("supervisor", True, "deadline kill, size caps, type/finite checks here"),
        IsolationLayer("rlimits", rlimits_ok, f"worker reports {rl}"),
        IsolationLayer("no_new_privs", iso.get("no_new_privs") is True, "PR_SET_NO_NEW_PRIVS"),
        IsolationLayer(
            "unprivileged_uid",
            uid not in (None, 0, os.getuid()) and no_caps,
            f"worker uid {uid} (one per worker: {config.per_worker_uid}), trainer uid "
            f"{os.getuid()}, effective capabilities {iso.get('cap_eff')}",
        ),
        IsolationLayer(
            "hidden_processes",
            iso.get("visible_pids") == 1,
            f"{iso.get('visible_pids')} pids visible in the worker's /proc (hidepid)",
            required=hides,
        ),
        IsolationLayer(
            "seccomp",
            seccomp_ok,
            f"mode {iso.get('seccomp_mode')}, {iso.get('seccomp_rules')} rules, "
            f"probe errnos {attacks}, errors {iso.get('errors')}",
        ),
        IsolationLayer(
            "namespaces",
            ns_ok,
            f"separate {separate}, read-only root {iso.get('root_read_only')}, "
            f"{iso.get('visible_pids')} pids visible",
        ),
    )
    return IsolationReport(layers)
