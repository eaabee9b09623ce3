"""Owner-only opening of a round's environment copies (spade_jax.spade.env_copies), on a
fake two-host job in one process: two threads, each a host, whose all-gather is a barrier
over shared slots (the real collective's semantics: every host calls it at the same
point and gets every host's value in process order)."""

from __future__ import annotations

import threading

import pytest

from spade_jax import distributed
from spade_jax.rollout.agent_loop import episode_owner
from spade_jax.spade import agreement
from spade_jax.spade.env_copies import CopyGroup, layout_owners, open_owned_copies
from spade_jax.spade.window import VALID, Outcome, Verdict


class _Env:
    def __init__(self, program: str, host: int):
        self.program, self.host, self.closed = program, host, False

    def close(self):
        assert not self.closed, "closed twice"
        self.closed = True


class _Opener:
    """``open_envs`` of one host: fails the listed (program, n-th load on this host)."""

    def __init__(self, host: int, failures: set[tuple[str, int]]):
        self.host, self.failures, self.loads, self.made = host, failures, {}, []

    def __call__(self, program: str, count: int):
        envs = []
        for _ in range(count):
            n = self.loads[program] = self.loads.get(program, 0) + 1
            if (program, n) in self.failures:
                return envs, Verdict(Outcome.LOAD_ERROR, "TimeoutError")
            envs.append(_Env(program, self.host))
            self.made.append(envs[-1])
        return envs, VALID


class _FakeJob:
    """Two hosts in two threads; ``all_gather_json`` and ``failing_hosts`` as collectives."""

    def __init__(self, hosts: int = 2):
        self.hosts, self.barrier = hosts, threading.Barrier(hosts, timeout=30)
        self.slots: list = [None] * hosts
        self.local = threading.local()

    def all_gather_json(self, value):
        self.slots[self.local.host] = value
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before every host has read it
        return out

    def failing_hosts(self, failed: bool) -> list[int]:
        return [h for h, f in enumerate(self.all_gather_json(bool(failed))) if f]

    def run(self, fn) -> list:
        results: list = [None] * self.hosts
        errors: list = []

        def host(h):
            self.local.host = h
            try:
                results[h] = fn(h)
            except BaseException as e:  # surfaced in the test thread
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=host, args=(h,)) for h in range(self.hosts)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


@pytest.fixture
def job(monkeypatch) -> _FakeJob:
    job = _FakeJob()
    monkeypatch.setattr(agreement, "single_host", lambda: False)
    monkeypatch.setattr(distributed, "all_gather_json", job.all_gather_json)
    monkeypatch.setattr(distributed, "failing_hosts", job.failing_hosts)
    return job


GROUPS = [CopyGroup("a", "A", 5), CopyGroup("b", "B", 5), CopyGroup("c", "C", 5),
          CopyGroup("mem", "R", 3)]


def test_each_host_opens_only_the_copies_it_steps(job):
    openers = [_Opener(h, set()) for h in range(2)]
    out = job.run(lambda h: open_owned_copies(GROUPS, openers[h], processes=2, process=h))
    # 18 episodes: host 0 steps the first 9 (a, b's copies 0-3), host 1 the rest.
    assert [len(envs) for envs, _ in out[0]] == [5, 5, 5, 3]
    assert all(v.ok for part in out for _, v in part)
    flat = [[e for envs, _ in part for e in envs] for part in out]
    for i, (e0, e1) in enumerate(zip(*flat, strict=True)):
        owner = episode_owner(i, 18, 2)
        assert ((e0 is not None), (e1 is not None)) == (owner == 0, owner == 1), i
        assert (e0 or e1).host == owner
    assert openers[0].loads == {"A": 5, "B": 4} and openers[1].loads == {"B": 1, "C": 5, "R": 3}
    assert not any(e.closed for o in openers for e in o.made)


def test_a_dropped_group_relays_the_batch_and_moves_copies(job):
    """Host 0 fails its 2nd copy of A (it opens A's first copy: A is dropped everywhere);
    host 1 fails its only copy of B, whose first copy host 0 opened and passed: host 1
    opens it again. The batch without A (13 episodes, host 0 the first 7) moves B's last
    copy and C's first two to host 0: host 1 closes them, host 0 opens them."""
    openers = [_Opener(0, {("A", 2)}), _Opener(1, {("B", 1)})]
    out = job.run(lambda h: open_owned_copies(GROUPS, openers[h], processes=2, process=h))
    for part in out:
        assert part[0] == ([], Verdict(Outcome.LOAD_ERROR, "TimeoutError"))
        assert [v.ok for _, v in part[1:]] == [True, True, True]
    owners = layout_owners([5, 5, 5, 3], [False, True, True, True], 2)
    assert owners[1:] == [[0] * 5, [0, 0, 1, 1, 1], [1] * 3]
    for h, part in enumerate(out):
        for (envs, _), group_owners in zip(part[1:], owners[1:], strict=True):
            assert [e is not None for e in envs] == [o == h for o in group_owners]
            assert all(not e.closed and e.host == h for e in envs if e is not None)
    assert openers[0].loads == {"A": 2, "B": 5, "C": 2}
    assert openers[1].loads == {"B": 2, "C": 5, "R": 3}
    # Everything opened and not handed out was closed: A's copy on host 0, B's retried
    # copy and C's first two on host 1.
    for h, part in enumerate(out):
        kept = {id(e) for envs, _ in part for e in envs if e is not None}
        leftover = [e for e in openers[h].made if id(e) not in kept]
        assert all(e.closed for e in leftover)
        assert sorted(e.program for e in leftover) == (["A"] if h == 0 else ["B", "C", "C"])


def test_one_host_opens_everything_and_drops_what_fails():
    opener = _Opener(0, {("C", 3)})
    out = open_owned_copies(GROUPS, opener, processes=1, process=0)
    assert [(len(envs), v.ok) for envs, v in out] == [(5, True), (5, True), (0, False), (3, True)]
    assert opener.loads == {"A": 5, "B": 5, "C": 3, "R": 3}
    assert [e.closed for e in opener.made if e.program == "C"] == [True, True]


def test_a_host_that_cannot_reopen_stops_both_hosts(job, monkeypatch):
    import jax

    monkeypatch.setattr(jax, "process_index", lambda: job.local.host)
    openers = [_Opener(0, set()), _Opener(1, {("B", 1), ("B", 2)})]
    with pytest.raises(RuntimeError, match=r"host\(s\) \[1\]"):
        job.run(lambda h: open_owned_copies(GROUPS, openers[h], processes=2, process=h))
