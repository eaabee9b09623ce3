"""Orbax checkpoints of model parameters (the format training runs start from).

Layout of a directory written by :func:`save_orbax`:
  config.json     Hugging Face-style architecture config (``ModelConfig.to_hf``)
  params/         Orbax ``StandardCheckpointer`` tree of the nnx parameter state
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from spade_jax import sharding, storage
from spade_jax.models.config import ModelConfig
from spade_jax.models.hf_io import abstract_model
from spade_jax.models.qwen3 import ModelOptions, Qwen3
from spade_jax.models.safetensors_io import CheckpointError


def save_orbax(model: Qwen3, config: ModelConfig, path: storage.PathLike) -> None:
    """Writes ``config.json`` and ``params/`` (blocks until the write is complete); ``path``
    may be local or gs://."""
    path = storage.absolute(path)
    if (path / "params").exists():
        raise FileExistsError(f"{path / 'params'} already exists; choose an empty --out_dir")
    path.mkdir(parents=True, exist_ok=True)
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path / "params", pure)
    checkpointer.wait_until_finished()
    if jax.process_index() == 0:
        (path / "config.json").write_text(json.dumps(config.to_hf(), indent=2))


def load_orbax(
    path: storage.PathLike,
    dtype=jnp.float32,
    *,
    mesh: jax.sharding.Mesh | None = None,
    rules: sharding.Rules = sharding.DEFAULT_RULES,
    options: ModelOptions | None = None,
) -> tuple[Qwen3, ModelConfig]:
    """Restores a model written by :func:`save_orbax` (local or gs://), straight into its
    shardings."""
    path = storage.absolute(path)
    if not (path / "config.json").exists() or not (path / "params").is_dir():
        raise CheckpointError(f"{path} is not an Orbax model checkpoint (needs config.json and params/)")
    config = ModelConfig.from_hf(path / "config.json")
    name = jnp.dtype(dtype).name
    options = dataclasses.replace(options or ModelOptions(), dtype=name, param_dtype=name)
    graphdef, state = nnx.split(abstract_model(config, options))
    params = nnx.state(nnx.merge(graphdef, state), nnx.Param)

    def target(var):
        value = var.get_value()
        shard = (sharding.named_sharding(sharding.param_axes(var), mesh, rules) if mesh
                 else jax.sharding.SingleDeviceSharding(jax.devices()[0]))
        return jax.ShapeDtypeStruct(value.shape, jnp.dtype(dtype), sharding=shard)

    abstract = nnx.to_pure_dict(jax.tree.map(target, params, is_leaf=lambda x: isinstance(x, nnx.Variable)))
    try:
        restored = ocp.StandardCheckpointer().restore(path / "params", abstract)
    except Exception as e:  # orbax raises many types; name the checkpoint either way
        raise CheckpointError(f"cannot restore parameters from {path / 'params'}: {e}") from e
    nnx.replace_by_pure_dict(state, restored)
    return nnx.merge(graphdef, state), config
