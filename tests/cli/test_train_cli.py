"""`python -m spade_jax.train` end to end at a very small size, as a user runs it: a fresh
workdir, metrics, report, checkpoints; then runs killed (SIGKILL) or preempted (SIGTERM)
and resumed, which must equal uninterrupted runs."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from xla_test_flags import jax_flags

# The tiny experiment's own warm start length, learning rate and designer budget (so
# programs validate), but in batches of 2 instead of 4 (half the time; the 160 steps end
# at a loss of ~0.017 instead of ~0.013 and round 0's programs all validate, as with 4;
# fewer steps do not: 120 steps of 4 left 2 of 5 programs invalid, 80 steps all of them),
# a shorter run and a cheaper evaluation.
SHRINK = [
    "--set", "warm_start.batch_size=2",
    "--set", "spade.rounds=2",
    "--set", "spade.eval_every=2",
    "--set", "eval.suites=('RG-Math',)",
    "--set", "eval.tasks_per_suite=1",
    "--set", "eval.problems_per_task=1",
    "--set", "eval.max_new_tokens=4",
    "--set", "agent.max_turn_tokens=8",
    "--set", "checkpoint_every=1",
]


def _command(workdir, *extra: str) -> list[str]:
    return [sys.executable, "-m", "spade_jax.train", "--experiment=tiny", f"--workdir={workdir}",
            *SHRINK, *extra]


def _env(xla_flags: str = "") -> dict[str, str]:
    """One CPU device; XLA's default level unless ``xla_flags`` says otherwise."""
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags}


# KILL_RUN (below) has no warm start and no designer sampling: compiling is most of its
# time, so it uses the suite's compile flags (tests/support/xla_test_flags.py; at LLVM -O0
# alone it ran in 51-76 s against 64-94 s at the default level: alone, cold compile cache,
# interleaved, 2026-12-06). The replay kill runs sample the designer's programs and were no
# faster at -O0 (53-56 s against 51-52 s): they keep the default level. Every run a test compares runs with the same flags.
KILL_RUN_FLAGS = jax_flags()


def _train(workdir, *extra: str, timeout: int = 1500, xla_flags: str = ""
           ) -> subprocess.CompletedProcess:
    return subprocess.run(_command(workdir, *extra), capture_output=True, text=True,
                          env=_env(xla_flags), timeout=timeout)


def _rounds(workdir) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(1500)  # one CLI run with the tiny warm start (~2 min alone, ~4 on 2 busy cores)
def test_main_command_runs_and_reports(tmp_path):
    workdir = tmp_path / "run"
    r = _train(workdir)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _rounds(workdir)
    assert [row["step"] for row in rows] == [0, 1]
    for key in ("validity_rate", "regret_raw_mean", "regret_clipped_mean", "learnable_share",
                "vendi_per_n", "time/design", "time/rollout", "time/score", "time/update"):
        assert key in rows[-1] or key in rows[0], key
    # Values, not keys (issue 16.8): programs validated, the regret is a number, and every
    # step trained on a non-empty agent batch; the designer sample of step 0 was trained
    # at step 1 (delay 1), the window's hint plays ran once, at step 0.
    assert rows[0]["validity_rate"] > 0 and rows[0]["valid_envs"] > 0
    assert math.isfinite(rows[0]["regret_raw_mean"])
    assert all(row["batch/agent"] > 0 and row["episodes/no_hint"] > 0 for row in rows)
    assert rows[0]["episodes/hint"] > 0 and rows[1]["episodes/hint"] == 0
    assert rows[0]["batch/designer"] == 0 and rows[1]["batch/designer"] > 0
    assert rows[0]["hints_written"] > 0
    assert any(k.startswith("eval/") for k in rows[-1])
    # Router replay (issue 22, tiny runs with it): telemetry every step per role; the
    # designer's routing crossed its one-step delay (and sits in round 0's checkpoint, the
    # step-1 one: a checkpoint is numbered by the rounds done).
    for row, roles in zip(rows, (("agent",), ("agent", "designer")), strict=True):
        for role in roles:
            for stat in ("flip_rate", "flip_rate_free", "tis_clip_replay", "tis_clip_free"):
                assert 0 <= row[f"train/replay/{role}/{stat}"] <= 1, (role, stat)
            assert math.isfinite(row[f"train/replay/{role}/logp_gap_replay"])
    assert "train/replay/designer/flip_rate" not in rows[0]
    from spade_jax.checkpoint import CheckpointConfig, CheckpointManager

    with CheckpointManager(CheckpointConfig(workdir / "checkpoints")) as manager:
        restored = manager.restore(1)
    assert restored.run_state["step"] == 0
    # The TrainState's arrays by name (issue 21), not by leaf position.
    assert {"step", "rng", "params/embed_vd", "opt_state/1/0/mu/embed_vd"} <= restored.state.keys()
    pending = restored.run_state["loop"]["pending"]
    routes = [s["routing"] for p in pending for s in p["samples"]]
    assert routes and all(r["dtype"] == "|u1" and isinstance(r["data"], str) for r in routes)
    report = (workdir / "report.md").read_text()
    assert "validity_rate" in report and "plots/" in report
    assert "## Router replay" in report and (workdir / "plots" / "router_replay.png").exists()
    assert list((workdir / "plots").glob("*.png"))
    assert (workdir / "checkpoints").is_dir()
    # A resume of this command is the kill tests' (below): resumed runs equal uninterrupted
    # ones, designer samples and their routing pending in the checkpoint included.


@pytest.mark.slow  # JAX subprocesses (~14 s loaded)
def test_bad_flags_get_clear_errors(tmp_path):
    r = _train(tmp_path / "x", "--set", "spade.roundz=3", timeout=120)
    assert r.returncode == 2 and "roundz" in r.stderr
    r = _train(tmp_path / "x", "--set", "spade.rounds=many", timeout=120)
    assert r.returncode == 2 and "spade.rounds" in r.stderr
    # Replayed supervised rows without their NLL term's weight would train nothing.
    r = _train(tmp_path / "x", "--set", "spade.supervised_replay=2", timeout=120)
    assert r.returncode == 2 and "train.supervised_coef=0.0: set both" in r.stderr
    assert "Traceback" not in r.stderr
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-m", "spade_jax.train", "--experiment=nope",
                        f"--workdir={tmp_path}"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "unknown experiment" in r.stderr
    r = subprocess.run([sys.executable, "-m", "spade_jax.train", "--experiment=toy:nope",
                        f"--workdir={tmp_path}"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "toy variants" in r.stderr and "Traceback" not in r.stderr
    # The recipe experiments refuse to start without their corpus, naming the flag.
    r = subprocess.run([sys.executable, "-m", "spade_jax.train", "--experiment=qwen3_30b_a3b",
                        f"--workdir={tmp_path / 'q'}"], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 2 and "--corpus=" in r.stderr and "corpus.stand_in=True" in r.stderr
    assert not (tmp_path / "q" / "config.json").exists()
    missing = tmp_path / "no_such_corpus.jsonl"
    r = subprocess.run([sys.executable, "-m", "spade_jax.train", "--experiment=qwen3_30b_a3b",
                        f"--corpus={missing}", f"--workdir={tmp_path / 'q'}"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and f"{missing}' does not exist" in r.stderr
    assert "Traceback" not in r.stderr


# A fixed pool of seed programs (no warm start needed for valid games), windows of 2 steps,
# memory and replays on: a kill mid-window leaves games, cached hint returns, window
# returns, pending scores and memory in flight.
KILL_RUN = ["--set", "warm_start.steps=0", "--set", "spade.rounds=4", "--set", "spade.eval_every=0",
            "--set", "spade.designer_mode='fixed_pool'", "--set", "spade.hint_mode='designer'",
            "--set", "agent.max_turn_tokens=8", "--set", "spade.memory_train_envs=1"]


def _last_rows(workdir) -> dict[int, dict]:
    """Step -> its last logged row without timings (a step rerun after the kill wins)."""
    rows = {}
    for row in _rounds(workdir):
        rows[row["step"]] = {k: v for k, v in row.items() if not k.startswith("time/")
                             and k != "wall_time" and not k.endswith("_seconds")}
    return rows


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """One uninterrupted KILL_RUN, the reference of the kill and preemption tests."""
    workdir = tmp_path_factory.mktemp("straight") / "run"
    r = _train(workdir, *KILL_RUN, xla_flags=KILL_RUN_FLAGS)
    assert r.returncode == 0, r.stderr[-3000:]
    return workdir


@pytest.mark.slow
@pytest.mark.timeout(2400)  # three CLI runs (~6 min on 2 busy cores)
def test_kill_9_mid_window_then_resume_equals_an_uninterrupted_run(straight, tmp_path):
    """The CLI killed with SIGKILL once step 2's checkpoint is committed (mid-window:
    rounds 2-3 are one window), then resumed, logs the same metrics (losses, returns,
    regret, memory counts) and ends with bit-identical weights."""
    killed = tmp_path / "killed"
    # The same tokenizer for the second run (a fresh one is trained on the checkout's text,
    # which may change between the runs).
    run = [*KILL_RUN, "--set", f"tokenizer.path='{straight / 'tokenizer' / 'spm.model'}'"]
    _kill_after_checkpoint(killed, run, 2, xla_flags=KILL_RUN_FLAGS)
    r = _train(killed, *run, xla_flags=KILL_RUN_FLAGS)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from step" in (killed / "train.log").read_text()
    want, got = _last_rows(straight), _last_rows(killed)
    assert sorted(got) == list(range(4))
    for step in range(4):
        assert json.dumps(got[step], sort_keys=True) == json.dumps(want[step], sort_keys=True), step
    _assert_same_final_checkpoint(straight, killed, 4)


@pytest.mark.slow
@pytest.mark.timeout(2400)  # two CLI runs after the shared reference (~5 min on 2 busy cores)
def test_sigterm_mid_window_drops_the_round_saves_and_resumes_from_there(straight, tmp_path):
    """SIGTERM (a spot VM's preemption notice) while round 3 plays (mid-window: rounds 2-3
    are one window), with no periodic checkpoint to fall back on: the run stops at the next
    safe point inside round 3, before its update (round 3 is in no metric and no
    checkpoint), saves the state after round 2 as checkpoint 3, and exits 0; the resumed
    run redoes round 3 and ends where the uninterrupted run ended, bit for bit."""
    import signal
    import time

    preempted = tmp_path / "preempted"
    run = [*KILL_RUN, "--set", f"tokenizer.path='{straight / 'tokenizer' / 'spm.model'}'",
           "--set", "checkpoint_every=100"]
    proc = subprocess.Popen(_command(preempted, *run), env=_env(KILL_RUN_FLAGS),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline, log = time.monotonic() + 1200, preempted / "train.log"
        while not (log.exists() and "step 3 started" in log.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, "round 3 never started"
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=600) == 0, proc.stderr.read()[-3000:]
    finally:
        proc.kill()
    text = log.read_text()
    assert ("preempted during step 3: the step is dropped; saved the state after step 2 "
            "as checkpoint 3") in text
    assert [row["step"] for row in _rounds(preempted)] == [0, 1, 2]  # round 3 never updated
    from spade_jax.checkpoint import CheckpointConfig, CheckpointManager

    with CheckpointManager(CheckpointConfig(preempted / "checkpoints")) as manager:
        assert manager.all_steps() == [3]
    r = _train(preempted, *run, xla_flags=KILL_RUN_FLAGS)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from step 2" in log.read_text()
    want, got = _last_rows(straight), _last_rows(preempted)
    assert sorted(got) == list(range(4))
    for step in range(4):
        assert json.dumps(got[step], sort_keys=True) == json.dumps(want[step], sort_keys=True), step
    _assert_same_final_checkpoint(straight, preempted, 4)


# Router replay across a kill (issue 22): the designer role on (no fixed pool), no warm
# start, so the designer's programs are mostly invalid; the 0.0 invalid penalty still
# trains them, one step after they were drawn (tiny: designer_delay=1, windows of 2 steps,
# router_replay=True), so step 0's designer samples and their recorded routing sit in the
# checkpoint written after step 0 (checkpoint 1) and are replayed at step 1, the resumed
# run's one step (two rounds: a third, 2026-12-07 and before, showed nothing more).
REPLAY_KILL_RUN = ["--set", "warm_start.steps=0", "--set", "spade.rounds=2",
                   "--set", "spade.eval_every=0", "--set", "agent.max_turn_tokens=8",
                   "--set", "spade.invalid_penalty=0.0", "--set", "keep_checkpoints=10"]


def _pending_routing(workdir, checkpoint: int) -> list:
    """The encoded routing of every designer sample pending in checkpoint ``checkpoint``."""
    from spade_jax.checkpoint import CheckpointConfig, CheckpointManager

    with CheckpointManager(CheckpointConfig(workdir / "checkpoints")) as manager:
        pending = manager.restore(checkpoint).run_state["loop"]["pending"]
    return [s["routing"] for p in pending for s in p["samples"]]


@pytest.mark.slow
@pytest.mark.timeout(2400)  # three CLI runs without warm start (85-108 s together in the suite)
def test_kill_9_with_pending_designer_routing_then_resume_equals_an_uninterrupted_run(tmp_path):
    """The CLI with router replay on, SIGKILLed once the checkpoint after step 0 (holding
    step 0's designer samples and their recorded routing) is committed and resumed from it,
    equals an uninterrupted run: the same pending routing bytes in that checkpoint, the same metrics
    every step (the designer's replay telemetry of step 1, computed on the routing restored
    from the checkpoint, included), bit-identical final weights and run state."""
    from spade_jax.rollout.routing import decode_routing

    straight, killed = tmp_path / "straight", tmp_path / "killed"
    r = _train(straight, *REPLAY_KILL_RUN)
    assert r.returncode == 0, r.stderr[-3000:]
    run = [*REPLAY_KILL_RUN, "--set", f"tokenizer.path='{straight / 'tokenizer' / 'spm.model'}'"]
    _kill_after_checkpoint(killed, run, 1)
    # Step 0's designer samples wait in the checkpoint with their routing: uint8
    # [prompt + output - 1, 2 MoE layers, top-2], as the uninterrupted run recorded them.
    routes = _pending_routing(killed, 1)
    assert routes and routes == _pending_routing(straight, 1)
    for route in routes:
        experts = decode_routing(route)
        assert experts.dtype == np.uint8 and experts.shape[1:] == (2, 2) and len(experts) > 8
        assert experts.max() < 4 and (experts[..., 0] != experts[..., 1]).all()
    r = _train(killed, *run)
    assert r.returncode == 0, r.stderr[-3000:]
    log = (killed / "train.log").read_text()
    assert "resumed from step 0" in log, "the resume did not start after step 0"
    want, got = _last_rows(straight), _last_rows(killed)
    assert sorted(got) == list(range(2))
    # The designer trained on step 0's samples at step 1 (after the resume), with replay.
    assert got[1]["batch/designer"] > 0 and "train/replay/designer/flip_rate" in got[1]
    assert math.isfinite(got[1]["train/replay/designer/logp_gap_replay"])
    for step in range(2):
        assert json.dumps(got[step], sort_keys=True) == json.dumps(want[step], sort_keys=True), step
    _assert_same_final_checkpoint(straight, killed, 2)


def _kill_after_checkpoint(workdir, run: list[str], step: int,
                           xla_flags: str = "") -> None:
    """Starts the CLI and SIGKILLs it as soon as checkpoint ``step`` (written after round
    ``step - 1``) is committed; ``xla_flags`` as :func:`_train`'s."""
    import signal
    import time

    from spade_jax.checkpoint import manifest_problem

    proc = subprocess.Popen(_command(workdir, *run), env=_env(xla_flags),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 1200
        while manifest_problem(workdir / "checkpoints" / str(step), step) is not None:
            assert proc.poll() is None and time.monotonic() < deadline, f"no step-{step} checkpoint"
            time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        proc.kill()


def _assert_same_final_checkpoint(straight, killed, step: int) -> None:
    import jax

    from spade_jax.checkpoint import CheckpointConfig, CheckpointManager

    def leaves(run):
        with CheckpointManager(CheckpointConfig(run / "checkpoints")) as manager:
            restored = manager.restore(step)
        flat = jax.tree_util.tree_flatten_with_path(restored.state)[0]
        return {jax.tree_util.keystr(k): np.asarray(v) for k, v in flat}, restored.run_state

    (want_state, want_run), (got_state, got_run) = leaves(straight), leaves(killed)
    assert want_state.keys() == got_state.keys()
    for name in want_state:
        assert np.array_equal(want_state[name], got_state[name]), name
    assert want_run == got_run
