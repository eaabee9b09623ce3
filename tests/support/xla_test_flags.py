"""XLA flags of the suite's JAX processes, set for compile speed (``fast_compile()``): the
suite's time is mostly XLA:CPU compiling tiny programs. LLVM at -O0 compiles them about a
third faster; XLA:CPU's classic fusion emitters instead of the MLIR ones, and one codegen
split instead of parallel LLVM modules on a box whose two cores are already busy, take
another ~half off (three compile-bound tests, cold cache: 127 s at -O0, 65 s with all
three; tests/README.md "Compile flags"). They change only the last bits of results
(tests/models/test_opt_level.py). tests/conftest.py sets them for the pytest processes; a
test that starts a JAX subprocess with XLA_FLAGS of its own builds them here
(``jax_flags()``), unless it checks numerics at the default flags (the exact-replay
driver's main report, the default-numerics replay bound; the engine and router-replay
drivers check plumbing on exact numerics and add them to the exact flag), a result
measured at them (the learning check), or runs mostly compiled code rather than compiling
(a `spade_jax.train` run with a warm start: 84 s at the default flags, 114 s with these;
the kill and resume runs, without one, are mostly compiling and use them)."""

from __future__ import annotations

import os
import subprocess
import sys

LLVM_O0 = "--xla_backend_optimization_level=0"
# XLA:CPU's classic fusion emitters instead of the MLIR ones, one LLVM module per program
# instead of parallel codegen splits. XLA aborts a process on a flag it does not know, and
# jax is not pinned for CPU installs, so these are used only where this jaxlib accepts them.
_EMITTER_FLAGS = "--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1"
# Where the probe's answer is kept for the suite's worker processes and subprocesses.
_ENV_KEY = "SPADE_TEST_FAST_COMPILE"


def fast_compile() -> str:
    """The suite's compile flags: LLVM at -O0 and, when this jaxlib's XLA accepts them, the
    classic emitters and one codegen split (probed once per suite, in a subprocess, ~2 s;
    the answer travels to the other processes in the environment)."""
    if _ENV_KEY not in os.environ:
        flags = f"{LLVM_O0} {_EMITTER_FLAGS}"
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
        probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                               capture_output=True, text=True, timeout=300)
        if probe.returncode != 0:
            print(f"tests: XLA refused {_EMITTER_FLAGS!r}; compiling at {LLVM_O0} only "
                  f"({probe.stderr.strip().splitlines()[-1:]})", file=sys.stderr)
            flags = LLVM_O0
        os.environ[_ENV_KEY] = flags
    return os.environ[_ENV_KEY]


def jax_flags(devices: int = 1) -> str:
    """XLA_FLAGS for a JAX subprocess on ``devices`` simulated CPU devices, compiling fast."""
    if devices > 1:
        return f"--xla_force_host_platform_device_count={devices} {fast_compile()}"
    return fast_compile()


def exact_fast_compile_flags() -> str:
    """XLA_FLAGS for a subprocess that checks plumbing on exact numerics (FMA off,
    ``numerics.EXACT_CPU_XLA_FLAG``) compiling fast: the engine and router-replay drivers."""
    from spade_jax.models import numerics

    return f"{numerics.EXACT_CPU_XLA_FLAG} {fast_compile()}"
