"""Several JAX CPU processes on this host forming one distributed system, as a multi-host
TPU slice would start them: each process gets JAX_COORDINATOR_ADDRESS (a free loopback
port), JAX_NUM_PROCESSES and JAX_PROCESS_ID, which ``distributed.maybe_initialize()``
reads; collectives between the processes go over gloo. Used by ``tests/multihost/``
(import it inside the test: the worker processes, the test files run as scripts, do not
have the tests folder on their path).
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path

from xla_test_flags import jax_flags

REPO = Path(__file__).resolve().parents[2]
COORDINATION = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def jax_env(devices: int = 1, **extra: str) -> dict[str, str]:
    """The environment of one JAX process on ``devices`` simulated CPU devices, importing
    this checkout, alone (no coordination variables inherited); ``extra`` added."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO),
               XLA_FLAGS=jax_flags(devices))
    for key in COORDINATION:
        env.pop(key, None)
    return {**env, **extra}


def host_envs(hosts: int, devices_per_host: int = 1, **extra: str) -> list[dict[str, str]]:
    """One :func:`jax_env` per process of a ``hosts``-process system on a fresh port."""
    port = free_port()
    return [jax_env(devices_per_host, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                    JAX_NUM_PROCESSES=str(hosts), JAX_PROCESS_ID=str(host), **extra)
            for host in range(hosts)]


def start(commands: Sequence[Sequence[str]],
          envs: Sequence[dict[str, str]]) -> list[subprocess.Popen]:
    """Starts ``commands[i]`` with ``envs[i]`` in the repository, all at once (the
    processes of one system wait for each other), output and errors captured together."""
    return [subprocess.Popen(list(command), cwd=REPO, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
            for command, env in zip(commands, envs, strict=True)]


def wait(procs: Sequence[subprocess.Popen], timeout: float) -> list[str]:
    """Each process's output, waiting up to ``timeout`` seconds for each; kills any still
    running at the end (one process failing leaves the others waiting in a collective)."""
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=timeout)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return logs


def run_processes(commands: Sequence[Sequence[str]], envs: Sequence[dict[str, str]],
                  names: Sequence[str], timeout: float) -> list[str]:
    """:func:`start` and :func:`wait`, then asserts every process exited 0, showing the end
    of a failed one's output. Returns each one's output."""
    procs = start(commands, envs)
    logs = wait(procs, timeout)
    for name, proc, log in zip(names, procs, logs, strict=True):
        assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{log[-4000:]}"
    return logs
