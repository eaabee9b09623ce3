"""What validation checks also holds while programs are played.

A program sees its inputs, so it can tell the validator from an agent: the games below
behave on anything but the words an agent would answer with (the door names of their own
observation, boxed), and there they turn slow (2 s of CPU a call), pin memory or turn
nondeterministic. Validation now plays like an agent too (seeded), and catches each; and
a game that breaks a limit mid-run is stopped, its episode ends with end reason
"env_limit", its reported rewards sum to what the contract pays for an unfinished
episode, and the pool blocklists it. The contract texts state the enforced budgets.

The slow games spin on their own CPU clock (`time.process_time`, the quantity the
supervisor reads from /proc), not for a loop count timed in this process: a count timed
while the other test worker shared the core ran in under half its CPU time in the
sandbox, and the game slipped under the budget. `time` is outside the import allow-list,
so these pools run without the static gate (a filter, not a limit; tested elsewhere).
"""

from __future__ import annotations

import pytest

from spade_jax.envs import (
    PROGRAM_CONTRACT,
    REFERENCE_CONTRACT,
    EnvPool,
    EnvProgramError,
    ProgramLoadError,
    SandboxConfig,
    make_env,
    validate_program,
)
from spade_jax.envs.runtime_limits import program_id

DOORS = r"""
class DoorsEnv:
    def __init__(self, max_turns=25):
        self.max_turns = max_turns

    def reset(self, seed=None):
        self.rng = random.Random(seed)
        self.turn = 0
        self.prize = self.rng.choice(["amber", "cobalt", "violet"])
        return "Three doors: amber, cobalt and violet. Open one with \\boxed{colour}.", {}

    def step(self, action):
        self.turn += 1
        m = re.search(r"\\boxed\{(.*)\}", action)
        door = m.group(1).strip() if m else ""
        if door not in ("amber", "cobalt", "violet"):
            return "Name a door: amber, cobalt or violet.", 0.0, False, self.turn >= self.max_turns, {}
        @misbehave@
        if door == self.prize:
            return "You found the prize!", 1.0, True, False, {}
        return door + " is empty.", 0.0, False, self.turn >= self.max_turns, {}
"""


def _spin(cpu_s: float, indent: int = 8) -> str:
    """Step-body code that burns `cpu_s` seconds of the worker's own CPU time, whatever the
    load (a loaded machine stretches the wall clock, not the CPU time)."""
    pad = " " * indent
    return (f"import time as cpu_clock\n{pad}spin_start = cpu_clock.process_time()\n"
            f"{pad}while cpu_clock.process_time() - spin_start < {cpu_s}:\n{pad}    pass")


@pytest.fixture(scope="module")
def misbehaviours() -> dict[str, str]:
    return {
        "honest": "pass",
        "slow": _spin(4.0),  # twice the pool's 2 s budget
        "memory": "self.hold = b'x' * (300 << 20)",
        "nondeterministic": "return door + ' is ' + str(random.random()), 0.0, False, "
                            "self.turn >= self.max_turns, {}",
    }


def _doors(misbehaviours: dict[str, str], kind: str) -> str:
    return DOORS.replace("@misbehave@", misbehaviours[kind])


@pytest.fixture(scope="module")
def pool():
    # A 2 s CPU budget: writing 300 MiB took 1.01 s of CPU on a loaded box (the memory
    # game then failed "slow_call"). The deadline sits far above it so that a spin given a
    # seventh of a core is still stopped by its CPU budget.
    config = SandboxConfig(call_deadline_s=15.0, call_cpu_budget_s=2.0, worker_memory_mb=200,
                           spare_workers=2, replay_audit_rate=1.0, static_gate=False)
    with EnvPool(config, seed=5) as p:
        if p.isolation_report().missing:
            pytest.skip(f"sandbox layers missing here: {p.isolation_report().missing}")
        yield p


@pytest.mark.parametrize("kind,codes", [
    ("slow", {"slow_call"}),
    ("memory", {"memory_limit", "resource_limit"}),
    ("nondeterministic", {"nondeterministic_reset"}),
])  # fmt: skip
def test_validation_plays_like_an_agent(kind, codes, misbehaviours, pool):
    """The validator's scripted, random and adversarial actions never name a door; its
    agent-like episodes do (words of the observation, boxed), and the game is caught."""
    report = validate_program(_doors(misbehaviours, kind), pool=pool, seed=7)
    assert not report.ok and report.code in codes, report.reason
    assert "agent_like_actions" in report.reason
    assert pool.blocked(_doors(misbehaviours, kind)) is None  # validation never blocklists
    honest = validate_program(_doors(misbehaviours, "honest"), pool=pool, seed=7)
    assert honest.ok, honest.reason
    assert "agent_like_actions" in honest.checks_passed
    again = validate_program(_doors(misbehaviours, "honest"), pool=pool, seed=7)
    assert again.transcript_hash == honest.transcript_hash  # seeded: the same run


@pytest.mark.parametrize("kind,code", [
    ("slow", "slow_call"),
    ("memory", "memory_limit"),
    ("nondeterministic", "nondeterministic_replay"),
])  # fmt: skip
def test_a_game_breaking_a_limit_mid_run_is_stopped_scored_and_blocklisted(
    kind, code, misbehaviours, pool
):
    source = _doors(misbehaviours, kind)
    env = make_env(source, pool, contract="reference", max_turns=3)
    bystander = make_env(source, pool, contract="reference", max_turns=3)
    bystander.reset(seed=1)
    env.reset(seed=1)
    rewards = [env.step("\\boxed{look}")[1]]  # not a door: the game behaves
    with pytest.raises(EnvProgramError) as failed:
        for action in ("\\boxed{amber}", "\\boxed{cobalt}", "\\boxed{violet}"):
            # No pause between steps: memory taken in a call is checked when it ends, not
            # only by the zygote's 0.1 s poll (which a fast step slips between).
            rewards.append(env.step(action)[1])
    assert failed.value.error.code == code, failed.value.error
    assert failed.value.end_reason == "env_limit"
    assert sum(rewards) == 0.0  # the recipe's score of an unfinished episode
    assert pool.blocked(source).code == code
    assert pool.blocklist()[program_id(source)].code == code
    with pytest.raises(ProgramLoadError, match="blocklisted"):
        make_env(source, pool, contract="reference")
    with pytest.raises(EnvProgramError) as refused:  # an open handle gets no new episode
        bystander.reset(seed=2)
    assert refused.value.error.code == "blocklisted" and refused.value.end_reason == "env_limit"
    env.close()
    bystander.close()


def test_honest_play_is_audited_and_left_alone(misbehaviours, pool):
    source = _doors(misbehaviours, "honest")
    env = make_env(source, pool, contract="reference", max_turns=3)
    for seed in range(3):
        env.reset(seed=seed)
        for action in ("\\boxed{amber}", "\\boxed{cobalt}", "\\boxed{violet}"):
            _, _, terminated, truncated, _ = env.step(action)  # audited at the end
            if terminated or truncated:
                break
    assert pool.blocked(source) is None
    env.close()


def test_the_loop_can_blocklist_a_program_and_calls_under_budget_pass(misbehaviours, pool):
    """`block` is the loop's handle for its own rules (the recipe's 300 s play); a call
    that uses a third of the CPU budget passes whatever the wall clock says."""
    from spade_jax.envs import SandboxError

    source = DOORS.replace("@misbehave@", _spin(0.6))
    handle = pool.open(source, contract="reference")
    handle.reset(0)
    assert handle.step("\\boxed{amber}").ok
    pool.block(source, SandboxError("timeout", "the play took over 300 s"))
    assert "300 s" in str(pool.blocked(source))
    assert handle.reset(1).error.code == "blocklisted"
    handle.close()
    with pytest.raises(TypeError):
        pool.block(source, "not an error")


@pytest.mark.slow  # two games spinning seconds of CPU on purpose
def test_an_agent_answer_that_slows_an_honest_game_does_not_blocklist_it():
    """Issue 30 item 13 / issue 34: an agent's answer can make an honest game's step slow
    (a huge number to parse). Validation keeps its 1 s CPU budget, but played games run
    under the play-time limits (the recipe drops a step only past 30 s): a 2 s step is
    played, replay-audited under the same limits and not blocklisted; a step past the play
    budget ends the episode "env_limit" and blocklists the game."""
    config = SandboxConfig(call_deadline_s=10.0, worker_memory_mb=200, spare_workers=2,
                           replay_audit_rate=1.0, play_call_cpu_budget_s=3.5,
                           play_call_deadline_s=30.0, static_gate=False)
    slower = DOORS.replace("@misbehave@", _spin(8.0))
    with EnvPool(config, seed=5) as pool:
        if pool.isolation_report().missing:
            pytest.skip(f"sandbox layers missing here: {pool.isolation_report().missing}")
        source = DOORS.replace("@misbehave@", _spin(2.0))
        report = validate_program(source, pool=pool, seed=7)
        assert not report.ok and report.code == "slow_call"  # validation: 1 s budget
        env = make_env(source, pool, contract="reference", max_turns=3)
        env.reset(seed=1)
        for action in ("\\boxed{amber}", "\\boxed{cobalt}", "\\boxed{violet}"):
            *_, terminated, truncated, _ = env.step(action)  # 2 s of CPU, audited at the end
            if terminated or truncated:
                break
        assert terminated or truncated
        env.close()
        assert pool.blocked(source) is None
        env = make_env(slower, pool, contract="reference", max_turns=3)
        env.reset(seed=1)
        with pytest.raises(EnvProgramError) as failed:
            env.step("\\boxed{amber}")
        assert failed.value.error.code == "slow_call" and failed.value.end_reason == "env_limit"
        assert pool.blocked(slower).code == "slow_call"
        env.close()


# A game that waits as long as the agent says (a stand-in for an honest step that an
# agent's answer slows down: a huge number to parse). It needs `time`: no static gate.
NAP = r"""
import time

class NapEnv:
    def __init__(self, max_turns=3):
        self.max_turns = max_turns
    def reset(self, seed=None):
        return "How long should I nap? Answer \\boxed{seconds}.", {}
    def step(self, action):
        m = re.search(r"\\boxed\{(.*)\}", action)
        if m and m.group(1) == "spin":  # CPU instead of wall clock
            @spin@
        else:
            time.sleep(float(m.group(1)) if m else 0.0)
        return "Rested.", 1.0, True, False, {}
"""


@pytest.mark.slow
def test_play_calls_run_under_their_own_limits():
    """Issue 30 item 13: played games get the play-time limits, validation's runs (trial
    handles) keep theirs. A 1.2 s step is over validation's 1 s deadline but within play's
    2.5 s, a step of ~0.4 s of CPU over validation's 0.2 s budget but within play's 1.5 s:
    both are played, and their replay audits run under the same play limits; a step past
    2.5 s ends the episode "env_limit" and blocklists the game. The wall deadlines sit far
    above the CPU budgets so that on a loaded machine (the spin getting a fifth of a core)
    the CPU budget is still what stops the spin in validation."""
    config = SandboxConfig(call_deadline_s=1.0, play_call_deadline_s=2.5,
                           call_cpu_budget_s=0.2, play_call_cpu_budget_s=1.5,
                           load_deadline_s=5.0, static_gate=False, spare_workers=1,
                           replay_audit_rate=1.0)
    nap = NAP.replace("@spin@", _spin(0.4, indent=12))
    with EnvPool(config, seed=3) as pool:
        if pool.isolation_report().missing:
            pytest.skip(f"sandbox layers missing here: {pool.isolation_report().missing}")
        trials = pool.open_many([nap, nap], contract="reference", trial=True)  # validation's
        for trial, action, code in zip(trials, ("\\boxed{1.2}", "\\boxed{spin}"),
                                       ("timeout", "slow_call"), strict=True):
            assert trial.reset(0).ok
            assert trial.step(action).error.code == code
            trial.close()
        assert pool.blocked(nap) is None  # validation never blocklists
        env = make_env(nap, pool, contract="reference")
        for seed, action in enumerate(("\\boxed{1.2}", "\\boxed{spin}")):
            env.reset(seed=seed)
            assert env.step(action)[1:3] == (1.0, True)  # and replay-audited
        assert pool.blocked(nap) is None
        env.reset(seed=2)
        with pytest.raises(EnvProgramError) as failed:
            env.step("\\boxed{30}")
        assert failed.value.error.code == "timeout" and failed.value.end_reason == "env_limit"
        assert pool.blocked(nap).code == "timeout"
        env.close()


def test_the_contract_texts_state_the_enforced_limits():
    config = SandboxConfig()
    assert config.call_cpu_budget_s == 1.0 and config.worker_memory_mb == 512
    for text in (PROGRAM_CONTRACT, REFERENCE_CONTRACT):
        words = " ".join(text.split())
        assert "at most 1 second of CPU time" in words and "at most 512 MiB of memory" in words
        assert "well within a second" not in words
