"""Each planted fault changes exactly the signal it names (the runs that show the learning
check failing under them are scripts/planted_faults.py's)."""

import numpy as np
import pytest

from spade_jax.planted_faults import FAULTS, planted
from spade_jax.rl import trainer as trainer_module
from spade_jax.rl.batch import TrainSequence
from spade_jax.spade.loop import SpadeLoop


def test_unknown_fault_is_refused():
    with pytest.raises(ValueError, match="unknown fault"):
        with planted("gradient_sign"):
            pass


def test_advantage_sign(monkeypatch):
    seqs = [TrainSequence([1, 2, 3], [0, 1, 1], [0.0] * 3, 0.5),
            TrainSequence([1, 2], [0, 1], [0.0] * 2, np.array([0.0, -0.25]))]
    monkeypatch.setattr(SpadeLoop, "role_sequences", lambda self, role, groups, step, scale=1.0:
                        (seqs, [0]))
    with planted("advantage_sign"):
        out, kept = SpadeLoop.role_sequences(None, "agent", [], 0)
    assert out[0].advantage == -0.5 and list(out[1].advantage) == [0.0, 0.25] and kept == [0]
    assert SpadeLoop.role_sequences(None, "agent", [], 0)[0] is seqs  # restored


def test_loss_mask_shift():
    seqs = [TrainSequence([5, 6, 7, 8], [0, 1, 1, 0], [0.0] * 4, 1.0)]
    before = np.asarray(trainer_module.pack_sequences(seqs).loss_mask)
    with planted("loss_mask_shift"):
        after = np.asarray(trainer_module.pack_sequences(seqs).loss_mask)
    assert before[0, :4].tolist() == [0, 1, 1, 0] and after[0, :4].tolist() == [0, 0, 1, 1]


def test_designer_reward_permutation(monkeypatch):
    seen = []
    monkeypatch.setattr(SpadeLoop, "designer_sequences",
                        lambda self, samples, totals, num_agent, step, penalized=None:
                        seen.append((totals, penalized)))
    with planted("designer_reward_permutation"):
        SpadeLoop.designer_sequences(None, [1, 2, 3, 4], [0.1, 0.2, 0.3, -1.0], 8, 5,
                                     penalized=[False, False, False, True])
    totals, penalized = seen[0]
    assert sorted(totals) == [-1.0, 0.1, 0.2, 0.3]
    assert all(a != b for a, b in zip(totals, [0.1, 0.2, 0.3, -1.0], strict=True))  # none own
    # a penalty keeps its flag wherever it lands (a moved -1 is still trained as one)
    assert [t == -1.0 for t in totals] == list(penalized)


def test_hint_swap(monkeypatch):
    class Game:
        hint_returns = [1.0, 1.0]
        returns_by_offset = [[0.0, 0.0, 0.5], []]

        def written_round(self, start):
            return start

    class Window:
        start = 4
        games = [Game()]

    monkeypatch.setattr(SpadeLoop, "play", lambda self, window, step: ["records"])
    with planted("hint_swap"):
        assert SpadeLoop.play(None, Window, 4) == ["records"]
    game = Window.games[0]
    assert game.hint_returns == [0.0, 0.0, 0.5] and game.returns_by_offset[0] == [1.0, 1.0]


def test_every_fault_is_covered():
    assert set(FAULTS) == {"advantage_sign", "loss_mask_shift", "designer_reward_permutation",
                           "hint_swap"}
