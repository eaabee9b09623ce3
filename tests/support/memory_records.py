"""`EnvironmentRecord`s built from a `designer_reward` result, for the memory and prompt
tests (the loop builds its records from a window's game statistics instead)."""

from __future__ import annotations

from typing import Any

from spade_jax.spade.memory import EnvironmentRecord
from spade_jax.spade.reward import DesignerReward


def record_from_reward(env_id: str, program_source: str, hint: str, skill: str,
                       round_index: int, reward: DesignerReward, **extra: Any
                       ) -> EnvironmentRecord:
    """A memory record carrying ``reward``'s regime, regret, win rates and mean returns;
    ``extra`` sets the record's optional fields."""
    return EnvironmentRecord(
        env_id=env_id, program_source=program_source, hint=hint, skill=skill,
        round_index=round_index, regime=reward.regime, regret=reward.regret,
        win_rate_hint=reward.win_rate_hint, win_rate_no_hint=reward.win_rate,
        mean_return_hint=reward.mean_hint, mean_return_no_hint=reward.mean_no_hint,
        designer_reward=reward.total, **extra)
