"""One host failing stops the whole job at once (``distributed.fail_fast``), and one host
dying (SIGKILL, a lost VM) ends the job on every host within the heartbeat timeout.

Without it, the failing process's exit waits in JAX's shutdown barrier (up to 5 minutes)
while the other host waits for it in its next collective: the job hangs for minutes
before anything exits. Measured on this box without ``fail_fast``: both processes hung
for 5 minutes, then aborted (SIGABRT) when the shutdown barrier timed out; with it both
exit, status 1, within seconds.
"""

from __future__ import annotations

import signal
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


# Both hosts past a first collective, then busy outside any (as a host waits in a TPU
# collective over ICI, which a dead peer never breaks): only JAX's coordination service,
# which stops hearing the dead host's heartbeats, can end the survivor.
BUSY_WORKER = textwrap.dedent("""
    import time
    from spade_jax import distributed

    distributed.maybe_initialize()
    import jax

    distributed.agree_json({"warm": 1})
    print("ready", jax.process_index(), flush=True)
    time.sleep(600)
    print("host", jax.process_index(), "woke up", flush=True)
""")
HEARTBEAT_S = 10


@pytest.mark.slow  # two JAX processes and a heartbeat timeout (~15-25 s each)
@pytest.mark.parametrize("victim", [1, 0], ids=["worker_dies", "coordinator_dies"])
def test_a_dead_host_ends_every_other_host_within_the_heartbeat_timeout(victim):
    envs = multiproc.host_envs(2, SPADE_JAX_HEARTBEAT_TIMEOUT_S=str(HEARTBEAT_S))
    procs = multiproc.start([[sys.executable, "-c", BUSY_WORKER]] * 2, envs)
    try:
        for proc in procs:  # both joined and past the first collective
            while "ready" not in (line := proc.stdout.readline()):
                assert line, "a host exited before it was ready"
        procs[victim].send_signal(signal.SIGKILL)
        survivor = procs[1 - victim]
        # Bounded: the heartbeat timeout plus slack, far below the survivor's 600 s sleep.
        log = survivor.communicate(timeout=10 * HEARTBEAT_S)[0]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    assert survivor.returncode == -signal.SIGABRT, log[-3000:]
    assert "Terminating process because the JAX distributed service detected fatal errors" in log
    assert "woke up" not in log
