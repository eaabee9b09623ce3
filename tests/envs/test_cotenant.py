"""Co-tenants: programs sharing one pool cannot signal, kill or sense each other.

All hostile programs here run with the static gate off (they reach `ctypes`, `os`, ...
through `sys.modules`, which a gate can be walked past to do): what is tested is the
kernel layers (seccomp, a uid per worker, the pool's liveness check on spare workers).
"""

from __future__ import annotations

import textwrap
import time

import pytest

from spade_jax.envs import EnvPool, SandboxConfig, supervisor
from spade_jax.envs.pool import arm_order
from spade_jax.envs.results import SandboxError

HONEST = """
import random

class Environment:
    def reset(self, seed=None):
        self.rng = random.Random(seed)
        self.t = 0
        return f"start {seed}", {}

    def step(self, action):
        self.t += 1
        return f"t={self.t} {self.rng.randint(0, 9)}", 0.0, self.t >= 3, False, {}
"""


def _hostile(reset_body: str) -> str:
    """A paper-contract program whose reset() runs `reset_body` and returns its `out` list."""
    return (
        "import sys\n"
        "class Environment:\n"
        "    def reset(self, seed=None):\n"
        "        out = []\n"
        + textwrap.indent(textwrap.dedent(reset_body), " " * 8)
        + "\n        return ' '.join(str(x) for x in out), {}\n"
        "    def step(self, action):\n"
        "        return 'x', 0.0, True, False, {}\n"
    )


# Every path the kernel offers to deliver a signal to another process of the same uid
# without kill(): an async-I/O owner on a pipe (fcntl F_SETOWN / F_SETOWN_EX + F_SETSIG +
# O_ASYNC, or ioctl FIOSETOWN / SIOCSPGRP + FIOASYNC), then a write that raises the signal;
# and the plain kill()/tgkill() syscalls as a baseline.
SIGNAL_OTHERS = _hostile(
    """\
    import os, ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    me = os.getpid()
    # /proc may hide the others: aim at every small pid (workers are numbered in order).
    targets = [p for p in range(1, 400) if p != me]
    F_SETFL, F_SETOWN, F_SETSIG, F_SETOWN_EX = 4, 8, 10, 15
    FIOSETOWN, SIOCSPGRP, FIOASYNC = 0x8901, 0x8902, 0x5452
    O_ASYNC = 0o20000

    class Owner(ctypes.Structure):
        _fields_ = [('type', ctypes.c_int), ('pid', ctypes.c_int)]

    def arm(pid, how):
        r, w = os.pipe()
        one = ctypes.c_int(1)
        target = ctypes.c_int(pid)
        if how == 'setown':
            rc = libc.fcntl(r, F_SETOWN, pid)
        elif how == 'setown_ex':
            rc = libc.fcntl(r, F_SETOWN_EX, ctypes.byref(Owner(1, pid)))
        elif how == 'fiosetown':
            rc = libc.ioctl(r, FIOSETOWN, ctypes.byref(target))
        else:
            rc = libc.ioctl(r, SIOCSPGRP, ctypes.byref(target))
        rc2 = libc.fcntl(r, F_SETSIG, 9)
        rc3 = libc.fcntl(r, F_SETFL, O_ASYNC) if how.startswith('setown') else libc.ioctl(
            r, FIOASYNC, ctypes.byref(one))
        os.write(w, b'x')
        os.close(r)
        os.close(w)
        return int(rc == 0 and rc2 == 0 and rc3 == 0)

    for how in ('setown', 'setown_ex', 'fiosetown', 'siocspgrp'):
        out.append(how + '=' + str(sum(arm(pid, how) for pid in targets)))
    # Direct paths: kill, tgkill, rt_sigqueueinfo, pidfd_open + pidfd_send_signal, and
    # harming another process without a signal: prlimit64 (CPU limit 0), setpriority,
    # sched_setaffinity. Each entry: the best return code over all targets (0 = worked).
    limit = (ctypes.c_ulong * 2)(0, 0)
    mask = ctypes.c_ulong(1)
    info = ctypes.create_string_buffer(128)
    direct = {
        'kill': lambda pid: libc.kill(pid, 9),
        'tgkill': lambda pid: libc.syscall(234, pid, pid, 9),
        'sigqueue': lambda pid: libc.syscall(129, pid, 9, info),
        'pidfd': lambda pid: libc.syscall(424, libc.syscall(434, pid, 0), 9, None, 0),
        'prlimit': lambda pid: libc.syscall(302, pid, 0, ctypes.byref(limit), None),
        'setpriority': lambda pid: libc.setpriority(0, pid, 19),
        'affinity': lambda pid: libc.sched_setaffinity(pid, 8, ctypes.byref(mask)),
    }
    for name, attack in direct.items():
        out.append(name + '=' + str(max(attack(pid) for pid in targets)))
    """
)


@pytest.fixture(scope="module")
def pool():
    config = SandboxConfig(call_deadline_s=3.0, spare_workers=3, static_gate=False)
    with EnvPool(config) as p:
        if p.isolation_report().missing:
            pytest.skip(f"sandbox layers missing here: {p.isolation_report().missing}")
        yield p


def _play(handle, seed: int) -> list[str]:
    first = handle.reset(seed)
    assert first.ok, first.error
    observations = [first.observation]
    for _ in range(3):
        result = handle.step("go")
        assert result.ok, result.error
        observations.append(result.observation)
    return observations


def test_hostile_cotenant_cannot_kill_honest_workers(pool):
    """A hostile and an honest program in one pool: the honest episodes are unaffected
    (their running workers and the spare workers handed out afterwards)."""
    honest = pool.open_many([HONEST, HONEST])
    expected = [_play(h, 5) for h in honest]
    assert expected[0] == expected[1]
    hostile = pool.open(SIGNAL_OTHERS)
    report = hostile.reset(0)
    assert report.ok, report.error
    counts = dict(item.split("=") for item in report.observation.split())
    # No signal path worked: every attempt to arm an owner was refused, kill() failed.
    assert {counts[k] for k in ("setown", "setown_ex", "fiosetown", "siocspgrp")} == {"0"}
    direct = ("kill", "tgkill", "sigqueue", "pidfd", "prlimit", "setpriority", "affinity")
    assert {counts[k] for k in direct} == {"-1"}, counts
    for handle, before in zip(honest, expected, strict=True):
        assert _play(handle, 5) == before
    # Spares that were forked before the attack are alive when handed out.
    fresh = pool.open_many([HONEST] * (pool.config.spare_workers + 1))
    for handle in fresh:
        assert handle.ok, handle.error
        assert _play(handle, 5) == expected[0]
    for handle in [*honest, *fresh, hostile]:
        handle.close()


def test_a_worker_sees_no_other_process(pool):
    """Own uid + /proc mounted with hidepid: the only pid a worker finds is its own."""
    probe = _hostile("import os\nout.append(sorted(int(p) for p in os.listdir('/proc') "
                     "if p.isdigit()) == [os.getpid()])")
    handles = pool.open_many([probe] * 3)
    assert [h.reset(0).observation for h in handles] == ["True"] * 3
    for handle in handles:
        handle.close()
    assert pool.isolation_report().as_dict()["hidden_processes"]["active"]


def test_workers_run_under_distinct_uids(pool):
    probe = _hostile("import os\nout.append(os.getuid())")
    handles = pool.open_many([probe] * 4)
    uids = [int(h.reset(0).observation) for h in handles]
    assert len(set(uids)) == 4 and 0 not in uids
    for handle in handles:
        handle.close()


def test_pool_replaces_a_dead_spare_before_handing_it_out():
    config = SandboxConfig(call_deadline_s=3.0, spare_workers=2)
    with EnvPool(config) as pool:
        if pool.isolation_report().missing:
            pytest.skip("sandbox layers missing here")
        victims = list(pool._spares)
        for worker in victims:
            assert not isinstance(supervisor.await_hello(worker, 10.0), SandboxError)
            worker.zygote.kill(worker.pid)  # as a co-tenant's signal would, after hello
        time.sleep(0.5)
        handles = pool.open_many([HONEST] * 2)
        for handle in handles:
            assert handle.ok, handle.error
            assert handle.worker not in victims
            assert _play(handle, 1)[0] == "start 1"
            handle.close()


# ----------------------------------------------------------------------------- arms

# Each copy of a program tries to learn its load order through a lock on an object every
# worker can open read-only: flock() on "/" and on a stdlib file, a POSIX read lock
# tested with F_GETLK, an OFD lock, a lease. The first copy would get "1", later "0".
LOCK_ORDER = _hostile(
    """\
    import os, ctypes, struct
    libc = ctypes.CDLL(None, use_errno=True)
    LOCK_EX, LOCK_NB = 2, 4
    F_GETLK, F_SETLK, F_OFD_GETLK, F_OFD_SETLK, F_SETLEASE = 5, 6, 36, 37, 1024
    F_RDLCK, F_WRLCK = 0, 1
    KEEP = getattr(sys, '_keep_fds', [])
    sys._keep_fds = KEEP
    for path in ('/', os.__file__, '/proc/1/stat'):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            out.append('open_failed')
            continue
        KEEP.append(fd)
        out.append('flock=' + str(int(libc.flock(fd, LOCK_EX | LOCK_NB) == 0)))
        for get, put in ((F_GETLK, F_SETLK), (F_OFD_GETLK, F_OFD_SETLK)):
            query = ctypes.create_string_buffer(struct.pack('hhqqi', F_WRLCK, 0, 0, 0, 0), 32)
            got = libc.fcntl(fd, get, query)
            free = got == 0 and struct.unpack('hhqqi', query.raw[:28])[0] == 2  # F_UNLCK
            hold = ctypes.create_string_buffer(struct.pack('hhqqi', F_RDLCK, 0, 0, 0, 0), 32)
            out.append('lk=' + str(int(free)) + str(int(libc.fcntl(fd, put, hold) == 0)))
        out.append('lease=' + str(int(libc.fcntl(fd, F_SETLEASE, F_RDLCK) == 0)))
    """
)


def test_copies_of_a_program_cannot_learn_their_load_order(pool):
    """Arm blindness: n copies opened together (the hint and no-hint arms) see exactly the
    same world; no lock or lease on a shared read-only object is granted to any."""
    handles = pool.open_many([LOCK_ORDER] * 4)
    seen = [h.reset(0).observation for h in handles]
    assert len(set(seen)) == 1, seen
    assert "=1" not in seen[0] and "lk=1" not in seen[0], seen[0]
    for handle in handles:
        handle.close()


def test_arm_order_is_a_seeded_interleaving():
    order = arm_order(4, 4, seed=123)
    assert sorted(order) == [("hint", i) for i in range(4)] + [("no_hint", i) for i in range(4)]
    assert order == arm_order(4, 4, seed=123)
    assert order != arm_order(4, 4, seed=124) or order != arm_order(4, 4, seed=125)
    # Over many seeds the first slot is a hint copy about half the time (no arm first).
    firsts = [arm_order(8, 8, seed=s)[0][0] for s in range(400)]
    assert 150 < firsts.count("hint") < 250


def test_open_many_assigns_workers_in_a_seeded_random_order(pool):
    """With `order_seed`, the worker (and so the pid) of each copy does not follow the
    position in the list: pid rank says nothing about the arm."""
    probe = _hostile("import os\nout.append(os.getpid())")
    ranks = []
    for seed in range(6):
        handles = pool.open_many([probe] * 4, order_seed=seed)
        pids = [int(h.reset(0).observation) for h in handles]
        ranks.append(tuple(sorted(range(4), key=pids.__getitem__)))
        for handle in handles:
            handle.close()
    assert len(set(ranks)) > 1, ranks



# ----------------------------------------------------------------------------- oracles

# Every question a worker could ask the kernel about a pid or a uid, asked for each pid up
# to its own + 64 and each uid of the worker range (and root): an oracle answers
# differently for a pid or uid in use than for a free one. Answers are (return code,
# errno) pairs; `distinct` lists the targets whose answer differs from a surely free one.
ORACLES = _hostile(
    """\
    import os, ctypes, json
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    me, my_uid = os.getpid(), os.getuid()
    buf = ctypes.create_string_buffer(512)
    buf2 = ctypes.create_string_buffer(64)
    nr = @numbers@

    def call(name, *args):
        ctypes.set_errno(0)
        rc = libc.syscall(ctypes.c_long(nr[name]), *[ctypes.c_long(a) for a in args])
        return (int(rc >= 0), ctypes.get_errno() if rc < 0 else 0)

    def capget(pid):
        header = ctypes.create_string_buffer((0x20080522).to_bytes(4, 'little')
                                             + pid.to_bytes(4, 'little', signed=True))
        return call('capget', ctypes.addressof(header), ctypes.addressof(buf))

    def proc(pid):
        try:
            with open(f'/proc/{pid}/stat') as f:
                return (1, len(f.read()) > 0)
        except OSError as err:
            return (0, err.errno)

    A = ctypes.addressof
    by_pid = {
        'getpgid': lambda p: call('getpgid', p),
        'getsid': lambda p: call('getsid', p),
        'sched_getaffinity': lambda p: call('sched_getaffinity', p, 128, A(buf)),
        'sched_getparam': lambda p: call('sched_getparam', p, A(buf)),
        'sched_getscheduler': lambda p: call('sched_getscheduler', p),
        'sched_rr_get_interval': lambda p: call('sched_rr_get_interval', p, A(buf)),
        'sched_getattr': lambda p: call('sched_getattr', p, A(buf), 48, 0),
        'get_robust_list': lambda p: call('get_robust_list', p, A(buf), A(buf2)),
        'getpriority_process': lambda p: call('getpriority', 0, p),
        'getpriority_pgrp': lambda p: call('getpriority', 1, p),
        'ioprio_get_process': lambda p: call('ioprio_get', 1, p),
        'cpu_clock': lambda p: call('clock_gettime', ((~p) << 3) | 2, A(buf)),
        'capget': capget,
        'prlimit64': lambda p: call('prlimit64', p, 7, 0, A(buf)),
        'kill0': lambda p: call('kill', p, 0),
        'pidfd_open': lambda p: call('pidfd_open', p, 0),
        'proc': proc,
    }
    by_uid = {
        'getpriority_user': lambda u: call('getpriority', 2, u),
        'ioprio_get_user': lambda u: call('ioprio_get', 3, u),
    }
    try:
        free_pid = int(open('/proc/sys/kernel/pid_max').read()) - 1
    except OSError:
        free_pid = 32767
    pids = range(1, me + 65)
    uids = [0, *range(@uid_base@, @uid_base@ + @uid_count@)]
    distinct = {}
    for name, ask in by_pid.items():
        free = ask(free_pid)
        distinct[name] = [p for p in pids if p != me and ask(p) != free]
    for name, ask in by_uid.items():
        free = ask(1)
        distinct[name] = [u for u in uids if u != my_uid and ask(u) != free]
    files = {}
    for path in ('/proc/loadavg', '/proc/sys/kernel/ns_last_pid'):
        try:
            files[path] = open(path).read()
        except OSError as err:
            files[path] = type(err).__name__
    try:
        files['pts'] = {n: os.stat('/dev/pts/' + n).st_uid for n in os.listdir('/dev/pts')}
    except OSError as err:
        files['pts'] = type(err).__name__
    try:
        os.close(os.open('/dev/ptmx', os.O_RDONLY))  # a new pty shows up in /dev/pts
        files['ptmx'] = 'opened'
    except OSError as err:
        files['ptmx'] = type(err).__name__
    out.append(json.dumps({'me': me, 'uid': my_uid, 'distinct': distinct, 'files': files}))
    """
)


def test_a_worker_can_name_no_other_process_and_no_other_uid():
    """Siblings (running and spare workers), the zygote and bubblewrap's init share the
    pid namespace; none of them answers any question a worker can ask: every pid but
    its own and every uid but its own looks free."""
    import json

    pyseccomp = pytest.importorskip("pyseccomp")
    names = ("getpgid", "getsid", "sched_getaffinity", "sched_getparam", "sched_getscheduler",
             "sched_rr_get_interval", "sched_getattr", "get_robust_list", "getpriority",
             "ioprio_get", "clock_gettime", "capget", "prlimit64", "kill", "pidfd_open")
    numbers = {n: pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, n) for n in names}
    config = SandboxConfig(call_deadline_s=60.0, spare_workers=2, static_gate=False,
                           worker_uid_base=400_000, worker_uid_count=2_000)
    source = (ORACLES.replace("@numbers@", repr(numbers))
              .replace("@uid_base@", "400000").replace("@uid_count@", "2000"))
    with EnvPool(config) as pool:
        if pool.isolation_report().missing:
            pytest.skip(f"sandbox layers missing here: {pool.isolation_report().missing}")
        siblings = pool.open_many([HONEST] * 2)
        for handle in siblings:
            assert handle.reset(0).ok
        probes = pool.open_many([source] * 2)
        seen = []
        for probe in probes:
            result = probe.reset(0)
            assert result.ok, result.error
            seen.append(json.loads(result.observation))
        for handle in (*siblings, *probes):
            handle.close()
    for report in seen:
        assert {name: found for name, found in report["distinct"].items() if found} == {}
        files = report["files"]
        assert files["pts"] == "FileNotFoundError" and files["ptmx"] == "FileNotFoundError"
        for path in ("/proc/loadavg", "/proc/sys/kernel/ns_last_pid"):
            assert files[path] in ("PermissionError", ""), files[path]
    assert seen[0]["uid"] != seen[1]["uid"]
