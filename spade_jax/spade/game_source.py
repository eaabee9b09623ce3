"""Where a run's games come from: one strategy object, chosen once by the run builder.

`SelfDesign` (SPADE: the policy writes each window's programs), `FixedPool` (a fixed set of
programs drawn without replacement: the fixed-designer ablation, the toy world's pools),
`FixedEnv` (the fixed-environment baselines: no designer, the agent trains on the
baseline's tasks, in a step of their own). The loop asks its source for a window's games
(handing it the loop's `Designer`) and whether the policy writes programs; a source that
plays steps of its own gets `baseline_round.AgentStep`, never the loop itself. The loop
never branches on a mode string. The run
builder maps the experiment's ``spade.designer_mode`` / ``spade.baseline`` to one of these
(`run.build_loop`); a new source is a new class here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from spade_jax.rollout.agent_loop import EpisodeSpec
from spade_jax.spade.baseline_round import AgentStep, run_baseline_round


class FixedEnvBaseline(Protocol):
    """The fixed-environment baselines: this step's episodes (one env each), and what the
    agent's returns on them were (adaptive-difficulty baselines use it)."""

    def episodes(self, round_index: int, plays_per_task: int) -> list[EpisodeSpec]: ...

    def feedback(self, returns_by_env: dict[str, list[float]]) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class GameSource:
    """A window's games. The base plays no step of its own and keeps no state."""

    # Whether the policy writes the programs: then designer samples are trained, a
    # window's missing games are designed again, and the corpus feeds the prompts.
    writes_programs: bool = False

    def new_games(self, designer: Any, step: int) -> tuple[list[Any], list[Any], list[Any]]:
        """The games of the window starting at ``step`` (``designer``: the loop's
        `design.Designer`, which writes, validates and opens programs), the designer samples
        that wait for their delayed update, and the attempts made (for the metrics)."""
        raise NotImplementedError

    def run_step(self, agent: AgentStep, step: int) -> dict[str, float] | None:
        """A whole step of the source's own (the baselines), or None: the loop's step."""
        del agent, step
        return None

    def task_opener(self) -> Callable[[str], Any] | None:
        """What opens a fresh env of one of the source's own tasks by env id (a baseline's
        replacement plays under a group filter's refill), or None: games are programs."""
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        del state


class SelfDesign(GameSource):
    """SPADE: the policy designs each window's games (the loop's `Designer`)."""

    writes_programs = True

    def new_games(self, designer: Any, step: int) -> tuple[list[Any], list[Any], list[Any]]:
        return designer.design(step)


class FixedPool(GameSource):
    """Games drawn from a fixed pool of (program, hint, skill), a seeded permutation per
    pass, so no game comes back before the pool is exhausted; no designer samples."""

    def __init__(self, programs: Sequence[tuple[str, Any, str]]) -> None:
        if not programs:
            raise ValueError("FixedPool needs at least one program (spade.pool_dir is empty?)")
        self.programs = list(programs)
        self.cursor = 0  # draws so far, across passes

    def new_games(self, designer: Any, step: int) -> tuple[list[Any], list[Any], list[Any]]:
        games, self.cursor = designer.fixed_pool_games(step, self.programs, self.cursor)
        return games, [], []

    def state_dict(self) -> dict[str, Any]:
        return {"cursor": self.cursor}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.cursor = int(state.get("cursor", 0))


class FixedEnv(GameSource):
    """A fixed-environment baseline: each step the agent plays the baseline's tasks and
    trains on them (`baseline_round.run_baseline_round`); no designer, no windows."""

    def __init__(self, baseline: FixedEnvBaseline) -> None:
        self.baseline = baseline

    def run_step(self, agent: AgentStep, step: int) -> dict[str, float]:
        return run_baseline_round(agent, self.baseline, step)

    def task_opener(self) -> Callable[[str], Any] | None:
        return getattr(self.baseline, "new_env", None)

    def state_dict(self) -> dict[str, Any]:
        return {"baseline": self.baseline.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("baseline") is not None:
            self.baseline.load_state_dict(state["baseline"])
