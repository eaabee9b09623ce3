"""XLA flags of the suite's JAX processes: LLVM at -O0 for XLA:CPU (the suite's time is
mostly compiling tiny programs; -O0 compiles them about a third faster and changes only the
last bits of results, tests/models/test_opt_level.py). tests/conftest.py sets it for the
pytest processes; a test that starts a JAX subprocess with XLA_FLAGS of its own builds them
here (``jax_flags()``), unless it checks numerics at the default level (the exact-replay
driver's main report, the default-numerics replay bound; the engine and router-replay
drivers check plumbing on exact numerics and add -O0 to the exact flag), a result
measured at it (the learning check), or runs mostly compiled code
rather than compiling (a `spade_jax.train` run's warm start took 123 s at -O0 against
80 s: the train-command tests with a warm start keep the default level; those without
one, the kill and resume runs, are mostly compiling and use -O0: 51 s against 64-71 s)."""

from __future__ import annotations

LLVM_O0 = "--xla_backend_optimization_level=0"
# The suite's compile flags: LLVM at -O0, XLA:CPU's classic fusion emitters instead of the
# MLIR ones, one LLVM module per program instead of parallel codegen splits.
FAST_COMPILE = (f"{LLVM_O0} --xla_cpu_use_fusion_emitters=false "
                "--xla_cpu_parallel_codegen_split_count=1")


def jax_flags(devices: int = 1) -> str:
    """XLA_FLAGS for a JAX subprocess on ``devices`` simulated CPU devices, at -O0."""
    if devices > 1:
        return f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}"
    return FAST_COMPILE


def exact_flags_o0() -> str:
    """XLA_FLAGS for a subprocess that checks plumbing on exact numerics (FMA off,
    ``numerics.EXACT_CPU_XLA_FLAG``) at -O0: the engine and router-replay drivers."""
    from spade_jax.models import numerics

    return f"{numerics.EXACT_CPU_XLA_FLAG} {FAST_COMPILE}"
