"""Code that runs inside a sandbox worker: lock the process down, then serve one program.

Runs in a process forked by the zygote (see zygote.py); imports only the stdlib, the
framing module and the seccomp filter. Order matters: new session -> fds -> rlimits ->
drop uid/gid -> not dumpable, parent-death signal -> no_new_privs -> seccomp. After that
the program's source is exec'd. Every value the program returns is type-checked here
*without calling the program's methods* (exact types only), and again in the trainer,
which trusts nothing this process says.
"""

from __future__ import annotations

import builtins
import ctypes
import math
import os
import resource
import signal
import sys
import types

from spade_jax.envs import contract, protocol, seccomp_filter, tool_base, tools

_PR_SET_PDEATHSIG = 1
_PR_SET_DUMPABLE = 4
_PR_SET_NO_NEW_PRIVS = 38
# Freed on MemoryError so the worker can still build and send its error reply.
_RESERVE_BYTES = 4 << 20
# The info key by which the play wrapper marks a step it answered for a failed game.
PROGRAM_ERROR_KEY = "program_error"


def _prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}) failed")


def _isolate(channel_fd: int, limits: dict) -> dict:
    """Applies every in-process layer; returns what was applied, as measured afterwards."""
    report: dict = {"errors": []}
    os.setsid()  # own process group: the supervisor kills the whole group
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.closerange(3, channel_fd)
    os.closerange(channel_fd + 1, 1 << 16)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL)
    sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the worker

    cpu = int(limits["cpu_limit_s"])
    memory = int(limits["memory_limit_bytes"])
    rlimits = {
        "RLIMIT_AS": (memory, memory),
        "RLIMIT_CPU": (cpu, cpu + 1),
        "RLIMIT_FSIZE": (0, 0),
        "RLIMIT_NOFILE": (int(limits["max_open_files"]),) * 2,
        "RLIMIT_CORE": (0, 0),
    }
    for name, value in rlimits.items():
        resource.setrlimit(getattr(resource, name), value)

    if limits["drop_privileges"] and os.getuid() == 0:
        os.setgroups([])
        os.setgid(int(limits["gid"]))
        os.setuid(int(limits["uid"]))
        # Only now: RLIMIT_NPROC is not checked for root, and counts the sandbox uid.
        resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
    try:
        _prctl(_PR_SET_DUMPABLE, 0)  # siblings with the same uid cannot ptrace or read /proc/mem
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # after setuid, which clears it
        _prctl(_PR_SET_NO_NEW_PRIVS, 1)
    except OSError as err:
        report["errors"].append(f"prctl: {err}")
    if limits["use_seccomp"]:
        try:
            report["seccomp_rules"] = seccomp_filter.load_filter()
        except Exception as err:  # noqa: BLE001 - any failure means "layer missing"
            report["errors"].append(f"seccomp: {type(err).__name__}: {err}")
    report.update(_self_status())
    return report


def _self_status() -> dict:
    """What the kernel says about this process (read back, not assumed)."""
    status = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("NoNewPrivs", "Seccomp", "Uid", "CapEff"):
                status[key] = value.split()[0] if key == "Uid" else value.strip()
    rlimits = {
        name: resource.getrlimit(getattr(resource, name))[1]
        for name in ("RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_CORE")
    }
    namespaces = {}
    for ns in ("pid", "net", "ipc", "mnt", "uts"):
        try:
            namespaces[ns] = os.readlink(f"/proc/self/ns/{ns}")
        except OSError:
            namespaces[ns] = None
    return {
        "uid": os.getuid(),
        "no_new_privs": status.get("NoNewPrivs") == "1",
        "seccomp_mode": int(status.get("Seccomp", "0")),
        "cap_eff": status.get("CapEff"),
        "rlimits": rlimits,
        "namespaces": namespaces,
        "root_read_only": bool(os.statvfs("/").f_flag & os.ST_RDONLY),
        "visible_pids": sum(1 for name in os.listdir("/proc") if name.isdigit()),
    }


def _probe_attacks() -> dict:
    """Tries what a hostile program would; each entry is the errno it got (0 = it worked)."""

    def attempt(action) -> int:
        try:
            action()
            return 0
        except OSError as err:
            return err.errno or -1

    def try_fork() -> None:
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)

    def try_write() -> None:
        path = "/tmp/.spade_sandbox_probe"
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT))
        os.unlink(path)

    import socket

    libc = ctypes.CDLL(None, use_errno=True)

    def try_libc(call) -> None:
        if call() != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, os.strerror(errno))

    def try_signal_owner() -> None:  # F_SETOWN: the kernel would signal that pid on I/O
        read_end, write_end = os.pipe()
        try:
            try_libc(lambda: libc.fcntl(read_end, 8, os.getppid()))
        finally:
            os.close(read_end)
            os.close(write_end)

    def try_flock() -> None:
        fd = os.open("/", os.O_RDONLY)
        try:
            try_libc(lambda: libc.flock(fd, 2 | 4))  # LOCK_EX | LOCK_NB
        finally:
            os.close(fd)

    return {
        "signal_owner": attempt(try_signal_owner),
        "flock": attempt(try_flock),
        "fork": attempt(try_fork),
        "socket": attempt(lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()),
        "write_file": attempt(try_write),
        "kill_parent": attempt(lambda: os.kill(os.getppid(), 0)),
        # a pid oracle: the process group of the parent (denied for any pid but 0)
        "pid_oracle": attempt(lambda: try_libc(lambda: min(0, libc.getpgid(os.getppid())))),
    }


# ----------------------------------------------------------------------------- values


def _plain(value, depth: int = 0, max_depth: int = 8):
    """A JSON-safe copy of an info value using exact types only (no user methods run)."""
    kind = type(value)
    if value is None or kind in (bool, str):
        return value
    if kind is int:
        return value if abs(value) < 2**63 else f"<int of {value.bit_length()} bits>"
    if kind is float:
        return value if math.isfinite(value) else repr(value)
    if depth >= max_depth:
        return "<nested too deep>"
    if kind in (list, tuple):
        return [_plain(item, depth + 1, max_depth) for item in value[:1000]]
    if kind is dict:
        return {k: _plain(v, depth + 1, max_depth)
                for k, v in list(value.items())[:1000] if type(k) is str}
    return f"<{kind.__name__}>"


# numpy's own scalar types by kind ("f" float, "i"/"u" integer, "b" bool), read before
# any program runs (a program could patch numpy afterwards). Empty without numpy.
_NUMPY_SCALARS: dict[str, frozenset] = {}


def _read_numpy_scalars() -> None:
    numpy = sys.modules.get("numpy")
    if numpy is None:
        return
    for kind in "fiub":
        _NUMPY_SCALARS[kind] = frozenset(
            t for t in numpy.sctypeDict.values() if numpy.dtype(t).kind == kind
        )


def _numpy_scalar(value, kinds: str) -> bool:
    """True if `value` is exactly one of numpy's scalar types of the given kinds. Exact
    types only, no subclass: converting it runs numpy's code, never the program's."""
    return any(type(value) in _NUMPY_SCALARS.get(kind, ()) for kind in kinds)


def _number(value) -> float:
    kind = type(value)
    if _numpy_scalar(value, "fiu"):  # a game's np.float64 / np.int64 reward
        value = value.item()
        kind = type(value)
    if kind is bool or not (kind is float or kind is int):
        raise _Reject("bad_type", f"reward is {kind.__name__}, not float")
    try:
        return float(value)
    except OverflowError:
        raise _Reject("nonfinite_reward", "integer reward out of float range") from None


def _flag(value, name: str) -> bool:
    if _numpy_scalar(value, "b"):
        value = value.item()
    if type(value) is bool:
        return value
    if type(value) is int and value in (0, 1):
        return bool(value)
    raise _Reject("bad_type", f"{name} is {type(value).__name__}, not bool")


def _observation(value, limits: dict) -> str:
    if type(value) is not str:
        raise _Reject("bad_type", f"observation is {type(value).__name__}, not str")
    if len(value) > limits["max_observation_chars"]:
        raise _Reject(
            "observation_too_large",
            f"{len(value)} chars > cap {limits['max_observation_chars']}",
        )
    return value


def _info(value) -> dict:
    if type(value) is not dict:
        raise _Reject("bad_type", f"info is {type(value).__name__}, not dict")
    return _plain(value)


class _Reject(Exception):
    def __init__(self, code: str, detail: str) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail


# ----------------------------------------------------------------------------- serving


class _Program:
    """The loaded Environment instance and the ops the supervisor may call on it."""

    def __init__(self, limits: dict) -> None:
        self.limits = limits
        self.env = None
        self.kind = "paper"
        self.tools: dict[str, dict] = {}  # tool contracts: name -> checked schema

    def load(self, request: dict) -> dict:
        # A real module (dataclasses and typing look classes' modules up in sys.modules),
        # with a private copy of builtins: the program may patch its own, not the worker's.
        module = types.ModuleType("environment_program")
        module.__builtins__ = dict(builtins.__dict__)
        sys.modules[module.__name__] = module
        namespace = module.__dict__
        self.kind = request.get("contract", "paper")
        reference = self.kind in contract.RECIPE_SCORED
        if reference:
            namespace.update(_implicit_names())
        if self.kind == "reference_tool_use":  # the recipe's base class, by name or import
            namespace["ToolUseBaseEnv"] = tool_base.ToolUseBaseEnv
            sys.modules["tool_use_base_env"] = tool_base
        code = compile(request["source"], "<environment>", "exec")
        exec(code, namespace)  # noqa: S102 - this is the sandbox
        if reference:
            self.env = _build_game(_game_class(namespace, module.__name__),
                                   int(request["max_turns"]))
            if self.kind == "reference_tool_use":
                return {"tools": self._read_tools()}
            return {}
        if self.kind == "tool":
            cls = namespace.get(contract.TOOL_CLASS)
            if not isinstance(cls, type):
                raise _Reject("missing_contract", f"no class named {contract.TOOL_CLASS}")
            for method in ("reset", "check"):
                if not callable(getattr(cls, method, None)):
                    raise _Reject("missing_contract",
                                  f"{contract.TOOL_CLASS} has no {method}() method")
            self.env = cls()
            return {"tools": self._read_tools()}
        cls = namespace.get("Environment")
        if not isinstance(cls, type):
            raise _Reject("missing_contract", "no class named Environment")
        for method in ("reset", "step"):
            if not callable(getattr(cls, method, None)):
                raise _Reject("missing_contract", f"Environment has no {method}() method")
        self.env = cls()
        return {}

    def _read_tools(self) -> list:
        """The program's tool list as checked plain JSON (`TOOLS`, or the recipe base's
        get_tools()); "bad_tools" naming the tool and the problem otherwise."""
        if self.kind == "tool":
            declared = getattr(self.env, "TOOLS", None)
        else:
            declared = self.env.get_tools()
        try:
            checked = tools.check_tool_schemas(_plain(declared, max_depth=32))
        except tools.ToolSchemaError as err:
            raise _Reject("bad_tools", str(err)) from None
        self.tools = {tool["function"]["name"]: tool for tool in checked}
        if self.kind == "tool":
            for name in self.tools:
                if not callable(getattr(self.env, f"tool_{name}", None)):
                    raise _Reject("bad_tools", f"tool {name!r} has no method tool_{name}()")
        return checked

    def reset(self, request: dict) -> dict:
        result = self.env.reset(seed=request["seed"])
        if type(result) is str:  # lenient: bare observation
            observation, info = result, {}
        elif type(result) in (tuple, list) and len(result) == 2:
            observation, info = result
        else:
            raise _Reject("bad_type", f"reset() returned {type(result).__name__}, not (str, dict)")
        reply = {"obs": _observation(observation, self.limits), "info": _info(info)}
        if self.kind in contract.TOOL_CONTRACTS:
            reply["tools"] = self._read_tools()
        return reply

    def step(self, request: dict) -> dict:
        if self.kind == "tool":
            return self._tool_step(request["action"])
        if self.kind == "reference_tool_use":
            return self._recipe_tool_step(request["action"])
        if request.get("lenient"):
            return self._lenient_step(request["action"])
        return self._checked_step(request["action"])

    def _checked_step(self, action: str) -> dict:
        result = self.env.step(action)
        if type(result) not in (tuple, list) or len(result) not in (4, 5):
            raise _Reject(
                "bad_type", "step() must return (obs, reward, terminated, truncated, info)"
            )
        if len(result) == 5:
            observation, reward, terminated, truncated, info = result
        else:  # lenient: gym's old (obs, reward, done, info)
            observation, reward, terminated, info = result
            truncated = False
        return {
            "obs": _observation(observation, self.limits),
            "reward": _number(reward),
            "terminated": _flag(terminated, "terminated"),
            "truncated": _flag(truncated, "truncated"),
            "info": _info(info),
        }

    def _run_calls(self, calls: list, dispatch) -> list[tuple[str, bool, str]]:
        """Each call checked against the tool schemas, then run by ``dispatch(name,
        arguments) -> (ok, text)``; a call that fails the check is an error result and
        reaches no method of the program."""
        results = []
        for call in calls:
            problems = tools.call_problems(self.tools, call)
            if problems:
                tool = self.tools.get(call["name"])
                usage = f" (usage: {tools.signature(tool)})" if tool is not None else ""
                results.append((call["name"], False, "; ".join(problems) + usage))
            else:
                results.append((call["name"], *dispatch(call["name"], call["arguments"])))
        return results

    def _tool_step(self, action: str) -> dict:
        """A turn of a "tool" program: the final answer is checked, or the calls run."""
        calls, errors, content = tools.parse_action(action)
        answer = tools.final_answer(calls, errors, content)
        results: list = []
        tail = None
        if answer is None:
            calls, dropped = tools.split_calls(calls)
            errors = errors + dropped

            def dispatch(name: str, arguments: dict) -> tuple[bool, str]:
                return True, tools.result_text(
                    _plain(getattr(self.env, f"tool_{name}")(**arguments), max_depth=32))

            results = self._run_calls(calls, dispatch)
            follow = getattr(self.env, "next_instruction", None)
            if callable(follow):
                tail = follow()
                if tail is not None and type(tail) is not str:
                    raise _Reject("bad_type", f"next_instruction() returned "
                                              f"{type(tail).__name__}, not str or None")
        progress = _number(self.env.check(answer))
        if not 0.0 <= progress <= 1.0:
            raise _Reject("reward_out_of_range", f"check() returned {progress!r}, not in [0, 1]")
        if answer is not None:
            observation = "Final answer received. The episode is over."
        else:
            observation = tools.render_observation(results, errors, tail)
        return {"obs": _observation(observation, self.limits), "reward": progress,
                "terminated": answer is not None, "truncated": False,
                "info": {"progress": progress}}

    def _recipe_tool_step(self, action: str) -> dict:
        """A turn of a recipe tool game, as the recipe plays one: a reply with
        <answer>...</answer> goes to the game's step(); a reply with tool calls runs each
        through the game's execute_tool() (checked against the schemas first; no reward,
        the episode goes on); any other reply goes to step() (the game's format error),
        with the parse errors put before its observation."""
        calls, errors, content = tools.parse_action(action)
        if tools.answer_tag(content) is not None or not calls:
            reply = self._checked_step(content)
            if errors and tools.answer_tag(content) is None:
                text = tools.render_observation([], errors) + "\n\n" + reply["obs"]
                reply["obs"] = _observation(text, self.limits)
            return reply
        calls, dropped = tools.split_calls(calls)

        def dispatch(name: str, arguments: dict) -> tuple[bool, str]:
            outcome = self.env.execute_tool(name, arguments)
            if type(outcome) is not dict or type(outcome.get("output")) is not str:
                raise _Reject("bad_type", "execute_tool() must return {'output': str, ...}")
            return outcome.get("returncode") == 0, outcome["output"]

        observation = tools.render_observation(self._run_calls(calls, dispatch),
                                               errors + dropped)
        return {"obs": _observation(observation, self.limits), "reward": 0.0,
                "terminated": False, "truncated": False, "info": {}}

    def _lenient_step(self, action: str) -> dict:
        """The recipe's play wrapper around a reference game's step(): an exception, or a
        reply that is not a 5-tuple (a list is not one: the recipe checks for a tuple),
        becomes an observation for the agent with reward -1 and the episode terminated; a
        5-tuple's parts are coerced (str observation, float reward, bool flags, a dict
        info). Coercing runs the program's own methods (``__str__``, ``__float__``): here,
        in its worker, where an error they raise is the agent's observation too."""
        try:
            result = self.env.step(action)
            if not isinstance(result, tuple) or len(result) != 5:
                return _ended_by_program("Invalid game response", self.limits)
            observation, reward, terminated, truncated, info = result
            observation = "No observation" if observation is None else str(observation)
            reward = 0.0 if reward is None else float(reward)
            terminated, truncated = bool(terminated), bool(truncated)
        except MemoryError:
            raise
        except Exception as err:  # noqa: BLE001 - the program's error is the agent's observation
            try:
                message = str(err)[:500]
            except Exception:  # noqa: BLE001 - a hostile __str__
                message = type(err).__name__
            return _ended_by_program(f"Error: {message}", self.limits)
        return {
            "obs": _observation(observation, self.limits),
            "reward": _number(reward),
            "terminated": terminated,
            "truncated": truncated,
            "info": _lenient_info(info),
        }


def _lenient_info(info) -> dict:
    """A played step's info as the recipe keeps it: a dict of plain values, else empty.
    The wrapper's own marker (``program_error``) is the wrapper's to set: a game's key of
    that name is dropped."""
    try:
        plain = _info(info) if type(info) is dict else {}
    except _Reject:
        return {}
    plain.pop(PROGRAM_ERROR_KEY, None)
    return plain


def _ended_by_program(observation: str, limits: dict) -> dict:
    """A played step the program failed: the recipe's error observation, -1, terminated."""
    return {"obs": _observation(observation, limits), "reward": -1.0, "terminated": True,
            "truncated": False, "info": {PROGRAM_ERROR_KEY: True}}


def _implicit_names() -> dict:
    """The recipe's import-free names, bound to the modules the zygote loaded (a module it
    did not load, e.g. numpy with `reference_imports` empty, is left out)."""
    names = {}
    for name, target in contract.REFERENCE_IMPLICIT_NAMES.items():
        module_name, _, attribute = target.partition(":")
        module = sys.modules.get(module_name)
        if module is not None:
            names[name] = getattr(module, attribute) if attribute else module
    return names


def _game_class(namespace: dict, module_name: str) -> type:
    """The recipe's game class: the first class defined at the program's top level whose
    name ends in "Env" and that has reset() and step(). A class that is a base of another
    such class (a helper like `GridEnv` under `MazeEnv(GridEnv)`) is passed over."""
    playable = [
        value for name, value in list(namespace.items())
        if isinstance(value, type) and name.endswith("Env") and name == value.__name__
        and value.__module__ == module_name
        and callable(getattr(value, "reset", None)) and callable(getattr(value, "step", None))
    ]  # fmt: skip
    bases = {base for cls in playable for base in cls.__mro__[1:]}
    chosen = [cls for cls in playable if cls not in bases]
    if not chosen:
        raise _Reject(
            "missing_contract", "no top-level class whose name ends in Env has reset() and step()"
        )
    return chosen[0]


def _build_game(cls: type, max_turns: int):
    """As the recipe builds a game: with its own defaults first (``cls()``; a class that
    needs the argument gets ``cls(max_turns=N)``), then its turn limit set to the smaller
    of its own (a positive int) and the budget N; a ``max_turns`` attribute that is not
    one gets N."""
    try:
        game = cls()
    except TypeError:
        game = cls(max_turns=max_turns)
    own = getattr(game, "max_turns", None)
    if type(own) is int and own > 0:
        game.max_turns = min(own, max_turns)
    elif hasattr(game, "max_turns"):
        game.max_turns = max_turns
    return game


def _handle(program: _Program, request: dict) -> dict:
    op = request.get("op")
    if op not in ("load", "reset", "step"):
        return {"ok": False, "code": "protocol_violation", "detail": f"unknown op {op!r}"}
    if op in ("reset", "step") and program.env is None:
        return {"ok": False, "code": "episode_over", "detail": "no program loaded"}
    try:
        return {"ok": True, **getattr(program, op)(request)}
    except _Reject as err:
        return {"ok": False, "code": err.code, "detail": err.detail}
    except MemoryError:
        return {"ok": False, "code": "memory_limit", "detail": f"MemoryError in {op}"}
    except BaseException as err:  # noqa: BLE001 - SystemExit/KeyboardInterrupt from the program too
        code = "load_failed" if op == "load" else "program_error"
        try:
            detail = f"{type(err).__name__}: {str(err)[:500]}"
        except BaseException:  # noqa: BLE001 - a hostile __str__
            detail = type(err).__name__
        return {"ok": False, "code": code, "detail": f"{op}: {detail}"}


def serve(channel_fd: int, limits: dict) -> None:
    """Entry point of a freshly forked worker; never returns normally."""
    hello = {"n": "hello", "ok": True, "pid": os.getpid()}
    try:
        hello["isolation"] = _isolate(channel_fd, limits)
    except Exception as err:  # noqa: BLE001 - report, the supervisor decides
        hello = {"n": "hello", "ok": False, "code": "crash", "detail": f"isolation: {err!r}"}
    _read_numpy_scalars()
    if "random" in sys.modules:
        # The zygote's global random state is inherited by every fork; reseed so a program
        # using it unseeded is caught as nondeterministic rather than looking consistent.
        sys.modules["random"].seed()
    if "numpy" in sys.modules:  # the same for numpy's global generator
        sys.modules["numpy"].random.seed()
    if hello.get("ok") and limits.get("probe"):
        hello["attacks"] = _probe_attacks()
    protocol.write_all(channel_fd, protocol.encode(hello))
    program = _Program(limits)
    reader = protocol.FrameReader(int(limits["max_message_bytes"]))
    reserve = bytearray(_RESERVE_BYTES)
    while True:
        try:
            request = protocol.read_blocking(channel_fd, reader)
        except protocol.ProtocolError:
            os._exit(3)
        if request is None or request.get("op") == "close":
            os._exit(0)
        reply = _handle(program, request)
        reply["n"] = request.get("n")
        try:
            data = protocol.encode(reply)
        except MemoryError:
            reserve.clear()
            data = protocol.encode({"n": reply["n"], "ok": False, "code": "memory_limit"})
        except (ValueError, TypeError) as err:
            data = protocol.encode(
                {"n": reply["n"], "ok": False, "code": "bad_type", "detail": str(err)[:200]}
            )
        if len(data) > limits["max_message_bytes"]:
            data = protocol.encode(
                {"n": reply["n"], "ok": False, "code": "message_too_large",
                 "detail": f"reply of {len(data)} bytes"}
            )  # fmt: skip
        protocol.write_all(channel_fd, data)
