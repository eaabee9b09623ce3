"""SIGTERM -> stop at the next safe point, within a step, not only between steps.

A spot / preemptible TPU VM gets SIGTERM about 30 s before it is taken away. One SPADE
step of a 30B policy (designer sampling, 25-turn agent plays, the update) takes minutes,
so waiting for the step to end loses the slice before anything is saved. Instead:

* :class:`PreemptionGuard` turns SIGTERM into a flag (``install()`` also makes it the
  process's guard, the one :func:`check_safe_point` reads);
* the run marks the part of a step whose work can be thrown away as
  :meth:`PreemptionGuard.interruptible` (everything before the update: sampling, plays,
  scoring) and calls :meth:`PreemptionGuard.commit` when the update starts;
* the sampler's decode loop and the agent loop's scheduler call :func:`check_safe_point`
  once per decode chunk / tick; inside an interruptible block, once a preemption was
  requested on any host, it raises :class:`Preempted` on every host at the same call;
* the run catches it, drops the step, saves the state of the last completed step (the
  parameters are untouched until the update; the loop's state was kept as JSON when the
  step began), and exits. The resumed run redoes the dropped step from the same seeds.

So the time from the signal to the save is one decode chunk (or one agent-loop tick) plus
the checkpoint write, not the rest of the step. A signal during the update waits for the
update to finish (it cannot be dropped once parameters changed) and is saved at the step's
end, as before.

Several hosts: each host may get the signal at a different moment, so the flag is
all-gathered; every host makes the same sequence of safe-point calls (the sampler and the
scheduler decide only from shared values), so the gather is one collective that all hosts
enter together. It runs every ``every``-th call (a flag read on one host costs nothing).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from types import FrameType

import numpy as np

log = logging.getLogger(__name__)

# Multi-host: safe-point calls between two all-gathers of the flag. A call is one decode
# chunk or one scheduler tick (tens to hundreds of milliseconds on a TPU), so the stop
# comes a few seconds after the signal at most.
GATHER_EVERY = 8


class Preempted(Exception):
    """A requested stop reached a safe point inside a step: the step is abandoned (nothing
    it did is kept); the caller saves the last completed step and exits."""


class PreemptionGuard:
    """Turns SIGTERM into a save-and-stop request.

    On several hosts each host may see the signal at a different step, so
    :meth:`requested` agrees across processes (any host signalled -> all stop).
    """

    def __init__(self) -> None:
        self._signalled = threading.Event()
        self._armed = False
        self._calls = 0

    @classmethod
    def install(cls, signals: tuple[int, ...] = (signal.SIGTERM,)) -> PreemptionGuard:
        """Creates a guard, makes it the handler of ``signals`` (main thread only) and the
        process's guard (:func:`active_guard`)."""
        global _active
        guard = cls()
        for signum in signals:
            signal.signal(signum, guard._handle)
        _active = guard
        return guard

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        del frame
        log.warning("received signal %d: saving a checkpoint at the next safe point", signum)
        self._signalled.set()

    def request(self) -> None:
        """Asks for a save-and-stop as if the signal had arrived (tests, manual stops)."""
        self._signalled.set()

    def requested(self) -> bool:
        """Whether any host was signalled (a collective on several hosts: every host calls
        it at the same point)."""
        import jax

        local = self._signalled.is_set()
        if jax.process_count() == 1:
            return local
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.asarray(local, dtype=np.int32))
        return bool(np.max(flags))

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """A block whose work may be dropped: inside it (until :meth:`commit`),
        :func:`check_safe_point` raises :class:`Preempted` once a stop was requested."""
        self._armed, self._calls = True, 0
        try:
            yield
        finally:
            self._armed = False

    def commit(self) -> None:
        """The step starts to change what it cannot drop (the update): safe points in the
        rest of the block no longer raise; a signal is honoured after the step."""
        self._armed = False

    def check(self, every: int = GATHER_EVERY) -> None:
        """Raises :class:`Preempted` inside an armed block once any host was signalled (see
        :func:`check_safe_point`)."""
        if not self._armed:
            return
        import jax

        self._calls += 1
        if jax.process_count() > 1 and self._calls % every:
            return  # hosts gather the flag on the same calls: every `every`-th one
        if self.requested():
            self._armed = False
            raise Preempted("a preemption was requested: the step in progress is dropped")


_active: PreemptionGuard | None = None


def active_guard() -> PreemptionGuard | None:
    """The guard :meth:`PreemptionGuard.install` made the process's (None before)."""
    return _active


def check_safe_point() -> None:
    """A point in a step where the step may be abandoned: raises :class:`Preempted` when
    the process's guard is inside an interruptible block and a stop was requested (on any
    host); otherwise returns at once. Called by the sampler once per decode chunk and by
    the agent loop once per scheduler tick."""
    if _active is not None:
        _active.check()
