"""One host failing stops the whole job at once (``distributed.fail_fast``).

Without it, the failing process's exit waits in JAX's shutdown barrier (up to 5 minutes)
while the other host waits for it in its next collective: the job hangs for minutes
before anything exits. Measured on this box without ``fail_fast``: both processes hung
for 5 minutes, then aborted (SIGABRT) when the shutdown barrier timed out; with it both
exit, status 1, within seconds.
"""

from __future__ import annotations

import sys
import textwrap
import time

import multiproc
import pytest

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


@pytest.mark.slow  # two JAX processes (~10 s)
def test_one_host_raising_ends_both_processes_within_seconds():
    procs = multiproc.start([[sys.executable, "-c", WORKER]] * 2, multiproc.host_envs(2))
    start = time.monotonic()
    logs = multiproc.wait(procs, timeout=150)  # far below 300 s
    assert time.monotonic() - start < 150
    assert [proc.returncode for proc in procs] == [1, 1], logs
    assert "RuntimeError: host 1 breaks between two collectives" in logs[1]
    assert "process 1 failed; exiting without the shutdown barrier" in logs[1]
    assert "went on" not in logs[0] + logs[1]
    assert "process 0 failed" in logs[0]  # its collective broke when host 1 left
