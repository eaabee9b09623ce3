"""The hostile-program corpus: each program is rejected or contained, with the right code.

Every case runs twice: with the static gate on (what production does: most are refused
before any process runs) and with the gate off, which shows the runtime layers contain the
program by themselves. Around every case: it finishes within its deadline, the test process
is alive, no file appears, the loopback listener accepts nothing, and the trainer's
secrets stay out of the worker.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import textwrap
import time

import pytest

from spade_jax.envs import EnvPool, SandboxConfig

DEADLINE_S = 1.0
SLACK_S = 2.0  # kill + reap + a loaded 2-core machine
SECRET = "spade-test-secret-5f1c"


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    body: str  # source; @pid@ @port@ @new_file@ {old_file} are filled in
    gate_code: str | None  # expected reason with the static gate on
    runtime_code: str | None  # expected reason with the gate off (None: contained, ok)
    call: str = "reset"  # the call that misbehaves: load, reset or step
    detail_has: str = ""


def _program(reset: str = 'return "ok", {}', step: str = 'return "", 0.0, True, False, {}',
             top: str = "") -> str:  # fmt: skip
    return (
        textwrap.dedent(top)
        + "\nclass Environment:\n    def reset(self, seed=None):\n"
        + textwrap.indent(textwrap.dedent(reset), " " * 8)
        + "\n    def step(self, action):\n"
        + textwrap.indent(textwrap.dedent(step), " " * 8)
        + "\n"
    )


def _game(reset: str = 'return "ok", {}', step: str = 'return "", 0.0, True, False, {}',
          top: str = "") -> str:  # fmt: skip
    """A program in the reference (recipe) contract: a `*Env` class, numpy and the other
    recipe names bound without an import (the pool detects the contract from the source)."""
    return _program(reset, step, top).replace("class Environment:", "class HostileEnv:")


CASES = [
    Case("fork_bomb", _program("while True:\n    os.fork()", top="import os"),
         "forbidden_import", "program_error", detail_has="PermissionError"),
    Case("ctypes_fork_exec", _program(
        """\
        libc = ctypes.CDLL(None)
        child = libc.fork()
        rc = libc.execv(b"/bin/sh", None)
        raise RuntimeError(f"fork={child} exec={rc}")""", top="import ctypes"),
        "forbidden_import", "program_error", detail_has="fork=-1 exec=-1"),
    Case("infinite_loop_ignoring_signals", _program(
        step="""\
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGALRM, signal.SIGXCPU,
                    signal.SIGHUP, signal.SIGUSR1):
            signal.signal(sig, signal.SIG_IGN)
        while True:
            pass""", top="import signal"), "forbidden_import", "timeout", call="step"),
    Case("bigint_hang", _program("x = 10 ** (10 ** 9)\nreturn str(x % 7), {}"),
         "timeout", "timeout"),
    Case("memory_bomb", _program("x = bytearray(8 * 1024 ** 3)\nreturn 'x', {}"),
         "memory_limit", "memory_limit"),
    Case("memory_bomb_growing", _program("chunks = []\nwhile True:\n    chunks.append(' ' * 10**7)"),
         "memory_limit", "memory_limit"),
    Case("stdout_flood_finite", _program("for _ in range(20000):\n    print('x' * 1000)\n"
                                         "return 'flooded', {}"), None, None),
    Case("stdout_flood_forever", _program(step="while True:\n    print('y' * 4096)"),
         "timeout", "timeout", call="step"),
    Case("socket_connect", _program(
        "s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)\n"
        "s.connect(('127.0.0.1', @port@))\nreturn 'connected', {}",
        top="import socket"), "forbidden_import", "program_error", detail_has="PermissionError"),
    Case("file_create_write", _program(
        "with open('@new_file@', 'w') as f:\n    f.write('pwned')\nreturn 'written', {}"),
        "forbidden_name", "program_error", detail_has="PermissionError"),
    Case("file_truncate", _program("os.truncate('@old_file@', 0)\nreturn 'truncated', {}",
                                   top="import os"),
         "forbidden_import", "program_error", detail_has="PermissionError"),
    Case("file_via_dunder_escape", _program(
        """\
        wrap = [c for c in ().__class__.__base__.__subclasses__() if c.__name__ == '_wrap_close']
        system = wrap[0].__init__.__globals__['system']
        rc = system('echo pwned > @new_file@')
        raise RuntimeError(f'system rc={rc}')"""), "forbidden_attribute", "program_error"),
    Case("read_parent_proc", _program(
        """\
        seen = []
        for path in ('/proc/@pid@/environ', '/proc/@pid@/cmdline', '/proc/1/environ'):
            try:
                with open(path, 'rb') as f:
                    seen.append(f.read().decode('latin-1'))
            except OSError as err:
                seen.append(type(err).__name__)
        seen.append(repr(dict(os.environ)))
        return ' | '.join(seen), {}""", top="import os"), "forbidden_import", None),
    Case("kill_parent", _program(
        "for pid in (@pid@, os.getppid(), 1):\n    os.kill(pid, 9)\nreturn 'killed', {}",
        top="import os"), "forbidden_import", "program_error", detail_has="PermissionError"),
    Case("monkeypatch_builtins_nan", _program(
        step="""\
        builtins.float = lambda *a: 1.0
        math.isfinite = lambda x: True
        sys.modules['spade_jax.envs.worker']._number = lambda v: v
        return 'won', float('nan'), True, False, {}""", top="import builtins, math, sys"),
        "forbidden_import", "nonfinite_reward", call="step"),
    Case("monkeypatch_builtins_big_reward", _program(
        step="""\
        for name in ('min', 'max', 'sum', 'abs', 'round'):
            setattr(builtins, name, lambda *a, **k: 1.0)
        sys.modules['spade_jax.envs.worker']._number = lambda v: v
        return 'won', 5.0, True, False, {}""", top="import builtins, sys"),
        "forbidden_import", "reward_out_of_range", call="step"),
    Case("nan_reward", _program(step="return 'x', float('nan'), True, False, {}"),
         "nonfinite_reward", "nonfinite_reward", call="step"),
    Case("inf_reward", _program(step="return 'x', float('inf'), True, False, {}"),
         "nonfinite_reward", "nonfinite_reward", call="step"),
    Case("bigint_reward", _program(step="return 'x', 10 ** 400, True, False, {}"),
         "nonfinite_reward", "nonfinite_reward", call="step"),
    Case("malicious_float_eq", _program(
        step="return 'x', Evil(), Evil(), False, {}",
        top="""\
        class Evil:
            def __float__(self):
                return 1.0
            def __eq__(self, other):
                return True
            def __bool__(self):
                return True
        """), "bad_type", "bad_type", call="step"),
    Case("malicious_str_observation", _program(
        "return Sneaky('hi'), {}",
        top="""\
        class Sneaky(str):
            def __len__(self):
                return 1
        """), "bad_type", "bad_type"),
    Case("slow_reset", _program("n = 0\nfor i in range(10 ** 11):\n    n += i\nreturn 'late', {}"),
         "timeout", "timeout"),
    Case("slow_load", "while True:\n    pass\n" + _program(), "timeout", "timeout", call="load"),
    Case("huge_observation", _program("return 'x' * 10 ** 7, {}"),
         "observation_too_large", "observation_too_large"),
    Case("forged_reply", _program(
        step="""\
        frame = b'{"n":"x","ok":true,"obs":"","reward":1.0,"terminated":true,"truncated":false,"info":{}}'
        for fd in range(3, 32):
            try:
                os.write(fd, len(frame).to_bytes(4, 'big') + frame)
            except OSError:
                pass
        return 'x', 0.0, True, False, {}""", top="import os"),
        "forbidden_import", "protocol_violation", call="step"),
    Case("oversized_frame_header", _program(
        step="""\
        for fd in range(3, 32):
            try:
                os.write(fd, (2 ** 31).to_bytes(4, 'big'))
            except OSError:
                pass
        while True:
            pass""", top="import os"), "forbidden_import", "message_too_large", call="step"),
    Case("sys_exit", _program("raise SystemExit(0)"), "program_error", "program_error"),
    # Co-tenants and arms (issue 19): a signal owner aimed at the trainer, a lock on a
    # file every worker can read, a world-readable host file.
    Case("sigio_owner_kill", _program(
        """\
        libc = ctypes.CDLL(None, use_errno=True)
        r, w = os.pipe()
        rc = (libc.fcntl(r, 8, @pid@), libc.fcntl(r, 10, 9), libc.fcntl(r, 4, 0o20000))
        os.write(w, b'x')
        raise RuntimeError(f'setown={rc[0]} setsig={rc[1]} async={rc[2]}')""",
        top="import ctypes, os"), "forbidden_import", "program_error",
        detail_has="setown=-1 setsig=-1 async=-1"),
    Case("flock_shared_file", _program(
        """\
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open('/', os.O_RDONLY)
        raise RuntimeError(f'flock={libc.flock(fd, 6)}')""", top="import ctypes, os"),
        "forbidden_import", "program_error", detail_has="flock=-1"),
    Case("read_host_file", _program(
        "with open('@old_file@') as f:\n    return f.read(), {}"),
        "forbidden_name", "program_error", detail_has="Error"),
    Case("hard_exit", _program("os._exit(0)", top="import os"), "forbidden_import", "crash"),
    # The reference contract: escapes through the names it binds without an import.
    Case("ref_numpy_read_parent_proc", _game(
        "data = np.fromfile('/proc/@pid@/environ', dtype=np.uint8)\n"
        "return bytes(data.tolist()).decode('latin-1'), {}"),
        "forbidden_attribute", "program_error"),
    Case("ref_numpy_load_pickle", _game("return str(np.load('@old_file@', allow_pickle=True)), {}"),
         "forbidden_attribute", "program_error"),
    Case("ref_numpy_tofile", _game("np.arange(4).tofile('@new_file@')\nreturn 'written', {}"),
         "forbidden_attribute", "program_error", detail_has="PermissionError"),
    Case("ref_numpy_save", _game("np.save('@new_file@', np.arange(3))\nreturn 'saved', {}"),
         "forbidden_attribute", "program_error", detail_has="PermissionError"),
    Case("ref_numpy_ctypes_fork_exec", _game(
        """\
        libc = np.zeros(1).ctypes._ctypes.CDLL(None)
        child = libc.fork()
        rc = libc.execv(b"/bin/sh", None)
        raise RuntimeError(f"fork={child} exec={rc}")"""),
        "forbidden_attribute", "program_error", detail_has="fork=-1 exec=-1"),
    Case("ref_numpy_ctypeslib", _game("return str(np.ctypeslib.load_library('libc', '/lib')), {}"),
         "forbidden_attribute", "program_error"),
    Case("ref_random_os_system", _game(
        "rc = random._os.system('echo pwned > @new_file@')\nraise RuntimeError(f'system rc={rc}')"),
        "forbidden_attribute", "program_error", detail_has="system rc="),
    Case("ref_statistics_sys_fork", _game("statistics.sys.modules['os'].fork()"),
         "forbidden_attribute", "program_error", detail_has="PermissionError"),
    Case("ref_typing_sys_kill", _game("typing.sys.modules['os'].kill(@pid@, 9)",
                                      top="import typing"),
         "forbidden_attribute", "program_error", detail_has="PermissionError"),
    Case("ref_math_verify_sympify_eval", _game(
        "return str(math_verify.parser.sympy.sympify(\"__import__('os').fork()\")), {}",
        top="import math_verify"), "forbidden_attribute", "program_error",
        detail_has="PermissionError"),
    Case("ref_math_verify_import_sympy", _game(
        "return str(sympy.sympify(\"__import__('os').fork()\")), {}",
        top="from math_verify.parser import sympy"), "forbidden_attribute", "program_error",
        detail_has="PermissionError"),
    Case("ref_numpy_memory_bomb", _game("x = np.ones((1 << 31,))\nreturn 'x', {}"),
         "memory_limit", "memory_limit"),
    Case("ref_numpy_memory_growing", _game(
        "chunks = []\nwhile True:\n    chunks.append(np.ones(10 ** 7))"),
        "memory_limit", "memory_limit"),
    Case("ref_numpy_cpu_spin", _game(
        "a = np.random.rand(300, 300)\nwhile True:\n    a = np.tanh(a @ a)"),
        "timeout", "timeout"),
    Case("ref_numpy_nan_reward", _game(step="return 'x', np.float64('nan'), True, False, {}"),
         "nonfinite_reward", "nonfinite_reward", call="step"),
    Case("ref_patch_worker_big_reward", _game(
        step="""\
        statistics.sys.modules['spade_jax.envs.worker']._number = lambda v: v
        return 'won', 50.0, True, False, {}"""),
        "forbidden_attribute", "reward_out_of_range", call="step"),
]  # fmt: skip


@pytest.fixture(scope="module")
def listener():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    yield server
    server.close()


@pytest.fixture(scope="module")
def pools():
    os.environ[SECRET.upper().replace("-", "_")] = SECRET  # a "credential" in the trainer env
    base = SandboxConfig(
        call_deadline_s=DEADLINE_S, load_deadline_s=DEADLINE_S, memory_limit_mb=256, spare_workers=1
    )
    gated = EnvPool(base)
    ungated = EnvPool(dataclasses.replace(base, static_gate=False))
    if ungated.isolation_report().missing:
        gated.close()
        ungated.close()
        pytest.skip(f"sandbox layers missing here: {ungated.isolation_report().as_dict()}")
    yield {True: gated, False: ungated}
    gated.close()
    ungated.close()


def _run(pool: EnvPool, source: str, call: str):
    handle = pool.open(source)
    if call == "load" or not handle.ok:
        return handle.error, ""
    first = handle.reset(seed=0)
    if call == "reset" or not first.ok:
        handle.close()
        return first.error, first.observation
    result = handle.step("go")
    handle.close()
    return result.error, result.observation


@pytest.mark.parametrize("gate", [True, False], ids=["gate_on", "gate_off"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hostile_program_is_contained(case, gate, pools, listener, tmp_path):
    tmp_path.chmod(0o777)  # writable by anyone: only the sandbox stands in the way
    old_file = tmp_path / "precious.txt"
    old_file.write_text("keep me")
    new_file = tmp_path / "pwned.txt"
    fills = {"@pid@": os.getpid(), "@port@": listener.getsockname()[1],
             "@new_file@": new_file, "@old_file@": old_file}  # fmt: skip
    source = case.body
    for key, value in fills.items():
        source = source.replace(key, str(value))
    start = time.monotonic()
    error, observation = _run(pools[gate], source, case.call)
    elapsed = time.monotonic() - start

    expected = case.gate_code if gate else case.runtime_code
    assert (error.code if error else None) == expected, (error, observation[:300])
    if case.detail_has and not gate:
        assert case.detail_has in error.detail
    assert elapsed < DEADLINE_S + SLACK_S
    assert not new_file.exists()
    assert old_file.read_text() == "keep me"
    with pytest.raises(BlockingIOError):
        listener.accept()
    assert SECRET not in observation
    if case.name == "read_parent_proc" and not gate:
        # The trainer's /proc is invisible (own pid namespace) and its env was cleared.
        assert "FileNotFoundError" in observation or "PermissionError" in observation
        assert "spade_jax" not in observation


def test_pool_survives_the_corpus(pools):
    """After every hostile case, both pools still run a good program (of each contract)."""
    for good in (_program(step='return "done", 1.0, True, False, {}'),
                 _game(step='return "done", np.float64(3.0), True, False, {}')):  # fmt: skip
        for pool in pools.values():
            handle = pool.open(good)
            assert handle.reset(seed=1).observation == "ok"
            assert handle.step(r"\boxed{a}").reward == 1.0  # reference: clipped from 3.0
            handle.close()
