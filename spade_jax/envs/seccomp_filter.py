"""The seccomp filter loaded into every sandbox worker (stdlib + pyseccomp only).

Default-allow with an explicit deny list returning EPERM: a default-deny list would have to
track every syscall a CPython build happens to use, while the deny list names the
capabilities a program must never have. Denied: creating processes or threads, exec,
signals (kill() and the async-I/O owner paths of fcntl/ioctl that make the kernel send
one), advisory locks and leases (a channel between workers), sockets and socket messaging,
ptrace and cross-process memory access, every way to create, write, truncate, rename or
delete a file, SysV/POSIX IPC and memfd (which would let two workers share state or hide
memory), namespace and mount changes, io_uring/bpf/perf/userfaultfd, changing scheduling
or limits of other processes, and every call that answers a question about another
process or user (getpgid, getsid, getpriority incl. PRIO_USER, sched_get*, the CPU clock of
a pid, ...): a worker can name no other process and no other uid. Syscalls of a foreign
architecture (e.g. 32-bit `int 0x80`) kill the process: libseccomp's default bad-arch
action.

Argument widths: a rule compares a 64-bit register, but the kernel reads `int` arguments
(fcntl's command, ioctl's request, a pid, a clock id) as their low 32 bits, so
`fcntl(fd, (1 << 32) | F_SETLK)` is a lock to the kernel and no match for a rule that
compares the whole register with F_SETLK. Every rule with an argument condition is written
in one of three forms that cannot be walked past that way (`Condition.kind`): the low 32
bits equal a value, a flag bit set (the mask drops the high bits), or "not zero" over the
whole register (which refuses every high-bit variant of the one allowed value, 0).
`ARG_RULES` lists them; `tests/envs/test_seccomp_widths.py` sends the high-bit variant of
each and expects EPERM.
"""

from __future__ import annotations

import dataclasses
import errno
import os

# Denied outright.
DENIED_SYSCALLS: tuple[str, ...] = (
    # processes, threads, exec
    "fork", "vfork", "clone", "clone3", "execve", "execveat",
    # signals to anyone (a worker never needs to signal; the parent kills it)
    "kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo",
    "pidfd_open", "pidfd_send_signal", "pidfd_getfd",
    # advisory locks: a lock on a file every worker can read would tell copies of one
    # program apart (fcntl's lock commands are filtered below)
    "flock",
    # sockets (the channel is an inherited socketpair used with read/write)
    "socket", "socketpair", "connect", "bind", "listen", "accept", "accept4",
    "sendto", "sendmsg", "sendmmsg", "recvmsg", "recvmmsg", "setsockopt",
    # tracing and other processes' memory
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "process_madvise",
    # filesystem writes (open/openat with write flags are filtered below)
    "creat", "openat2", "truncate", "ftruncate", "fallocate",
    "rename", "renameat", "renameat2", "unlink", "unlinkat", "rmdir", "mkdir", "mkdirat",
    "link", "linkat", "symlink", "symlinkat", "mknod", "mknodat",
    "chmod", "fchmod", "fchmodat", "chown", "fchown", "lchown", "fchownat",
    "utime", "utimes", "utimensat", "futimesat",
    "setxattr", "lsetxattr", "fsetxattr", "removexattr", "lremovexattr", "fremovexattr",
    "name_to_handle_at", "open_by_handle_at", "memfd_create", "memfd_secret",
    # IPC that could carry state between workers
    "shmget", "shmat", "shmctl", "semget", "semop", "semtimedop", "semctl",
    "msgget", "msgsnd", "msgrcv", "msgctl", "mq_open", "mq_unlink", "mq_timedsend",
    # namespaces, mounts, kernel facilities
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "mount_setattr",
    "fsopen", "fsconfig", "fsmount", "fspick", "move_mount", "open_tree",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "bpf", "perf_event_open",
    "userfaultfd", "keyctl", "add_key", "request_key", "fanotify_init", "inotify_init",
    "inotify_init1", "init_module", "finit_module", "delete_module", "kexec_load",
    "kexec_file_load", "reboot", "acct", "quotactl", "swapon", "swapoff", "syslog",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "sethostname",
    "setdomainname", "ioperm", "iopl", "personality", "vhangup",
    # other processes' scheduling
    "setpriority", "sched_setscheduler", "sched_setparam", "sched_setattr", "ioprio_set",
    "migrate_pages", "move_pages", "mbind", "set_mempolicy",
    # oracles on other processes and users: getpriority(PRIO_USER, uid) and ioprio_get
    # answer "is some process running as this uid", capget reads any pid's capabilities,
    # setpgid probes process groups. A game needs none of them.
    "getpriority", "ioprio_get", "capget", "capset", "setpgid",
    # process attributes: every option a worker needs (no_new_privs, not dumpable, the
    # parent-death signal) is set before the filter loads; PR_SET_DUMPABLE would re-open
    # the worker to inspection, PR_SET_PTRACER to tracing.
    "prctl",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Condition:
    """One argument test of a rule, in a form whose high 32 bits cannot fool it.

    kind "low32": the low 32 bits (what the kernel reads for an `int` argument) equal
      `value`. kind "bits": every bit of `value` is set (a flag; the high bits are masked
      away). kind "nonzero": the whole 64-bit register is not 0: the one value allowed is
      0 itself ("this process"), so a high-bit variant of 0 is refused too.
    """

    arg: int
    kind: str
    value: int = 0


@dataclasses.dataclass(frozen=True)
class ArgRule:
    """Deny `syscall` with EPERM when every condition holds. `name` is a stable id."""

    name: str
    syscall: str
    conditions: tuple[Condition, ...]


# fcntl() commands denied: async-I/O owners and signals (F_SETOWN + F_SETSIG + O_ASYNC
# makes the kernel signal any pid of the same uid when the fd becomes ready), leases and
# directory notifications (signals), and every record-lock command (a lock or a lock query
# on a shared read-only file is a channel between workers).
FCNTL_COMMANDS: dict[str, int] = {
    "F_GETLK": 5, "F_SETLK": 6, "F_SETLKW": 7, "F_SETOWN": 8, "F_SETSIG": 10,
    "F_SETOWN_EX": 15, "F_OFD_GETLK": 36, "F_OFD_SETLK": 37, "F_OFD_SETLKW": 38,
    "F_SETLEASE": 1024, "F_GETLEASE": 1025, "F_NOTIFY": 1026,
}  # fmt: skip
F_SETFL = 4
# ioctl() requests that set a signal owner or async mode, or push input into a terminal.
IOCTL_REQUESTS: dict[str, int] = {
    "FIOSETOWN": 0x8901, "SIOCSPGRP": 0x8902, "FIOASYNC": 0x5452, "TIOCSPGRP": 0x5410,
    "TIOCSTI": 0x5412,
}  # fmt: skip
# open()/openat() flags that create or modify a file.
WRITE_FLAGS: dict[str, int] = {
    "O_WRONLY": os.O_WRONLY, "O_RDWR": os.O_RDWR, "O_CREAT": os.O_CREAT,
    "O_TRUNC": os.O_TRUNC, "O_APPEND": os.O_APPEND,
}  # fmt: skip
# Calls whose first argument is a pid: allowed on pid 0 (this process) only. On another
# pid each answers whether it exists (a pid oracle) or changes it.
SELF_ONLY: tuple[str, ...] = (
    "prlimit64", "sched_setaffinity", "sched_getaffinity", "sched_getparam",
    "sched_getscheduler", "sched_rr_get_interval", "sched_getattr", "getpgid", "getsid",
    "get_robust_list",
)  # fmt: skip
# Calls whose first argument is a clock id: a negative id is the CPU clock of a pid
# (`clock_getcpuclockid`), readable for any process of the namespace; bit 31 of the
# 32-bit id is its sign.
CLOCK_CALLS: tuple[str, ...] = ("clock_gettime", "clock_getres", "clock_nanosleep", "timer_create")
_SIGN_BIT_32 = 1 << 31


def _arg_rules() -> tuple[ArgRule, ...]:
    rules = []
    for flag, value in WRITE_FLAGS.items():
        for syscall, index in (("open", 1), ("openat", 2)):
            rules.append(ArgRule(f"{syscall}_{flag}", syscall, (Condition(index, "bits", value),)))
    for command, value in FCNTL_COMMANDS.items():
        rules.append(ArgRule(f"fcntl_{command}", "fcntl", (Condition(1, "low32", value),)))
    # F_SETFL with O_ASYNC (the other flags, e.g. O_NONBLOCK, stay allowed).
    rules.append(ArgRule("fcntl_F_SETFL_O_ASYNC", "fcntl", (
        Condition(1, "low32", F_SETFL), Condition(2, "bits", os.O_ASYNC))))
    for request, value in IOCTL_REQUESTS.items():
        rules.append(ArgRule(f"ioctl_{request}", "ioctl", (Condition(1, "low32", value),)))
    for syscall in SELF_ONLY:
        rules.append(ArgRule(f"{syscall}_other_pid", syscall, (Condition(0, "nonzero"),)))
    for syscall in CLOCK_CALLS:
        rules.append(ArgRule(f"{syscall}_pid_clock", syscall,
                             (Condition(0, "bits", _SIGN_BIT_32),)))
    return tuple(rules)


ARG_RULES: tuple[ArgRule, ...] = _arg_rules()


def _seccomp_arg(sc, condition: Condition):
    if condition.kind == "low32":
        return sc.Arg(condition.arg, sc.MASKED_EQ, 0xFFFFFFFF, condition.value)
    if condition.kind == "bits":
        return sc.Arg(condition.arg, sc.MASKED_EQ, condition.value, condition.value)
    if condition.kind == "nonzero":
        return sc.Arg(condition.arg, sc.NE, 0)
    raise ValueError(f"unknown condition kind {condition.kind!r}")


def load_filter() -> int:
    """Builds and loads the filter into this process; returns the number of rules added.

    Raises ImportError if pyseccomp/libseccomp is missing and OSError if loading fails;
    the worker reports either in its hello message and the supervisor then marks the
    seccomp layer missing.
    """
    import pyseccomp as sc

    deny = sc.ERRNO(errno.EPERM)
    sandbox = sc.SyscallFilter(defaction=sc.ALLOW)
    added = 0
    for name in DENIED_SYSCALLS:
        try:
            sandbox.add_rule(deny, name)
            added += 1
        except (OSError, RuntimeError, ValueError):
            pass  # syscall absent on this architecture (e.g. fork on aarch64)
    for rule in ARG_RULES:
        try:
            sandbox.add_rule(deny, rule.syscall, *(_seccomp_arg(sc, c) for c in rule.conditions))
            added += 1
        except (OSError, RuntimeError, ValueError):
            if rule.syscall != "open":  # open() is absent on aarch64; every other must load
                raise
    sandbox.load()
    return added
