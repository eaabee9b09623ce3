"""`python -m spade_jax.train --experiment=tiny_tool_use` end to end (issue 32: the tool
track runs on a CPU machine with programs that validate): the warm-started tiny policy
writes tool environments, the sandbox validates them under the tool contract, the policy
writes their hints and plays them with native tool calls (taught by demonstrations)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.slow
@pytest.mark.timeout(1500)  # the warm start (~110 s) and one step (~70 s), more on 2 busy cores
def test_tiny_tool_use_writes_valid_tool_environments_and_plays_them(tmp_path):
    # One CPU device at XLA's default level, as the README's command runs it. The
    # experiment's 300 warm-start steps in batches of 2 instead of 4 (half the time, 220 s
    # -> 110 s alone): 3 of 5 programs then validate (4 of 5 with 4); 200 steps of 2 left
    # every program invalid (measured 2026-12-06).
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    proc = subprocess.run([sys.executable, "-m", "spade_jax.train", "--experiment=tiny_tool_use",
                           f"--workdir={tmp_path}", "--set", "spade.rounds=1",
                           "--set", "warm_start.batch_size=2"],
                          capture_output=True, text=True, env=env, timeout=1400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert row["validity_rate"] > 0 and row["valid_envs"] > 0
    # The hint writer is the untrained policy: some games get no usable hint (no hint arm).
    assert 0 < row["hints_written"] <= row["valid_envs"]
    assert row["episodes/hint"] == 2 * row["hints_written"]  # tiny's hint_plays
    assert row["episodes/no_hint"] == 2 * row["valid_envs"]  # plays_per_game
    assert row["batch/agent"] > 0
    # The warm start's demonstrated episodes taught the agent to call tools: episodes go
    # on past the first reply (a reply without a call would end them at once).
    assert row["agent/turns_mean"] > 1
    log = (tmp_path / "train.log").read_text()
    assert "warm start: 300 steps on 18 designer, 3 hint-writer and 9 agent examples" in log
