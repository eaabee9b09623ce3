"""The published recipe's loop behaviours (issue 30, REFERENCE.md "Second audit"), each
re-derived from the authors' rule on inputs where it and the earlier behaviour differ:
the update's sample cut, memory timing, missing games, timed-out plays, fresh prompts per
attempt, uniform corpus draws, the last window's flush, and the corpus requirement.
The scripted policy, tokenizer and pool are test_loop's."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from spade_jax.envs import EnvPool, SandboxConfig
from spade_jax.experiment import CorpusMissing, load_experiment, require_corpus
from spade_jax.spade.corpus import CorpusSampler, CorpusSamplerConfig, Document, InMemoryCorpus
from spade_jax.spade.window import Outcome
from tests.spade.test_loop import (
    ALL_VALID,
    BROKEN_PROGRAM,
    OTHER,
    VALID,
    WINDOW,
    ByteTokenizer,
    ScriptedPolicy,
    _agent,
    _designer,
    _loop,
    _text,
)


@pytest.fixture(scope="module")
def pool():
    with EnvPool(SandboxConfig(call_deadline_s=2.0)) as p:
        yield p


def _doc_of(prompt_ids) -> str:
    """The corpus document named in a designer prompt ("text of document N")."""
    text = ByteTokenizer().decode(prompt_ids)
    return text.split("text of document ")[1].split()[0].strip(".,")


def test_update_cuts_to_the_global_batch_designer_samples_first(pool):
    """Item 1: at a designer-training round the designer samples go first and the list is
    cut to the global batch, so the last games' plays are not trained."""
    config = dataclasses.replace(WINDOW, rounds=2, designer_delay=1, global_batch=12)
    policy = ScriptedPolicy(ALL_VALID)
    loop = _loop(pool, policy, config)
    m0 = loop.run_step(0)
    m1 = loop.run_step(1)
    # Round 0: 4 games x 3 plays = 12 agent samples, nothing cut.
    assert [s.role for s in policy.updates[0]] == ["agent"] * 12 and m0["batch/trimmed"] == 0
    # Round 1: 4 designer samples (delay 1) + 12 plays -> the first 12: designer first.
    roles = [s.role for s in policy.updates[1]]
    assert roles == ["designer"] * 4 + ["agent"] * 8 and m1["batch/trimmed"] == 4
    # The plays cut are the last games' (agent samples are in game order): the 8 kept
    # are the first 8 of the 12 the rule produced.
    full = _loop(pool, ScriptedPolicy(ALL_VALID), dataclasses.replace(config, global_batch=0))
    full.run_step(0)
    full.run_step(1)
    uncut = _agent(full.update.__self__.updates[1])
    assert [list(s.token_ids) for s in _agent(policy.updates[1])] == \
        [list(s.token_ids) for s in uncut[:8]]
    # Without a global batch every sample is trained (the earlier behaviour).
    policy = ScriptedPolicy(ALL_VALID)
    loop = _loop(pool, policy, dataclasses.replace(config, global_batch=0))
    loop.run_step(0)
    loop.run_step(1)
    assert len(policy.updates[1]) == 16


@pytest.mark.slow
def test_a_game_enters_memory_at_the_end_of_the_round_that_wrote_it(pool):
    """Item 5: memory_at "regeneration": after round 0 (before any scoring) the window's
    games are in memory with the win share of round 0's plays, so the design at round 4
    can show them; memory_at "scoring" adds them only when scored (round 4, after that
    design)."""
    # Every skill in every window, so the second window's prompts can show the first's.
    config = dataclasses.replace(WINDOW, rounds=8, designer_delay=4, memory_at="regeneration",
                                 memory_examples=2, skills_per_window=0)
    policy = ScriptedPolicy(ALL_VALID)
    loop = _loop(pool, policy, config)
    loop.run_step(0)
    assert len(loop.memory) == 4
    for env_id in loop.memory._records:
        plays = [e["return"] for e in policy.episode_log[0]
                 if e["env_id"] == env_id and not e["hinted"]]
        hint = [e["return"] for e in policy.episode_log[0]
                if e["env_id"] == env_id and e["hinted"]]
        record = loop.memory[env_id]
        assert record.win_rate_no_hint == pytest.approx(np.mean(np.array(plays) > 0))
        assert record.regret == pytest.approx(np.mean(hint) - np.mean(plays))
    for step in range(1, 5):
        loop.run_step(step)
    second_design = ByteTokenizer().decode(policy.design_calls[-1][0][0])
    assert "Agent win rate" in second_design  # the new design saw window 0's games

    policy = ScriptedPolicy(ALL_VALID)
    late = _loop(pool, policy, dataclasses.replace(config, memory_at="scoring"))
    late.run_step(0)
    assert len(late.memory) == 0
    for step in range(1, 5):
        late.run_step(step)
    assert "Agent win rate" not in ByteTokenizer().decode(policy.design_calls[-1][0][0])
    assert len(late.memory) == 4  # scored at round 4, after its design


def test_missing_games_are_written_later_and_plays_per_game_fill_the_batch(pool):
    """Item 12: a slot whose attempts all failed is designed again at the window's next
    round; meanwhile each of the games that exist is played ceil(global_batch / games)
    times."""
    texts = [_text(BROKEN_PROGRAM), _text(VALID.source), _text(OTHER.source),
             _text(VALID.source)]
    config = dataclasses.replace(WINDOW, rounds=3, designer_delay=4, max_design_attempts=1,
                                 global_batch=12, regenerate_missing_games=True)
    policy = ScriptedPolicy(texts)
    loop = _loop(pool, policy, config)
    m0 = loop.run_step(0)
    assert m0["valid_envs"] == 3
    plays = [e for e in policy.episode_log[0] if not e["hinted"]]
    assert len(plays) == 3 * math.ceil(12 / 3)  # 4 plays each, not plays_per_game=3
    m1 = loop.run_step(1)
    assert m1["designer/missing_designed"] == 1
    window = loop.windows[0]
    late = [g for g in window.games if g.written_at == 1]
    assert len(late) == 1 and late[0].slot == 0 and late[0].env_id == "r0_w1_s0_m0"
    log1 = policy.episode_log[1]
    assert sum(1 for e in log1 if e["env_id"] == late[0].env_id and e["hinted"]) == \
        config.hint_plays  # its own hint arm at the round it was written
    assert sum(1 for e in log1 if not e["hinted"]) == 4 * 3  # back to 12 / 4
    assert len(loop.pending[0].samples) == 4  # trained with the window's samples
    m2 = loop.run_step(2)
    assert m2["designer/missing_designed"] == 0
    # Off (the earlier behaviour): the window keeps 3 games at 3 plays each.
    policy = ScriptedPolicy(texts)
    off = _loop(pool, policy, dataclasses.replace(config, regenerate_missing_games=False))
    off.run_step(0)
    off.run_step(1)
    assert sum(1 for e in policy.episode_log[1] if not e["hinted"]) == 3 * 3


class SlowGamePolicy(ScriptedPolicy):
    """Plays of ``slow`` report ``seconds`` of environment time; plays of ``broken`` end on
    a sandbox limit."""

    def __init__(self, texts, slow="", broken="", seconds=400.0):
        super().__init__(texts)
        self.slow, self.broken, self.seconds = slow, broken, seconds

    def run_episodes(self, specs, *, seed):
        records = super().run_episodes(specs, seed=seed)
        for rec in records:
            rec.cost.env_seconds = self.seconds if rec.env_id == self.slow else 1.0
            rec.end_reason = "env_limit" if rec.env_id == self.broken else "terminated"
        return records


def test_timed_out_plays_are_dropped_and_their_game_blocklisted(pool):
    """Item 13: a play over play_env_seconds, or one that ended on a sandbox limit, is not
    trained nor counted, and its game is not played again; without the recipe's settings
    the play counts (return as scored)."""
    config = dataclasses.replace(WINDOW, rounds=2, designer_delay=1, play_env_seconds=300.0,
                                 drop_failed_plays=True)
    policy = SlowGamePolicy(ALL_VALID, slow="r0_s1_m0", broken="r0_s2_m0")
    loop = _loop(pool, policy, config)
    m0 = loop.run_step(0)
    dropped = 2 * (config.plays_per_game + config.hint_plays)
    assert m0["plays/dropped"] == dropped and m0["episodes/end/env_limit"] == 5
    games = {g.env_id: g for g in loop.windows[0].games}
    for env_id in ("r0_s1_m0", "r0_s2_m0"):
        assert games[env_id].verdict.outcome is Outcome.BLOCKLISTED
        assert not games[env_id].hint_returns and not games[env_id].returns_by_offset[0]
    assert len(_agent(policy.updates[0])) == 2 * config.plays_per_game
    loop.run_step(1)
    assert {e["env_id"] for e in policy.episode_log[1]} == {"r0_s0_m0", "r0_s3_m0"}
    assert len(_designer(policy.updates[1])) == 2  # the blocklisted games are not scored

    policy = SlowGamePolicy(ALL_VALID, slow="r0_s1_m0", broken="r0_s2_m0")
    keep = _loop(pool, policy, dataclasses.replace(config, play_env_seconds=0.0,
                                                   drop_failed_plays=False))
    m0 = keep.run_step(0)
    assert m0["plays/dropped"] == 0 and len(_agent(policy.updates[0])) == 4 * 3


def test_each_attempt_draws_a_fresh_document_when_asked(pool):
    """Item 7: a slot that failed is retried with a fresh corpus document (and memory
    examples); the earlier behaviour reuses its first prompt."""
    texts = [_text(BROKEN_PROGRAM), _text(VALID.source), _text(OTHER.source),
             _text(VALID.source)]
    for fresh in (True, False):
        policy = ScriptedPolicy(texts)
        config = dataclasses.replace(WINDOW, rounds=1, designer_delay=0, max_design_attempts=2,
                                     fresh_prompt_per_attempt=fresh)
        loop = _loop(pool, policy, config)
        loop.run_step(0)
        first, second = policy.design_calls[0][0], policy.design_calls[1][0]
        assert len(second) == 1  # slot 0 retried
        assert (_doc_of(second[0]) != _doc_of(first[0])) == fresh


def test_uniform_corpus_draws_repeat_and_are_reproducible():
    """Item 8: the recipe draws documents independently and uniformly: a 3-document corpus
    serves 40 draws (with repeats), each draw seeded from (seed, draw number), so a
    resumed sampler draws what an uninterrupted one does."""
    corpus = InMemoryCorpus([Document(f"d{i}", f"text {i}", "t") for i in range(3)], "t")
    config = CorpusSamplerConfig(seed=5, documents_per_round=1, draws="uniform")
    straight = CorpusSampler(corpus, config)
    drawn = [d.doc_id for _ in range(20) for d in straight.sample(2)]
    assert len(drawn) == 40 and set(drawn) == {"d0", "d1", "d2"}
    want = [f"d{np.random.Generator(np.random.PCG64([5, 1, k])).integers(3)}" for k in range(40)]
    assert drawn == want
    first = CorpusSampler(corpus, config)
    for _ in range(7):
        first.sample(2)
    resumed = CorpusSampler(corpus, config)
    resumed.load_state_dict(first.state_dict())
    assert [d.doc_id for _ in range(13) for d in resumed.sample(2)] == drawn[14:]
    without = CorpusSampler(corpus, CorpusSamplerConfig(seed=5, documents_per_round=1))
    with pytest.raises(Exception, match="unseen documents"):
        for _ in range(4):
            without.sample(1)


def test_the_recipe_experiment_refuses_to_start_without_its_corpus(tmp_path):
    """Item 8: the 30B experiment names the flag instead of falling back to the stand-in."""
    config = load_experiment("qwen3_30b_a3b")
    with pytest.raises(CorpusMissing, match="--corpus=") as err:
        require_corpus(config)
    assert "corpus.stand_in=True" in str(err.value)
    require_corpus(load_experiment("qwen3_30b_a3b", ["corpus.stand_in=True"]))
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "a document"}\n')
    require_corpus(load_experiment("qwen3_30b_a3b", [f"corpus.paths=('{corpus}',)"]))
    with pytest.raises(CorpusMissing, match="'c.jsonl' does not exist"):  # checked up front
        require_corpus(load_experiment("qwen3_30b_a3b", ["corpus.paths=('c.jsonl',)"]))
    require_corpus(load_experiment("tiny"))  # CPU experiments keep the stand-in


@pytest.mark.slow
def test_the_last_windows_designer_samples_are_not_flushed_in_the_recipe(pool):
    """Item 14: the recipe never trains the last window's designer samples (its final flush
    is skipped); flush_at_end=True (ours) trains them at the last round."""
    # Windows at 0, 2, 4 (interval 2, delay 2): round 0's samples are trained at 2,
    # round 2's at 4, round 4's (the last window) only by a final flush.
    for flush, want in ((False, [0, 0, 4, 0, 4]), (True, [0, 0, 4, 0, 8])):
        policy = ScriptedPolicy(ALL_VALID)
        config = dataclasses.replace(WINDOW, rounds=5, regeneration_interval=2,
                                     designer_delay=2, flush_at_end=flush)
        loop = _loop(pool, policy, config)
        for step in range(5):
            loop.run_step(step)
        assert [len(_designer(u)) for u in policy.updates] == want
