"""Designer rewards, the public names in one place (a re-export module; no logic here).

The rules live one per file under :mod:`spade_jax.spade.rewards` (see its docstring for
the window they score and the file of each rule) and are registered in the one rule
registry, :mod:`spade_jax.rl.registry` (category ``designer_rewards``), whose config
resolver they share with the update rules. Regret and the window's win rate have a single
definition each, in :mod:`spade_jax.spade.regret`.

This module keeps every name experiments, tests and docs import from
``spade_jax.spade.reward`` working with the same signature, so the split did not change
a single import.
"""

from spade_jax.spade.regret import ReturnsLike
from spade_jax.spade.rewards.base import (
    DESIGNER_REWARDS,
    RETURN_BOUNDS,
    DesignerRewardRule,
    Regime,
    ScoredEnvironment,
    StatelessRule,
    StepsLike,
    env_reward_scale,
    make_designer_reward,
    register_designer_reward,
    validate_returns,
    variance_bonus,
    window_returns,
    window_steps,
)
from spade_jax.spade.rewards.blend import (
    BlendConfig,
    BlendReward,
    BlendRule,
    blend_reward,
    plateau_score,
)
from spade_jax.spade.rewards.ema import (
    EMALearningPotential,
    EMALearningPotentialConfig,
    LearningPotential,
)
from spade_jax.spade.rewards.hint_regret import (
    DesignerReward,
    DesignerRewardConfig,
    HintRegretConfig,
    HintRegretReward,
    classify_regime,
    designer_reward,
    flat_top_anchor,
)
from spade_jax.spade.rewards.learning_potential import (
    LearningPotentialConfig,
    LearningPotentialRule,
    WindowLearningPotential,
)
from spade_jax.spade.rewards.micro_lp import (
    MicroLearningPotential,
    MicroLPConfig,
    MicroLPRule,
    window_improvement,
)
from spade_jax.spade.rewards.regret_rule import RegretConfig, RegretRule, WindowRegret
from spade_jax.spade.rewards.solve_rate import SolveRateConfig, SolveRateRule

__all__ = [
    "DESIGNER_REWARDS",
    "RETURN_BOUNDS",
    "BlendConfig",
    "BlendReward",
    "BlendRule",
    "DesignerReward",
    "DesignerRewardConfig",
    "DesignerRewardRule",
    "EMALearningPotential",
    "EMALearningPotentialConfig",
    "HintRegretConfig",
    "HintRegretReward",
    "LearningPotential",
    "LearningPotentialConfig",
    "LearningPotentialRule",
    "MicroLPConfig",
    "MicroLPRule",
    "MicroLearningPotential",
    "Regime",
    "RegretConfig",
    "RegretRule",
    "ReturnsLike",
    "ScoredEnvironment",
    "SolveRateConfig",
    "SolveRateRule",
    "StatelessRule",
    "StepsLike",
    "WindowLearningPotential",
    "WindowRegret",
    "blend_reward",
    "classify_regime",
    "designer_reward",
    "env_reward_scale",
    "flat_top_anchor",
    "make_designer_reward",
    "plateau_score",
    "register_designer_reward",
    "validate_returns",
    "variance_bonus",
    "window_improvement",
    "window_returns",
    "window_steps",
]
