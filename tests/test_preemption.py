"""``spade_jax.preemption``: SIGTERM becomes a flag; safe points raise ``Preempted`` only
inside an interruptible block and before ``commit()``. (The rollout's safe points:
``tests/rollout/test_preempt_points.py``; a SIGTERM mid-window through the real command,
saved at the next safe point and resumed: ``tests/cli/test_train_cli.py``.)"""

from __future__ import annotations

import os
import signal

import pytest

from spade_jax import preemption
from spade_jax.preemption import Preempted, PreemptionGuard


@pytest.fixture
def installed():
    previous_handler = signal.getsignal(signal.SIGTERM)
    previous_guard = preemption.active_guard()
    guard = PreemptionGuard.install()
    yield guard
    signal.signal(signal.SIGTERM, previous_handler)
    preemption._active = previous_guard  # noqa: SLF001 (restore the process's guard)


def test_sigterm_sets_the_flag_of_the_process_guard(installed):
    assert preemption.active_guard() is installed and not installed.requested()
    os.kill(os.getpid(), signal.SIGTERM)  # the process survives: a request, not an exit
    assert installed.requested()


def test_safe_points_raise_only_inside_an_uncommitted_block(installed):
    installed.request()
    preemption.check_safe_point()  # not interruptible (start-up, warm start): no raise
    with installed.interruptible():
        with pytest.raises(Preempted):
            preemption.check_safe_point()
        preemption.check_safe_point()  # raised once: the block is disarmed
    with installed.interruptible():
        installed.commit()  # the update started: the step cannot be dropped any more
        preemption.check_safe_point()
    preemption.check_safe_point()


def test_no_guard_no_effect(monkeypatch):
    monkeypatch.setattr(preemption, "_active", None)
    preemption.check_safe_point()
    guard = PreemptionGuard()  # not installed: safe points do not read it
    guard.request()
    with guard.interruptible():
        preemption.check_safe_point()
        with pytest.raises(Preempted):
            guard.check()
