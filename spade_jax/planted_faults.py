"""Planted faults: four ways to break SPADE's signal path, for showing that the toy
world's learning check (``spade_jax.toy.check``) notices when the algorithm is broken.

Diagnostic tooling, never used by a run: each fault is a context manager that patches
one place of the loop or the trainer for the duration of a run in this process.

    with planted("advantage_sign"):
        run_experiment(config, workdir)

advantage_sign   every training sequence's advantage negated (both roles)
loss_mask_shift  the loss mask moved one token right: the update trains the token after
                 each sampled one (the first prompt token after a reply, not the reply's
                 first token)
designer_reward_permutation
                 the designer rewards of a scoring round handed to the wrong programs (a
                 seeded cyclic shift, so no program keeps its own)
hint_swap        a new game's hint-arm and no-hint returns swapped before anything reads
                 them (regret, memory regimes, designer reward)
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from unittest import mock

import numpy as np

from spade_jax.rl import trainer as trainer_module
from spade_jax.spade.loop import SpadeLoop

FAULTS = ("advantage_sign", "loss_mask_shift", "designer_reward_permutation", "hint_swap")


def _negated(sequences):
    return [dataclasses.replace(s, advantage=-s.advantage if isinstance(s.advantage, float)
                                else -np.asarray(s.advantage)) for s in sequences]


@contextlib.contextmanager
def planted(fault: str) -> Iterator[None]:
    """Patches ``fault`` (one of FAULTS) in for the ``with`` block."""
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; known: {FAULTS}")
    if fault == "advantage_sign":
        original = SpadeLoop.role_sequences

        def role_sequences(self, role, groups, step, scale=1.0):
            sequences, kept = original(self, role, groups, step, scale)
            return _negated(sequences), kept

        patch = mock.patch.object(SpadeLoop, "role_sequences", role_sequences)
    elif fault == "loss_mask_shift":
        original_pack = trainer_module.pack_sequences

        def pack_sequences(sequences, config=None):
            batch = original_pack(sequences, config)
            mask = np.asarray(batch.loss_mask)
            shifted = np.zeros_like(mask)
            shifted[:, 1:] = mask[:, :-1]
            return dataclasses.replace(batch, loss_mask=shifted)

        patch = mock.patch.object(trainer_module, "pack_sequences", pack_sequences)
    elif fault == "designer_reward_permutation":
        original_designer = SpadeLoop.designer_sequences

        def designer_sequences(self, samples, totals, num_agent, step, penalized=None):
            # each reward moves with its penalty flag (a moved -1 still joins a group)
            shift = 1 + step % max(1, len(totals) - 1)
            if penalized is not None:
                penalized = list(np.roll(penalized, shift))
            return original_designer(self, samples, list(np.roll(totals, shift)), num_agent,
                                     step, penalized=penalized)

        patch = mock.patch.object(SpadeLoop, "designer_sequences", designer_sequences)
    else:
        original_play = SpadeLoop.play

        def play(self, window, step):
            records = original_play(self, window, step)
            offset = step - window.start
            for game in window.games:
                if game.written_round(window.start) == step:
                    game.hint_returns, game.returns_by_offset[offset] = (
                        game.returns_by_offset[offset], game.hint_returns)
            return records

        patch = mock.patch.object(SpadeLoop, "play", play)
    with patch:
        yield
