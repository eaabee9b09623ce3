"""Sandbox runtime: isolation layers measured, hint/no-hint separation, concurrency,
snapshot/fork, the gymnasium wrapper (checked by gymnasium's own env_checker), the
protocol's caps, and refusal when a layer is missing."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import time
import warnings

import pytest
from gymnasium.utils.env_checker import check_env

from spade_jax.envs import EnvPool, EnvProgramError, SandboxConfig, make_env, protocol
from spade_jax.envs.static_gate import check_source

GUESS = '''
import random

class Environment:
    """Guess a digit; 0.25 partial credit for the right parity, 0.75 more for the digit."""

    def reset(self, seed=None):
        self.rng = random.Random(seed)
        self.target = self.rng.randint(0, 9)
        self.t = 0
        self.parity_paid = False
        return f"Guess a digit 0-9 (seed {seed}).", {}

    def step(self, action):
        self.t += 1
        guess = action.strip()
        reward = 0.0
        if guess.isdigit() and len(guess) == 1:
            if not self.parity_paid and int(guess) % 2 == self.target % 2:
                self.parity_paid, reward = True, 0.25
            if int(guess) == self.target:
                return "right", reward + 0.75, True, False, {"t": self.t}
        return f"wrong ({self.rng.random():.3f})", reward, False, self.t >= 8, {"t": self.t}
'''

COUNTER = """
import random
STATE = {"runs": 0}
class Environment:
    count = 0
    def reset(self, seed=None):
        Environment.count += 1
        STATE["runs"] += 1
        return f"{Environment.count} {STATE['runs']} {random.random()}", {}
    def step(self, action):
        return "", 0.0, True, False, {}
"""

SPIN = """
class Environment:
    def reset(self, seed=None):
        return "", {}
    def step(self, action):
        n = 0
        for i in range(int(action)):
            n += i
        return str(n), 0.0, True, False, {}
"""


@pytest.fixture(scope="module")
def pool():
    with EnvPool(SandboxConfig(call_deadline_s=3.0, spare_workers=2)) as p:
        yield p


def test_isolation_layers_are_measured_active(pool):
    report = pool.isolation_report()
    if not report.complete:
        pytest.skip(f"layers missing on this machine: {report.missing}")
    layers = report.as_dict()
    for name in ("rlimits", "no_new_privs", "unprivileged_uid", "seccomp", "namespaces",
                 "hidden_processes"):
        assert layers[name]["active"], layers[name]
    assert "pid" in layers["namespaces"]["detail"] and "net" in layers["namespaces"]["detail"]


def test_zygote_never_imports_jax_or_gymnasium(pool):
    import jax  # noqa: F401 - the trainer has JAX loaded; the sandbox must not inherit it

    probe = """
class Environment:
    def reset(self, seed=None):
        return ",".join(sorted(m for m in ("jax", "gymnasium", "numpy", "spade_jax.envs.pool")
                               if m in sys.modules)), {}
    def step(self, action):
        return "", 0.0, True, False, {}
"""
    with EnvPool(dataclasses.replace(pool.config, static_gate=False)) as ungated:
        handle = ungated.open(probe)
        assert handle.reset(0).observation == ""


def test_hint_and_no_hint_handles_share_no_state(pool):
    """Two handles of one program (the hint and no-hint arms) are separate processes."""
    hint_arm, plain_arm = pool.open_many([COUNTER, COUNTER])
    first, second = hint_arm.reset(1), plain_arm.reset(1)
    assert first.observation.split()[:2] == ["1", "1"]
    assert second.observation.split()[:2] == ["1", "1"]
    assert first.observation != second.observation  # the global RNG is per worker, too
    assert hint_arm.worker.pid != plain_arm.worker.pid
    assert hint_arm.reset(2).observation.split()[:2] == ["2", "2"]  # same handle: same process
    hint_arm.close()
    plain_arm.close()


class _LoggedChannel:
    """A worker's channel that logs (name, "send" / "reply") into ``events``."""

    def __init__(self, channel, name: str, events: list) -> None:
        self._channel, self._name, self._events = channel, name, events

    def send(self, data):
        self._events.append((self._name, "send"))
        return self._channel.send(data)

    def recv(self, size):
        data = self._channel.recv(size)
        self._events.append((self._name, "reply"))
        return data

    def __getattr__(self, attr):
        return getattr(self._channel, attr)


def test_step_many_runs_workers_concurrently(pool, monkeypatch):
    """Both calls are in flight before either reply is read, each in its own worker
    process: the schedule is checked, not how long it took (no timing in tests)."""
    handles = pool.open_many([SPIN] * 2)
    pool.reset_many([(h, 0) for h in handles])
    work = "400000"
    single = handles[0].step(work)
    pool.reset_many([(h, 0) for h in handles])
    events: list = []
    for name, h in zip("ab", handles, strict=True):
        monkeypatch.setattr(h.worker, "channel", _LoggedChannel(h.worker.channel, name, events))
    both = pool.step_many([(h, work) for h in handles])
    assert (
        single.observation
        == both[0].observation
        == both[1].observation
        == str(sum(range(int(work))))
    )
    # A reply may arrive in more than one read; what matters is that both were sent first.
    kinds = [kind for _, kind in events]
    assert kinds[:2] == ["send", "send"] and set(kinds[2:]) == {"reply"}, events
    assert {name for name, _ in events} == {"a", "b"}
    assert handles[0].worker.pid != handles[1].worker.pid
    for h in handles:
        h.close()


def test_snapshot_fork_reproduces_and_branches(pool):
    handle = pool.open(GUESS)
    handle.reset(7)
    for action in ["x", "1", "3"]:
        handle.step(action)
    snap = handle.snapshot()
    twin = pool.fork(snap)
    assert twin.ok and twin.transcript_digest == snap.digest
    assert twin.worker.pid != handle.worker.pid
    # Same next action -> same outcome in both branches; the branches are independent.
    a, b = handle.step("5"), twin.step("5")
    assert (a.observation, a.reward, a.terminated) == (b.observation, b.reward, b.terminated)
    assert twin.episode_return == pytest.approx(handle.episode_return)
    twin.close()
    handle.close()


def test_replay_of_nondeterministic_program_is_flagged(pool):
    source = COUNTER.replace(
        'return "", 0.0, True, False, {}', "return str(random.random()), 0.0, False, False, {}"
    )
    handle = pool.open(source)
    handle.reset(0)
    handle.step("a")
    twin = pool.fork(handle.snapshot())
    assert twin.error is not None and twin.error.code == "nondeterministic_replay"
    handle.close()


def test_gymnasium_env_checker_passes_and_fork_works(pool):
    env = make_env(GUESS, pool=pool)
    check_env(env, skip_render_check=True)
    obs, _ = env.reset(seed=3)
    assert env.observation_space.contains(obs)
    env.step("2")
    branch = env.fork()
    snap = env.snapshot()
    o1 = env.step("4")
    o2 = branch.step("4")
    assert o1[:3] == o2[:3]
    env.restore(snap)
    assert env.step("4")[:3] == o1[:3]
    branch.close()
    env.close()


def test_env_sanitizes_non_printable_observations(pool):
    source = """
class Environment:
    def reset(self, seed=None):
        return "caf\\u00e9 \\u2603", {}
    def step(self, action):
        return "\\x00", 1.0, True, False, {}
"""
    env = make_env(source, pool=pool)
    obs, info = env.reset(seed=0)
    assert obs == "caf? ?" and info["raw_observation"] == "caf\u00e9 \u2603"
    assert env.observation_space.contains(env.step("a")[0])
    env.close()


def test_runtime_failure_ends_episode_with_reason(pool):
    env = make_env(SPIN, pool=pool)
    env.reset(seed=0)
    with pytest.raises(EnvProgramError) as failed:
        env.step("not a number")
    assert failed.value.error.code == "program_error"
    # The env is usable again after a failed episode: a new one starts.
    assert env.reset(seed=1)[0] == ""


def test_missing_layer_refuses_untrusted_code_unless_allowed():
    weak = SandboxConfig(use_seccomp=False, spare_workers=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with EnvPool(weak) as pool:
            assert "seccomp" in pool.isolation_report().missing
            handle = pool.open(GUESS)
            assert handle.error.code == "weak_isolation"
    assert any("SANDBOX WEAK" in str(w.message) for w in caught)
    with pytest.warns(RuntimeWarning, match="SANDBOX WEAK"):
        with EnvPool(dataclasses.replace(weak, allow_weak_isolation=True)) as pool:
            handle = pool.open(GUESS)
            assert handle.ok and handle.reset(0).ok


def test_frame_reader_caps_and_rejects_garbage():
    reader = protocol.FrameReader(max_bytes=64)
    message = {"n": "ab", "x": [1, 2.5, None, "\ud800"]}
    frame = protocol.encode(message)
    assert reader.feed(frame[:3]) == [] and reader.feed(frame[3:]) == [message]
    with pytest.raises(protocol.ProtocolError) as err:
        reader.feed((1000).to_bytes(4, "big"))
    assert err.value.code == "message_too_large"
    with pytest.raises(protocol.ProtocolError) as err:
        protocol.FrameReader(64).feed((5).to_bytes(4, "big") + b"[1,2]")
    assert err.value.code == "protocol_violation"


@pytest.mark.parametrize(
    ("source", "code"),
    [
        ("x = (", "syntax_error"),
        ("import subprocess\nclass Environment: pass", "forbidden_import"),
        ("from . import x", "forbidden_import"),
        ("class Environment:\n def reset(self): return eval('1')\n def step(self, a): pass", "forbidden_name"),
        ("class Environment:\n def reset(self): return getattr(self, '__dict__')\n def step(self, a): pass", "forbidden_attribute"),
        ("class Env:\n pass", "missing_contract"),
        ("class Environment:\n def reset(self): pass", "missing_contract"),
        ("x = 1\n" * 40000, "source_too_large"),
        ("class Environment:\n def reset(self): pass\n def step(self, a): pass", None),
    ],
)  # fmt: skip
def test_static_gate_reason_codes(source, code):
    result = check_source(source, SandboxConfig())
    assert (result.error.code if result.error else None) == code


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="call_deadline_s"):
        SandboxConfig(call_deadline_s=0)
    with pytest.raises(ValueError, match="memory_limit_mb"):
        SandboxConfig(memory_limit_mb=16)
    with pytest.raises(ValueError, match="max_message_bytes"):
        SandboxConfig(max_message_bytes=1000)


def test_pool_close_leaves_no_processes():
    pool = EnvPool(SandboxConfig(spare_workers=2))
    handle = pool.open(GUESS)
    handle.reset(0)
    zygote_pid = pool._zygote._process.pid
    pool.close()
    time.sleep(0.2)
    alive = subprocess.run(["ps", "-o", "pid=", "--ppid", str(zygote_pid)], capture_output=True)
    assert alive.stdout.strip() == b""
    with pytest.raises(ProcessLookupError):
        os.kill(zygote_pid, 0)
