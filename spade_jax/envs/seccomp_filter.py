"""The seccomp filter loaded into every sandbox worker (stdlib + pyseccomp only).

Default-allow with an explicit deny list returning EPERM: a default-deny list would have to
track every syscall a CPython build happens to use, while the deny list names the
capabilities a program must never have. Denied: creating processes or threads, exec,
signals (kill() and the async-I/O owner paths of fcntl/ioctl that make the kernel send
one), advisory locks and leases (a channel between workers), sockets and socket messaging, ptrace and cross-process memory access, every way to
create, write, truncate, rename or delete a file, SysV/POSIX IPC (which would let two
workers share state), namespace and mount changes, io_uring/bpf/perf/userfaultfd, and
changing scheduling or limits of other processes. Syscalls of a foreign architecture (e.g.
32-bit `int 0x80`) kill the process: libseccomp's default bad-arch action.
"""

from __future__ import annotations

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
    # other processes' scheduling (all workers share one uid)
    "setpriority", "sched_setscheduler", "sched_setparam", "sched_setattr", "ioprio_set",
    "migrate_pages", "move_pages", "mbind", "set_mempolicy",
)  # fmt: skip

# fcntl() commands denied: async-I/O owners and signals (F_SETOWN + F_SETSIG + O_ASYNC
# makes the kernel signal any pid of the same uid when the fd becomes ready), leases and
# directory notifications (signals), and every record-lock command (a lock or a lock query
# on a shared read-only file is a channel between workers).
_F_GETLK, _F_SETLK, _F_SETLKW, _F_SETOWN, _F_SETSIG, _F_SETOWN_EX = 5, 6, 7, 8, 10, 15
_F_OFD_GETLK, _F_OFD_SETLK, _F_OFD_SETLKW = 36, 37, 38
_F_SETLEASE, _F_GETLEASE, _F_NOTIFY = 1024, 1025, 1026
DENIED_FCNTL: tuple[int, ...] = (
    _F_GETLK, _F_SETLK, _F_SETLKW, _F_SETOWN, _F_SETSIG, _F_SETOWN_EX,
    _F_OFD_GETLK, _F_OFD_SETLK, _F_OFD_SETLKW, _F_SETLEASE, _F_GETLEASE, _F_NOTIFY,
)  # fmt: skip
# ioctl() requests that set a signal owner or async mode: FIOSETOWN, SIOCSPGRP, FIOASYNC,
# TIOCSPGRP.
DENIED_IOCTL: tuple[int, ...] = (0x8901, 0x8902, 0x5452, 0x5410)
_F_SETFL = 4

# open()/openat() flags that create or modify a file.
_WRITE_FLAGS = (os.O_WRONLY, os.O_RDWR, os.O_CREAT, os.O_TRUNC, os.O_APPEND)
_PR_SET_DUMPABLE = 4


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
    for flag in _WRITE_FLAGS:
        for name, flags_arg in (("open", 1), ("openat", 2)):
            try:
                sandbox.add_rule(deny, name, sc.Arg(flags_arg, sc.MASKED_EQ, flag, flag))
                added += 1
            except (OSError, RuntimeError, ValueError):
                pass
    for command in DENIED_FCNTL:
        sandbox.add_rule(deny, "fcntl", sc.Arg(1, sc.EQ, command))
    # F_SETFL with O_ASYNC (the other flags, e.g. O_NONBLOCK, stay allowed).
    sandbox.add_rule(
        deny, "fcntl", sc.Arg(1, sc.EQ, _F_SETFL), sc.Arg(2, sc.MASKED_EQ, os.O_ASYNC, os.O_ASYNC)
    )
    for request in DENIED_IOCTL:
        sandbox.add_rule(deny, "ioctl", sc.Arg(1, sc.EQ, request))
    added += len(DENIED_FCNTL) + 1 + len(DENIED_IOCTL)
    # prlimit64 on another pid could starve a sibling worker; on itself it can only lower.
    sandbox.add_rule(deny, "prlimit64", sc.Arg(0, sc.NE, 0))
    # Re-enabling core dumps / ptrace access to this process is never needed.
    sandbox.add_rule(deny, "prctl", sc.Arg(0, sc.EQ, _PR_SET_DUMPABLE))
    sandbox.add_rule(deny, "sched_setaffinity", sc.Arg(0, sc.NE, 0))
    added += 3
    sandbox.load()
    return added
