"""The KL reference of a run that makes its starting policy (the warm start): anchored to
the warm-started policy, not the model built at step 0, and carried by checkpoints so a
resume gets it back (``Trainer.anchor_reference``; spade_jax/rl/trainer.py)."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from spade_jax.checkpoint import named_arrays
from spade_jax.models import ModelConfig, ModelOptions, Qwen3
from spade_jax.rl.batch import PackConfig
from spade_jax.rl.optim import OptimizerConfig
from spade_jax.rl.train_step import RoleConfig, TrainConfig
from spade_jax.rl.trainer import Trainer

KL = TrainConfig(optimizer=OptimizerConfig(learning_rate=1e-2),
                 agent=RoleConfig(loss=dict(kl_coef=0.1)))


def _trainer(config: TrainConfig, seed: int) -> Trainer:
    cfg = ModelConfig(architecture="Qwen3ForCausalLM", vocab_size=24, hidden_size=16,
                      num_layers=1, num_heads=2, num_kv_heads=2, head_dim=8,
                      intermediate_size=24)
    return Trainer(Qwen3(cfg, ModelOptions(), rngs=nnx.Rngs(seed)), config, pack=PackConfig(),
                   seed=0)


def _reference(named: dict) -> dict[str, np.ndarray]:
    return {k[len("reference/"):]: np.asarray(v) for k, v in named.items()
            if k.startswith("reference/")}


def test_the_anchored_reference_is_the_warm_started_policy_and_a_resume_restores_it():
    trainer = _trainer(KL, seed=0)
    built = {k: np.asarray(v) for k, v in named_arrays(trainer.state.params).items()}
    assert not _reference(trainer.named_arrays())  # a loaded start: nothing extra to save
    # What the warm start does: new weights in the train state.
    trainer.state = trainer.state.replace(
        params=jax.tree.map(lambda p: p * 0.5 + 0.25, trainer.state.params))
    trainer.anchor_reference()
    saved = trainer.named_arrays()
    reference = _reference(saved)
    warm = {k: np.asarray(v) for k, v in named_arrays(trainer.state.params).items()}
    assert reference.keys() == warm.keys() == built.keys()
    for name in warm:
        np.testing.assert_array_equal(reference[name], warm[name])
    assert any(not np.array_equal(reference[n], built[n]) for n in built)  # not the init

    resumed = _trainer(KL, seed=1)  # another init: everything must come from the checkpoint
    resumed.expect_saved_reference()
    assert set(resumed.named_arrays()) == set(saved)  # the restore template names it
    resumed.restore(saved)
    for name, value in _reference(resumed.named_arrays()).items():
        np.testing.assert_array_equal(value, reference[name])
    for name, value in named_arrays(resumed.state.params).items():
        np.testing.assert_array_equal(np.asarray(value), warm[name])


def test_without_kl_there_is_no_reference_to_anchor_or_save():
    trainer = _trainer(TrainConfig(), seed=0)
    trainer.anchor_reference()
    trainer.expect_saved_reference()
    assert not _reference(trainer.named_arrays())
