"""What crosses the sandbox boundary is measured or bounded outside the program.

Hostile programs run with the static gate off (reaching `sys.modules` is how a gate is
walked past), so each test shows the runtime check by itself: usage read from /proc, not
from the worker; rewards bounded per step and cumulatively; fresh validation seeds; an
overall validation deadline; host files out of sight; a pool-wide memory budget.
"""

from __future__ import annotations

import math
import os
import textwrap
import time

import pytest

from spade_jax.envs import (
    EnvPool,
    EnvProgramError,
    SandboxConfig,
    ValidationConfig,
    make_env,
    validate_program,
    validate_programs,
)

HONEST = """
import random

class Environment:
    def reset(self, seed=None):
        self.rng = random.Random(seed)
        self.t = 0
        return f"start {self.rng.randint(0, 9)}", {}

    def step(self, action):
        self.t += 1
        done = self.t >= 3
        return f"t={self.t}", (1.0 if done else 0.0), done, False, {}
"""


def _paper(reset: str, step: str = "return 'x', 0.0, True, False, {}", top: str = "") -> str:
    return (
        "import sys\n" + textwrap.dedent(top)
        + "\nclass Environment:\n    def reset(self, seed=None):\n"
        + textwrap.indent(textwrap.dedent(reset), " " * 8)
        + "\n    def step(self, action):\n"
        + textwrap.indent(textwrap.dedent(step), " " * 8)
        + "\n"
    )


@pytest.fixture(scope="module")
def pool():
    config = SandboxConfig(call_deadline_s=3.0, spare_workers=2, static_gate=False)
    with EnvPool(config) as p:
        if p.isolation_report().missing:
            pytest.skip(f"sandbox layers missing here: {p.isolation_report().missing}")
        yield p


# ----------------------------------------------------------------------------- usage

# Holds ~300 MiB (written, so resident) and patches every usage report the worker could
# send, in the worker module and in the resource module it would read.
FORGED_USAGE = _paper(
    "self.t = 0\nreturn 'hi', {}",
    "self.t += 1\nreturn 'x', 0.0, self.t >= 2, False, {}",
    top="""\
    HOLD = b'x' * (300 << 20)
    worker = sys.modules['spade_jax.envs.worker']
    if hasattr(worker, '_Program'):
        worker._Program.usage = lambda self, request: {'cpu_s': 0.0, 'max_rss_kb': 10}
    resource = sys.modules['resource']

    class _Usage:
        ru_utime = ru_stime = 0.0
        ru_maxrss = 10
    resource.getrusage = lambda who: _Usage()
    """,
)


def test_resource_check_reads_usage_outside_the_worker(pool):
    config = ValidationConfig(max_rss_mb=200)
    report = validate_program(FORGED_USAGE, pool=pool, config=config)
    assert report.code == "resource_limit", report.reason
    assert "max_rss_kb" in report.reason
    # The same program under a budget it fits validates: the check measured ~300 MiB.
    assert validate_program(FORGED_USAGE, pool=pool, config=ValidationConfig(max_rss_mb=900)).ok


def test_usage_is_the_kernel_count(pool):
    handle = pool.open(FORGED_USAGE)
    usage = handle.usage()
    assert usage["max_rss_kb"] > 300 * 1024
    handle.close()


# ----------------------------------------------------------------------------- rewards

# Honest on small seeds (every seed the old validator used was small), poisonous on others.
SEED_DEPENDENT = _paper(
    "self.seed, self.t = seed, 0\nreturn 'go', {}",
    """\
    self.t += 1
    if self.seed is not None and self.seed >= 5000:
        return 'x', (1e300 if self.t == 1 else -1e300), self.t >= 2, False, {}
    return 'x', (1.0 if self.t >= 2 else 0.0), self.t >= 2, False, {}""",
)


def test_every_step_reward_is_bounded_at_the_boundary(pool):
    env = make_env(SEED_DEPENDENT, pool)
    env.reset(seed=10**6)
    with pytest.raises(EnvProgramError) as failed:
        env.step("a")  # +1e300, which -1e300 would have cancelled into a "valid" return
    assert failed.value.error.code == "reward_out_of_range"
    env.close()
    handle = pool.open(SEED_DEPENDENT)
    handle.reset(10**6)
    result = handle.step("a")
    assert (result.reward, result.terminated, result.error.code) == (0.0, True,
                                                                     "reward_out_of_range")
    handle.close()


@pytest.mark.parametrize("rewards,code", [
    ((0.9, 0.9), "return_out_of_range"),  # each step fine, the running sum is not
    ((-1.0, -0.5), "return_out_of_range"),
    ((1.5,), "reward_out_of_range"),
    ((float("nan"),), "nonfinite_reward"),
])
def test_running_return_stays_in_bounds(pool, rewards, code):
    source = _paper(
        "self.t = 0\nreturn 'go', {}",
        f"self.t += 1\nr = {list(rewards)!r}\n"
        "return 'x', r[self.t - 1], self.t >= len(r), False, {}",
    ).replace("nan", "float('nan')")
    env = make_env(source, pool)
    env.reset(seed=0)
    seen = []
    with pytest.raises(EnvProgramError) as failed:
        for _ in rewards:
            seen.append(env.step("a")[1])
    assert failed.value.error.code == code
    # What reached the caller before the error is within the contract's bounds.
    assert all(math.isfinite(r) for r in seen) and -1.0 <= sum(seen) <= 1.0
    env.close()


def test_validation_seeds_are_fresh_per_run(pool):
    report = validate_program(SEED_DEPENDENT, pool=pool, seed=3)
    assert report.code == "reward_out_of_range", report.reason
    assert report.seed == 3
    drawn = {validate_program(HONEST, pool=pool).seed for _ in range(3)}
    assert len(drawn) == 3  # seed=None: fresh seeds each time
    again = [validate_program(HONEST, pool=pool, seed=11) for _ in range(2)]
    assert again[0].ok and again[0].transcript_hash == again[1].transcript_hash


# ----------------------------------------------------------------------------- deadline

SLEEPER = _paper(
    "self.t = 0\nreturn 'zz', {}",
    "import time\ntime.sleep(0.8)\nself.t += 1\nreturn 'z', 0.0, self.t >= 60, False, {}",
)


def test_validation_has_an_overall_deadline(pool):
    config = ValidationConfig(max_total_s=3.0)
    start = time.monotonic()
    report = validate_program(SLEEPER, pool=pool, config=config)
    elapsed = time.monotonic() - start
    assert report.code == "validation_timeout", report.reason
    assert elapsed < 3.0 + 4.0  # load (<= its own deadline) + kill + a loaded machine


def test_validate_programs_runs_candidates_in_parallel(pool, monkeypatch):
    """The four candidates are validated side by side: each validation waits at a barrier
    for the other three before it starts, so a sequential schedule fails (the barrier
    breaks) instead of the test timing anything."""
    import threading

    from spade_jax.envs import validate as validate_module

    nap = _paper("import time\ntime.sleep(0.05)\nself.t = 0\nreturn 'go', {}",
                 "self.t += 1\nreturn 'x', 0.0, True, False, {}")
    sources = [nap, nap, "class Environment:\n    pass\n", nap]
    barrier = threading.Barrier(len(sources), timeout=60)
    validate_one = validate_module.validate_program

    def together(*args, **kwargs):
        barrier.wait()
        return validate_one(*args, **kwargs)

    monkeypatch.setattr(validate_module, "validate_program", together)
    reports = validate_programs(sources, pool=pool, seeds=[1, 2, 3, 4], max_parallel=4)
    assert [r.ok for r in reports] == [True, True, False, True]
    assert reports[2].code == "missing_contract"
    assert [r.seed for r in reports] == [1, 2, 3, 4]


# ----------------------------------------------------------------------------- host files

READ_FILES = _paper(
    """\
    import os
    for path in @paths@:
        try:
            with open(path, 'rb') as f:
                out = f.read(200).decode('latin-1')
        except OSError as err:
            out = type(err).__name__
        self_listing = []
        for folder in ('/', '/etc', '/tmp', '/home', '/root', '/work'):
            try:
                self_listing.append(','.join(os.listdir(folder)))
            except OSError as err:
                self_listing.append(type(err).__name__)
        sys.stdout.write(out)
        self.seen = getattr(self, 'seen', []) + [out] + self_listing
    return ' | '.join(self.seen), {}""",
)


def test_host_files_are_out_of_sight(pool):
    """A world-readable host file (in /tmp, /etc, the repository, site-packages of a
    package the sandbox does not need) cannot be read from inside the sandbox."""
    import tempfile

    fd, secret_path = tempfile.mkstemp(prefix="spade-host-", dir="/tmp")
    os.write(fd, b"host-secret-7d1e")
    os.close(fd)
    os.chmod(secret_path, 0o644)
    pytest_init = os.path.realpath(pytest.__file__)
    paths = [secret_path, "/etc/passwd", "/etc/hostname", os.path.realpath(__file__),
             pytest_init]
    try:
        source = READ_FILES.replace("@paths@", repr(paths))
        handle = pool.open(source)
        observation = handle.reset(0).observation
        handle.close()
    finally:
        os.unlink(secret_path)
    assert observation, "the probe ran"
    assert "host-secret-7d1e" not in observation
    assert "root:" not in observation
    with open(__file__, "rb") as f:
        assert f.read(60).decode("latin-1") not in observation
    with open(pytest_init, "rb") as f:
        assert f.read(60).decode("latin-1") not in observation
    assert "spade-host-" not in observation  # /tmp cannot even be listed


# ----------------------------------------------------------------------------- pool memory

HOG = """
class Environment:
    def reset(self, seed=None):
        self.hold = b'x' * (300 << 20)  # written, so resident
        self.t = 0
        return 'holding', {}
    def step(self, action):
        self.t += 1
        return 'still holding', 0.0, self.t >= 5, False, {}
"""


def test_pool_memory_budget_kills_the_largest_worker_with_a_clear_error():
    # A CPU budget well above the hogs' page faulting (writing 300 MB took 1.01 s of CPU on
    # a loaded box, a "slow_call"): the memory budget is what is under test.
    config = SandboxConfig(call_deadline_s=5.0, call_cpu_budget_s=5.0, memory_limit_mb=512,
                           pool_memory_mb=700, reference_imports=frozenset(), spare_workers=1)
    with EnvPool(config) as pool:
        if pool.isolation_report().missing:
            pytest.skip("sandbox layers missing here")
        honest = pool.open(HONEST)
        assert honest.reset(1).ok
        hogs = pool.open_many([HOG] * 4)
        pool.reset_many([(h, 0) for h in hogs])
        time.sleep(1.0)  # the zygote checks every 0.1 s
        results = pool.step_many([(h, "a") for h in hogs])
        codes = [r.error.code if r.error else "ok" for r in results]
        assert 2 <= codes.count("pool_memory_limit") <= 3, codes
        assert set(codes) <= {"ok", "pool_memory_limit"}, codes
        failed = next(r.error for r in results if r.error)
        assert "700 MiB" in failed.detail and "largest" in failed.detail, failed.detail
        # The small honest worker was not the one sacrificed.
        assert honest.step("a").ok
        for handle in (*hogs, honest):
            handle.close()
        # With the hogs gone, the pool works as before.
        again = pool.open(HONEST)
        assert again.reset(2).ok and again.step("a").ok
        again.close()


# ----------------------------------------------------------------------------- smaller ones

def test_reset_failure_raises_instead_of_an_empty_observation(pool):
    source = _paper("if seed == 1:\n    raise ValueError('no')\nreturn 'fine', {}")
    env = make_env(source, pool)
    assert env.reset(seed=0)[0] == "fine"
    with pytest.raises(EnvProgramError) as failed:
        env.reset(seed=1)
    assert failed.value.error.code == "program_error" and "no" in failed.value.error.detail
    env.close()


DEEP_INFO = _paper(
    """\
    sys.modules['spade_jax.envs.worker']._info = lambda value: value  # skip the worker's cap
    deep = 'bottom'
    for _ in range(300):
        deep = {'a': deep}
    wide = {f'k{i}': i for i in range(5000)}
    return 'x', {'deep': deep, 'wide': wide, 'big': 10 ** 30, 'text': 'y' * 10 ** 5,
                 'rows': [[1, 2]] * 100}""",
)


def test_nested_info_is_flattened_and_bounded(pool):
    handle = pool.open(DEEP_INFO)
    result = handle.reset(0)
    assert result.ok, result.error
    info = result.info
    assert len(info) <= 64
    for key, value in info.items():
        assert type(key) is str
        assert value is None or type(value) in (bool, int, float, str, list), (key, value)
        if type(value) is list:
            assert all(type(v) in (bool, int, float, str) or v is None for v in value)
        if type(value) is str:
            assert len(value) <= 1000
    assert type(info["deep.a.a.a"]) is str and info["deep.a.a.a"].startswith('{"a"')
    assert info["big"] == "<int of 100 bits>"
    assert len(info["text"]) == 1000
    assert "wide.k0" in info and info["wide.k0"] == 0
    handle.close()


def test_default_pool_retries_a_zygote_killed_at_start(monkeypatch):
    from spade_jax.envs import launcher, validate

    original = launcher.Zygote._request
    killed = []

    def request(self, message, fds=()):
        if not killed:  # the first zygote dies before it answers its first request
            killed.append(self._process.pid)
            os.killpg(self._process.pid, 9)
            self._process.wait()
        return original(self, message, fds)

    monkeypatch.setattr(launcher.Zygote, "_request", request)
    monkeypatch.setattr(validate, "_default_pool", None)
    try:
        report = validate_program(HONEST)
        assert killed and report.ok, report.reason
    finally:
        if validate._default_pool is not None:
            validate._default_pool.close()


# ----------------------------------------------------------------------------- shared memory

# Holds memory with mmap: MAP_SHARED | MAP_ANONYMOUS pages (which the kernel counts as
# shared memory, not anonymous: once they escaped every budget, which counted resident
# minus shared) or MAP_PRIVATE | MAP_ANONYMOUS pages, written so they are resident; then
# tries memfd_create (memfd pages would count as shared memory too). A shared mapping of
# /dev/zero cannot hold anything: it needs /dev/zero open for writing (refused), and read
# faults map the zero page.
SHARED_HOG = _paper(
    """\
    ctypes, os = sys.modules['ctypes'], sys.modules['os']
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    size, flags = @mib@ << 20, {'shared': 0x01, 'private': 0x02}['@how@'] | 0x20
    try:
        os.memfd_create('hold')
        memfd = 'allowed'
    except OSError as err:
        memfd = type(err).__name__
    addr = libc.mmap(None, size, 3, flags, -1, 0)  # PROT_READ | PROT_WRITE
    ctypes.memset(addr, 1, size)
    self.t = 0
    return 'holding, memfd ' + memfd, {}""",
    "self.t += 1\nreturn 'still holding', 0.0, self.t >= 5, False, {}",
)


def _hog(mib: int, how: str = "shared") -> str:
    return SHARED_HOG.replace("@mib@", str(mib)).replace("@how@", how)


def _held_after(pool: EnvPool, source: str) -> tuple[str, object]:
    """The opening observation and the first error of reset() or of a step 1 s later (the
    zygote checks every 0.1 s, so the kill can come during either)."""
    handle = pool.open(source)
    first = handle.reset(0)
    if not first.ok:
        return first.observation, first.error
    time.sleep(1.0)
    result = handle.step("a")
    handle.close()
    return first.observation, result.error


@pytest.mark.parametrize("how", ["shared", "private"])
def test_a_worker_over_its_memory_budget_is_killed_shared_pages_included(how):
    config = SandboxConfig(memory_limit_mb=512, worker_memory_mb=100, spare_workers=0,
                           reference_imports=frozenset(), static_gate=False,
                           call_cpu_budget_s=5.0)  # memory under test, not page-fault CPU
    with EnvPool(config) as pool:
        if pool.isolation_report().missing:
            pytest.skip("sandbox layers missing here")
        _, error = _held_after(pool, _hog(160, how))
        assert error is not None and error.code == "memory_limit", error
        assert "over its budget of 100 MiB" in error.detail
        # A worker holding less than its budget is left alone; memfd_create is refused.
        opening, error = _held_after(pool, _hog(40, how))
        assert (opening, error) == ("holding, memfd PermissionError", None)


def test_pool_budget_counts_shared_anonymous_memory():
    config = SandboxConfig(memory_limit_mb=512, pool_memory_mb=200, worker_memory_mb=None,
                           spare_workers=0, reference_imports=frozenset(), static_gate=False,
                           call_cpu_budget_s=5.0)  # memory under test, not page-fault CPU
    with EnvPool(config) as pool:
        if pool.isolation_report().missing:
            pytest.skip("sandbox layers missing here")
        honest = pool.open(HONEST)
        assert honest.reset(1).ok
        _, error = _held_after(pool, _hog(260))
        assert error is not None and error.code == "pool_memory_limit", error
        assert "200 MiB" in error.detail
        assert honest.step("a").ok
        honest.close()


# ----------------------------------------------------------------------------- cut episodes

PENALTY_FIRST = _paper(
    "self.t = 0\nreturn 'go', {}",
    "self.t += 1\nr = [-1.0, 0.0, 0.5, 1.0][self.t - 1]\nreturn 'x', r, self.t >= 4, False, {}",
)


def test_a_cut_paper_episode_returns_within_0_1(pool):
    """The agent loop may cut an episode after any step (its turn or token budget): the
    rewards reported so far must sum into [0, 1] then too, not only at the natural end.
    The program's running return here is -1, -1, -0.5, then 0.5 at the end."""
    handle = pool.open(PENALTY_FIRST)
    handle.reset(0)
    reported, raw = [], []
    for _ in range(4):
        result = handle.step("a")
        assert result.ok, result.error
        reported.append(result.reward)
        raw.append(result.info.get("raw_reward", result.reward))
        assert 0.0 <= sum(reported) <= 1.0, reported  # a cut here returns this
    assert raw == [-1.0, 0.0, 0.5, 1.0]
    assert sum(reported) == pytest.approx(sum(raw)) == pytest.approx(0.5)  # natural end
    assert result.terminated
    handle.close()
