"""Sandboxed environment programs: validation, execution and gymnasium wrappers.

    from spade_jax.envs import validate_program, make_env
    report = validate_program(source, hint="...")   # report.ok, report.reason
    env = make_env(source)                          # gymnasium.Env, sandboxed
    env = make_env(game, contract="reference", max_turns=25)   # a recipe-format game

Contracts: "paper" (`class Environment`, `PROGRAM_CONTRACT`), "reference" (the published
recipe's `*Env` games, `REFERENCE_CONTRACT`), the tool contracts "tool"
(`class ToolEnvironment`, `TOOL_CONTRACT`) and "reference_tool_use" (the recipe's
`ToolUseBaseEnv` games), chosen by name, or "auto" (the default: paper or reference,
detected).

The reasoning-gym environments (`make_reasoning_gym_env`, `RG_SUITES`) are imported on
first access: reasoning_gym takes seconds to import.
"""

from spade_jax.envs.config import SandboxConfig
from spade_jax.envs.contract import (
    DEFAULT_ALLOWED_IMPORTS,
    PROGRAM_CONTRACT,
    REFERENCE_CONTRACT,
    TOOL_CONTRACT,
    detect_contract,
    render_contract,
)
from spade_jax.envs.gym_env import (
    EnvProgramError,
    ProgramLoadError,
    SandboxedTextEnv,
    make_env,
)
from spade_jax.envs.pool import (
    EnvHandle,
    EnvPool,
    EpisodeSnapshot,
    IsolationReport,
    arm_order,
)
from spade_jax.envs.results import REASON_CODES, ResetResult, SandboxError, StepResult
from spade_jax.envs.validate import (
    ValidationConfig,
    ValidationReport,
    validate_program,
    validate_programs,
)

_LAZY = {"RG_SUITES", "make_reasoning_gym_env", "ReasoningGymEnv", "rg_tasks_by_category"}

__all__ = [
    "DEFAULT_ALLOWED_IMPORTS",
    "EnvHandle",
    "EnvPool",
    "EpisodeSnapshot",
    "IsolationReport",
    "PROGRAM_CONTRACT",
    "REFERENCE_CONTRACT",
    "TOOL_CONTRACT",
    "EnvProgramError",
    "ProgramLoadError",
    "REASON_CODES",
    "ResetResult",
    "SandboxConfig",
    "SandboxError",
    "SandboxedTextEnv",
    "StepResult",
    "ValidationConfig",
    "ValidationReport",
    "arm_order",
    "detect_contract",
    "make_env",
    "render_contract",
    "validate_program",
    "validate_programs",
    *sorted(_LAZY),
]


def __getattr__(name: str):
    if name in _LAZY:
        from spade_jax.envs import reasoning_gym_envs

        return getattr(reasoning_gym_envs, name)
    raise AttributeError(f"module 'spade_jax.envs' has no attribute {name!r}")
