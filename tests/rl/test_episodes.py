"""The episode batch the step credits read (``rl/episodes.py``): turn spans outside an
episode's tokens are refused."""

from __future__ import annotations

import pytest
from rule_references import played

from spade_jax.rl.episodes import EpisodeBatch, episode_batch


def test_episode_batch_rejects_spans_outside_the_tokens():
    episode = played(["a"])
    episode.turn_spans[0] = (2, 99)
    with pytest.raises(ValueError, match="outside"):
        episode_batch([episode], [0.0], [0])
    assert isinstance(episode_batch([played(["a"])], [0.0], [0]), EpisodeBatch)
