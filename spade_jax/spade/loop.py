"""One SPADE self-play round, as plain Python around the jitted sampler and train step.

    design   -> the policy (designer role) writes programs + hints, grounded in freshly
                sampled corpus documents and examples from the environment memory
    validate -> every program goes through the sandbox's validation; invalid ones get the
                designer a fixed penalty and never reach the agent
    rollout  -> the policy (agent role) plays each valid program n_hint times with the hint
                and n_no_hint times without, through the multi-turn loop
    reward   -> designer reward from returns only (hint-based regret + difficulty anchor),
                computed here, in the trainer process
    update   -> one GRPO step on both roles into the same weights; designer groups join the
                update ``designer_delay - 1`` rounds after they were produced

Designer delay: the no-hint arm runs ``n_hint * k`` episodes (the paper's 16k) in the round
the environment was written, and the designer's update for that round is applied k - 1
rounds later (k = 1: same round).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import gymnasium
import jax
import numpy as np

from spade_jax import distributed, rl
from spade_jax.envs import EnvPool, make_env, validate_program
from spade_jax.rl.batch import TrainSequence
from spade_jax.rollout.agent_loop import EpisodeSpec
from spade_jax.rollout.records import EpisodeRecord
from spade_jax.spade import env_stats
from spade_jax.spade.config import SpadeConfig
from spade_jax.spade.corpus import CorpusSampler, Document
from spade_jax.spade.diversity import ProgramFeaturiser, normalized_vendi_score
from spade_jax.spade.memory import EnvironmentMemory, EnvironmentRecord
from spade_jax.spade.prompts import (
    DESIGNER_SYSTEM_PROMPTS,
    DesignerOutput,
    agent_first_observation,
    designer_user_prompt,
    parse_designer_output,
)
from spade_jax.spade.reward import DesignerRewardRule
from spade_jax.spade.skills import Skill, get_skill_set

log = logging.getLogger(__name__)


class HintedEnv(gymnasium.Wrapper):
    """Shows the designer's hint to the agent with the first observation. The program
    never sees it: only the observation text going to the policy changes."""

    def __init__(self, env: gymnasium.Env, hint: str):
        super().__init__(env)
        self.hint = hint

    def reset(self, **kwargs):
        observation, info = self.env.reset(**kwargs)
        return agent_first_observation(observation, self.hint), info


@dataclasses.dataclass
class Candidate:
    """One designer sample: where it came from, what it wrote, what became of it."""

    slot: int
    skill: str
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    doc_ids: tuple[str, ...]
    parsed: DesignerOutput | None = None
    reason: str = ""  # "" valid, else the parse / validation reason code
    env_id: str = ""
    returns_hint: list[float] = dataclasses.field(default_factory=list)
    returns_no_hint: list[float] = dataclasses.field(default_factory=list)
    opening_observation: str = ""
    reward: Any = None  # DesignerReward / LearningPotential
    designer_return: float = 0.0


# What the loop needs from the outside: sampling and training are injected, so the round
# logic runs the same with the real policy and with a scripted stand-in in tests.
# generate(prompts, round_index) -> (tokens, logprobs) per prompt
Generate = Callable[[list[list[int]], int], tuple[list[list[int]], list[list[float]]]]
RunEpisodes = Callable[[list[EpisodeSpec]], list[EpisodeRecord]]
Update = Callable[[list[TrainSequence]], dict[str, float]]


class FixedEnvBaseline(Protocol):
    """The fixed-environment baselines: this round's episodes (one env each), and what the
    agent's returns on them were (adaptive-difficulty baselines use it)."""

    def episodes(self, round_index: int, plays_per_task: int) -> list[EpisodeSpec]: ...

    def feedback(self, returns_by_env: dict[str, list[float]]) -> None: ...


class SpadeLoop:
    """Holds the run state of self-play (memory, corpus cursor, trackers, designer queue)
    and runs rounds. ``state_dict()`` is everything a checkpoint needs beyond the weights."""

    def __init__(
        self,
        config: SpadeConfig,
        *,
        tokenizer: Any,
        pool: EnvPool,
        generate: Generate,
        run_episodes: RunEpisodes,
        update: Update,
        corpus_sampler: CorpusSampler | None,
        memory: EnvironmentMemory,
        reward_rule: DesignerRewardRule,
        fixed_pool: Sequence[tuple[str, str, str]] = (),
        baseline: FixedEnvBaseline | None = None,
        seed: int = 0,
    ):
        self.config, self.tokenizer, self.pool = config, tokenizer, pool
        self.generate, self.run_episodes, self.update = generate, run_episodes, update
        self.corpus_sampler, self.memory, self.reward_rule = corpus_sampler, memory, reward_rule
        self.fixed_pool, self.baseline, self.seed = list(fixed_pool), baseline, seed
        self.skills: tuple[Skill, ...] = get_skill_set(config.skills)
        self.learnable = env_stats.LearnableShareTracker(
            env_stats.LearnableShareConfig(window=config.learnable_window))
        self.designer_queue: collections.deque = collections.deque()
        self.featuriser = ProgramFeaturiser()
        self.used_doc_ids: set[str] = set()

    # ---- run state ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "corpus": self.corpus_sampler.state_dict() if self.corpus_sampler else None,
            "memory": self.memory.state_dict(),
            "learnable": self.learnable.state_dict(),
            "reward_rule": self.reward_rule.state_dict(),
            "designer_queue": [
                [r, [dataclasses.asdict(s) for s in seqs]] for r, seqs in self.designer_queue
            ],
            "used_doc_ids": sorted(self.used_doc_ids),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.corpus_sampler and state.get("corpus"):
            self.corpus_sampler.load_state_dict(state["corpus"])
        self.memory.load_state_dict(state["memory"])
        self.learnable.load_state_dict(state["learnable"])
        self.reward_rule.load_state_dict(state["reward_rule"])
        self.designer_queue = collections.deque(
            (r, [TrainSequence(**s) for s in seqs]) for r, seqs in state["designer_queue"])
        self.used_doc_ids = set(state.get("used_doc_ids", ()))

    # ---- phases ------------------------------------------------------------------------
    def _slot_skill(self, round_index: int, slot: int) -> Skill:
        return self.skills[(round_index * self.num_slots + slot) % len(self.skills)]

    @property
    def num_slots(self) -> int:
        return max(1, self.config.envs_per_round // self.config.designer_group_size)

    def design(self, round_index: int) -> list[Candidate]:
        """Designer prompts -> sampled programs (or the fixed pool's programs)."""
        cfg = self.config
        if cfg.designer_mode == "fixed_pool":
            rng = np.random.default_rng([self.seed, round_index, 1])
            picks = rng.choice(len(self.fixed_pool), size=cfg.envs_per_round,
                               replace=len(self.fixed_pool) < cfg.envs_per_round)
            return [Candidate(slot=i, skill=self.fixed_pool[p][2], prompt_ids=[], output_ids=[],
                              output_logprobs=[], doc_ids=(),
                              parsed=DesignerOutput(self.fixed_pool[p][0], self.fixed_pool[p][1], ""))
                    for i, p in enumerate(picks)]
        skills = [self._slot_skill(round_index, slot) for slot in range(self.num_slots)]
        docs_per_slot, examples_per_slot = self._prompt_draws(skills)
        prompts, meta = [], []
        for slot, (skill, docs, examples) in enumerate(
                zip(skills, docs_per_slot, examples_per_slot, strict=True)):
            reused = [d.doc_id for d in docs if d.doc_id in self.used_doc_ids]
            if reused:  # the sampler draws without replacement; guard the invariant
                raise RuntimeError(f"corpus documents reused within a run: {reused}")
            self.used_doc_ids.update(d.doc_id for d in docs)
            user = designer_user_prompt(skill.name, [d.text for d in docs], examples,
                                        max_doc_chars=cfg.max_doc_chars)
            ids = self.tokenizer.apply_chat_template(
                [{"role": "system", "content": DESIGNER_SYSTEM_PROMPTS[cfg.prompt_style]},
                 {"role": "user", "content": user}],
                add_generation_prompt=True, enable_thinking=False)
            for _ in range(cfg.designer_group_size):
                prompts.append(list(ids))
                meta.append((slot, skill.name, tuple(d.doc_id for d in docs)))
        tokens, logprobs = self.generate(prompts, round_index)
        return [Candidate(slot=s, skill=k, prompt_ids=p, output_ids=list(t),
                          output_logprobs=list(lp), doc_ids=d)
                for p, t, lp, (s, k, d) in zip(prompts, tokens, logprobs, meta, strict=True)]

    def _prompt_draws(self, skills: Sequence[Skill]) -> tuple[list[list[Document]],
                                                               list[list[dict[str, Any]]]]:
        """Corpus documents and memory examples for each designer slot of this round.

        Multi-host: every host builds the same designer prompts (they are rows of one global
        batch), but each reads its own corpus (the default one is extracted from locally
        installed packages) and keeps its own memory, so process 0's draws are used
        everywhere: one broadcast per round, a no-op on one host.
        """
        cfg = self.config
        docs_per_slot: list[list[Document]] = []
        examples_per_slot: list[list[dict[str, Any]]] = []
        for skill in skills:
            docs = []
            if cfg.use_corpus and self.corpus_sampler is not None and cfg.docs_per_prompt:
                docs = self.corpus_sampler.sample(cfg.docs_per_prompt)
            examples = []
            if cfg.use_memory and self.memory.records and cfg.memory_examples:
                examples = [_memory_example(r) for r in
                            self.memory.sample_for_prompt(cfg.memory_examples, skill.name)]
            docs_per_slot.append(docs)
            examples_per_slot.append(examples)
        if jax.process_count() == 1:  # one host: nothing to agree on, objects untouched
            return docs_per_slot, examples_per_slot
        agreed = distributed.agree_json(
            {"docs": [[dataclasses.astuple(d) for d in docs] for docs in docs_per_slot],
             "examples": examples_per_slot})
        return ([[Document(*d) for d in docs] for docs in agreed["docs"]], agreed["examples"])

    def _replay_picks(self) -> list[EnvironmentRecord]:
        """Memory environments replayed for agent training this round; process 0's picks
        on every host (see ``_prompt_draws``). Called whenever the config asks for replay,
        even with an empty memory, so every host makes the same collective calls."""
        cfg = self.config
        picks = (self.memory.sample_for_training(cfg.memory_train_envs)
                 if self.memory.records else [])
        if jax.process_count() == 1:
            return picks
        return [EnvironmentRecord.from_json(r)
                for r in distributed.agree_json([r.to_json() for r in picks])]

    def validate(self, candidates: list[Candidate], round_index: int) -> None:
        for i, cand in enumerate(candidates):
            cand.env_id = f"r{round_index}_c{i}"
            cand.reason = self._check(cand)
        if jax.process_count() > 1:
            # Validation runs under wall-clock deadlines, so a program near one can pass
            # here and fail on another host: every host keeps process 0's verdicts.
            outcomes = self._agree_outcomes(
                "validation", [c.env_id for c in candidates], [c.reason for c in candidates],
                lambda i: self._check(candidates[i]))
            for cand, reason in zip(candidates, outcomes, strict=True):
                cand.reason = reason

    def _check(self, cand: Candidate) -> str:
        """Parses (if needed) and validates one candidate: "" valid, else the reason code."""
        if cand.parsed is None:
            text = self.tokenizer.decode(cand.output_ids, skip_special_tokens=True)
            parsed = parse_designer_output(text)
            if not isinstance(parsed, DesignerOutput):
                return f"parse_{parsed.code}"
            cand.parsed = parsed
        report = validate_program(cand.parsed.program, hint=cand.parsed.hint, pool=self.pool)
        if not report.ok:
            return report.reason.split(":", 1)[0].strip() or "invalid"
        return ""

    def _agree_outcomes(self, stage: str, names: Sequence[str], local: Sequence[str],
                        recheck: Callable[[int], str]) -> list[str]:
        """Multi-host: process 0's per-item outcomes ("" ok, else a reason code), the same
        on every host. An item process 0 rejected is dropped here whatever this host found;
        one process 0 accepted but this host rejected (e.g. a deadline hit only here) is
        rechecked once with ``recheck(i)`` (-> new local outcome). If it fails again, or
        the hosts disagree on the item count, every host raises, since a host that went
        on alone would wait forever in the next collective."""
        agreed = [str(r) for r in distributed.agree_json(list(local))]
        problems = []
        if len(agreed) != len(local):
            problems.append(f"{len(local)} items here, {len(agreed)} on process 0")
        else:
            for i, (mine, primary) in enumerate(zip(local, agreed, strict=True)):
                if mine and not primary:
                    again = recheck(i)
                    if again:
                        problems.append(f"{names[i]} ({mine!r}, then {again!r} on a retry)")
                    else:
                        log.warning("%s: %s failed here (%s) but passed on process 0 and on a "
                                    "retry; kept", stage, names[i], mine)
                elif primary and not mine:
                    log.warning("%s: %s passed here but failed on process 0 (%s); dropped",
                                stage, names[i], primary)
        failing = distributed.failing_hosts(bool(problems))
        if failing:
            here = (f"this host ({jax.process_index()}) rejects " + "; ".join(problems)
                    if problems else f"this host ({jax.process_index()}) agrees with process 0")
            raise RuntimeError(
                f"multi-host {stage}: host(s) {failing} cannot reproduce process 0's outcome "
                f"(process 0 accepted what they reject, even after a retry), so the hosts "
                f"would train on different environments; {here}")
        return agreed

    def _open_envs(self, program: str, count: int) -> tuple[list[gymnasium.Env], str]:
        """``count`` fresh sandboxed copies of a program (a fresh worker per episode: arms
        never share state), stopping at the first that fails to load: (envs, reason)."""
        envs = []
        for _ in range(count):
            try:
                envs.append(make_env(program, self.pool))
            except Exception as e:  # noqa: BLE001 - untrusted program; record, go on
                return envs, f"load_error: {type(e).__name__}"
        return envs, ""

    def _agree_loads(self, stage: str, names: Sequence[str], programs: Sequence[str],
                     opened: list[tuple[list[gymnasium.Env], str]], count: int) -> None:
        """Multi-host: every host keeps the programs that loaded on process 0 (in place in
        ``opened``): ones that failed there are closed here; ones that failed only here
        get their missing copies opened once more (see ``_agree_outcomes``)."""
        def recheck(i: int) -> str:
            envs, _ = opened[i]
            more, reason = self._open_envs(programs[i], count - len(envs))
            envs.extend(more)
            return reason

        outcomes = self._agree_outcomes(stage, names, [reason for _, reason in opened], recheck)
        for i, reason in enumerate(outcomes):
            envs, _ = opened[i]
            if reason:
                for env in envs:
                    env.close()
                envs = []
            opened[i] = (envs, reason)

    def rollout(self, candidates: list[Candidate], round_index: int) -> list[EpisodeRecord]:
        """Both arms of every valid candidate in one batch of episodes; fills in returns."""
        cfg = self.config
        rng = np.random.default_rng([self.seed, round_index, 2])
        todo = [c for c in candidates if not c.reason]
        count = cfg.n_hint + cfg.no_hint_episodes
        seeds = [rng.integers(0, 2**31 - 1, size=count) for _ in todo]
        opened = [self._open_envs(c.parsed.program, count) for c in todo]
        if jax.process_count() > 1:  # a load deadline can also be hit on one host only
            self._agree_loads("environment loading", [c.env_id for c in todo],
                              [c.parsed.program for c in todo], opened, count)
        specs, owners = [], []
        for cand, cand_seeds, (envs, reason) in zip(todo, seeds, opened, strict=True):
            if reason:
                cand.reason = reason
            # One host: the copies opened before a load failure still run (as they always
            # have); their returns never count, since the candidate now has a reason.
            for j, (env, seed) in enumerate(zip(envs, cand_seeds, strict=False)):
                hinted = j < cfg.n_hint
                if hinted:
                    env = HintedEnv(env, cand.parsed.hint)
                specs.append(EpisodeSpec(env=env, env_id=cand.env_id, seed=int(seed)))
                owners.append((cand, hinted))
        records = self.run_episodes(specs) if specs else []
        for (cand, hinted), rec in zip(owners, records, strict=True):
            ret = float(np.clip(rec.return_, 0.0, 1.0))
            (cand.returns_hint if hinted else cand.returns_no_hint).append(ret)
            if not hinted and not cand.opening_observation and rec.observations:
                cand.opening_observation = rec.observations[0]
        for spec in specs:
            spec.env.close()
        return [rec for (cand, hinted), rec in zip(owners, records, strict=True)
                if not hinted and not cand.reason]

    def score(self, candidates: list[Candidate]) -> None:
        penalty = self.config.reward.invalid_penalty
        for cand in candidates:
            if cand.reason or not cand.returns_no_hint:
                cand.designer_return = penalty
                cand.reason = cand.reason or "no_episodes"
                continue
            # One no-hint step per candidate until the loop keeps regeneration windows.
            cand.reward = self.reward_rule.score(cand.returns_hint, [cand.returns_no_hint],
                                                 skill=cand.skill)
            cand.designer_return = float(cand.reward.total)

    # ---- training data -----------------------------------------------------------------
    def agent_sequences(self, records: list[EpisodeRecord], estimator: str) -> list[TrainSequence]:
        """No-hint episodes, grouped per environment, with group-relative advantages."""
        by_env: dict[str, list[EpisodeRecord]] = collections.defaultdict(list)
        for rec in records:
            if any(rec.loss_mask):
                by_env[rec.env_id].append(rec)
        seqs = []
        for group in by_env.values():
            adv = _group_advantages([r.return_ for r in group], estimator)
            seqs += [TrainSequence(r.token_ids, r.loss_mask, r.logprobs, float(a), "agent")
                     for r, a in zip(group, adv, strict=True)]
        return seqs

    def designer_sequences(self, candidates: list[Candidate], estimator: str) -> list[TrainSequence]:
        by_slot: dict[int, list[Candidate]] = collections.defaultdict(list)
        for cand in candidates:
            if cand.output_ids:
                by_slot[cand.slot].append(cand)
        seqs = []
        for group in by_slot.values():
            adv = _group_advantages([c.designer_return for c in group], estimator)
            for cand, a in zip(group, adv, strict=True):
                ids = cand.prompt_ids + cand.output_ids
                mask = [0] * len(cand.prompt_ids) + [1] * len(cand.output_ids)
                lps = [0.0] * len(cand.prompt_ids) + cand.output_logprobs
                seqs.append(TrainSequence(ids, mask, lps, float(a), "designer"))
        return seqs

    # ---- the round ---------------------------------------------------------------------
    def run_round(self, round_index: int) -> dict[str, float]:
        cfg, times, metrics = self.config, {}, {}
        agent_estimator, designer_estimator = cfg.agent_advantage, cfg.designer_advantage
        t0 = time.perf_counter()
        if cfg.baseline != "none":
            return self._baseline_round(round_index, agent_estimator)
        candidates = self.design(round_index)
        times["design"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        self.validate(candidates, round_index)
        times["validate"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        records = self.rollout(candidates, round_index)
        records += self._memory_replay(round_index)
        if jax.process_count() > 1:
            self._agree_returns(candidates, records)
        self.score(candidates)
        times["rollout"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        seqs = self.agent_sequences(records, agent_estimator)
        if cfg.train_designer and cfg.designer_mode == "self":
            self.designer_queue.append((round_index, self.designer_sequences(candidates,
                                                                             designer_estimator)))
        while self.designer_queue and self.designer_queue[0][0] <= round_index - (cfg.designer_delay - 1):
            seqs += self.designer_queue.popleft()[1]
        update_metrics = self.update(seqs) if seqs else {"skipped_no_data": 1.0}
        times["update"] = time.perf_counter() - t0

        self._remember(candidates, round_index)
        metrics.update(self._round_metrics(candidates, records))
        metrics.update({f"train/{k}": v for k, v in update_metrics.items()})
        metrics.update({f"time/{k}": v for k, v in times.items()})
        metrics["tokens/designer_generated"] = float(sum(len(c.output_ids) for c in candidates))
        metrics["tokens/agent_generated"] = float(sum(r.cost.tokens_generated for r in records))
        metrics["agent/parse_failures"] = float(sum(r.cost.parse_failures for r in records))
        metrics["agent/env_seconds"] = float(sum(r.cost.env_seconds for r in records))
        return metrics

    def _memory_replay(self, round_index: int) -> list[EpisodeRecord]:
        """Agent training episodes on environments sampled from memory (depth)."""
        cfg = self.config
        if not (cfg.use_memory and cfg.memory_train_envs):
            return []
        picks = self._replay_picks()
        rng = np.random.default_rng([self.seed, round_index, 3])
        seeds = [rng.integers(0, 2**31 - 1, size=cfg.n_hint) for _ in picks]
        opened = [self._open_envs(rec.program_source, cfg.n_hint) for rec in picks]
        if jax.process_count() > 1:
            self._agree_loads("memory replay loading", [f"mem_{r.env_id}" for r in picks],
                              [r.program_source for r in picks], opened, cfg.n_hint)
        specs = [EpisodeSpec(env=env, env_id=f"mem_{rec.env_id}", seed=int(seed))
                 for rec, rec_seeds, (envs, _) in zip(picks, seeds, opened, strict=True)
                 for env, seed in zip(envs, rec_seeds, strict=False)]
        records = self.run_episodes(specs) if specs else []
        for spec in specs:
            spec.env.close()
        return records

    def _agree_returns(self, candidates: list[Candidate], records: list[EpisodeRecord]) -> None:
        """Multi-host: process 0's episode returns on every host (one broadcast a round).

        Rewards come from untrusted programs under wall-clock deadlines, so an episode can
        time out on one host only; the returns behind the agent advantages and the designer
        reward are made process 0's. (The tokens of such an episode still differ: the
        rollout loop would have to agree each turn's observation for those to match.)
        """
        local = {"hint": [c.returns_hint for c in candidates],
                 "no_hint": [c.returns_no_hint for c in candidates],
                 "records": [float(r.return_) for r in records]}
        agreed = distributed.agree_json(local)

        def shape(returns: dict[str, Any]) -> list[Any]:  # episodes per candidate arm, records
            return [[len(x) for x in returns["hint"]], [len(x) for x in returns["no_hint"]],
                    len(returns["records"])]

        failing = distributed.failing_hosts(shape(local) != shape(agreed))
        if failing:
            raise RuntimeError(
                f"multi-host rollout: host(s) {failing} ran a different set of episodes than "
                f"process 0 (episodes per hinted arm, no-hint arm, records: this host "
                f"({jax.process_index()}) {shape(local)}, process 0 {shape(agreed)}), so "
                "their training batches would differ")
        for cand, hint, no_hint in zip(candidates, agreed["hint"], agreed["no_hint"], strict=True):
            cand.returns_hint = [float(x) for x in hint]
            cand.returns_no_hint = [float(x) for x in no_hint]
        for rec, ret in zip(records, agreed["records"], strict=True):
            rec.return_ = float(ret)

    def _remember(self, candidates: list[Candidate], round_index: int) -> None:
        if not self.config.use_memory:
            return
        for cand in candidates:
            if cand.reason or cand.reward is None or not hasattr(cand.reward, "regime"):
                continue
            returns = cand.returns_hint + cand.returns_no_hint
            self.memory.add(EnvironmentRecord.from_reward(
                cand.env_id, cand.parsed.program, cand.parsed.hint, cand.skill, round_index,
                cand.reward, reward_levels=env_stats.reward_levels(returns),
                strict_partial_levels=env_stats.strict_partial_levels(returns),
                corpus_doc_ids=cand.doc_ids))

    def _round_metrics(self, candidates: list[Candidate], records) -> dict[str, float]:
        valid = [c for c in candidates if not c.reason]
        m: dict[str, float] = {"candidates": float(len(candidates)),
                               "valid_envs": float(len(valid)),
                               "validity_rate": len(valid) / max(1, len(candidates))}
        for reason, count in collections.Counter(c.reason for c in candidates if c.reason).items():
            m[f"invalid/{reason}"] = float(count)
        m["designer/reward_mean"] = float(np.mean([c.designer_return for c in candidates])) \
            if candidates else 0.0
        scored = [c for c in valid if c.reward is not None]
        # Every round logs the same keys (NaN: no valid environment this round), so a
        # stretch with nothing to score shows up as a gap in the curves, not a missing key.
        nan = float("nan")
        m.update({k: nan for k in ("regret_raw_mean", "regret_clipped_mean", "regret_negative_share",
                                   "return_hint_mean", "return_no_hint_mean", "win_rate_mean",
                                   "designer/anchor_mean", "designer/total_mean",
                                   "reward_levels_mean", "strict_partial_levels_mean",
                                   "formula_reveal_rate")})
        if scored and hasattr(scored[0].reward, "regret"):
            regrets = np.array([c.reward.regret for c in scored])
            m.update({
                "regret_raw_mean": float(regrets.mean()),
                "regret_clipped_mean": float(np.mean([c.reward.clipped for c in scored])),
                "regret_negative_share": float(np.mean(regrets < 0)),
                "return_hint_mean": float(np.mean([c.reward.mean_hint for c in scored])),
                "return_no_hint_mean": float(np.mean([c.reward.mean_no_hint for c in scored])),
                "win_rate_mean": float(np.mean([c.reward.win_rate for c in scored])),
                "designer/anchor_mean": float(np.mean([c.reward.anchor for c in scored])),
                "designer/total_mean": float(np.mean([c.reward.total for c in scored])),
            })
            for regime in ("frontier", "mastered", "intractable"):
                m[f"regime/{regime}"] = float(sum(str(c.reward.regime) == regime for c in scored))
        elif scored:
            m["designer/total_mean"] = float(np.mean([c.reward.total for c in scored]))
        threshold = self.config.success_threshold
        win_rates = [float(np.mean(np.asarray(c.returns_no_hint) >= threshold))
                     for c in valid if c.returns_no_hint]
        m["learnable_share"] = self.learnable.record_round(win_rates)
        if len(valid) >= 1:
            sources = [c.parsed.program for c in valid]
            try:
                m["vendi_per_n"] = normalized_vendi_score(self.featuriser(sources))
            except ValueError:
                m["vendi_per_n"] = float("nan")
            levels = [env_stats.reward_levels(c.returns_hint + c.returns_no_hint) for c in valid]
            partial = [env_stats.strict_partial_levels(c.returns_hint + c.returns_no_hint)
                       for c in valid]
            m["reward_levels_mean"] = float(np.mean(levels))
            m["strict_partial_levels_mean"] = float(np.mean(partial))
            m["formula_reveal_rate"] = float(np.mean(
                [env_stats.formula_reveal(c.opening_observation) for c in valid]))
        else:
            m["vendi_per_n"] = nan
        for name, count in self.memory.regime_counts().items():
            m[f"memory/{name}"] = float(count)
        return m

    # ---- fixed-environment baselines ----------------------------------------------------
    def _baseline_round(self, round_index: int, estimator: str) -> dict[str, float]:
        if self.baseline is None:
            raise ValueError(f"baseline {self.config.baseline!r} needs a FixedEnvBaseline")
        t0 = time.perf_counter()
        specs = self.baseline.episodes(round_index, self.config.n_hint)
        records = self.run_episodes(specs)
        if jax.process_count() > 1:
            self._agree_returns([], records)
        t_roll = time.perf_counter() - t0
        t0 = time.perf_counter()
        update_metrics = self.update(self.agent_sequences(records, estimator))
        by_env: dict[str, list[float]] = collections.defaultdict(list)
        for rec in records:
            by_env[rec.env_id].append(rec.return_)
        threshold = self.config.success_threshold
        win_rates = [float(np.mean(np.asarray(v) >= threshold)) for v in by_env.values()]
        self.baseline.feedback(by_env)
        return {
            "return_no_hint_mean": float(np.mean([r.return_ for r in records])) if records else 0.0,
            "learnable_share": self.learnable.record_round(win_rates),
            **{f"train/{k}": v for k, v in update_metrics.items()},
            "time/rollout": t_roll, "time/update": time.perf_counter() - t0,
        }


def _group_advantages(rewards: Sequence[float], estimator: str) -> np.ndarray:
    rule = rl.advantage_estimators.get(estimator)
    rewards = np.asarray(rewards, np.float32)
    adv, _ = rule.fn(rewards, len(rewards), rule.make_config())
    return np.asarray(adv, np.float32)


def _memory_example(record: EnvironmentRecord) -> dict[str, Any]:
    return {"program": record.program_source, "hint": record.hint, "regime": str(record.regime),
            "win_rate": record.win_rate_no_hint, "regret": record.regret}
