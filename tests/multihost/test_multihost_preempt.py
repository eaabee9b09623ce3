"""A preemption seen by one host stops every host at the same safe point
(``spade_jax.preemption``): two JAX processes, only host 1 is signalled (a real SIGTERM to
itself) in the middle of a run of safe points; both raise ``Preempted`` at the same call,
the first all-gather after the signal (every ``GATHER_EVERY``-th call)."""

from __future__ import annotations

import sys
import textwrap

import multiproc
import pytest

WORKER = textwrap.dedent("""
    import os, signal
    from spade_jax import distributed, preemption

    distributed.maybe_initialize()
    import jax

    guard = preemption.PreemptionGuard.install()
    stopped_at = None
    with guard.interruptible():
        for call in range(1, 100):
            if call == 11 and jax.process_index() == 1:
                os.kill(os.getpid(), signal.SIGTERM)  # host 1's preemption notice only
            try:
                preemption.check_safe_point()
            except preemption.Preempted:
                stopped_at = call
                break
    print("host", jax.process_index(), "stopped at", stopped_at, flush=True)
""")


@pytest.mark.slow  # two JAX processes (~10 s)
def test_one_hosts_sigterm_stops_every_host_at_the_same_safe_point():
    from spade_jax.preemption import GATHER_EVERY

    logs = multiproc.run_processes([[sys.executable, "-c", WORKER]] * 2, multiproc.host_envs(2),
                                   ["host 0", "host 1"], timeout=150)
    first_gather_after = (11 // GATHER_EVERY + 1) * GATHER_EVERY  # 16 with GATHER_EVERY 8
    for host, log in enumerate(logs):
        assert f"host {host} stopped at {first_gather_after}" in log, log[-2000:]
