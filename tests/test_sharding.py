"""Placement helpers of ``spade_jax.sharding`` against hand-written expectations."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from spade_jax import sharding

pytestmark = pytest.mark.skipif(
    jax.device_count() < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")


def _mesh(**axes) -> jax.sharding.Mesh:
    return sharding.make_mesh(sharding.MeshConfig(data=1, **axes))


def test_tree_shardings_follow_axes_metadata_and_replicate_the_rest():
    mesh = _mesh(fsdp=2, tensor=2, expert=2)
    tree = {"w": nnx.Param(jnp.zeros((4, 6)), axes=("embed", "mlp")),
            "e": nnx.Param(jnp.zeros((2, 4, 6)), axes=("expert", "embed", "expert_mlp")),
            "step": jnp.zeros((), jnp.int32)}
    got = sharding.tree_shardings(tree, mesh)
    assert got["w"].spec == P("fsdp", "tensor")
    assert got["e"].spec == P("expert", "fsdp", "tensor")
    assert got["step"].spec == P()


def test_shard_batch_splits_rows_over_the_batch_axes_and_names_a_bad_count():
    mesh = _mesh(fsdp=2, expert=4)  # "batch" -> (data, fsdp, expert): 8 ways
    assert sharding.data_ways(mesh) == 8
    batch = {"ids": np.arange(16 * 3).reshape(16, 3), "adv": np.arange(16.0)}
    placed = sharding.shard_batch(batch, mesh)
    assert placed["ids"].sharding.spec == P(("fsdp", "expert"), None)
    assert placed["ids"].addressable_shards[0].data.shape == (2, 3)
    np.testing.assert_array_equal(np.asarray(placed["adv"]), batch["adv"])
    with pytest.raises(ValueError, match="batch of 12 rows does not split over 8 devices"):
        sharding.shard_batch({"ids": np.zeros((12, 3))}, mesh)


def test_activate_none_changes_nothing():
    x = jnp.ones((8, 4))
    with sharding.activate(None) as mesh:
        assert mesh is None
        assert sharding.constrain(x, ("batch", None)) is x  # no rules active: a no-op
