"""What crosses the sandbox boundary is measured or bounded outside the program.

Hostile programs run with the static gate off (reaching `sys.modules` is how a gate is
walked past), so each test shows the runtime check by itself: usage read from /proc, not
from the worker; rewards bounded per step and cumulatively; fresh validation seeds; an
overall validation deadline; host files out of sight; a pool-wide memory budget.
"""

from __future__ import annotations

import textwrap

import pytest

from spade_jax.envs import EnvPool, SandboxConfig, ValidationConfig, validate_program

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
