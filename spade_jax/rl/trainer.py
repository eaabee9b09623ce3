"""The trainer object a run hands to the SPADE loop: the train state and everything one
update needs, behind two calls.

`Trainer.update(sequences)` packs a step's sequences, annotates them with the frozen
reference policy's log-probs (KL runs), measures router-replay telemetry at the weights the
step differentiates, applies the jitted step (`update_epochs` times) and returns the
step's scalar metrics. `Trainer.sampling_policy()` is the policy the samplers draw from:
the trained parameters, resharded onto the decode mesh once per train state
(`DecodeCopy`). The state is an attribute, not a closure: checkpointing reads and restores
it (`named_arrays`, `restore`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from spade_jax import sharding
from spade_jax.checkpoint import named_arrays, state_from_named
from spade_jax.models import ModelOptions, Qwen3
from spade_jax.preemption import PreemptionGuard
from spade_jax.rl.batch import PackConfig, TrainSequence, pack_sequences
from spade_jax.rl.replay_stats import ReplayTelemetry
from spade_jax.rl.train_step import (
    ReferencePolicy,
    TrainConfig,
    init_train_state,
    make_train_step,
    needs_reference,
)


def decode_cast_dtype(model: Qwen3, mesh_config: sharding.MeshConfig) -> Any | None:
    """The dtype the decode copy casts to (``sharding.cast_for_decode``), None to keep the
    master dtype. ``decode_param_dtype="compute"``: the compute dtype when every module of
    ``model`` casts its weights to that one dtype before use (so the activations, and the
    norms that read their weight in the activations' dtype, are in it too) and the copy
    changes no number. A model whose modules differ (one built in fp32 whose top-level
    ``options.dtype`` was set to bf16 afterwards: its layers still compute in fp32) keeps
    the master dtype."""
    if mesh_config.decode_param_dtype == "master":
        return None
    dtypes = set()
    for _, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Module):
            continue
        for options in (getattr(node, "options", None), getattr(node, "opts", None)):
            if isinstance(options, ModelOptions):
                dtypes.add(jnp.dtype(options.compute_dtype))
        if getattr(node, "dtype", None) is not None:
            dtypes.add(jnp.dtype(node.dtype))
    return dtypes.pop() if len(dtypes) == 1 else None


class DecodeCopy:
    """The samplers' view of trained parameters under ``mesh_config.decode_layout``: the
    parameters resharded onto the decode mesh (:func:`sharding.decode_mesh`) once per train
    state, i.e. once per step, never per token, in ``mesh_config.decode_param_dtype`` (see
    :class:`sharding.MeshConfig`); the previous copy is dropped before the next is made.
    "train" (or no FSDP axis to re-purpose, or no mesh): the trainer's own parameters on
    its mesh."""

    def __init__(self, mesh_config: sharding.MeshConfig, mesh: Any, graphdef: Any,
                 params: Any, arch: Any) -> None:
        self.graphdef = graphdef
        self.mesh = None if mesh is None else sharding.decode_mesh(mesh, mesh_config, arch)
        self.resharded = self.mesh is not mesh
        self._dtype = (decode_cast_dtype(nnx.merge(graphdef, params), mesh_config)
                       if self.resharded else None)
        self._reshard = None  # built on first use: one compiled transfer for every step
        self._of: Any = None  # the params the copy was made of
        self._params: Any = None

    def policy(self, params: Any) -> Qwen3:
        """The model the samplers run for ``params`` (the copy is remade when they change)."""
        if not self.resharded:
            return nnx.merge(self.graphdef, params)
        if self._of is not params:
            self._of = self._params = None  # free the old copy before making the new one
            if self._reshard is None:
                self._reshard = sharding.resharder(params, self.mesh, compute_dtype=self._dtype)
            self._params = self._reshard(params)
            self._of = params
        return nnx.merge(self.graphdef, self._params)


_REFERENCE = "reference/"  # checkpoint names of an anchored KL reference's arrays


class Trainer:
    """The train state, the reference policy (KL runs), the replay telemetry (runs that
    record routing), the packing and the jitted step of one run."""

    def __init__(self, model: Qwen3, config: TrainConfig, *, pack: PackConfig, seed: int,
                 mesh: Any = None, mesh_config: sharding.MeshConfig | None = None,
                 routing_telemetry: bool = False, guard: PreemptionGuard | None = None
                 ) -> None:
        self.config, self.pack, self.guard = config, pack, guard
        self.graphdef, self.state = init_train_state(model, config, seed=seed, mesh=mesh)
        self._step = make_train_step(self.graphdef, config, mesh)
        # KL to the initial policy (8B recipe): its log-probs from a frozen copy of it.
        self._mesh = mesh
        self._reference = (ReferencePolicy(self.graphdef, config, self.state.params, mesh)
                           if needs_reference(config) else None)
        self._reference_saved = False  # the checkpoint carries it (anchor_reference)
        self._telemetry = (ReplayTelemetry(self.graphdef, config, mesh)
                           if routing_telemetry and model.config.is_moe else None)
        self.decode = DecodeCopy(mesh_config or sharding.MeshConfig(), mesh, self.graphdef,
                                 self.state.params, model.config)

    @property
    def sample_mesh(self) -> Any:
        """The mesh the samplers run on (the decode layout's)."""
        return self.decode.mesh

    def policy(self) -> Qwen3:
        """The current policy on the trainer's mesh (evaluation)."""
        return nnx.merge(self.graphdef, self.state.params)

    def sampling_policy(self) -> Qwen3:
        """The current policy as the samplers run it (the decode copy)."""
        return self.decode.policy(self.state.params)

    def update(self, sequences: Sequence[TrainSequence]) -> dict[str, float]:
        """One step on ``sequences``; returns its scalar metrics (plus replay telemetry)."""
        if self.guard is not None:
            self.guard.commit()  # from here the step changes the weights: a stop waits
        batch = pack_sequences(list(sequences), self.pack)
        if self._reference is not None:
            batch = self._reference.annotate(batch)
        # Routing-mismatch telemetry at the weights the step differentiates (before it).
        extra = self._telemetry(self.state.params, batch) if self._telemetry is not None else {}
        # update_epochs > 1: PPO's reuse of one batch (CleanRL's update_epochs); the ratio
        # against the sampler's log-probs grows each pass and the clip bounds it.
        for _ in range(self.config.update_epochs):
            self.state, metrics = self._step(self.state, batch)
        scalars = {k: float(v) for k, v in jax.device_get(metrics).items() if np.ndim(v) == 0}
        return {**scalars, **extra}

    def anchor_reference(self) -> None:
        """The KL reference becomes the current policy, and checkpoints carry it from now on.
        For a run whose starting policy is made in the run (the warm start), not loaded:
        the reference is the policy RL starts from, which the model built at step 0 is not,
        and which a resume can only get back from the checkpoint. No-op without KL."""
        if self._reference is None:
            return
        self._reference = ReferencePolicy(self.graphdef, self.config, self.state.params,
                                          self._mesh)
        self._reference_saved = True

    def expect_saved_reference(self) -> None:
        """A resume of a run that anchored its reference: the checkpoint holds it."""
        self._reference_saved = self._reference is not None

    def named_arrays(self) -> dict[str, jax.Array]:
        """The train state's arrays by name (what a checkpoint stores), and the anchored KL
        reference's under ``reference/``."""
        named = named_arrays(self.state)
        if self._reference_saved:
            named.update({f"{_REFERENCE}{name}": x
                          for name, x in named_arrays(self._reference.params).items()})
        return named

    def restore(self, named: Any) -> None:
        """Replaces the state (and an anchored reference) with a checkpoint's arrays."""
        if self._reference_saved:
            self._reference.params = state_from_named(
                {k[len(_REFERENCE):]: v for k, v in named.items() if k.startswith(_REFERENCE)},
                self._reference.params)
            named = {k: v for k, v in named.items() if not k.startswith(_REFERENCE)}
        self.state = state_from_named(named, self.state)
