"""One SPADE round = one optimizer step, as plain Python around the jitted sampler and step.

Rounds are grouped in regeneration windows of ``regeneration_interval`` rounds (the
published recipe: 4). In every round:

    design   -> (regeneration rounds only) the policy, as designer, writes
                ``envs_per_round`` programs grounded in corpus documents and memory
                examples, rejection-sampled until they validate (design.py)
    validate -> every program through the sandbox's validation; hint_mode "self": the
                policy writes each valid game's hint in an untrained call
    play     -> the agent plays every game of the window ``plays_per_game`` times (its GRPO
                group); at the regeneration round also ``hint_plays`` times with the hint
                (cached for the window, never trained); plus replays from memory
    score    -> designer samples written ``designer_delay`` rounds ago are scored by the
                designer reward rule on their window's returns so far (the last round
                flushes them all)
    advantage-> each role's update rule (``TrainConfig.agent`` / ``.designer``, a
                ``rl.update_rule.RoleConfig``) turns its groups into training sequences:
                agent group = the plays of one game this round; designer groups = one
                skill's samples, times the env reward scale (recipe) or one prompt's;
                a filter that refills (DAPO) has dropped agent groups replaced by new
                plays of the round's games (seeded from Phase.REFILL)
    update   -> one step on agent and designer samples together

A checkpoint taken after any round resumes exactly: windows, cached hint returns and
pending designer samples are in ``state_dict()``, and every draw is seeded from
(experiment seed, round, phase, index).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import gymnasium
import numpy as np

from spade_jax import distributed
from spade_jax.envs import EnvPool, arm_order
from spade_jax.rl.batch import SUPERVISED, TrainSequence
from spade_jax.rl.episodes import GroupRequest, StepContext
from spade_jax.rl.forks import PolicyRollouts
from spade_jax.rl.update_rule import DEFAULT_DESIGNER_RULE, Group, RoleConfig, apply_rule
from spade_jax.rollout.agent_loop import EpisodeSpec
from spade_jax.rollout.records import EndReason, EpisodeRecord
from spade_jax.seeding import Phase, derive_seed
from spade_jax.spade import agreement, env_copies, env_stats, step_metrics
from spade_jax.spade.baseline_round import AgentStep
from spade_jax.spade.config import Contract, DesignerGroups, MemoryTiming, SpadeConfig
from spade_jax.spade.corpus import CorpusSampler
from spade_jax.spade.design import Designer, PromptSampler
from spade_jax.spade.game_source import GameSource, SelfDesign
from spade_jax.spade.memory import EnvironmentMemory, EnvironmentRecord
from spade_jax.spade.prompts import agent_first_observation
from spade_jax.spade.reward import (
    DesignerRewardRule,
    ScoredEnvironment,
    env_reward_scale,
)
from spade_jax.spade.window import (
    VALID,
    DesignerSample,
    Game,
    GameStats,
    Outcome,
    Pending,
    Verdict,
    Window,
    game_stats,
)

log = logging.getLogger(__name__)


class HintedEnv(gymnasium.Wrapper):
    """Shows a hint to the agent with the first observation. The program never sees it:
    only the observation text going to the policy changes."""

    def __init__(self, env: gymnasium.Env, hint: str):
        super().__init__(env)
        self.hint = hint

    def reset(self, **kwargs):
        observation, info = self.env.reset(**kwargs)
        return agent_first_observation(observation, self.hint), info

    @property
    def tools(self) -> tuple[dict[str, Any], ...] | None:
        """The wrapped tool environment's schemas (gymnasium wrappers forward no attributes)."""
        return getattr(self.env, "tools", None)


class RunEpisodes(Protocol):
    """Plays the episodes (sampler call i seeded from ``derive_seed(seed, i)``)."""

    def __call__(self, specs: list[EpisodeSpec], *, seed: int) -> list[EpisodeRecord]: ...


Update = Callable[[list[TrainSequence]], dict[str, float]]


class SpadeLoop:
    """Run state of self-play (windows, pending designer samples, memory, corpus cursor,
    trackers) and the rounds. ``state_dict()`` is everything a checkpoint needs beyond
    the weights. Sampling, episodes and the update are injected callables, so the same
    logic runs with the real policy and with a scripted one in tests."""

    def __init__(self, config: SpadeConfig, *, tokenizer: Any, pool: EnvPool | None,
                 generate: PromptSampler, run_episodes: RunEpisodes, update: Update,
                 corpus_sampler: CorpusSampler | None, memory: EnvironmentMemory,
                 reward_rule: DesignerRewardRule, source: GameSource | None = None,
                 seed: int = 0, max_turns: int = 25,
                 rules: tuple[RoleConfig, RoleConfig] | None = None):
        self.config, self.tokenizer = config, tokenizer
        # Each role's update rule (TrainConfig.agent, TrainConfig.designer).
        agent_rule, designer_rule = rules or (RoleConfig(), DEFAULT_DESIGNER_RULE)
        self.rules = {"agent": agent_rule, "designer": designer_rule}
        if getattr(designer_rule.filter, "max_refill_rounds", 0) > 0:
            raise ValueError("train.designer.filter.max_refill_rounds must be 0: designer "
                             "samples are not plays of an environment, so the loop cannot "
                             "refill the designer's dropped groups")
        self.rule_metrics: dict[str, float] = {}
        self.step_attempts: list[Any] = []  # the designer attempts of the last step
        self.step_games: list[Game] = []  # the games written in the last step
        self.run_episodes, self.update = run_episodes, update
        self.corpus_sampler, self.memory, self.reward_rule = corpus_sampler, memory, reward_rule
        # Where the games come from (SelfDesign, FixedPool, FixedEnv): chosen by the run.
        self.source, self.seed = source if source is not None else SelfDesign(), seed
        # What spade.supervised_replay draws from (the run sets it: the warm start's
        # designer examples).
        self.supervised_examples: list[TrainSequence] = []
        self.designer = Designer(config, tokenizer=tokenizer, pool=pool, generate=generate,
                                 corpus_sampler=corpus_sampler, memory=memory, seed=seed,
                                 max_turns=max_turns)
        self.learnable = env_stats.LearnableShareTracker(
            env_stats.LearnableShareConfig(window=config.learnable_window))
        self.windows: dict[int, Window] = {}
        self.pending: list[Pending] = []

    # ---- run state ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "corpus": self.corpus_sampler.state_dict() if self.corpus_sampler else None,
            "memory": self.memory.state_dict(),
            "learnable": self.learnable.state_dict(),
            "reward_rule": self.reward_rule.state_dict(),
            "designer": self.designer.state_dict(),
            "windows": [w.to_json() for w in self.windows.values()],
            "pending": [p.to_json() for p in self.pending],
            "source": self.source.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.corpus_sampler and state.get("corpus"):
            self.corpus_sampler.load_state_dict(state["corpus"])
        self.memory.load_state_dict(state["memory"])
        self.learnable.load_state_dict(state["learnable"])
        self.reward_rule.load_state_dict(state["reward_rule"])
        self.designer.load_state_dict(state["designer"])
        self.windows = {int(w["start"]): Window.from_json(w) for w in state["windows"]}
        self.pending = [Pending.from_json(p) for p in state["pending"]]
        source = state.get("source")
        if source is None:  # a checkpoint written before the game sources
            source = {"cursor": state.get("pool_cursor", 0), "baseline": state.get("baseline")}
        self.source.load_state_dict(source)

    # ---- the round -----------------------------------------------------------------------
    def run_step(self, step: int) -> dict[str, float]:
        """One optimizer step: design (regeneration rounds, and a window's missing games),
        play, score, update."""
        cfg = self.config
        own = self.source.run_step(self.agent_step(), step)
        if own is not None:  # a fixed-environment baseline's step
            return own
        timer = step_metrics.PhaseTimer()
        attempts: list[Any] = []
        missing_designed = 0
        if cfg.is_regeneration(step):
            with timer("design"):
                attempts = self.regenerate(step)
        window = self.windows[cfg.window_start(step)]
        if not cfg.is_regeneration(step) and self._designs_missing():
            with timer("design"):
                attempts, missing_designed = self.design_missing(window, step)
        with timer("rollout"):
            records = self.play(window, step)
        if cfg.use_memory and cfg.memory_at == MemoryTiming.REGENERATION:
            self.remember_played(window, step)
        kept = [r for r in records if not getattr(r, "dropped", False)]
        agent = self.agent_sequences([r for r in kept if not r.hinted], step)
        with timer("score"):
            scored, designer = self.score_due(step, num_agent=len(agent))
        with timer("update"):
            seqs, trimmed = self.batch(designer, agent)
            if seqs:
                seqs += self.supervised_rows(step)
            update_metrics = self.update(seqs) if seqs else {"skipped_no_data": 1.0}
        if cfg.memory_at == MemoryTiming.SCORING:
            self.remember(scored)
        self._retire_windows(step)
        # The loop's own state moves here; the metrics are a pure function of the step.
        offset = step - window.start
        learnable = self.learnable.record_step(
            [float(np.mean(g.returns_by_offset[offset])) for g in window.games
             if g.verdict.ok and g.returns_by_offset[offset]])
        metrics = step_metrics.step_metrics(
            cfg, step=step, window=window, attempts=attempts, records=kept, scored=scored,
            classify=self.memory.classify, learnable_share=learnable,
            pending=sum(len(p.samples) for p in self.pending),
            memory_regimes=self.memory.regime_counts(),
            num_agent=len(agent) if cfg.train_agent else 0,
            num_designer=len(designer), update_metrics=update_metrics, times=timer.times)
        metrics.update(self.pop_rule_metrics())
        self.step_attempts = attempts
        self.step_games = [g for g in window.games if g.written_round(window.start) == step]
        metrics.update(_play_metrics(records))
        metrics["batch/trimmed"] = float(trimmed)
        metrics["designer/missing_designed"] = float(missing_designed)
        return metrics

    def supervised_rows(self, step: int) -> list[TrainSequence]:
        """``spade.supervised_replay`` of ``supervised_examples`` for this step's update, as
        supervised rows (trained by ``train.supervised_coef``'s NLL term, PPO-ptx), drawn
        with replacement with seed (seed, step, SUPERVISED_REPLAY): a resumed run draws
        the same ones."""
        count, examples = self.config.supervised_replay, self.supervised_examples
        if not count:
            return []
        if not examples:
            raise ValueError("spade.supervised_replay > 0 but the loop was given no "
                             "supervised examples to replay")
        rng = np.random.default_rng(derive_seed(self.seed, step, Phase.SUPERVISED_REPLAY))
        return [dataclasses.replace(examples[i], role=SUPERVISED)
                for i in rng.integers(0, len(examples), count)]

    def agent_step(self) -> AgentStep:
        """The operations lent to a game source that plays steps of its own."""
        return AgentStep(seed=self.seed, plays_per_game=self.config.plays_per_game,
                         run_episodes=self.run_episodes, agent_sequences=self.agent_sequences,
                         update=self.update, record_learnable=self.learnable.record_step,
                         pop_rule_metrics=self.pop_rule_metrics)

    def batch(self, designer: list[TrainSequence], agent: list[TrainSequence]
              ) -> tuple[list[TrainSequence], int]:
        """The update's samples and how many were cut. With ``global_batch`` (the recipe):
        the designer's first, then the agent's, cut to that many, so at designer-training
        rounds the last games' plays are not trained. Without: every agent sample, then
        every designer sample. With ``train_agent`` off, the designer's only."""
        if not self.config.train_agent:
            agent = []
        limit = self.config.global_batch
        if not limit:
            return agent + designer, 0
        seqs = designer + agent
        return seqs[:limit], max(0, len(seqs) - limit)

    # ---- design --------------------------------------------------------------------------
    def regenerate(self, step: int) -> list[Any]:
        """New window at ``step``: games (designed or drawn from the pool), hints, and the
        designer samples that wait for their delayed update. Returns the attempts made."""
        cfg = self.config
        games, samples, attempts = self.source.new_games(self.designer, step)
        self._prepare(games, step)
        self.windows[step] = Window(step, games)
        self.pending.append(Pending(step, samples if cfg.train_designer else []))
        return attempts

    def _designs_missing(self) -> bool:
        return self.config.regenerate_missing_games and self.source.writes_programs

    def design_missing(self, window: Window, step: int) -> tuple[list[Any], int]:
        """``regenerate_missing_games`` (the recipe): the designer writes the window's
        missing games at a later round of the window (slots whose attempts all failed, or
        whose game was blocklisted); they play from this round on, with their own hint arm
        at this round. Their designer samples join the window's pending ones (trained with
        them). Returns (attempts, games written)."""
        cfg = self.config
        live = {g.slot for g in window.games if g.verdict.ok}
        missing = [s for s in range(cfg.num_slots) if s not in live]
        if not missing:
            return [], 0
        games, samples, attempts = self.designer.design(window.start, missing, written_at=step)
        self._prepare(games, step)
        window.games += games
        if cfg.train_designer:
            pending = next((p for p in self.pending if p.produced_at == window.start), None)
            if pending is None:  # already trained: a pending entry of their own
                self.pending.append(Pending(window.start, samples))
            else:
                pending.samples += samples
        return attempts, len(games)

    def _prepare(self, games: list[Game], step: int) -> None:
        """New games' hints (hint_mode "self") and probed reward levels."""
        if self.config.policy_writes_hints:
            self.designer.write_hints(games, step)
        self.designer.probe_levels(games, step)

    # ---- play ----------------------------------------------------------------------------
    def play(self, window: Window, step: int) -> list[EpisodeRecord]:
        """This round's episodes of the window's games (plus the hint arm at the round a
        game was written, plus memory replays), in one batch; returns go into the games.
        Every record carries ``hinted``, ``owner`` (the Game or memory record) and
        ``dropped`` (a play timed out or failed under ``drop_failed_plays``: its game is
        blocklisted, the play is neither trained nor counted)."""
        cfg = self.config
        offset = step - window.start
        live = [g for g in window.games if g.verdict.ok]
        plays = cfg.plays_for(len(live))
        hint_counts = [cfg.hint_plays if g.written_round(window.start) == step and g.hint else 0
                       for g in live]
        picks = self.replay_picks() if cfg.use_memory and cfg.memory_train_envs else []
        # One batch layout for games and replays: each host opens only the copies it steps.
        opened = self._open([g.env_id for g in live] + [f"mem_{r.env_id}" for r in picks],
                            [g.program for g in live] + [r.program_source for r in picks],
                            [n + plays for n in hint_counts]
                            + [cfg.plays_per_game] * len(picks))
        specs, owners = [], []
        for index, (game, n_hint, (envs, verdict)) in enumerate(zip(
                live, hint_counts, opened[:len(live)], strict=True)):
            if not verdict.ok:
                game.verdict = verdict
                continue
            # Copies are assigned to the arms in a seeded interleaving, so neither arm
            # always gets the first-opened workers.
            order = arm_order(n_hint, plays, derive_seed(self.seed, step, Phase.ARM_ORDER, index))
            for env, (arm, play) in zip(envs, order, strict=True):
                hinted = arm == "hint"
                phase = Phase.HINT_ARM if hinted else Phase.AGENT
                if hinted and env is not None:  # None: another host steps this copy
                    env = HintedEnv(env, game.hint)
                specs.append(EpisodeSpec(env=env, env_id=game.env_id,
                                         seed=derive_seed(self.seed, step, phase, index, play)))
                owners.append((game, hinted))
        specs, owners = self._add_replays(specs, owners, step, picks, opened[len(live):])
        records = self._run(specs, step)
        drops = self._drops(records)
        for rec, (owner, hinted), drop in zip(records, owners, drops, strict=True):
            rec.hinted, rec.owner, rec.dropped = hinted, owner, bool(drop)
            if isinstance(owner, Game):
                if drop:
                    if owner.verdict.ok:
                        log.warning("game %s blocklisted for the run: a play ended %s after "
                                    "%.0f s of environment calls", owner.env_id, drop,
                                    rec.cost.env_seconds)
                    owner.verdict = Verdict(Outcome.BLOCKLISTED, drop)
                    continue
                (owner.hint_returns if hinted else owner.returns_by_offset[offset]).append(
                    float(rec.return_))
                if (owner.written_round(window.start) == step and not hinted
                        and not owner.opening_observation and rec.observations):
                    owner.opening_observation = rec.observations[0]
        self._refresh_replayed([r for r in records if not r.dropped], step)
        return records

    def _drops(self, records: list[EpisodeRecord]) -> list[str]:
        """Why each play is dropped ("" = kept), process 0's verdicts on every host:
        "play_timeout" (``play_env_seconds`` exceeded by its environment's calls, summed),
        or with ``drop_failed_plays`` its end reason when it ended on a sandbox limit or an
        environment error."""
        cfg = self.config
        reasons = []
        for rec in records:
            if cfg.play_env_seconds and rec.cost.env_seconds > cfg.play_env_seconds:
                reasons.append("play_timeout")
            elif cfg.drop_failed_plays and rec.end_reason in DROPPED_END_REASONS:
                reasons.append(rec.end_reason)
            else:
                reasons.append("")
        return agreement.agree_drops(reasons)

    def _open(self, names: list[str], programs: list[str], counts: list[int]
              ) -> list[tuple[list[Any], Any]]:
        """Fresh copies of each program, as consecutive episodes of one batch; only the
        copies this host steps are opened (None for the others), and the load verdicts are
        agreed across hosts (:func:`env_copies.open_owned_copies`)."""
        return env_copies.open_owned_copies(
            [env_copies.CopyGroup(*g) for g in zip(names, programs, counts, strict=True)],
            self.designer.open_envs)

    def _add_replays(self, specs: list, owners: list, step: int, picks: list[EnvironmentRecord],
                     opened: list[tuple[list[Any], Any]]) -> tuple[list, list]:
        """Memory environments replayed for agent training this round (depth), after the
        games: ``picks`` and their copies (opened with the games', in one layout)."""
        for index, (record, (envs, _)) in enumerate(zip(picks, opened, strict=True)):
            for j, env in enumerate(envs):
                specs.append(EpisodeSpec(env=env, env_id=f"mem_{record.env_id}",
                                         seed=derive_seed(self.seed, step, Phase.MEMORY_REPLAY,
                                                          index, j)))
                owners.append((record, False))
        return specs, owners

    def replay_picks(self) -> list[EnvironmentRecord]:
        """Memory environments replayed this round; process 0's picks on every host.
        Called whenever replay is on, even with an empty memory, so every host makes the
        same collective calls."""
        picks = (self.memory.sample_for_training(self.config.memory_train_envs)
                 if self.memory.records else [])
        return agreement.agree_records(picks)

    def _run(self, specs: list[EpisodeSpec], step: int,
             seed: int | None = None) -> list[EpisodeRecord]:
        """One batch of episodes (sampler draws seeded from ``seed``, by default the
        round's agent seed); process 0's returns on every host."""
        seed = derive_seed(self.seed, step, Phase.AGENT) if seed is None else seed
        try:
            records = self.run_episodes(self._with_tools(specs), seed=seed) if specs else []
        finally:
            for spec in specs:
                if spec.env is not None:  # None: another host steps it
                    spec.env.close()
        returns = agreement.agree_returns([float(r.return_) for r in records])
        for rec, ret in zip(records, returns, strict=True):
            rec.return_ = ret
        return records

    def _with_tools(self, specs: list[EpisodeSpec]) -> list[EpisodeSpec]:
        """Under the tool contract, each episode with its environment's tool schemas (the
        chat template renders them into the first prompt), agreed across hosts."""
        if self.config.contract != Contract.TOOL:
            return specs
        tools = agreement.agree_tools([None if s.env is None else s.env.tools for s in specs])
        return [dataclasses.replace(s, tools=t) for s, t in zip(specs, tools, strict=True)]

    def _refresh_replayed(self, records: list[EpisodeRecord], step: int) -> None:
        """Replayed memory environments get this round's no-hint statistics."""
        by_env: dict[str, list[float]] = collections.defaultdict(list)
        for rec in records:
            if isinstance(rec.owner, EnvironmentRecord):
                by_env[rec.owner.env_id].append(float(rec.return_))
        for env_id, returns in by_env.items():
            if env_id in self.memory:
                self.memory.update(env_id, step, win_rate_no_hint=float(np.mean(np.array(returns) > 0)),
                                   mean_return_no_hint=float(np.clip(np.mean(returns), -1, 1)))

    # ---- score ---------------------------------------------------------------------------
    def score_due(self, step: int, num_agent: int) -> tuple[list[ScoredGame], list[TrainSequence]]:
        """Scores the windows whose designer samples are due (written ``designer_delay``
        rounds ago; with ``flush_at_end`` every one at the last round) and returns their
        designer sequences. A game written at a later round of its window (a missing game)
        is scored on the rounds from the one it was written."""
        cfg = self.config
        flush = cfg.flush_at_end and step == cfg.rounds - 1
        due = [p for p in self.pending if flush or p.produced_at + cfg.designer_delay <= step]
        self.pending = [p for p in self.pending if p not in due]
        scored: list[ScoredGame] = []
        samples, totals, penalized = [], [], []
        for pending in due:
            window = self.windows[pending.produced_at]
            observed = min(step - window.start + 1, cfg.regeneration_interval)
            by_id = {}
            for game in window.games:
                first = game.written_round(window.start) - window.start
                returns = game.returns_by_offset[first:observed]
                if game.verdict.ok and any(returns):
                    result = self.reward_rule.score(game.hint_returns, returns, skill=game.skill)
                    by_id[game.env_id] = result
                    scored.append(ScoredGame(game, window.start,
                                             game_stats(game, first, observed), result))
            for sample in pending.samples:
                total = (float(by_id[sample.env_id].total) if sample.env_id in by_id
                         else cfg.invalid_penalty)
                if total is not None:
                    samples.append((pending.produced_at, sample))
                    totals.append(total)
                    penalized.append(sample.env_id not in by_id)
        sequences = self.designer_sequences(samples, totals, num_agent, step,
                                            penalized=penalized)
        attribution = reward_attribution([s for _, s in samples], totals, sequences)
        if np.isfinite(attribution):
            self.rule_metrics["designer/reward_attribution"] = attribution
        return scored, sequences

    def designer_sequences(self, samples: list[tuple[int, DesignerSample]],
                           totals: list[float], num_agent: int, step: int,
                           penalized: Sequence[bool] | None = None) -> list[TrainSequence]:
        """The designer's update rule on its due samples. ``designer_groups`` "skill" (the
        recipe): groups of one skill, totals < 0 dropped, advantages times the env reward
        scale; "prompt": the samples of one designer prompt, unscaled.

        ``penalized[i]``: sample i's total is ``invalid_penalty`` (its program failed
        validation, or its game scored nothing), not a reward rule's score. The recipe's
        drop of negative totals is about scores (a blend < 0), so a penalized sample joins
        its skill's group whatever its sign: without that, ``invalid_penalty=-1`` would
        silently train nothing under skill groups. None: no sample is penalized."""
        cfg = self.config
        if not samples:
            return []
        penalized = [False] * len(samples) if penalized is None else list(penalized)
        groups: dict[Any, list[int]] = {}
        scale = 1.0
        if cfg.designer_groups == DesignerGroups.SKILL:
            scale = env_reward_scale(len(samples), num_agent, cfg.regeneration_interval,
                                     cfg.max_env_reward_scale)
        for i, ((produced, sample), total) in enumerate(zip(samples, totals, strict=True)):
            if cfg.designer_groups == DesignerGroups.PROMPT:
                groups.setdefault((produced, sample.slot), []).append(i)
            elif total >= 0 or penalized[i]:
                groups.setdefault(sample.skill, []).append(i)
        members = list(groups.values())
        sequences, kept = self.role_sequences("designer", [
            Group([_designer_episode(samples[i][1]) for i in group], [totals[i] for i in group])
            for group in members], step, scale)
        order = [i for g in kept for i in members[g]]  # back into the samples' order
        return [seq for _, seq in sorted(zip(order, sequences, strict=True), key=lambda x: x[0])]

    def agent_sequences(self, records: list[EpisodeRecord], step: int) -> list[TrainSequence]:
        """No-hint episodes through the agent's update rule; group = the plays of one game
        in this round."""
        groups: dict[str, list[EpisodeRecord]] = {}
        for rec in records:
            if any(rec.loss_mask):
                groups.setdefault(rec.env_id, []).append(rec)
        return self.role_sequences("agent", [Group(g) for g in groups.values()], step)[0]

    def role_sequences(self, role: str, groups: list[Group], step: int,
                   scale: float = 1.0) -> tuple[list[TrainSequence], list[int]]:
        """``role``'s update rule on ``groups``: (training sequences, indices of the groups
        kept). Its metrics go to ``rule_metrics``; forks and policy judges go through this
        round's :class:`PolicyRollouts`; multi-host: process 0's advantages everywhere
        (forked returns can differ per host)."""
        rule = self.rules[role]
        context = StepContext(
            rollouts=self._rollouts(groups, step, refill=role == "agent"), role=role,
            seed_parts=(self.seed, step, Phase.CREDIT, ROLE_INDEX[role]),
            refill_seed_parts=(self.seed, step, Phase.REFILL, ROLE_INDEX[role]))
        out = apply_rule(rule, groups, role_name=role, context=context, advantage_scale=scale)
        self.rule_metrics.update({f"rule/{role}/{k}": v for k, v in out.metrics.items()})
        dropped = set(out.dropped_groups)
        kept = [g for g in range(len(groups) + len(out.refill_groups)) if g not in dropped]
        return _agree_advantages(out.sequences), kept

    def pop_design_records(self) -> list[dict[str, Any]]:
        """The last step's designer attempts as JSON objects (``Designer.attempt_record``:
        reply text, verdict, stated level; and the hint its game was played with), for the
        run's ``designs.jsonl``."""
        attempts, self.step_attempts = self.step_attempts, []
        games, self.step_games = self.step_games, []
        hints = {(g.slot, g.program): g.hint for g in games}
        records = []
        for attempt in attempts:
            record = self.designer.attempt_record(attempt)
            program = attempt.parsed.program if attempt.parsed is not None else None
            # the hint the game made of this attempt was shown with (None: no game, or no hint)
            record["hint"] = hints.get((attempt.slot, program))
            records.append(record)
        return records

    def pop_rule_metrics(self) -> dict[str, float]:
        """The update rules' metrics since the last call (``rule/<role>/<part>/<name>``)."""
        metrics, self.rule_metrics = self.rule_metrics, {}
        return metrics

    def _rollouts(self, groups: list[Group], step: int, refill: bool) -> PolicyRollouts:
        programs = {ep.env_id: _program_of(ep) for g in groups for ep in g.episodes}
        owners = {ep.env_id: getattr(ep, "owner", None) for g in groups for ep in g.episodes}

        def make_env(env_id: str):
            envs, verdict = self.designer.open_envs(programs[env_id], 1)
            if not verdict.ok or not envs:
                raise RuntimeError(f"forking {env_id!r}: the program did not load ({verdict})")
            return envs[0]

        def run(specs: list[EpisodeSpec], seed: int) -> list[EpisodeRecord]:
            return self.run_episodes(self._with_tools(specs), seed=seed)

        def play_groups(requests: list[GroupRequest], seed: int) -> list[list[EpisodeRecord]]:
            return self._play_refill(requests, programs, owners, step, seed)

        return PolicyRollouts(run_episodes=run, make_env=make_env, complete_fn=self._complete,
                              play_groups_fn=play_groups if refill else None)

    def _play_refill(self, requests: list[GroupRequest], programs: dict[str, str],
                     owners: dict[str, Any], step: int, seed: int) -> list[list[EpisodeRecord]]:
        """A group filter's replacement groups: new no-hint plays of this round's
        environments in one batch (returns agreed across hosts, as every play's). They
        train the agent only: the window's statistics keep the round's regular plays.
        A fixed-environment baseline's tasks are opened by the baseline."""
        open_task = self.source.task_opener()
        if all(programs.get(r.env_id) for r in requests):
            opened = self._open([r.env_id for r in requests],
                                [programs[r.env_id] for r in requests],
                                [len(r.seeds) for r in requests])
        elif open_task is not None and not any(programs.get(r.env_id) for r in requests):
            opened = [([open_task(r.env_id) for _ in r.seeds], VALID) for r in requests]
        else:
            raise ValueError(f"refill: the loop has no program or baseline task for "
                             f"{sorted(r.env_id for r in requests if not programs.get(r.env_id))}")
        specs, slots = [], []
        for j, (request, (envs, verdict)) in enumerate(zip(requests, opened, strict=True)):
            if not verdict.ok:  # did not load this time: no replacement from it
                continue
            for env, env_seed in zip(envs, request.seeds, strict=True):
                specs.append(EpisodeSpec(env=env, env_id=request.env_id, seed=env_seed))
                slots.append(j)
        records = self._run(specs, step, seed=seed)
        played: list[list[EpisodeRecord]] = [[] for _ in requests]
        for rec, j in zip(records, slots, strict=True):
            rec.hinted, rec.owner = False, owners[rec.env_id]
            if any(rec.loss_mask):  # as agent_sequences: a play without policy tokens
                played[j].append(rec)
        return played

    def _complete(self, prompts, seed: int) -> list[str]:
        """The policy's single-turn replies (a policy judge), with the hint writer's
        sampler settings."""
        tok = self.tokenizer
        ids = [tok.apply_chat_template([{"role": "user", "content": p}],
                                       add_generation_prompt=True) for p in prompts]
        tokens, *_ = self.designer.generate(ids, seed=seed, purpose="hint")
        return [tok.decode(t, skip_special_tokens=True) for t in tokens]

    # ---- memory --------------------------------------------------------------------------
    def remember(self, scored: list[ScoredGame]) -> None:
        """``memory_at`` "scoring": scored games enter memory with the loop's own
        statistics of their window (any reward rule)."""
        if not self.config.use_memory:
            return
        for item in scored:
            self._memorise(item.game, item.window_start, item.stats, float(item.result.total))

    def remember_played(self, window: Window, step: int) -> None:
        """``memory_at`` "regeneration" (the recipe): the games written this round enter
        memory at its end, with this round's plays (their win share) and hint arm, so the
        next design can use them. Their designer reward is not known yet (0)."""
        offset = step - window.start
        for game in window.games:
            if (game.written_round(window.start) == step and game.verdict.ok
                    and game.returns_by_offset[offset]):
                self._memorise(game, step, game_stats(game, offset, offset + 1), 0.0)

    def _memorise(self, game: Game, round_index: int, stats: GameStats,
                  designer_reward: float) -> None:
        if game.env_id in self.memory:
            return
        self.memory.add(EnvironmentRecord(
            env_id=game.env_id, program_source=game.program, hint=game.hint or "",
            skill=game.skill, round_index=round_index,
            regime=self.memory.classify(stats.regret, stats.hint_mean, stats.mean_return),
            regret=stats.regret,
            win_rate_hint=float(np.mean(np.array(game.hint_returns) > 0))
            if game.hint_returns else 0.0,
            win_rate_no_hint=stats.solve_rate,
            mean_return_hint=float(np.clip(stats.hint_mean, -1, 1)),
            mean_return_no_hint=float(np.clip(stats.mean_return, -1, 1)),
            designer_reward=designer_reward, corpus_doc_ids=game.doc_ids,
            reward_levels=_count(game.reward_levels),
            strict_partial_levels=_count(game.strict_partial_levels)))

    def _retire_windows(self, step: int) -> None:
        """Drops windows that are neither current nor awaited by pending samples."""
        keep = {self.config.window_start(step + 1), *(p.produced_at for p in self.pending)}
        self.windows = {s: w for s, w in self.windows.items() if s in keep}


@dataclasses.dataclass(frozen=True)
class ScoredGame:
    """A game scored at its designer samples' due round: the loop's own statistics and
    the designer reward rule's result."""

    game: Game
    window_start: int
    stats: GameStats
    result: ScoredEnvironment


ROLE_INDEX = {"agent": 0, "designer": 1}
# End reasons of a play dropped under SpadeConfig.drop_failed_plays: a sandbox limit (a
# call over the play deadline or CPU budget) or an environment error.
DROPPED_END_REASONS = (EndReason.ENV_LIMIT, EndReason.ENV_ERROR)


def _play_metrics(records: list[EpisodeRecord]) -> dict[str, float]:
    """How this round's plays ended (``episodes/end/<reason>``) and how many were dropped."""
    counts = collections.Counter(r.end_reason or "unknown" for r in records)
    metrics = {f"episodes/end/{reason}": float(n) for reason, n in sorted(counts.items())}
    metrics["plays/dropped"] = float(sum(bool(getattr(r, "dropped", False)) for r in records))
    return metrics


def _program_of(episode: EpisodeRecord) -> str | None:
    """The program an agent episode ran (its owner: a window's Game or a memory record)."""
    owner = getattr(episode, "owner", None)
    return getattr(owner, "program", None) or getattr(owner, "program_source", None)


def _agree_advantages(sequences: list[TrainSequence]) -> list[TrainSequence]:
    """Multi-host: every host trains on process 0's advantages."""
    if agreement.single_host():
        return sequences
    local = [s.advantage if isinstance(s.advantage, float) else [float(x) for x in s.advantage]
             for s in sequences]
    agreed = distributed.agree_json(local)
    failing = distributed.failing_hosts(len(agreed) != len(local))
    if failing:
        raise RuntimeError(f"multi-host update rule: host(s) {failing} built a different "
                           f"number of training sequences than process 0")
    return [dataclasses.replace(s, advantage=a if isinstance(a, float) else np.asarray(
        a, np.float32)) for s, a in zip(sequences, agreed, strict=True)]


def _designer_episode(sample: DesignerSample) -> EpisodeRecord:
    """A designer sample as a one-turn episode (its output is the turn)."""
    rec = EpisodeRecord(env_id=sample.env_id, seed=0)
    rec.append(list(sample.prompt_ids), policy=False)
    rec.append(list(sample.output_ids), policy=True, logprobs=list(sample.output_logprobs))
    rec.turn_spans.append((len(sample.prompt_ids), len(rec.token_ids)))
    rec.routing = sample.routing  # router replay: the routes it was sampled with
    return rec


def reward_attribution(samples: Sequence[DesignerSample], totals: Sequence[float],
                       sequences: Sequence[TrainSequence]) -> float:
    """How well the advantages the designer is trained with follow its own games' scores:
    the Pearson correlation between the advantage of each program it trains and that
    program's score (or penalty), centred within its advantage group. Sequences are
    matched to samples by their tokens (prompt + program), not by position, so a score
    handed to the wrong program reads low: 1 when every program gets its own (a
    mean-centred rule; a group-normalised one reads slightly below when its groups' spreads
    differ), about 0 when the scores are shuffled. Identical programs (a designer that has
    converged writes the same one several times, each with its own game) are one point,
    their mean advantage against their mean score. NaN with fewer than 3 distinct programs
    or no spread on either side."""
    scores: dict[tuple[int, ...], list[float]] = collections.defaultdict(list)
    for sample, total in zip(samples, totals, strict=True):
        scores[tuple(sample.prompt_ids) + tuple(sample.output_ids)].append(float(total))
    advantages: dict[int, dict[tuple[int, ...], list[float]]] = collections.defaultdict(
        lambda: collections.defaultdict(list))
    for seq in sequences:
        key = tuple(int(t) for t in seq.token_ids)
        if key not in scores:
            continue
        advantage = np.asarray(seq.advantage, np.float64)
        if advantage.ndim:  # per-token: the mean over the trained tokens
            mask = np.asarray(seq.loss_mask, bool)
            advantage = advantage[mask].mean() if mask.any() else np.float64(0.0)
        advantages[seq.group][key].append(float(advantage))
    points = []
    for by_key in advantages.values():
        counts = {key: len(advs) for key, advs in by_key.items()}
        group_mean = sum(n * np.mean(scores[key]) for key, n in counts.items()) / sum(
            counts.values())
        points += [(np.mean(advs), np.mean(scores[key]) - group_mean)
                   for key, advs in by_key.items()]
    if len(points) < 3:
        return float("nan")
    adv, centred = np.array(points, np.float64).T
    if adv.std() < 1e-12 or centred.std() < 1e-12:
        return float("nan")
    return float(np.corrcoef(adv, centred)[0, 1])


def _count(value: float) -> int:
    """A probed level count as the memory stores it (0: not measured)."""
    return int(value) if np.isfinite(value) else 0
