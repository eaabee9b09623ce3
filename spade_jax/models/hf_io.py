"""Hugging Face <-> spade_jax conversion for the Qwen3 family.

Loading streams tensor by tensor: the model is first built abstractly (no memory), then
each parameter is read from its safetensors shard(s), transformed in numpy, checked for
shape, and placed straight into its target sharding. At no point does one host hold the
whole model.

Expert weights are accepted in both layouts found in the wild: per-expert tensors as on
the Hub (``mlp.experts.{e}.gate_proj.weight``) and the fused layout of recent
``transformers`` (``mlp.experts.gate_up_proj`` [E, 2F, D], ``mlp.experts.down_proj``
[E, D, F]). Export always writes the Hub layout. Checkpoint directories may be local or
remote (``gs://...``, through ``etils.epath``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from spade_jax import sharding, storage
from spade_jax.models.config import ModelConfig
from spade_jax.models.qwen3 import ModelOptions, Qwen3
from spade_jax.models.safetensors_io import (
    CheckpointError,
    TensorIndex,
    shard_tensors,
    write_safetensors,
)

log = logging.getLogger(__name__)

Path_ = tuple  # an nnx state path, e.g. ("layers", 0, "attn", "q_dnh")


@dataclasses.dataclass(frozen=True)
class ParamMapping:
    """How one of our parameters is stored in a Hugging Face checkpoint."""

    path: Path_
    shape: tuple[int, ...]
    load: Callable[[TensorIndex], np.ndarray]  # reads + transforms HF tensors
    export: Callable[[np.ndarray], list[tuple[str, np.ndarray]]]  # ours -> HF tensors
    # A stacked parameter of a scanned model ([L, ...]): the per-layer mappings it stacks,
    # so loading and saving can stream one layer at a time.
    layers: tuple[ParamMapping, ...] = ()


def _linear(path: Path_, hf_name: str, shape: tuple[int, ...]) -> ParamMapping:
    """HF nn.Linear weight [out, in] <-> ours [in, *out_dims]."""
    in_dim = shape[0]

    def load(index: TensorIndex) -> np.ndarray:
        w = _get(index, hf_name, (int(np.prod(shape[1:])), in_dim))
        return w.T.reshape(shape)

    def export(arr: np.ndarray) -> list[tuple[str, np.ndarray]]:
        return [(hf_name, np.ascontiguousarray(arr.reshape(in_dim, -1).T))]

    return ParamMapping(path, shape, load, export)


def _output_linear(path: Path_, hf_name: str, shape: tuple[int, ...]) -> ParamMapping:
    """HF weight [out, in] <-> ours [*in_dims, out] (o_proj, down_proj)."""
    out_dim = shape[-1]

    def load(index: TensorIndex) -> np.ndarray:
        w = _get(index, hf_name, (out_dim, int(np.prod(shape[:-1]))))
        return w.T.reshape(shape)

    def export(arr: np.ndarray) -> list[tuple[str, np.ndarray]]:
        return [(hf_name, np.ascontiguousarray(arr.reshape(-1, out_dim).T))]

    return ParamMapping(path, shape, load, export)


def _copy(path: Path_, hf_name: str, shape: tuple[int, ...], flat: bool = False) -> ParamMapping:
    """Stored as is (``flat``: HF keeps it as one vector, e.g. q_proj.bias [N*H])."""
    hf_shape = (int(np.prod(shape)),) if flat else shape

    def load(index: TensorIndex) -> np.ndarray:
        return _get(index, hf_name, hf_shape).reshape(shape)

    def export(arr: np.ndarray) -> list[tuple[str, np.ndarray]]:
        return [(hf_name, np.ascontiguousarray(arr.reshape(hf_shape)))]

    return ParamMapping(path, shape, load, export)


def _experts(path: Path_, prefix: str, which: str, shape: tuple[int, ...]) -> ParamMapping:
    """Stacked expert weights: ours gate/up [E, D, F], down [E, F, D]."""
    num_experts, a, b = shape

    def load(index: TensorIndex) -> np.ndarray:
        fused = f"{prefix}.gate_up_proj" if which in ("gate", "up") else f"{prefix}.down_proj"
        if fused in index:  # transformers>=5 in-memory layout
            if which == "down":
                return _get(index, fused, (num_experts, b, a)).transpose(0, 2, 1)
            both = _get(index, fused, (num_experts, 2 * b, a))
            half = both[:, :b] if which == "gate" else both[:, b:]
            return half.transpose(0, 2, 1)
        hf_shape = (b, a)  # nn.Linear [out, in]
        return np.stack(
            [_get(index, f"{prefix}.{e}.{which}_proj.weight", hf_shape).T for e in range(num_experts)]
        )

    def export(arr: np.ndarray) -> list[tuple[str, np.ndarray]]:
        return [(f"{prefix}.{e}.{which}_proj.weight", np.ascontiguousarray(arr[e].T))
                for e in range(num_experts)]

    return ParamMapping(path, shape, load, export)


def _get(index: TensorIndex, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name not in index:
        raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {index.directory}")
    got = index.shape(name)
    if tuple(got) != tuple(shape):
        raise CheckpointError(
            f"tensor {name!r} in {index.file_of(name)} has shape {tuple(got)}, expected {tuple(shape)}"
        )
    return index.get(name)


def param_mappings(config: ModelConfig, scan_layers: bool = False) -> list[ParamMapping]:
    """Every parameter of :class:`Qwen3` with its Hugging Face storage; with ``scan_layers``,
    the per-layer parameters are grouped into stacked ``("layers", ...)`` ones."""
    maps = _per_layer_mappings(config)
    if not scan_layers:
        return maps
    grouped: dict[Path_, list[ParamMapping]] = {}
    out = []
    for m in maps:
        if m.path[0] == "layers":
            grouped.setdefault(("layers", *m.path[2:]), []).append(m)
        else:
            out.append(m)
    return out + [_stacked(path, per_layer) for path, per_layer in grouped.items()]


def _stacked(path: Path_, per_layer: list[ParamMapping]) -> ParamMapping:
    def load(index: TensorIndex) -> np.ndarray:
        return np.stack([m.load(index) for m in per_layer])

    def export(arr: np.ndarray) -> list[tuple[str, np.ndarray]]:
        return [t for i, m in enumerate(per_layer) for t in m.export(arr[i])]

    return ParamMapping(path, (len(per_layer), *per_layer[0].shape), load, export,
                        tuple(per_layer))


def _per_layer_mappings(config: ModelConfig) -> list[ParamMapping]:
    c = config
    d, n, k, h = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    maps = [_copy(("embed_vd",), "model.embed_tokens.weight", (c.vocab_size, d)),
            _copy(("final_norm", "weight"), "model.norm.weight", (d,))]
    if not c.tie_word_embeddings:
        maps.append(_linear(("lm_head_dv",), "lm_head.weight", (d, c.vocab_size)))
    for i in range(c.num_layers):
        L, hf = ("layers", i), f"model.layers.{i}"
        maps += [
            _copy((*L, "input_norm", "weight"), f"{hf}.input_layernorm.weight", (d,)),
            _copy((*L, "post_attn_norm", "weight"), f"{hf}.post_attention_layernorm.weight", (d,)),
            _linear((*L, "attn", "q_dnh"), f"{hf}.self_attn.q_proj.weight", (d, n, h)),
            _linear((*L, "attn", "k_dkh"), f"{hf}.self_attn.k_proj.weight", (d, k, h)),
            _linear((*L, "attn", "v_dkh"), f"{hf}.self_attn.v_proj.weight", (d, k, h)),
            _output_linear((*L, "attn", "o_nhd"), f"{hf}.self_attn.o_proj.weight", (n, h, d)),
        ]
        if c.qkv_bias:
            maps += [
                _copy((*L, "attn", "q_bias_nh"), f"{hf}.self_attn.q_proj.bias", (n, h), flat=True),
                _copy((*L, "attn", "k_bias_kh"), f"{hf}.self_attn.k_proj.bias", (k, h), flat=True),
                _copy((*L, "attn", "v_bias_kh"), f"{hf}.self_attn.v_proj.bias", (k, h), flat=True),
            ]
        if c.o_bias:
            maps.append(_copy((*L, "attn", "o_bias_d"), f"{hf}.self_attn.o_proj.bias", (d,)))
        if c.qk_norm:
            maps += [
                _copy((*L, "attn", "q_norm", "weight"), f"{hf}.self_attn.q_norm.weight", (h,)),
                _copy((*L, "attn", "k_norm", "weight"), f"{hf}.self_attn.k_norm.weight", (h,)),
            ]
        if c.is_moe_layer(i):
            e, f, M = c.num_experts, c.moe_intermediate_size, (*L, "moe")
            maps += [
                _linear((*M, "router_de"), f"{hf}.mlp.gate.weight", (d, e)),
                _experts((*M, "gate_edf"), f"{hf}.mlp.experts", "gate", (e, d, f)),
                _experts((*M, "up_edf"), f"{hf}.mlp.experts", "up", (e, d, f)),
                _experts((*M, "down_efd"), f"{hf}.mlp.experts", "down", (e, f, d)),
            ]
            if c.shared_expert_intermediate_size:
                maps += _mlp_maps((*M, "shared_expert"), f"{hf}.mlp.shared_expert", d,
                                  c.shared_expert_intermediate_size)
                maps.append(_linear((*M, "shared_gate_d1"), f"{hf}.mlp.shared_expert_gate.weight", (d, 1)))
        else:
            maps += _mlp_maps((*L, "mlp"), f"{hf}.mlp", d, c.intermediate_size)
    return maps


def _mlp_maps(path: Path_, hf: str, d: int, f: int) -> list[ParamMapping]:
    return [
        _linear((*path, "gate_df"), f"{hf}.gate_proj.weight", (d, f)),
        _linear((*path, "up_df"), f"{hf}.up_proj.weight", (d, f)),
        _output_linear((*path, "down_fd"), f"{hf}.down_proj.weight", (f, d)),
    ]


def abstract_model(config: ModelConfig, options: ModelOptions | None = None) -> Qwen3:
    """The model's structure with ShapeDtypeStruct leaves (allocates nothing)."""
    return nnx.eval_shape(lambda: Qwen3(config, options, rngs=nnx.Rngs(0)))


def load_hf(
    path: storage.PathLike,
    dtype=jnp.float32,
    *,
    mesh: jax.sharding.Mesh | None = None,
    rules: sharding.Rules = sharding.DEFAULT_RULES,
    options: ModelOptions | None = None,
) -> tuple[Qwen3, ModelConfig]:
    """Loads a Hugging Face checkpoint directory into a :class:`Qwen3`.

    Args:
      path: directory with config.json and one or many ``*.safetensors`` (local or gs://).
      dtype: parameter and activation dtype (jnp.float32 or jnp.bfloat16).
      mesh: place each parameter straight into its sharding on this mesh.
      rules: logical-axis rules for ``mesh``.
      options: run options; ``dtype`` overrides its dtypes.
    Returns:
      (model, config).
    """
    path = storage.as_path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    config = ModelConfig.from_hf(path)
    name = jnp.dtype(dtype).name
    options = dataclasses.replace(options or ModelOptions(), dtype=name, param_dtype=name)
    index = TensorIndex(path)
    abstract = abstract_model(config, options)
    graphdef, state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(state))
    mappings = param_mappings(config, options.scan_layers)
    expected_paths = {m.path for m in mappings}
    if set(flat) != expected_paths:  # guards the mapping table itself
        raise AssertionError(f"mapping/model mismatch: {set(flat) ^ expected_paths}")

    for m in mappings:
        var = flat[m.path]
        if mesh is not None and m.layers:
            # Stacked: each device's shard is assembled one layer at a time, so the host
            # never holds a whole stacked tensor (the "layers" axis is never sharded).
            def shard(idx, m=m):
                layers = m.layers[idx[0]]
                return np.stack([np.asarray(ml.load(index))[idx[1:]] for ml in layers]
                                ).astype(jnp.dtype(dtype))

            target = sharding.named_sharding(sharding.param_axes(var), mesh, rules)
            var.set_value(jax.make_array_from_callback(m.shape, target, shard))
            continue
        arr = np.asarray(m.load(index)).astype(jnp.dtype(dtype))
        if mesh is None:
            value = jnp.asarray(arr)
        else:
            target = sharding.named_sharding(sharding.param_axes(var), mesh, rules)
            value = jax.make_array_from_callback(arr.shape, target, lambda idx, a=arr: a[idx])
        var.set_value(value)
    unused = index.names() - _hf_names(config, index)
    if unused:
        log.warning("ignoring %d checkpoint tensors not used by %s, e.g. %s",
                    len(unused), config.architecture, sorted(unused)[:3])
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    return model, config


def _hf_names(config: ModelConfig, index: TensorIndex) -> set[str]:
    """HF tensor names the mapping reads (either expert layout)."""
    names: set[str] = set()
    for m in param_mappings(config):
        exported = {n for n, _ in m.export(np.zeros(m.shape, np.float32))}
        if any(n in index for n in exported):
            names |= exported
        else:  # fused expert layout
            prefix = exported.pop().rsplit(".", 3)[0]
            names |= {f"{prefix}.gate_up_proj", f"{prefix}.down_proj"}
    return names


def hf_tensors(model: Qwen3) -> Iterator[tuple[str, np.ndarray]]:
    """Streams the model's parameters as (HF name, numpy array), one at a time."""
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    for m in param_mappings(model.config, model.options.scan_layers):
        value = flat[m.path].get_value()
        # A stacked parameter is gathered and exported one layer at a time.
        for mapping, part in (zip(m.layers, value, strict=True) if m.layers else [(m, value)]):
            if jax.process_count() > 1:
                from jax.experimental import multihost_utils

                part = multihost_utils.process_allgather(part, tiled=True)
            yield from mapping.export(np.asarray(jax.device_get(part)))


def save_hf(model: Qwen3, config: ModelConfig, path: storage.PathLike,
            max_shard_bytes: int = 5 * 1024**3) -> None:
    """Writes config.json + safetensors shards that ``transformers`` loads."""
    if jax.process_index() != 0:
        for _ in hf_tensors(model):  # take part in the gathers, write nothing
            pass
        return
    write_hf(hf_tensors(model), config, path,
             dtype=jnp.dtype(model.options.storage_dtype).name, max_shard_bytes=max_shard_bytes)


def write_hf(tensors: Iterator[tuple[str, np.ndarray]], config: ModelConfig,
             path: storage.PathLike, *, dtype: str,
             max_shard_bytes: int = 5 * 1024**3) -> list[str]:
    """Writes a Hugging Face checkpoint directory (local or gs://) from a stream of
    (HF name, array): each shard file is written as soon as it is full, so at most two
    shards are in memory at once (the second tells whether the first is the only one,
    which is then named ``model.safetensors``). Returns the files written."""
    path = storage.as_path(path)
    path.mkdir(parents=True, exist_ok=True)
    shards = shard_tensors(tensors, max_shard_bytes)
    current, following = next(shards, []), next(shards, None)
    weight_map, total, files, number = {}, 0, [], 1
    while current:
        fname = ("model.safetensors" if number == 1 and following is None
                 else f"model-{number:05d}.safetensors")
        write_safetensors(path / fname, current)
        for name, arr in current:
            weight_map[name] = fname
            total += arr.nbytes
        files.append(fname)
        current, following = following or [], next(shards, None) if following else None
        number += 1
    if len(files) > 1:
        (path / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        files.append("model.safetensors.index.json")
    hf_config = config.to_hf()
    hf_config["torch_dtype"] = hf_config["dtype"] = dtype
    (path / "config.json").write_text(json.dumps(hf_config, indent=2))
    return files + ["config.json"]
