"""Settings of the SPADE self-play loop; each paper ablation is one field here."""

from __future__ import annotations

import dataclasses

from spade_jax.spade.reward import DesignerRewardConfig

DESIGNER_MODES = ("self", "fixed_pool")
BASELINES = ("none", "fixed_env_grpo", "fixed_env_rlve")


@dataclasses.dataclass(frozen=True)
class SpadeConfig:
    """One SPADE run.

    Attributes:
      rounds: self-play rounds (the paper: 400 rollout steps).
      envs_per_round: environment slots per round (the paper: 24).
      designer_group_size: designer samples per slot prompt: the designer's GRPO group.
      n_hint: agent episodes per environment with the hint (the paper: 16).
      designer_delay: k, rounds by which designer updates trail the agent's; the no-hint
        arm runs ``16 * k`` episodes (``n_no_hint`` overrides that).
      n_no_hint: agent episodes per environment without the hint (None = 16 * k scaled
        like n_hint: ``n_hint * designer_delay``).
      skills: "main" (six skills) or "two_skill" (curriculum ablation).
      use_memory: keep and feed back the environment memory (ablation: False).
      use_corpus: condition the designer on freshly sampled corpus documents (ablation: False).
      train_designer: GRPO-update the designer role (self-generation ablation: False).
      designer_mode: "self" (the policy designs) or "fixed_pool" (programs from pool_dir).
      pool_dir: directory of ``*.py`` programs (+ ``*.hint.txt``) for designer_mode fixed_pool;
        empty = the project's seed programs.
      designer_reward: registered designer reward name: "hint_regret" or
        "ema_learning_potential".
      reward: the hint-regret reward's weights, band, thresholds and invalid penalty.
      success_threshold: an episode return at or above this counts as solved (win rate).
      baseline: "none" (SPADE) or a fixed-environment baseline on the reasoning-gym pool:
        "fixed_env_grpo" (uniform tasks) or "fixed_env_rlve" (adaptive difficulty).
      docs_per_prompt: corpus documents per designer prompt.
      max_doc_chars: characters kept of each document in the prompt.
      memory_examples: memory records shown per designer prompt.
      memory_train_envs: environments per round replayed from memory for agent training.
      learnable_window: rounds in the learnable-share window (the paper: 16).
      eval_every: run the held-out suites every N rounds (0 = never).
      agent_advantage / designer_advantage: advantage estimator of each role (a name in
        ``spade_jax.rl.advantage_estimators``: "grpo", "dr_grpo", "rloo"); the loss per
        role is ``train.agent`` / ``train.designer``.
      prompt_style: designer system prompt, "full" (contract, quality criteria, format) or
        "compact" (a few lines, for CPU-sized policies).
    """

    rounds: int = 400
    envs_per_round: int = 24
    designer_group_size: int = 4
    n_hint: int = 16
    designer_delay: int = 1
    n_no_hint: int | None = None
    skills: str = "main"
    use_memory: bool = True
    use_corpus: bool = True
    train_designer: bool = True
    designer_mode: str = "self"
    pool_dir: str = ""
    designer_reward: str = "hint_regret"
    reward: DesignerRewardConfig = dataclasses.field(default_factory=DesignerRewardConfig)
    success_threshold: float = 1.0
    baseline: str = "none"
    docs_per_prompt: int = 2
    max_doc_chars: int = 1500
    memory_examples: int = 2
    memory_train_envs: int = 0
    learnable_window: int = 16
    eval_every: int = 20
    agent_advantage: str = "grpo"
    designer_advantage: str = "grpo"
    prompt_style: str = "full"

    def __post_init__(self):
        for name in ("rounds", "envs_per_round", "designer_group_size", "n_hint",
                     "designer_delay", "learnable_window"):
            if getattr(self, name) < 1:
                raise ValueError(f"spade.{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 < self.success_threshold <= 1.0:
            raise ValueError(f"spade.success_threshold must be in (0, 1], got {self.success_threshold}")
        if self.n_no_hint is not None and self.n_no_hint < 1:
            raise ValueError(f"spade.n_no_hint must be >= 1 or None, got {self.n_no_hint}")
        if self.skills not in ("main", "two_skill"):
            raise ValueError(f"spade.skills must be 'main' or 'two_skill', got {self.skills!r}")
        from spade_jax import rl

        for name in (self.agent_advantage, self.designer_advantage):
            rl.advantage_estimators.get(name)  # KeyError listing the known names
        if self.prompt_style not in ("full", "compact"):
            raise ValueError(f"spade.prompt_style must be 'full' or 'compact', got {self.prompt_style!r}")
        if self.designer_mode not in DESIGNER_MODES:
            raise ValueError(f"spade.designer_mode must be one of {DESIGNER_MODES}")
        if self.baseline not in BASELINES:
            raise ValueError(f"spade.baseline must be one of {BASELINES}, got {self.baseline!r}")
        for name in ("docs_per_prompt", "memory_examples", "memory_train_envs", "eval_every",
                     "max_doc_chars"):
            if getattr(self, name) < 0:
                raise ValueError(f"spade.{name} must be >= 0")

    @property
    def no_hint_episodes(self) -> int:
        """Episodes in the no-hint arm: 16k in the paper (n_hint * k here)."""
        return self.n_no_hint if self.n_no_hint is not None else self.n_hint * self.designer_delay
