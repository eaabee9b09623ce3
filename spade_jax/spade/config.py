"""Settings of the SPADE self-play loop; each paper / recipe ablation is one field here.

One round is one optimizer step (the recipe's "rollout"). Games live in regeneration
windows: every ``regeneration_interval`` rounds the designer writes ``envs_per_round`` new
games, and the agent trains on all of them in every round of the window. The recipe's
numbers are the 30B games run of the authors' published code (docs/spade.md); the paper's
text variant (design, hint arms, reward and update every round) is the configuration
``regeneration_interval=1, designer_delay=0, hint_mode="designer",
designer_reward="hint_regret", invalid_penalty=-1.0, designer_groups="prompt"`` with the
designer's rule ``train.designer.advantage_estimator="grpo"`` (experiments/spade_paper_text.py).
Each role's update rule (advantage estimator, step credit, loss, ...) is its
``TrainConfig`` role (``spade_jax.rl.update_rule.RoleConfig``), not part of this config.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from typing import Any


class HintMode(enum.StrEnum):
    """Where a game's hint comes from (`SpadeConfig.hint_mode`)."""

    SELF = "self"  # the recipe: the policy writes one from the program, untrained
    DESIGNER = "designer"  # the paper text: the designer writes it next to the program
    NONE = "none"  # no hint arm


class DesignerMode(enum.StrEnum):
    """Who writes the programs (`SpadeConfig.designer_mode`)."""

    SELF = "self"  # the policy
    FIXED_POOL = "fixed_pool"  # nobody: drawn from spade.pool_dir


class Baseline(enum.StrEnum):
    """SPADE, or a fixed-environment baseline on the reasoning-gym pool."""

    NONE = "none"
    FIXED_ENV_GRPO = "fixed_env_grpo"
    FIXED_ENV_RLVE = "fixed_env_rlve"  # adaptive difficulty


class GameSourceKind(enum.StrEnum):
    """Where a run's games come from (`SpadeConfig.game_source`, `spade.game_source`)."""

    SELF_DESIGN = "self_design"
    FIXED_POOL = "fixed_pool"
    FIXED_ENV = "fixed_env"


class DesignerGroups(enum.StrEnum):
    """How the designer's samples are grouped for its update rule."""

    SKILL = "skill"  # the recipe: per-skill centring, scaled by the env reward scale
    PROMPT = "prompt"  # the paper text: one GRPO group per designer prompt


class MemoryTiming(enum.StrEnum):
    """When a game enters memory (`SpadeConfig.memory_at`)."""

    SCORING = "scoring"
    REGENERATION = "regeneration"


class Contract(enum.StrEnum):
    """The game-program contract the designer is asked for (`spade_jax.envs.contract`)."""

    REFERENCE = "reference"  # the recipe's ``*Env`` classes, boxed actions
    PAPER = "paper"  # ``class Environment``
    # ``class ToolEnvironment``: tools over hidden state, played with native tool calls
    # (the agent needs AgentLoopConfig(action_format="tool_call", observation_role="tool"))
    TOOL = "tool"


class PromptStyle(enum.StrEnum):
    """The designer's system prompt."""

    FULL = "full"
    COMPACT = "compact"  # CPU-sized policies


class CorpusDraws(enum.StrEnum):
    """How corpus documents are drawn (`spade.corpus.CORPUS_DRAWS`)."""

    WITHOUT_REPLACEMENT = "without_replacement"
    UNIFORM = "uniform"


class MemorySelection(enum.StrEnum):
    """Which memory records the designer is shown (`spade.memory.SELECTIONS`)."""

    REGIME = "regime"
    RECIPE = "recipe"


class ProgramExtraction(enum.StrEnum):
    """How a designer reply becomes a program (`spade.extraction.PROGRAM_EXTRACTIONS`)."""

    LAST_BLOCK = "last_block"
    RECIPE = "recipe"


@dataclasses.dataclass(frozen=True)
class SpadeConfig:
    """One SPADE run.

    Attributes:
      rounds: optimizer steps (recipe: 400 rollouts); the last one flushes every designer
        sample still waiting for its delayed update.
      envs_per_round: games written per regeneration and played in every round of the
        window (recipe: 24). Must be a multiple of designer_group_size.
      regeneration_interval: rounds per window; new games at rounds 0, I, 2I... (recipe 4).
      plays_per_game: no-hint agent episodes per game per round = the agent's GRPO group
        (recipe: ceil(192 / 24) = 8).
      hint_plays: hint-arm episodes per game, played once at the regeneration round, never
        trained; their mean is cached for the window (recipe 16).
      designer_delay: rounds between writing a designer sample (round K) and training it
        (round K + delay) on the window's statistics; 0 = the same round (recipe 4).
      designer_group_size: designer samples per prompt (recipe 1; the paper text's GRPO
        group, e.g. 4).
      max_design_attempts: rejection sampling: attempts per designer sample until its
        program validates (recipe 5). Only valid attempts become games.
      supervised_replay: designer warm-start examples (prompt -> program, the warm start's
        own) added to every update as supervised rows, drawn with seed (seed, step,
        SUPERVISED_REPLAY); their NLL weighs ``train.supervised_coef`` (PPO-ptx; needs it
        > 0). 0 (recipe): none. An anchor for a policy whose program writing is learned
        from few examples and erodes as the shared weights train.
      supervised_replay_masks_level: the replayed rows do not train the tokens of their
        program's stated level (``LEVEL = n``, the toy world's): the replay anchors how a
        program is written, not the warm start's mix of levels, which RL's choice of level
        is meant to leave. Needs ``supervised_replay``.
      invalid_penalty: None (recipe): invalid attempts are never trained. A float: every
        invalid attempt (and a valid game that scored nothing) is trained with this
        designer reward (the paper text's -1); under skill groups it joins its skill's
        group whatever its sign (the recipe's drop of totals < 0 is for scores).
      hint_mode: "self" (recipe): after a game validates, the policy writes a short
        strategy hint from its source in a separate untrained call; "designer": the hint
        the designer wrote next to the program; "none": no hint arm.
      hint_temperature / hint_max_tokens / hint_attempts: the hint writer's sampling
        (recipe 0.3, 4096, 3 tries for a non-empty hint).
      hint_pattern: a regular expression a written hint must match in full to be used
        (tried again like an empty one); "" (recipe): any non-empty hint. A form check
        only, for worlds whose hints have a known shape (``chain:hint``'s tables); what
        the hint says is still the policy's.
      skills: a set of ``spade.skills.SKILL_SETS``: "main" (the recipe's six), "two_skill"
        (the recipe's curriculum ablation), "project" (the seed library's six).
      skills_per_window: skills active per regeneration, consecutive disjoint blocks of the
        skill list (recipe 3); 0 = every skill every window. Games are split evenly over
        the active skills.
      use_memory: keep and feed back the environment memory (ablation: False).
      use_corpus: condition the designer on freshly sampled corpus documents (ablation: False).
      train_designer: train the designer role (self-generation ablation: False).
      train_agent: train the agent role (default). False: the agent still plays every
        game and its returns still score the designer, but its samples are not trained,
        so its frontier stays where the warm start left it (``toy:check``, the designer
        path's learning check, where the designer has one place to go).
      designer_mode: "self" (the policy designs) or "fixed_pool" (programs from pool_dir,
        drawn without replacement across the run).
      pool_dir: directory of programs for designer_mode fixed_pool (``*.py`` + hints or the
        recipe's ``games/game_*.py``); empty = the project's seed programs.
      designer_reward: registered designer reward rule ("blend", "solve_rate", "regret",
        "learning_potential", "micro_lp", "hint_regret", ...); designer_reward_config: its
        settings (None = the rule's defaults, or a dict of overrides).
      designer_groups: the designer's advantage groups: "skill" (recipe: the samples of one
        skill, totals < 0 dropped, the rule's advantages times the env reward scale; with
        the rule's mean-centring estimator "dr_grpo" this is the recipe's per-skill
        centring) or "prompt" (the samples of one designer prompt, unscaled: paper text).
        The estimator itself is ``train.designer.advantage_estimator``.
      max_env_reward_scale: cap of the designer advantage scale actor / designer samples x
        interval (recipe 50).
      contract: the game-program contract, "reference" (the recipe's ``*Env`` classes,
        boxed actions) or "paper" (``class Environment``).
      baseline: "none" (SPADE) or a fixed-environment baseline on the reasoning-gym pool.
      docs_per_prompt / max_doc_chars: corpus documents per designer prompt, characters kept.
      max_doc_words: words kept from each document before the character cut (0 = no word
        cut; recipe 6000).
      max_program_chars: characters of a memory game's program shown in the designer
        prompt (recipe 2000: its memory stores a 2000-character excerpt).
      memory_capacity: environments the memory keeps (recipe: 200).
      memory_examples: memory records shown per designer prompt (with memory_selection
        "recipe": games to build on, besides one game to avoid).
      memory_selection: ``MemoryConfig.selection``: "regime" (examples by regime, the
        lowest-priority regime evicted first) or "recipe" (the top 10 by regret among games
        with win rate in [0.15, 0.85], one too easy or too hard game to avoid, first in,
        first out).
      memory_train_envs: memory games replayed for agent training every round.
      learnable_window: rounds in the learnable-share window (the paper: 16).
      eval_every: run the held-out suites every N rounds (0 = never).
      prompt_style: designer system prompt, "full" or "compact" (CPU-sized policies), of
        either contract (the reference contract's asks for no hint).
      designer_thinking: the chat template's thinking switch for designer prompts (the
        recipe: on for Qwen3-8B's designer only; the agent's is ``agent.enable_thinking``).
      probe_episodes / probe_time_budget_s: scripted sandbox episodes per new program (and
        their wall-clock budget) measuring the reward levels the PROGRAM can emit (the
        paper's reward-level metrics); 0 = not measured.
      global_batch: samples per update (recipe 192): the round's designer samples first,
        then the agent's, cut to this many, so at designer-training rounds the last games'
        plays are not trained (the authors' code); 0 = train every sample.
      regenerate_missing_games: when fewer games than ``envs_per_round`` validated, write
        the missing ones at the window's later rounds (recipe True) and play each game
        ceil(global_batch / games) times (``plays_per_game`` is then the floor; the
        recipe's 192 / 24 = 8). False: the window keeps the games it has, 8 plays each.
      memory_at: when a game enters memory: "scoring" (when its designer samples are
        scored, with the window's statistics) or "regeneration" (recipe: at the end of the
        round that wrote it, with that round's plays, usable by the next design).
      flush_at_end: the last round trains every designer sample still waiting (True) or
        only those due (False, the recipe: the last window's samples are never trained).
      play_env_seconds: a play whose environment calls took longer than this (recipe 300)
        is dropped and its game blocklisted; 0 = no limit.
      drop_failed_plays: a play that ended on a sandbox limit (``env_limit``: a call over
        the sandbox's play deadline, recipe 30 s) or an environment error is dropped (not
        trained, not counted in the game's statistics) and its game blocklisted for the
        rest of the run (recipe True); False: scored as a 0 play (``env_error`` return).
      fresh_prompt_per_attempt: every rejection-sampling attempt redraws its slot's
        corpus documents and memory examples (recipe True); False: one prompt per slot.
      corpus_draws: "without_replacement" (a document is used once per run; the corpus
        must hold rounds' worth) or "uniform" (recipe: independent uniform draws, repeats
        allowed).
      hint_top_p: top-p of the hint writer's sampler (recipe 0.9; 0 = the designer's).
      program_extraction: how a designer reply becomes a program
        (``spade.extraction.PROGRAM_EXTRACTIONS``): "last_block" (the last python block,
        a reply without one is a parse error) or "recipe" (the first python block, else
        the whole reply, f-string braces repaired). It reads no hint: replies that carry
        their hint (hint_mode "designer") are always read with "last_block".
    """

    rounds: int = 400
    envs_per_round: int = 24
    regeneration_interval: int = 4
    plays_per_game: int = 8
    hint_plays: int = 16
    designer_delay: int = 4
    designer_group_size: int = 1
    max_design_attempts: int = 5
    invalid_penalty: float | None = None
    supervised_replay: int = 0
    supervised_replay_masks_level: bool = False
    hint_mode: HintMode = HintMode.SELF
    hint_temperature: float = 0.3
    hint_max_tokens: int = 4096
    hint_attempts: int = 3
    hint_pattern: str = ""
    skills: str = "main"
    skills_per_window: int = 3
    use_memory: bool = True
    use_corpus: bool = True
    train_designer: bool = True
    train_agent: bool = True
    designer_mode: DesignerMode = DesignerMode.SELF
    pool_dir: str = ""
    designer_reward: str = "blend"
    designer_reward_config: Any = None
    designer_groups: DesignerGroups = DesignerGroups.SKILL
    max_env_reward_scale: float = 50.0
    contract: Contract = Contract.REFERENCE
    baseline: Baseline = Baseline.NONE
    docs_per_prompt: int = 1
    max_doc_chars: int = 1500
    max_doc_words: int = 0
    max_program_chars: int = 4000
    memory_capacity: int = 512
    memory_selection: MemorySelection = MemorySelection.REGIME
    memory_examples: int = 2
    memory_train_envs: int = 0
    learnable_window: int = 16
    eval_every: int = 20
    prompt_style: PromptStyle = PromptStyle.FULL
    designer_thinking: bool = False
    probe_episodes: int = 4
    probe_time_budget_s: float = 10.0
    global_batch: int = 0
    regenerate_missing_games: bool = False
    memory_at: MemoryTiming = MemoryTiming.SCORING
    flush_at_end: bool = True
    play_env_seconds: float = 0.0
    drop_failed_plays: bool = False
    fresh_prompt_per_attempt: bool = False
    corpus_draws: CorpusDraws = CorpusDraws.WITHOUT_REPLACEMENT
    hint_top_p: float = 0.0
    program_extraction: ProgramExtraction = ProgramExtraction.LAST_BLOCK

    def __post_init__(self):
        for name in ("rounds", "envs_per_round", "regeneration_interval", "plays_per_game",
                     "designer_group_size", "max_design_attempts", "hint_attempts",
                     "hint_max_tokens", "learnable_window", "memory_capacity",
                     "max_program_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"spade.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("hint_plays", "designer_delay", "docs_per_prompt", "memory_examples",
                     "memory_train_envs", "eval_every", "max_doc_chars", "max_doc_words",
                     "skills_per_window", "global_batch",
                     "probe_episodes", "supervised_replay"):
            if getattr(self, name) < 0:
                raise ValueError(f"spade.{name} must be >= 0, got {getattr(self, name)}")
        if self.envs_per_round % self.designer_group_size:
            raise ValueError(f"spade.envs_per_round ({self.envs_per_round}) must be a multiple "
                             f"of spade.designer_group_size ({self.designer_group_size})")
        # Mode fields take their enum's values (a string from an experiment file or an
        # override is converted here, so every branch compares enum members).
        for field in dataclasses.fields(self):
            if isinstance(field.default, enum.Enum):
                kind, value = type(field.default), getattr(self, field.name)
                try:
                    object.__setattr__(self, field.name, kind(value))
                except ValueError:
                    raise ValueError(f"spade.{field.name} must be one of "
                                     f"{[m.value for m in kind]}, got {value!r}") from None
        from spade_jax.spade.skills import SKILL_SETS

        if self.skills not in SKILL_SETS:
            raise ValueError(f"spade.skills must be one of {sorted(SKILL_SETS)}, got {self.skills!r}")
        try:
            re.compile(self.hint_pattern)
        except re.error as error:
            raise ValueError(f"spade.hint_pattern is not a regular expression "
                             f"({error}): {self.hint_pattern!r}") from None
        if not self.hint_temperature >= 0:
            raise ValueError(f"spade.hint_temperature must be >= 0, got {self.hint_temperature}")
        if self.hint_mode != HintMode.NONE and self.hint_plays < 1:
            raise ValueError(f"spade.hint_mode={self.hint_mode!r} needs spade.hint_plays >= 1")
        if not self.max_env_reward_scale > 0:
            raise ValueError(f"spade.max_env_reward_scale must be > 0, got {self.max_env_reward_scale}")
        if not self.play_env_seconds >= 0:
            raise ValueError(f"spade.play_env_seconds must be >= 0, got {self.play_env_seconds}")
        if not 0 <= self.hint_top_p <= 1:
            raise ValueError(f"spade.hint_top_p must be in [0, 1], got {self.hint_top_p}")
        if self.designer_writes_hints and self.contract != Contract.PAPER and \
                self.designer_mode == DesignerMode.SELF:
            raise ValueError(f"spade.hint_mode='designer' needs spade.contract='paper': the "
                             f"{self.contract.value} contract's designer prompt asks for a "
                             f"program without a hint (use hint_mode='self')")
        if not self.train_agent and (self.baseline != Baseline.NONE or not self.train_designer
                                     or self.designer_mode != DesignerMode.SELF):
            raise ValueError("spade.train_agent=False trains the designer alone, so it needs "
                             "spade.designer_mode='self', spade.train_designer=True and no "
                             "baseline (otherwise the run would train nothing)")

    @property
    def game_source(self) -> GameSourceKind:
        """Where the games come from, read once by the run builder (`run.build_game_source`
        makes the strategy object): a baseline's fixed environments, a fixed pool, or the
        policy's own designs."""
        if self.baseline != Baseline.NONE:
            return GameSourceKind.FIXED_ENV
        if self.designer_mode == DesignerMode.FIXED_POOL:
            return GameSourceKind.FIXED_POOL
        return GameSourceKind.SELF_DESIGN

    @property
    def designer_writes_hints(self) -> bool:
        """The designer writes each game's hint next to its program (the paper text), so
        its replies are parsed for one and a game's hint is the designer's."""
        return self.hint_mode == HintMode.DESIGNER

    @property
    def policy_writes_hints(self) -> bool:
        """The policy writes a hint for each validated game in a separate call (recipe)."""
        return self.hint_mode == HintMode.SELF

    @property
    def num_slots(self) -> int:
        """Designer prompts per regeneration (one GRPO group each)."""
        return self.envs_per_round // self.designer_group_size

    def is_regeneration(self, step: int) -> bool:
        return step % self.regeneration_interval == 0

    def window_start(self, step: int) -> int:
        return step - step % self.regeneration_interval

    def plays_for(self, live_games: int) -> int:
        """No-hint plays per game this round: ``plays_per_game``, or with
        ``regenerate_missing_games`` and a global batch, ceil(global_batch / games) (the
        recipe's rule when some slots failed: 192 / 23 games -> 9 plays each)."""
        if self.regenerate_missing_games and self.global_batch and live_games:
            return max(self.plays_per_game, -(-self.global_batch // live_games))
        return self.plays_per_game
