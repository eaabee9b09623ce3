"""A gymnasium.Env around a sandboxed environment program, with snapshot/restore/fork.

Observations and actions are `gymnasium.spaces.Text` over the printable ASCII charset.
A program may emit any text; characters outside the charset are replaced by "?" so the
observation is always inside the space, and the unaltered text is kept in
info["raw_observation"] whenever that happened. A sandbox failure in reset() or step()
(a crash, a timeout, a wrong type, a reward outside the contract's bounds, ...) raises
`EnvProgramError` carrying the `SandboxError`, so the failing call reports no observation
and no reward (an out-of-range reward never reaches a return). The agent loop ends the
episode with end_reason "env_error" ("env_limit" when the program broke a run-time limit
and the pool blocklisted it: `EnvProgramError.end_reason`); its record keeps the rewards
of the steps before the failure, and the SPADE loop trains it, like any episode with a
policy token, on that partial return (under the paper contract within [0, 1]; under the
reference contract 0: only a terminating step pays).

Under the reference (recipe) contract the env reports the recipe's score: every step's
reward is 0 except a terminating step's, which is the game's reward clipped to [-1, 1]
(the game's own reward is in info["raw_reward"]), and the episode is truncated after
`max_turns` steps. Summing the step rewards, as the agent loop does, gives the recipe's
episode reward.
"""

from __future__ import annotations

import string
from typing import Any

import gymnasium
from gymnasium import spaces

from spade_jax.envs.contract import AUTO_CONTRACT, REFERENCE_MAX_TURNS, resolve_contract
from spade_jax.envs.pool import EnvHandle, EnvPool, EpisodeSnapshot
from spade_jax.envs.results import SandboxError, StepResult
from spade_jax.envs.validate import default_pool

PRINTABLE = frozenset(string.printable)


def sanitize_observation(text: str, info: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``text`` with non-printable characters replaced by "?" (the raw text kept in
    ``info["raw_observation"]``), unchanged when it is all printable."""
    if all(ch in PRINTABLE for ch in text):
        return text, info
    clean = "".join(ch if ch in PRINTABLE else "?" for ch in text)
    return clean, dict(info, raw_observation=text)


class ProgramLoadError(RuntimeError):
    """make_env() was given a program that the sandbox refused or could not load."""


class EnvProgramError(RuntimeError):
    """reset() or step() of a sandboxed program failed; `error` says why (its `code` is a
    key of REASON_CODES). The episode is over; reset() again starts a new one."""

    def __init__(self, error: SandboxError) -> None:
        super().__init__(str(error))
        self.error = error

    @property
    def end_reason(self) -> str:
        """How the agent loop records the episode: "env_limit" when the program broke a
        run-time limit (and is blocklisted), else "env_error"."""
        return self.error.end_reason


class SandboxedTextEnv(gymnasium.Env):
    """One environment program in its own sandbox worker, as a gymnasium text env."""

    metadata = {"render_modes": []}

    def __init__(
        self,
        source: str,
        pool: EnvPool | None = None,
        *,
        contract: str = AUTO_CONTRACT,
        max_turns: int = REFERENCE_MAX_TURNS,
    ) -> None:
        self.pool = pool if pool is not None else default_pool()
        self.source = source
        self.contract = resolve_contract(contract, source)
        self.max_turns = max_turns
        config = self.pool.config
        charset = "".join(sorted(PRINTABLE))
        self.observation_space = spaces.Text(
            max_length=config.max_observation_chars, min_length=0, charset=charset
        )
        self.action_space = spaces.Text(
            max_length=config.max_action_chars, min_length=0, charset=charset
        )
        self._handle = self._open()

    def _open(self) -> EnvHandle:
        handle = self.pool.open(self.source, contract=self.contract, max_turns=self.max_turns)
        if not handle.ok:
            raise ProgramLoadError(f"environment program rejected: {handle.error}")
        return handle

    @property
    def handle(self) -> EnvHandle:
        return self._handle

    @property
    def tools(self) -> tuple[dict[str, Any], ...] | None:
        """A tool environment's function schemas, as the trainer checked them at load (for
        `EpisodeSpec.tools`: the chat template renders them into the first prompt); None
        under the text contracts. Fixed for the program: a reset that reports other tools
        fails ("bad_tools")."""
        return self._handle.tools

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        if self._handle.worker is None:  # the previous worker died: start a fresh one
            self._handle = self._open()
        program_seed = seed if seed is not None else int(self.np_random.integers(0, 2**31))
        result = self._handle.reset(program_seed)
        if not result.ok:
            raise EnvProgramError(result.error)
        return sanitize_observation(result.observation, result.info)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return self._unpack(self._handle.step(action))

    @staticmethod
    def _unpack(result: StepResult) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if result.error is not None:
            raise EnvProgramError(result.error)
        observation, info = sanitize_observation(result.observation, dict(result.info))
        return observation, result.reward, result.terminated, result.truncated, info

    # -- counterfactual branches --------------------------------------------------------

    def snapshot(self) -> EpisodeSnapshot:
        """The current mid-episode state (seed + actions + transcript digest)."""
        return self._handle.snapshot()

    def restore(self, snapshot: EpisodeSnapshot) -> tuple[str, dict[str, Any]]:
        """Moves this env to `snapshot`'s state (fresh worker, verified replay)."""
        handle = self.pool.fork(snapshot)
        if not handle.ok:
            raise RuntimeError(f"could not restore the snapshot: {handle.error}")
        self._handle.close()
        self._handle = handle
        return sanitize_observation(handle.last_observation, {})

    def fork(self) -> SandboxedTextEnv:
        """An independent copy of this env at its current state, in its own worker."""
        twin = SandboxedTextEnv.__new__(SandboxedTextEnv)
        twin.pool, twin.source = self.pool, self.source
        twin.contract, twin.max_turns = self.contract, self.max_turns
        twin.observation_space, twin.action_space = self.observation_space, self.action_space
        handle = self.pool.fork(self.snapshot())
        if not handle.ok:
            raise RuntimeError(f"could not fork the environment: {handle.error}")
        twin._handle = handle
        twin._np_random = None
        return twin

    def close(self) -> None:
        self._handle.close()


def make_env(
    source: str,
    pool: EnvPool | None = None,
    *,
    contract: str = AUTO_CONTRACT,
    max_turns: int = REFERENCE_MAX_TURNS,
) -> SandboxedTextEnv:
    """The sandboxed gymnasium env of a program (raises ProgramLoadError if it won't load).

    Args:
      source: the program text.
      pool: the sandbox pool (default: the process-wide one).
      contract: "paper" (`class Environment`, return = sum of rewards in [0, 1]),
        "reference" (the recipe's `*Env` games, scored as the recipe scores them),
        "tool" (`class ToolEnvironment`: tool calls, actions as the agent loop's
        ``action_format="tool_call"`` sends them; `env.tools` gives the schemas),
        "reference_tool_use" (the recipe's `ToolUseBaseEnv` games) or "auto" ("paper"
        if the source defines a top-level `class Environment`, else "reference").
      max_turns: the turn budget of the reference and tool contracts (the recipe's 25).
    """
    if not isinstance(source, str):
        raise TypeError(f"program source must be str, got {type(source).__name__}")
    return SandboxedTextEnv(source, pool, contract=contract, max_turns=max_turns)
