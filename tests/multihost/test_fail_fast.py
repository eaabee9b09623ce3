"""One host failing stops the whole job at once (``distributed.fail_fast``).

Without it, the failing process's exit waits in JAX's shutdown barrier (up to 5 minutes)
while the other host waits for it in its next collective: the job hangs for minutes
before anything exits. Measured on this box without ``fail_fast``: both processes hung
for 5 minutes, then aborted (SIGABRT) when the shutdown barrier timed out; with it both
exit, status 1, within seconds.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

WORKER = textwrap.dedent("""
    from spade_jax import distributed

    distributed.maybe_initialize()
    import jax

    with distributed.fail_fast():
        distributed.agree_json({"warm": 1})
        if jax.process_index() == 1:
            raise RuntimeError("host 1 breaks between two collectives")
        distributed.agree_json({"round": 2})  # host 0 waits here for host 1
    print("host", jax.process_index(), "went on", flush=True)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # two JAX processes (~10 s)
def test_one_host_raising_ends_both_processes_within_seconds():
    port = _free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-c", WORKER], cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", PYTHONPATH=str(REPO),
                 JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
                 JAX_PROCESS_ID=str(host))) for host in range(2)]
    start = time.monotonic()
    try:
        logs = [proc.communicate(timeout=150)[0] for proc in procs]  # far below 300 s
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert time.monotonic() - start < 150
    assert [proc.returncode for proc in procs] == [1, 1], logs
    assert "RuntimeError: host 1 breaks between two collectives" in logs[1]
    assert "process 1 failed; exiting without the shutdown barrier" in logs[1]
    assert "went on" not in logs[0] + logs[1]
    assert "process 0 failed" in logs[0]  # its collective broke when host 1 left
