"""The one place that knows about devices: the mesh and the logical-axis rules.

Models only *name* axes: parameters carry an ``axes=(...)`` metadata tuple of logical
names and activations call :func:`constrain` with logical names. This module maps those
names onto mesh axes with one short table of rules. Entry points (trainer, sampler,
conversion) build a mesh, pick a rule table and call :func:`activate`; nothing else does.

Mesh axes, outermost first:
  data    pure data parallelism (replicated params)
  fsdp    data parallelism with parameters and optimizer state sharded (ZeRO-3)
  tensor  tensor (model) parallelism inside attention heads / MLP hidden
  expert  expert parallelism for MoE layers
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor", "expert")
DECODE_LAYOUTS = ("auto", "tensor", "replicated", "train")
DECODE_PARAM_DTYPES = ("compute", "master")

LogicalAxes = tuple[str | None, ...]
Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

# Logical name -> mesh axis (or axes). A mesh axis is used at most once per array: if two
# dims of one array map to the same mesh axis, the later one is left replicated.
DEFAULT_RULES: Rules = (
    # activations
    ("batch", ("data", "fsdp", "expert")),
    ("seq", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
    ("act_expert", "expert"),
    ("cache_seq", None),
    # parameters
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("expert", "expert"),
    ("expert_mlp", "tensor"),
    ("norm", None),
    ("layers", None),  # the stacked-layer axis of a scanned model: every chip holds all layers
)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Shape of the device mesh.

    Attributes:
      data: pure data-parallel ways. -1 means "all remaining devices".
      fsdp: fully-sharded data-parallel ways.
      tensor: tensor-parallel ways.
      expert: expert-parallel ways (MoE).
      decode_layout: the sampler's copy of the weights (:func:`decode_mesh`): "auto" /
        "tensor" (the FSDP ways become tensor-parallel ways where the heads divide, the
        rest data-parallel), "replicated" (the FSDP ways become data-parallel ways: dense
        weights whole on every chip) or "train" (the trainer's layout, re-gathered by FSDP
        for every token).
      decode_param_dtype: the dtype of that copy (:func:`decode_dtype`): "compute" stores
        every weight in the dtype the forward reads it in (the model's compute dtype; fp32
        for weights marked ``read_dtype="float32"``, the MoE router), never wider than the
        master's. The forward casts each weight to that dtype before any use, so sampling is
        bit-identical to sampling with the master parameters, and under bf16 compute the
        copy, its per-token reads and the reshard are half the bytes. "master" keeps the
        master dtype (fp32). Without a copy (layout "train", or no FSDP axis) the sampler
        reads the master parameters either way.
    """

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    expert: int = 1
    decode_layout: str = "auto"
    decode_param_dtype: str = "compute"

    def __post_init__(self) -> None:
        if self.decode_layout not in DECODE_LAYOUTS:
            raise ValueError(f"MeshConfig.decode_layout must be one of {DECODE_LAYOUTS}, "
                             f"got {self.decode_layout!r}")
        if self.decode_param_dtype not in DECODE_PARAM_DTYPES:
            raise ValueError(f"MeshConfig.decode_param_dtype must be one of "
                             f"{DECODE_PARAM_DTYPES}, got {self.decode_param_dtype!r}")

    def shape(self, n_devices: int) -> tuple[int, int, int, int]:
        sizes = [self.data, self.fsdp, self.tensor, self.expert]
        if sum(s == -1 for s in sizes) > 1:
            raise ValueError(f"MeshConfig: at most one axis may be -1, got {self}")
        if any(s == 0 or s < -1 for s in sizes):
            raise ValueError(f"MeshConfig: axis sizes must be positive or -1, got {self}")
        known = int(np.prod([s for s in sizes if s != -1]))
        if -1 in sizes:
            if n_devices % known:
                raise ValueError(f"MeshConfig {self}: {n_devices} devices not divisible by {known}")
            sizes[sizes.index(-1)] = n_devices // known
        if int(np.prod(sizes)) != n_devices:
            raise ValueError(
                f"MeshConfig {self} needs {int(np.prod(sizes))} devices, {n_devices} available"
            )
        return tuple(sizes)  # type: ignore[return-value]


def make_mesh(config: MeshConfig | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Builds a (data, fsdp, tensor, expert) mesh over ``devices`` (default: all)."""
    config = config or MeshConfig()
    devices = list(devices if devices is not None else jax.devices())
    shape = config.shape(len(devices))
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)


@dataclasses.dataclass(frozen=True)
class _Active:
    mesh: Mesh
    rules: dict[str, str | tuple[str, ...] | None]


_ACTIVE: contextvars.ContextVar[_Active | None] = contextvars.ContextVar("spade_mesh", default=None)


@contextlib.contextmanager
def activate(mesh: Mesh | None, rules: Rules = DEFAULT_RULES) -> Iterator[Mesh | None]:
    """Makes ``mesh`` and ``rules`` the target of :func:`constrain` inside the block
    (``mesh=None``: nothing changes, for callers that run sharded or not)."""
    if mesh is None:
        yield None
        return
    token = _ACTIVE.set(_Active(mesh, dict(rules)))
    try:
        with jax.set_mesh(mesh):
            yield mesh
    finally:
        _ACTIVE.reset(token)


def logical_to_spec(
    axes: LogicalAxes, rules: Rules | dict | None = None, mesh: Mesh | None = None
) -> PartitionSpec:
    """Maps logical axis names to a PartitionSpec using ``rules``.

    Mesh axes of size 1 are dropped, and a mesh axis already used by an earlier dim of the
    same array is not reused (that dim stays replicated).
    """
    if rules is None:
        active = _ACTIVE.get()
        rules = active.rules if active else dict(DEFAULT_RULES)
        mesh = mesh or (active.mesh if active else None)
    rules = dict(rules)
    used: set[str] = set()
    out = []
    for name in axes:
        if name is None:
            out.append(None)
            continue
        if name not in rules:
            raise KeyError(f"no sharding rule for logical axis {name!r}; add it to the rule table")
        target = rules[name]
        targets = (target,) if isinstance(target, str) else tuple(target or ())
        keep = tuple(
            t for t in targets if t not in used and (mesh is None or mesh.shape[t] > 1)
        )
        used.update(keep)
        out.append(keep[0] if len(keep) == 1 else (keep or None))
    return PartitionSpec(*out)


def constrain(x: jax.Array, axes: LogicalAxes) -> jax.Array:
    """Sharding constraint on an activation by logical names; a no-op without a mesh."""
    active = _ACTIVE.get()
    if active is None:
        return x
    spec = logical_to_spec(axes, active.rules, active.mesh)
    return jax.lax.with_sharding_constraint(x, NamedSharding(active.mesh, spec))


def named_sharding(axes: LogicalAxes, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(axes, rules, mesh))


def param_axes(variable) -> LogicalAxes:
    """Logical axes of an nnx Variable (its ``axes`` metadata); replicated if absent."""
    meta = variable.get_metadata() if hasattr(variable, "get_metadata") else {}
    axes = meta.get("axes")
    if axes is None:
        return (None,) * np.ndim(variable.get_value() if hasattr(variable, "get_value") else variable)
    return tuple(axes)


def tree_shardings(tree: Any, mesh: Mesh, rules: Rules | None = None) -> Any:
    """NamedSharding per leaf: from ``axes`` metadata for nnx Variables (parameters, and the
    Adam moments that mirror them), replicated for everything else (step, counts, rng).
    ``rules=None`` uses the rules made active by :func:`activate` (else the defaults)."""

    def one(leaf):
        if isinstance(leaf, nnx.Variable):
            return NamedSharding(mesh, logical_to_spec(param_axes(leaf), rules, mesh))
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def constrain_tree(tree: Any, mesh: Mesh | None, rules: Rules | None = None) -> Any:
    """Pins every leaf of ``tree`` to :func:`tree_shardings` inside jit (no-op without a
    mesh): what keeps a train state's parameters and moments where the rules put them."""
    if mesh is None:
        return tree
    return jax.lax.with_sharding_constraint(tree, tree_shardings(tree, mesh, rules))


def data_ways(mesh: Mesh, rules: Rules = DEFAULT_RULES) -> int:
    """How many ways the "batch" rule splits rows over ``mesh``."""
    spec = logical_to_spec(("batch",), rules, mesh)
    return int(np.prod([mesh.shape[axis] for axis in jax.tree.leaves(tuple(spec))]))


def shard_batch(batch: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Any:
    """Places every array of ``batch`` (a pytree of [B, ...] arrays, e.g. a TrainBatch) on
    ``mesh`` with its rows split over the data-parallel ("batch") axes."""
    spec = logical_to_spec(("batch",), rules, mesh)
    ways = data_ways(mesh, rules)
    for leaf in jax.tree.leaves(batch):
        if np.shape(leaf)[0] % ways:
            raise ValueError(f"batch of {np.shape(leaf)[0]} rows does not split over "
                             f"{ways} devices")

    def put(x):
        return jax.device_put(x, NamedSharding(mesh, PartitionSpec(*spec, *(None,) * (x.ndim - 1))))

    return jax.tree.map(put, batch)


# ---- the sampler's layout ----------------------------------------------------------------
# Decoding one token multiplies every weight by a few rows: under the trainer's FSDP layout
# each chip all-gathers every weight for every token (ICI-bound). The sampler instead gets
# its own copy of the weights, resharded once per step (:func:`reshard`) onto a *decode
# mesh*: the same devices factored without an FSDP axis, under the same rules. With fsdp = 1
# the "embed" rule maps to nothing, so no weight is split along the dim a matmul contracts
# over its rows: heads / MLP hidden / vocab split over "tensor" (the per-token collectives
# are all-reduces of activations), experts over "expert" (all-to-alls of tokens), rows
# over "data" and "expert". The copy stores each weight in the dtype the forward reads it
# in (:func:`decode_dtype`): half the bytes under bf16 compute, the same numbers.


def _tensor_ways(arch, budget: int) -> int:
    """Largest power of two <= ``budget`` dividing ``budget`` and every dim the "tensor" rules
    split (query / kv heads, MLP hidden, expert hidden, vocab), so that shards are even."""
    dims = [arch.num_heads, arch.num_kv_heads, arch.vocab_size]
    if arch.intermediate_size and any(not arch.is_moe_layer(i) for i in range(arch.num_layers)):
        dims.append(arch.intermediate_size)
    if arch.num_experts:
        dims.append(arch.moe_intermediate_size)
    ways = 1
    while budget % (2 * ways) == 0 and all(d % (2 * ways) == 0 for d in dims):
        ways *= 2
    return ways


def decode_mesh_config(config: MeshConfig, n_devices: int, arch) -> MeshConfig:
    """The decode mesh's shape for ``config.decode_layout`` (see :class:`MeshConfig`), over the
    same ``n_devices`` as the trainer's mesh; "train" returns ``config``'s shape."""
    data, fsdp, tensor, expert = config.shape(n_devices)
    layout = config.decode_layout
    if layout == "train" or fsdp == 1:
        return dataclasses.replace(config, data=data, fsdp=fsdp, tensor=tensor, expert=expert)
    model_ways = fsdp * tensor
    new_tensor = tensor if layout == "replicated" else _tensor_ways(arch, model_ways)
    return dataclasses.replace(config, data=data * model_ways // new_tensor, fsdp=1,
                               tensor=new_tensor, expert=expert)


def decode_mesh(mesh: Mesh, config: MeshConfig, arch) -> Mesh:
    """The sampler's mesh over ``mesh``'s devices (in its order) for ``config.decode_layout``;
    ``mesh`` itself for "train" or when it has no FSDP axis to re-purpose."""
    shape = decode_mesh_config(config, mesh.size, arch)
    if shape.shape(mesh.size) == tuple(mesh.devices.shape):
        return mesh
    return make_mesh(shape, list(mesh.devices.flat))


def decode_dtype(variable: Any, compute_dtype: Any) -> np.dtype:
    """The dtype of ``variable`` in the sampler's copy (``decode_param_dtype="compute"``):
    the dtype the forward reads it in (its ``read_dtype`` metadata, else ``compute_dtype``)
    when that is a narrower float than it is stored in, else its own dtype. The forward casts
    every weight to its read dtype before use, so the copy changes no number it computes;
    never wider than stored, since widening would add bytes and no precision."""
    dtype = np.dtype(variable.get_value().dtype)
    read = np.dtype(variable.get_metadata().get("read_dtype") or compute_dtype)
    narrower = read.itemsize < dtype.itemsize
    return read if jnp.issubdtype(dtype, jnp.floating) and narrower else dtype


def cast_for_decode(tree: Any, compute_dtype: Any | None) -> Any:
    """``tree`` (parameters: nnx Variables) with every Variable cast to :func:`decode_dtype`;
    unchanged for ``compute_dtype=None`` (the master dtype kept)."""
    if compute_dtype is None:
        return tree

    def one(leaf):
        if not isinstance(leaf, nnx.Variable):
            return leaf
        return leaf.replace(leaf.get_value().astype(decode_dtype(leaf, compute_dtype)))

    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def resharder(like: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES,
              compute_dtype: Any | None = None):
    """A jitted copy of trees shaped like ``like`` (parameters: nnx Variables carrying
    ``axes``) onto ``mesh`` as the rules say, cast by :func:`cast_for_decode` (``None``: the
    dtypes kept). The decode mesh holds the same devices in the same order, so this is one
    SPMD program over the global arrays (multi-host too), the program ``spade_jax.aot``
    compiles for the per-step reshard; compiled once, reused."""
    return jax.jit(lambda tree: cast_for_decode(tree, compute_dtype),
                   out_shardings=tree_shardings(like, mesh, rules))


def reshard(tree: Any, mesh: Mesh | None, rules: Rules = DEFAULT_RULES,
            compute_dtype: Any | None = None) -> Any:
    """``tree`` copied onto ``mesh`` by :func:`resharder` (unchanged without a mesh)."""
    if mesh is None:
        return tree
    return resharder(tree, mesh, rules, compute_dtype)(tree)
