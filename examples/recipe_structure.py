"""The published recipe's round structure at CPU size, with a scripted policy.

    python examples/recipe_structure.py [--rounds=8] [--out=recipe_structure.jsonl]

The loop, the sandbox and the recipe's settings are the real ones (``qwen3_30b_a3b``'s
``spade`` block, scaled to 6 games a window, 2 plays a game and a global batch of 12); only
the policy is scripted, so every behaviour of the second audit (issue 30,
docs/reference_parity.md) that depends on what the policy writes happens on purpose:

- the designer's replies: a slot whose first attempt does not validate is retried with a
  fresh corpus document (item 7); one slot never validates in round 0 and is written at
  round 1 (item 12), while the games that exist are played ceil(12 / games) times;
- the games: one raises in ``step()`` on the action "jump" (item 3: the agent sees an error
  and reward -1), one sleeps past the sandbox's play deadline on "rest" (item 13: the play
  is dropped and the game blocklisted, then rewritten);
- the agent: each reply is chosen by the episode seed; some replies are cut at the turn's
  token cap (item 4: the episode ends "cut_reply", score 0).

Designer samples are trained first and the batch is cut to the global batch (item 1), and
games enter memory at the end of the round that wrote them (item 5). Each round prints the
metrics that show these; ``--out`` writes them as JSONL.

The scripted agent plays the sandboxed games with the agent loop's parser and end rules
(``AgentLoopConfig.end_on_cut_reply``); the engine path of a cut reply is checked in
tests/rollout/test_agent_loop.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from spade_jax.envs import EnvPool
from spade_jax.experiment import load_experiment
from spade_jax.rollout.agent_loop import ActionParser
from spade_jax.rollout.records import EpisodeRecord
from spade_jax.spade.corpus import CorpusSampler, CorpusSamplerConfig, Document, InMemoryCorpus
from spade_jax.spade.loop import SpadeLoop
from spade_jax.spade.memory import EnvironmentMemory, MemoryConfig
from spade_jax.spade.reward import make_designer_reward

# --------------------------------------------------------------------------- programs
_CLIMB = r'''
class {name}Env:
    def __init__(self, max_turns=12):
        self.max_turns = max_turns

    def reset(self, seed=None):
        rng = random.Random(seed)
        self.turn, self.pos, self.goal = 0, 0, rng.randint(2, 4)
        return f"Reach level {{self.goal}} of the {label}. Answer \\boxed{{{{up}}}} or \\boxed{{{{down}}}}.", {{}}

    def step(self, action):
        self.turn += 1
        found = re.search(r"\\boxed\{{([^}}]*)\}}", action)
        command = (found.group(1) if found else action).strip().lower()
{trap}        self.pos += {{"up": 1, "down": -1}}.get(command, 0)
        self.pos = max(self.pos, 0)
        if self.pos >= self.goal:
            return "You made it.", 1.0, True, False, {{}}
        return (f"Level {{self.pos}} of {{self.goal}}.", self.pos / self.goal, False,
                self.turn >= self.max_turns, {{}})

    def solution(self):
        return ["\\boxed{{up}}"] * self.goal
'''


def _game(name: str, label: str, trap: str = "") -> str:
    return _CLIMB.format(name=name, label=label, trap=trap)


TOWER = _game("Tower", "tower")
CAVE = _game("Cave", "cave")
HILL = _game("Hill", "hill")
# Raises in step() on "jump" (the word never appears in its observations, so validation's
# agent-like actions do not send it).
LAVA = _game("Lava", "volcano", '        if command == "jump":\n'
                               '            raise ValueError("the floor gave way")\n')
# Computes past the sandbox's per-call play limits on "rest".
SWAMP = _game("Swamp", "swamp", '        while command == "rest":\n'
                                '            self.turn += 1\n')
BROKEN = "class BrokenEnv:\n    def reset(self, seed=None):\n        return 1 / 0, {}\n"

# Designer replies per design call (a call = one rejection-sampling attempt, its prompts
# in slot order); later calls get valid games in turn.
DESIGN_SCRIPT = [
    [TOWER, LAVA, SWAMP, BROKEN, CAVE, BROKEN],  # round 0, attempt 0: slots 3 and 5 fail
    [HILL, BROKEN],  # attempt 1: slot 3 validates (a fresh document), slot 5 fails again
]
LATER = [HILL, CAVE, TOWER]


def _reply(program: str) -> str:
    return f"Here is the game.\n```python\n{program}```\n"


# --------------------------------------------------------------------------- tokenizer
class CharTokenizer:
    """Characters as token ids (0 ends a turn): the loop's prompts and decoding."""

    eos_ids = frozenset({0})
    pad_id = 0

    def apply_chat_template(self, messages, add_generation_prompt=False, enable_thinking=True):
        return self.encode("".join(f"<{m['role']}>{m['content']}" for m in messages))

    def encode(self, text: str) -> list[int]:
        return [min(ord(c), 60_000) + 1 for c in text]

    def decode(self, ids, skip_special_tokens=False) -> str:
        return "".join(chr(i - 1) for i in ids if i > 0)


# --------------------------------------------------------------------------- policy
class ScriptedPolicy:
    """The designer's replies from DESIGN_SCRIPT, a fixed hint, and an agent whose reply
    each turn is chosen by (episode seed, turn)."""

    CUT = "I am still thinking about which way to"  # no box, no end of turn: cut at the cap

    def __init__(self, tokenizer: CharTokenizer, end_on_cut_reply: bool, max_turns: int):
        self.tok, self.end_on_cut_reply, self.max_turns = tokenizer, end_on_cut_reply, max_turns
        self.design_calls: list[list[str]] = []
        self.parser = ActionParser(action_format="boxed")

    def generate(self, prompts, *, seed, purpose):
        if purpose == "hint":
            texts = ["Keep answering up until you reach the goal."] * len(prompts)
        else:
            call = len(self.design_calls)
            script = (DESIGN_SCRIPT[call] if call < len(DESIGN_SCRIPT)
                      else [LATER[(call + i) % len(LATER)] for i in range(len(prompts))])
            texts = [_reply(p) for p in script[:len(prompts)]]
            self.design_calls.append([self.tok.decode(p) for p in prompts])
        ids = [self.tok.encode(t) + [0] for t in texts]
        return ids, [[-1.0] * len(t) for t in ids]

    def agent_reply(self, seed: int, turn: int) -> tuple[str, bool]:
        """(reply, cut): seed % 6 picks the episode's style."""
        style = seed % 6
        if style == 0 and turn == 0:
            return self.CUT, True
        if style == 1:
            return r"\boxed{jump}", False
        if style == 2 and turn == 0:
            return r"\boxed{rest}", False
        return r"\boxed{up}", False

    def run_episodes(self, specs, *, seed):
        return [self._play(spec) for spec in specs]

    def _play(self, spec) -> EpisodeRecord:
        rec = EpisodeRecord(env_id=spec.env_id, seed=spec.seed)
        try:
            observation, _ = self._timed(rec, spec.env.reset, seed=spec.seed)
        except Exception as err:  # noqa: BLE001 - a sandboxed program failed
            rec.end_reason = _failure(err)
            return rec
        rec.observations.append(str(observation))
        for turn in range(self.max_turns):
            rec.append(self.tok.encode(f"<user>{observation}<assistant>"), policy=False)
            reply, cut = self.agent_reply(spec.seed, turn)
            ids = self.tok.encode(reply) + ([] if cut else [0])
            rec.append(ids, policy=True, logprobs=[-1.0] * len(ids))
            rec.turn_done_reasons.append("max_tokens" if cut else "eos")
            if cut and self.end_on_cut_reply:
                rec.end_reason, rec.truncated, rec.return_ = "cut_reply", True, 0.0
                return rec
            action, _ = self.parser(reply)
            try:
                observation, reward, terminated, truncated, info = self._timed(
                    rec, spec.env.step, action)
            except Exception as err:  # noqa: BLE001
                rec.end_reason = _failure(err)
                return rec
            rec.observations.append(str(observation))
            rec.step_rewards.append(float(reward))
            rec.return_ = float(sum(rec.step_rewards))
            rec.terminated, rec.truncated = bool(terminated), bool(truncated)
            if info.get("program_error"):  # the sandbox's play wrapper answered for the game
                rec.end_reason = "program_error"
                return rec
            if terminated or truncated:
                rec.end_reason = "terminated" if terminated else "truncated"
                return rec
        rec.end_reason, rec.truncated = "max_turns", True
        return rec

    @staticmethod
    def _timed(rec: EpisodeRecord, fn, *args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            rec.cost.env_seconds += time.perf_counter() - start

    def update(self, seqs):
        roles = [s.role for s in seqs]
        return {"samples": float(len(seqs)), "designer_first": float(
            roles == sorted(roles, key=lambda r: r != "designer"))}


def _failure(err: Exception) -> str:
    reason = getattr(err, "end_reason", None)
    return reason if reason in ("env_error", "env_limit") else "env_error"


# --------------------------------------------------------------------------- the run
def recipe_config(rounds: int):
    """The 30B experiment's loop and sandbox settings at CPU size."""
    experiment = load_experiment("qwen3_30b_a3b", ["corpus.stand_in=True"])
    spade = dataclasses.replace(
        experiment.spade, rounds=rounds, envs_per_round=6, plays_per_game=2, hint_plays=2,
        global_batch=12, max_design_attempts=2, probe_episodes=0, eval_every=0,
        memory_examples=1)
    # The recipe's play wrapper and its play-time limits, scaled from 30 s to 1.5 s.
    sandbox = dataclasses.replace(experiment.sandbox, call_deadline_s=2.0, load_deadline_s=10.0,
                                  play_call_deadline_s=1.5, play_call_cpu_budget_s=1.0)
    return experiment, spade, sandbox


ITEM_METRICS = {
    "1 batch cut (designer first)": "batch/trimmed",
    "3 step() raised -> reward -1": "episodes/end/program_error",
    "4 cut reply ends the episode": "episodes/end/cut_reply",
    "5 games in memory after their round": "memory/added",
    "7 fresh document per attempt": "designer/fresh_documents",
    "12 missing games written later": "designer/missing_designed",
    "13 plays dropped (game blocklisted)": "plays/dropped",
}


def main(argv: list[str] | None = None) -> int:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--rounds", type=int, default=8)
    args.add_argument("--out", default="")
    opts = args.parse_args(argv)
    experiment, spade, sandbox = recipe_config(opts.rounds)
    tokenizer = CharTokenizer()
    policy = ScriptedPolicy(tokenizer, experiment.agent.end_on_cut_reply,
                            experiment.agent.max_turns)
    corpus = InMemoryCorpus([Document(f"doc{i}", f"text of document {i}", "demo")
                             for i in range(50)], "demo")
    out = open(opts.out, "w") if opts.out else None  # noqa: SIM115
    totals = dict.fromkeys(ITEM_METRICS.values(), 0.0)
    with EnvPool(sandbox, seed=experiment.seed) as pool:
        loop = SpadeLoop(
            spade, tokenizer=tokenizer, pool=pool, generate=policy.generate,
            run_episodes=policy.run_episodes, update=policy.update,
            corpus_sampler=CorpusSampler(corpus, CorpusSamplerConfig(
                seed=experiment.seed, documents_per_round=1, draws=spade.corpus_draws)),
            memory=EnvironmentMemory(MemoryConfig(capacity=spade.memory_capacity,
                                                  selection=spade.memory_selection)),
            reward_rule=make_designer_reward(spade.designer_reward), seed=experiment.seed,
            max_turns=experiment.agent.max_turns,
            rules=(experiment.train.agent, experiment.train.designer))
        print("round | games | agent plays | designer | trimmed | cut | step error | "
              "dropped | memory | missing written | fresh docs")
        for step in range(opts.rounds):
            calls, memory_before = len(policy.design_calls), len(loop.memory)
            metrics = loop.run_step(step)
            metrics["memory/added"] = float(len(loop.memory) - memory_before)
            metrics["designer/fresh_documents"] = float(_fresh_documents(
                policy.design_calls[calls:]))
            for value in totals:
                totals[value] += metrics.get(value, 0.0)
            window = loop.windows.get(spade.window_start(step))
            games = sum(g.verdict.ok for g in window.games) if window else 0
            print(f"{step:5d} | {games:5d} | "
                  f"{metrics['batch/agent']:11.0f} | {metrics['batch/designer']:8.0f} | "
                  f"{metrics['batch/trimmed']:7.0f} | "
                  f"{metrics.get('episodes/end/cut_reply', 0):3.0f} | "
                  f"{metrics.get('episodes/end/program_error', 0):10.0f} | "
                  f"{metrics['plays/dropped']:7.0f} | {metrics['memory/added']:6.0f} | "
                  f"{metrics['designer/missing_designed']:15.0f} | "
                  f"{metrics['designer/fresh_documents']:10.0f}", flush=True)
            if out:
                out.write(json.dumps({"step": step, **metrics}) + "\n")
    if out:
        out.close()
    print("\nitem | metric | total")
    for item, name in ITEM_METRICS.items():
        print(f"{item} | {name} | {totals[name]:.0f}")
    missing = [item for item, name in ITEM_METRICS.items() if not totals[name]]
    if missing:
        print(f"did not occur: {missing}", file=sys.stderr)
        return 1
    return 0


def _fresh_documents(calls: list[list[str]]) -> int:
    """Retried prompts whose corpus document differs from the slot's previous attempt's
    (the design calls of one round: attempt 0 holds every slot in order)."""
    def doc(prompt: str) -> str:
        return prompt.split("text of document ")[1].split()[0] if "text of document " in prompt else ""

    fresh = 0
    for previous, retry in zip(calls, calls[1:], strict=False):
        firsts = {doc(p) for p in previous}
        fresh += sum(1 for p in retry if doc(p) and doc(p) not in firsts)
    return fresh


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    raise SystemExit(main())
