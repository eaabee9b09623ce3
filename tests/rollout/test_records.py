"""`EndReason` is the one list of episode end reasons: the agent loop's replies carry them
across hosts as JSON and back, and the sandbox's own names for how a failed call ends an
episode are among them (it names them by string, without importing the rollout side)."""

from __future__ import annotations

import json

import pytest

from spade_jax.envs.results import REASON_CODES, SandboxError
from spade_jax.rollout.agent_loop import EnvReply
from spade_jax.rollout.records import EndReason, EpisodeRecord


@pytest.mark.parametrize("code", sorted(REASON_CODES))
def test_every_sandbox_failure_ends_an_episode_with_an_end_reason(code):
    reason = SandboxError(code).end_reason
    assert EndReason(reason) in (EndReason.ENV_ERROR, EndReason.ENV_LIMIT)


@pytest.mark.parametrize("reason", [None, *EndReason])
def test_env_replies_cross_hosts_as_json_and_come_back_typed(reason):
    reply = EnvReply("obs", 0.5, True, False, reason, 0.01)
    back = EnvReply.from_wire(json.loads(json.dumps(list(reply))))
    assert back == reply and back.observation == "obs" and back.reward == 0.5
    assert back.end_reason is None or type(back.end_reason) is EndReason
    with pytest.raises(ValueError):
        EnvReply.from_wire(["obs", 0.0, False, False, "exploded", 0.0])


def test_a_record_writes_its_end_reason_as_a_plain_string():
    record = EpisodeRecord(env_id="e", seed=0, end_reason=EndReason.CUT_REPLY)
    assert json.dumps({"end": record.end_reason}) == '{"end": "cut_reply"}'
    assert record.end_reason == "cut_reply"
