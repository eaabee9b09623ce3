"""The suite compiles for speed (tests/conftest.py: LLVM -O0, the classic fusion emitters,
one codegen split; about half the compile time). That changes the last bits of XLA:CPU's
results (a probe's hash differs), so every comparison in the suite is either against a
reference with a tolerance or of a program against itself; this checks that those flags
and the default ones agree to float32 rounding. The exact-replay driver
(tests/test_exact_replay.py) sets its own flags and runs at the default level."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

PROBE = Path(__file__).resolve().parents[1] / "support" / "opt_level_probe.py"


def _probe(xla_flags: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags,
               JAX_ENABLE_COMPILATION_CACHE="false")
    proc = subprocess.run([sys.executable, str(PROBE)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.slow  # two JAX subprocesses (~10 s each)
def test_llvm_o0_agrees_with_the_default_level_to_float32_rounding():
    assert "--xla_backend_optimization_level=0" in os.environ["XLA_FLAGS"]
    low, default = _probe(os.environ["XLA_FLAGS"]), _probe("")
    for key in ("logits", "grads"):
        a, b = np.asarray(low[key]), np.asarray(default[key])
        assert a.shape == b.shape and np.all(np.isfinite(a))
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6 * np.abs(b).max())
    assert low["loss"] == pytest.approx(default["loss"], rel=1e-6)
