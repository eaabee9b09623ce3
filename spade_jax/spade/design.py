"""The design and validate phases of a regeneration round, and the hint writer.

    prompts   -> one designer prompt per slot: its skill (the window's active skills, in
                 turn), freshly sampled corpus documents and memory examples
    sample    -> ``designer_group_size`` samples per prompt, seeded (seed, round, DESIGN,
                 attempt)
    validate  -> every program through the sandbox's validation; a slot member whose
                 program fails is sampled again, up to ``max_design_attempts`` (rejection
                 sampling); invalid attempts are trained only under ``invalid_penalty``
    hints     -> hint_mode "self": the policy writes a strategy hint for every valid game
                 in a separate, untrained call at the hint temperature

All draws are seeded from (experiment seed, round, phase, index), so a resumed run redraws
exactly what an uninterrupted one draws.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from spade_jax.envs import make_env, validate_programs
from spade_jax.seeding import Phase, derive_seed, rng
from spade_jax.spade import agreement
from spade_jax.spade.config import (
    Contract,
    CorpusDraws,
    ProgramExtraction,
    PromptStyle,
    SpadeConfig,
)
from spade_jax.spade.corpus import CorpusSampler, Document
from spade_jax.spade.env_stats import ProbeConfig, probe_program_levels, stated_level
from spade_jax.spade.extraction import recipe_program
from spade_jax.spade.memory import EnvironmentMemory, EnvironmentRecord
from spade_jax.spade.prompts import (
    COMPACT_REFERENCE_DESIGNER_SYSTEM_PROMPT,
    DESIGNER_SYSTEM_PROMPTS,
    DesignerOutput,
    designer_user_prompt,
    hint_writer_messages,
    parse_designer_output,
    parse_hint,
    reference_designer_system_prompt,
    reference_designer_user_prompt,
    tool_designer_user_prompt,
    tool_hint_writer_messages,
    tool_prompts,
)
from spade_jax.spade.skills import active_skills, get_skill_set
from spade_jax.spade.window import (
    VALID,
    DesignerSample,
    Game,
    Outcome,
    Verdict,
)

# How much of a validator's reason an attempt keeps (a traceback can be long).
_MAX_DETAIL_CHARS = 500


class PromptSampler(Protocol):
    """The policy's sampler: token ids and per-token log-probs for every prompt, and
    optionally a third list: per prompt the recorded routing (``[P + n - 1, L, X]``,
    :mod:`spade_jax.rollout.routing`) or None. ``purpose`` is "design" (the designer's
    sampler) or "hint" (the hint writer's)."""

    def __call__(self, prompts: list[list[int]], *, seed: int, purpose: str
                 ) -> tuple[list[list[int]], list[list[float]]] | tuple[
                     list[list[int]], list[list[float]], list[np.ndarray | None]]: ...


@dataclasses.dataclass(frozen=True)
class SlotPrompt:
    slot: int
    skill: str
    prompt_ids: list[int]
    doc_ids: tuple[str, ...]


@dataclasses.dataclass
class Attempt:
    """One sampled designer output and what became of it."""

    slot: int
    member: int
    skill: str
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    verdict: Verdict = VALID
    parsed: DesignerOutput | None = None
    routing: np.ndarray | None = None  # recorded routing of prompt + output (router replay)
    doc_ids: tuple[str, ...] = ()  # the corpus documents its prompt held
    detail: str = ""  # the validator's whole reason when it rejected the program


def slot_skills(config: SpadeConfig, step: int) -> list[str]:
    """Skill of each designer slot of the window starting at ``step``: the window's active
    skills in turn, so games are split evenly over them (recipe: 24 games, 3 skills)."""
    skills = active_skills(get_skill_set(config.skills), step // config.regeneration_interval,
                           config.skills_per_window)
    return [skills[slot % len(skills)].name for slot in range(config.num_slots)]


class Designer:
    """Writes a window's games: prompts, rejection-sampled programs, hints."""

    def __init__(self, config: SpadeConfig, *, tokenizer: Any, pool: Any, generate: PromptSampler,
                 corpus_sampler: CorpusSampler | None, memory: EnvironmentMemory, seed: int,
                 max_turns: int):
        self.config, self.tokenizer, self.pool, self.generate = config, tokenizer, pool, generate
        self.corpus_sampler, self.memory, self.seed = corpus_sampler, memory, seed
        self.max_turns = max_turns
        self.used_doc_ids: set[str] = set()

    # ---- prompts -----------------------------------------------------------------------
    def prompts(self, step: int, slots: Sequence[int] | None = None) -> list[SlotPrompt]:
        """Designer prompts of the window starting at ``step`` for ``slots`` (default:
        every slot), each with freshly drawn corpus documents and memory examples."""
        cfg = self.config
        skills = slot_skills(cfg, step)
        slots = range(len(skills)) if slots is None else list(slots)
        docs, examples = self._prompt_draws([skills[s] for s in slots])
        out = []
        for slot, slot_docs, slot_examples in zip(slots, docs, examples, strict=True):
            skill = skills[slot]
            reused = [d.doc_id for d in slot_docs if d.doc_id in self.used_doc_ids]
            if reused and cfg.corpus_draws == CorpusDraws.WITHOUT_REPLACEMENT:
                raise RuntimeError(f"corpus documents reused within a run: {reused}")
            self.used_doc_ids.update(d.doc_id for d in slot_docs)
            ids = self.tokenizer.apply_chat_template(
                self.messages(skill, [d.text for d in slot_docs], slot_examples),
                add_generation_prompt=True, enable_thinking=cfg.designer_thinking)
            out.append(SlotPrompt(slot, skill, list(ids), tuple(d.doc_id for d in slot_docs)))
        return out

    def messages(self, skill: str, documents: list[str],
                  examples: list[dict[str, Any]]) -> list[dict[str, str]]:
        """The designer's chat for one slot, in the prompt family of the game contract:
        the recipe's games or tool environments (memory examples split into frontier
        programs to build on and others to avoid), or the paper's ``class Environment``
        with a hint."""
        cfg = self.config
        limits = dict(max_doc_chars=cfg.max_doc_chars, max_doc_words=cfg.max_doc_words,
                      max_program_chars=cfg.max_program_chars)
        good = [e for e in examples if e["build_on"]]
        bad = [e for e in examples if not e["build_on"]]
        if cfg.contract == Contract.REFERENCE:
            system = (COMPACT_REFERENCE_DESIGNER_SYSTEM_PROMPT if cfg.prompt_style == PromptStyle.COMPACT
                      else reference_designer_system_prompt(self.max_turns))
            user = reference_designer_user_prompt(skill, documents, good, bad, **limits)
        elif cfg.contract == Contract.TOOL:
            system = tool_prompts(cfg.prompt_style, self.max_turns).designer_system
            user = tool_designer_user_prompt(skill, documents, good, bad, **limits)
        else:
            system = DESIGNER_SYSTEM_PROMPTS[cfg.prompt_style]
            user = designer_user_prompt(skill, documents, examples, **limits)
        return [{"role": "system", "content": system}, {"role": "user", "content": user}]

    def _prompt_draws(self, skills: Sequence[str]) -> tuple[list[list[Document]],
                                                             list[list[dict[str, Any]]]]:
        """Corpus documents and memory examples per slot; process 0's on every host."""
        cfg = self.config
        docs, examples = [], []
        for skill in skills:
            slot_docs = []
            if cfg.use_corpus and self.corpus_sampler is not None and cfg.docs_per_prompt:
                slot_docs = self.corpus_sampler.sample(cfg.docs_per_prompt)
            slot_examples = []
            if cfg.use_memory and self.memory.records and cfg.memory_examples:
                build_on, avoid = self.memory.prompt_examples(cfg.memory_examples, skill)
                slot_examples = ([_memory_example(r, True) for r in build_on]
                                 + [_memory_example(r, False) for r in avoid])
            docs.append(slot_docs)
            examples.append(slot_examples)
        return agreement.agree_prompt_draws(docs, examples)

    # ---- sampling with rejection -------------------------------------------------------
    def design(self, step: int, slots: Sequence[int] | None = None, *, written_at: int | None = None
               ) -> tuple[list[Game], list[DesignerSample], list[Attempt]]:
        """The window's games (of ``slots``, default every slot), the designer samples to
        train, and every attempt made. ``written_at``: the round the games are written
        (default ``step``, the window's start; later for a window's missing games)."""
        cfg = self.config
        written_at = step if written_at is None else written_at
        prompts = {p.slot: p for p in self.prompts(step, slots)}
        wanted = [(s, m) for s in sorted(prompts) for m in range(cfg.designer_group_size)]
        attempts: list[Attempt] = []
        accepted: dict[tuple[int, int], Attempt] = {}
        tag = "" if written_at == step else f"w{written_at}_"  # ids of a window's later games
        for attempt_index in range(cfg.max_design_attempts):
            if not wanted:
                break
            if attempt_index and cfg.fresh_prompt_per_attempt:
                # The recipe: every attempt draws a fresh document and fresh examples.
                prompts.update({p.slot: p for p in self.prompts(
                    step, sorted({s for s, _ in wanted}))})
            tokens, logprobs, *routes = self.generate(
                [prompts[s].prompt_ids for s, _ in wanted],
                seed=derive_seed(self.seed, written_at, Phase.DESIGN, attempt_index),
                purpose="design")
            routes = routes[0] if routes else [None] * len(wanted)
            batch = [Attempt(s, m, prompts[s].skill, prompts[s].prompt_ids, list(t), list(lp),
                             routing=r, doc_ids=prompts[s].doc_ids)
                     for (s, m), t, lp, r in zip(wanted, tokens, logprobs, routes, strict=True)]
            self.validate(batch, [f"r{step}_{tag}s{a.slot}_m{a.member}_a{attempt_index}"
                                  for a in batch],
                          [derive_seed(self.seed, written_at, Phase.VALIDATION, attempt_index,
                                       a.slot, a.member) for a in batch])
            attempts += batch
            accepted.update({(a.slot, a.member): a for a in batch if a.verdict.ok})
            wanted = [(a.slot, a.member) for a in batch if not a.verdict.ok]
        games, samples = [], []
        for (s, m), att in sorted(accepted.items()):
            env_id = f"r{step}_{tag}s{s}_m{m}"
            hint = att.parsed.hint if cfg.designer_writes_hints else None
            games.append(Game(env_id=env_id, slot=s, skill=att.skill, program=att.parsed.program,
                              hint=hint, doc_ids=att.doc_ids,
                              returns_by_offset=[[] for _ in range(cfg.regeneration_interval)],
                              written_at=written_at))
            samples.append(_sample(att, env_id))
        if cfg.invalid_penalty is not None:
            samples += [_sample(a, None) for a in attempts if not a.verdict.ok]
        return games, samples, attempts

    def validate(self, batch: list[Attempt], names: list[str], seeds: list[int]) -> None:
        """Parses and validates every attempt (validations run in parallel, each with its
        seeded validation seed); process 0's verdicts on every host."""
        local = self._check(batch, seeds)
        verdicts = agreement.agree_verdicts("validation", names, local,
                                            lambda i: self._check([batch[i]], [seeds[i]])[0])
        for att, verdict in zip(batch, verdicts, strict=True):
            att.verdict = verdict

    def _check(self, batch: list[Attempt], seeds: list[int]) -> list[Verdict]:
        cfg = self.config
        verdicts = [self._parse(att) for att in batch]
        todo = [i for i, verdict in enumerate(verdicts) if verdict.ok]
        hints = [batch[i].parsed.hint if cfg.designer_writes_hints else None for i in todo]
        reports = validate_programs(
            [batch[i].parsed.program for i in todo], hints, pool=self.pool,
            contract=cfg.contract, max_turns=self.max_turns, seeds=[seeds[i] for i in todo])
        for i, report in zip(todo, reports, strict=True):
            if not report.ok:
                code = report.reason.split(":", 1)[0].strip() or "invalid"
                verdicts[i] = Verdict(Outcome.INVALID, code)
                batch[i].detail = report.reason[:_MAX_DETAIL_CHARS]
        return verdicts

    def attempt_record(self, att: Attempt) -> dict[str, Any]:
        """What one attempt wrote and what became of it, as a JSON object for the run's
        ``designs.jsonl``: the reply as decoded text, the verdict (and the validator's
        reason), the level the program states (``LEVEL = n``; None if none) and the
        prompt's and reply's token counts."""
        text = self.tokenizer.decode(att.output_ids, skip_special_tokens=True)
        program = att.parsed.program if att.parsed is not None else text
        return {"slot": att.slot, "member": att.member, "skill": att.skill,
                "verdict": att.verdict.label, "detail": att.detail,
                "level": stated_level(program), "prompt_tokens": len(att.prompt_ids),
                "reply_tokens": len(att.output_ids), "reply": text}

    def _parse(self, att: Attempt) -> Verdict:
        if att.parsed is not None:
            return VALID
        cfg = self.config
        text = self.tokenizer.decode(att.output_ids, skip_special_tokens=True)
        if cfg.program_extraction == ProgramExtraction.RECIPE and not cfg.designer_writes_hints:
            # The recipe's reading: the first python block or the whole reply, braces
            # repaired; every reply is a program and validation decides (extraction.py).
            program = recipe_program(text)
            if not program.strip():
                return Verdict(Outcome.PARSE_ERROR, "empty_program")
            att.parsed = DesignerOutput(program=program, hint="", raw=text)
            return VALID
        parsed = parse_designer_output(text, require_hint=cfg.designer_writes_hints)
        if not isinstance(parsed, DesignerOutput):
            return Verdict(Outcome.PARSE_ERROR, parsed.code)
        att.parsed = parsed
        return VALID

    # ---- fixed pool ----------------------------------------------------------------------
    def fixed_pool_games(self, step: int, pool: Sequence[tuple[str, str | None, str]],
                         cursor: int) -> tuple[list[Game], int]:
        """``envs_per_round`` programs of the pool, drawn without replacement across the
        run (a fresh seeded permutation per pass), from draw number ``cursor`` on."""
        cfg = self.config
        games = []
        for i in range(cfg.envs_per_round):
            index = cursor + i
            order = rng(self.seed, Phase.DESIGN, index // len(pool)).permutation(len(pool))
            source, hint, skill = pool[int(order[index % len(pool)])]
            games.append(Game(
                env_id=f"r{step}_p{i}", slot=i, skill=skill, program=source,
                hint=hint if cfg.designer_writes_hints else None, doc_ids=(),
                returns_by_offset=[[] for _ in range(cfg.regeneration_interval)]))
        return games, cursor + cfg.envs_per_round

    # ---- hints ---------------------------------------------------------------------------
    def write_hints(self, games: list[Game], step: int) -> None:
        """hint_mode "self": the policy reads each game's program and writes a hint (an
        untrained call); up to ``hint_attempts`` tries for a usable one (non-empty, and
        matching ``hint_pattern`` when set). Games left without one have no hint arm."""
        todo = [g for g in games if g.hint is None]
        for attempt_index in range(self.config.hint_attempts):
            if not todo:
                return
            prompts = [list(self.tokenizer.apply_chat_template(
                self.hint_messages(g.program), add_generation_prompt=True,
                enable_thinking=False)) for g in todo]
            tokens, *_ = self.generate(
                prompts, seed=derive_seed(self.seed, step, Phase.HINT_WRITE, attempt_index),
                purpose="hint")
            pattern = self.config.hint_pattern
            for game, ids in zip(todo, tokens, strict=True):
                hint = parse_hint(self.tokenizer.decode(ids, skip_special_tokens=True))
                game.hint = hint if hint is None or not pattern or re.fullmatch(
                    pattern, hint) else None
            todo = [g for g in todo if g.hint is None]

    def hint_messages(self, program: str) -> list[dict[str, str]]:
        """The hint writer's chat for one program of the run's contract."""
        if self.config.contract == Contract.TOOL:
            return tool_hint_writer_messages(program)
        return hint_writer_messages(program)

    def probe_levels(self, games: list[Game], step: int) -> None:
        """The reward levels each program can emit, probed in the sandbox with seeded
        scripted play ((seed, round, PROBE, game)); ``probe_episodes`` 0 turns it off."""
        cfg = self.config
        if not cfg.probe_episodes:
            return
        probe = ProbeConfig(episodes=cfg.probe_episodes, max_turns=self.max_turns,
                            time_budget_s=cfg.probe_time_budget_s)
        for index, game in enumerate(games):
            levels = probe_program_levels(game.program, seed=self.seed, step=step, index=index,
                                          pool=self.pool, contract=cfg.contract, config=probe)
            game.reward_levels = levels.reward_levels
            game.strict_partial_levels = levels.strict_partial_levels

    def open_envs(self, program: str, count: int) -> tuple[list[Any], Verdict]:
        """``count`` fresh sandboxed copies of a program (a fresh worker per episode),
        stopping at the first that fails to load."""
        envs = []
        for _ in range(count):
            try:
                envs.append(make_env(program, self.pool, contract=self.config.contract,
                                     max_turns=self.max_turns))
            except Exception as e:  # noqa: BLE001 - untrusted program; record, go on
                return envs, Verdict(Outcome.LOAD_ERROR, type(e).__name__)
        return envs, VALID

    def state_dict(self) -> dict[str, Any]:
        return {"used_doc_ids": sorted(self.used_doc_ids)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.used_doc_ids = set(state["used_doc_ids"])


def _sample(att: Attempt, env_id: str | None) -> DesignerSample:
    return DesignerSample(slot=att.slot, skill=att.skill, prompt_ids=att.prompt_ids,
                          output_ids=att.output_ids, output_logprobs=att.output_logprobs,
                          env_id=env_id, verdict=att.verdict, routing=att.routing)


def _memory_example(record: EnvironmentRecord, build_on: bool) -> dict[str, Any]:
    """A memory record as a prompt example; ``build_on``: shown as a game to build on
    (else as one to avoid)."""
    return {"program": record.program_source, "hint": record.hint, "regime": str(record.regime),
            "win_rate": record.win_rate_no_hint, "regret": record.regret, "build_on": build_on}


