"""Seccomp rules compare what the kernel reads, not the whole register.

The kernel reads `int` arguments (fcntl's command, ioctl's request, a pid, a clock id) as
their low 32 bits, so a rule that compares the 64-bit register with, say, F_SETLK misses
`fcntl(fd, (1 << 32) | F_SETLK)`, which is a lock to the kernel. For every rule of
`seccomp_filter.ARG_RULES` (and the calls denied outright because no game needs them), a
hostile program sends the high-bit variant from inside a worker: with the filter it gets
EPERM; in a worker without the filter the same call is not refused with EPERM (the kernel
takes it), which shows the refusal is the filter's.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import warnings

import pytest

from spade_jax.envs import EnvPool, SandboxConfig
from spade_jax.envs.seccomp_filter import ARG_RULES, FCNTL_COMMANDS, IOCTL_REQUESTS, WRITE_FLAGS

pyseccomp = pytest.importorskip("pyseccomp")

HIGH = 1 << 32
# The CPU clock of the calling process (clock_getcpuclockid(0)): ((~0) << 3) | 2, as the
# 32-bit value the kernel reads, with a high bit set on top.
OWN_CPU_CLOCK = HIGH | (-6 & 0xFFFFFFFF)
AT_FDCWD = -100

# Argument tokens the program resolves inside the worker: a read-only fd of /dev/null,
# the read end of a pipe, a directory fd, a zeroed 256-byte buffer (or one of ones), a
# struct f_owner_ex naming the worker itself, the path /dev/null, its own pid.
_FCNTL_ARG = {"F_GETLK": "buf", "F_SETLK": "buf", "F_SETLKW": "buf", "F_SETOWN": "self",
              "F_SETSIG": 0, "F_SETOWN_EX": "owner", "F_OFD_GETLK": "buf",
              "F_OFD_SETLK": "buf", "F_OFD_SETLKW": "buf", "F_SETLEASE": 2,
              "F_GETLEASE": 0, "F_NOTIFY": 0}  # fmt: skip
_FCNTL_FD = {"F_SETOWN": "pipe", "F_SETSIG": "pipe", "F_SETOWN_EX": "pipe", "F_NOTIFY": "dir"}

CALLS: dict[str, tuple[str, list]] = {
    **{f"{call}_{flag}": (call, ([AT_FDCWD] if call == "openat" else []) + ["path", HIGH | v, 0])
       for flag, v in WRITE_FLAGS.items() for call in ("open", "openat")},
    **{f"fcntl_{cmd}": ("fcntl", [_FCNTL_FD.get(cmd, "fd"), HIGH | v, _FCNTL_ARG[cmd]])
       for cmd, v in FCNTL_COMMANDS.items()},
    "fcntl_F_SETFL_O_ASYNC": ("fcntl", ["pipe", HIGH | 4, HIGH | 0o20000]),
    **{f"ioctl_{req}": ("ioctl", ["pipe", HIGH | v, "buf"]) for req, v in IOCTL_REQUESTS.items()},
    "prlimit64_other_pid": ("prlimit64", [HIGH, 7, 0, "buf"]),
    "sched_setaffinity_other_pid": ("sched_setaffinity", [HIGH, 8, "ones"]),
    "sched_getaffinity_other_pid": ("sched_getaffinity", [HIGH, 128, "buf"]),
    "sched_getparam_other_pid": ("sched_getparam", [HIGH, "buf"]),
    "sched_getscheduler_other_pid": ("sched_getscheduler", [HIGH]),
    "sched_rr_get_interval_other_pid": ("sched_rr_get_interval", [HIGH, "buf"]),
    "sched_getattr_other_pid": ("sched_getattr", [HIGH, "buf", 48, 0]),
    "getpgid_other_pid": ("getpgid", [HIGH]),
    "getsid_other_pid": ("getsid", [HIGH]),
    "get_robust_list_other_pid": ("get_robust_list", [HIGH, "buf", "buf2"]),
    "clock_gettime_pid_clock": ("clock_gettime", [OWN_CPU_CLOCK, "buf"]),
    "clock_getres_pid_clock": ("clock_getres", [OWN_CPU_CLOCK, "buf"]),
    "clock_nanosleep_pid_clock": ("clock_nanosleep", [OWN_CPU_CLOCK, 1, "buf", 0]),
    "timer_create_pid_clock": ("timer_create", [OWN_CPU_CLOCK, 0, "buf"]),
}  # fmt: skip
# Denied outright (no argument condition to walk past), with a high-bit argument anyway:
# re-enabling dumpable, PRIO_USER / IOPRIO_WHO_USER scans over uids.
OUTRIGHT = {
    "prctl_dumpable": ("prctl", [HIGH | 4, 1, 0, 0, 0]),
    "getpriority_user": ("getpriority", [HIGH | 2, 0]),
    "ioprio_get_user": ("ioprio_get", [HIGH | 3, 0]),
}
# Honest calls that must stay allowed next to the rules (the masks must not over-reach).
ALLOWED = {
    "fcntl_F_GETFL": ("fcntl", ["fd", 3, 0]),
    "fcntl_F_SETFL_O_NONBLOCK": ("fcntl", ["pipe", 4, 0o4000]),
    "ioctl_FIOCLEX": ("ioctl", ["fd", 0x5451, 0]),
    "open_read_only": ("open", ["path", 0, 0]),
    "sched_getaffinity_self": ("sched_getaffinity", [0, 128, "buf"]),
    "clock_gettime_monotonic": ("clock_gettime", [1, "buf"]),
    "clock_gettime_process_cputime": ("clock_gettime", [2, "buf"]),
    "getpgid_self": ("getpgid", [0]),
}

# Runs each (syscall, args) with libc.syscall and full 64-bit arguments; reports errno
# (0: the call succeeded). Reached through sys.modules: the static gate is off.
PROGRAM = """
import sys
CALLS = @calls@

class Environment:
    def reset(self, seed=None):
        os, ctypes = sys.modules['os'], sys.modules['ctypes']
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        null = os.open('/dev/null', os.O_RDONLY)
        pipe_r, pipe_w = os.pipe()
        folder = os.open('/', os.O_RDONLY)
        path = ctypes.create_string_buffer(b'/dev/null')
        keep = []
        out = {}
        for name, (nr, args) in CALLS.items():
            values = []
            for a in args:
                if a == 'fd': a = null
                elif a == 'pipe': a = pipe_r
                elif a == 'dir': a = folder
                elif a == 'self': a = os.getpid()
                elif a == 'path': a = ctypes.addressof(path)
                elif a in ('buf', 'buf2', 'ones', 'owner'):
                    buf = ctypes.create_string_buffer(b'\\xff' * 8 if a == 'ones' else 256)
                    if a == 'owner':
                        ctypes.memmove(buf, (1).to_bytes(4, 'little')
                                       + os.getpid().to_bytes(4, 'little'), 8)
                    keep.append(buf)
                    a = ctypes.addressof(buf)
                values.append(ctypes.c_long(a if a < 2 ** 63 else a - 2 ** 64))
            ctypes.set_errno(0)
            rc = libc.syscall(ctypes.c_long(nr), *values)
            out[name] = 0 if rc >= 0 else ctypes.get_errno()
            if rc > 2 and nr in (@opens@):
                os.close(rc)
        return json.dumps(out), {}

    def step(self, action):
        return 'x', 0.0, True, False, {}
"""


def _program(calls: dict[str, tuple[str, list]]) -> str:
    native = pyseccomp.Arch.NATIVE
    numbered = {name: (pyseccomp.resolve_syscall(native, call), args)
                for name, (call, args) in calls.items()}
    opens = ", ".join(str(pyseccomp.resolve_syscall(native, c)) for c in ("open", "openat"))
    return ("import json\n" + PROGRAM).replace("@calls@", repr(numbered)).replace("@opens@", opens)


def _errnos(config: SandboxConfig, calls: dict) -> dict[str, int]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the unfiltered pool is "weak"
        with EnvPool(config) as pool:
            if not config.use_seccomp:
                assert "seccomp" in pool.isolation_report().missing
            elif pool.isolation_report().missing:
                pytest.skip(f"sandbox layers missing here: {pool.isolation_report().missing}")
            handle = pool.open(_program(calls))
            result = handle.reset(0)
            handle.close()
    assert result.ok, result.error
    return json.loads(result.observation)


@pytest.fixture(scope="module")
def errnos():
    config = SandboxConfig(call_deadline_s=10.0, static_gate=False, spare_workers=0)
    every = {**CALLS, **OUTRIGHT, **ALLOWED}
    return {
        "filtered": _errnos(config, every),
        "unfiltered": _errnos(dataclasses.replace(config, use_seccomp=False,
                                                  allow_weak_isolation=True), every),
    }


def test_every_argument_rule_has_a_high_bit_case():
    assert set(CALLS) == {rule.name for rule in ARG_RULES}


@pytest.mark.parametrize("name", sorted({**CALLS, **OUTRIGHT}))
def test_high_bit_variant_is_refused(name, errnos):
    assert errnos["filtered"][name] == errno.EPERM, errnos["filtered"][name]
    # Without the filter the kernel does not refuse it with EPERM: what it reads is a
    # valid call (a lock, a signal owner, this process's own pid or CPU clock, ...).
    assert errnos["unfiltered"][name] != errno.EPERM


@pytest.mark.parametrize("name", sorted(ALLOWED))
def test_honest_calls_stay_allowed(name, errnos):
    assert errnos["filtered"][name] == 0
