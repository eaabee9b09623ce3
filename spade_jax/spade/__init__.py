"""SPADE loop pieces that do not need the model: designer reward, corpus, memory, metrics.

Kept free of the model (numpy and etils; jax only through `spade_jax.rl.registry`, the one
rule registry the designer rewards are registered in): the round loop built on these pieces
lives next to them and imports the model itself.

- where the regret is defined: `regret.py` (`regret`, `mean_return`, `window_win_rate`: one
  definition for every reward rule and for the loop's logged and remembered statistics)
- designer reward rules, one per file: `rewards/` (`blend.py`; paper text:
  `hint_regret.py::designer_reward`), re-exported by `reward.py`
- corpus grounding: `corpus.py` (readers, mixture, resumable sampler), `default_corpus.py`
- environment memory: `memory.py`
- diversity (Vendi) and the offline program featuriser: `diversity.py`
- code-level difficulty stats and the learnable share: `env_stats.py`
- skill sets (six-skill main run, two-skill ablation): `skills.py`
"""

from spade_jax.spade.corpus import (
    Corpus,
    CorpusExhaustedError,
    CorpusSampler,
    CorpusSamplerConfig,
    Document,
    InMemoryCorpus,
    JsonlCorpus,
    MixtureCorpus,
    ParquetCorpus,
    TextShardConfig,
)
from spade_jax.spade.default_corpus import DefaultCorpusConfig, default_corpus
from spade_jax.spade.diversity import (
    FeaturiserConfig,
    ProgramFeaturiser,
    normalized_vendi_score,
    vendi_score,
    vendi_score_from_similarity,
)
from spade_jax.spade.env_stats import (
    LearnableShareConfig,
    LearnableShareTracker,
    ProbeConfig,
    ProgramLevels,
    agent_return_levels,
    agent_return_strict_partial_levels,
    formula_reveal,
    formula_reveal_rate,
    formula_reveal_reason,
    is_physics_environment,
    physics_formula_reveal,
    probe_program_levels,
    reward_levels,
    strict_partial_levels,
)
from spade_jax.spade.memory import EnvironmentMemory, EnvironmentRecord, MemoryConfig
from spade_jax.spade.reward import (
    DESIGNER_REWARDS,
    BlendConfig,
    BlendReward,
    DesignerReward,
    DesignerRewardConfig,
    DesignerRewardRule,
    EMALearningPotential,
    EMALearningPotentialConfig,
    HintRegretReward,
    LearningPotential,
    Regime,
    blend_reward,
    designer_reward,
    env_reward_scale,
    make_designer_reward,
    register_designer_reward,
)
from spade_jax.spade.skills import (
    MAIN_SKILLS,
    SKILL_SETS,
    TWO_SKILL_CURRICULUM,
    Skill,
    get_skill_set,
)

__all__ = [
    "DESIGNER_REWARDS",
    "MAIN_SKILLS",
    "SKILL_SETS",
    "TWO_SKILL_CURRICULUM",
    "BlendConfig",
    "BlendReward",
    "Corpus",
    "CorpusExhaustedError",
    "CorpusSampler",
    "CorpusSamplerConfig",
    "DefaultCorpusConfig",
    "DesignerReward",
    "DesignerRewardConfig",
    "DesignerRewardRule",
    "Document",
    "EMALearningPotential",
    "EMALearningPotentialConfig",
    "EnvironmentMemory",
    "EnvironmentRecord",
    "FeaturiserConfig",
    "HintRegretReward",
    "InMemoryCorpus",
    "JsonlCorpus",
    "LearnableShareConfig",
    "LearnableShareTracker",
    "LearningPotential",
    "MemoryConfig",
    "MixtureCorpus",
    "ProbeConfig",
    "ParquetCorpus",
    "ProgramFeaturiser",
    "ProgramLevels",
    "Regime",
    "Skill",
    "TextShardConfig",
    "agent_return_levels",
    "agent_return_strict_partial_levels",
    "blend_reward",
    "default_corpus",
    "designer_reward",
    "env_reward_scale",
    "formula_reveal",
    "formula_reveal_rate",
    "formula_reveal_reason",
    "get_skill_set",
    "is_physics_environment",
    "make_designer_reward",
    "normalized_vendi_score",
    "physics_formula_reveal",
    "probe_program_levels",
    "register_designer_reward",
    "reward_levels",
    "strict_partial_levels",
    "vendi_score",
    "vendi_score_from_similarity",
]
