"""JSON forms of RNG state for the resume tests' own loops (the project's run derives every
draw from seeds, so it stores none): a JAX PRNG key and a NumPy Generator, bit-exact."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def key_to_json(key: jax.Array) -> dict[str, Any]:
    """A JAX PRNG key (typed ``jax.random.key`` or raw uint32) as JSON-able data."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        data = np.asarray(jax.random.key_data(key))
        impl: str | None = str(jax.random.key_impl(key))
    else:
        data, impl = np.asarray(key), None
    if data.dtype != np.uint32:
        raise TypeError(f"expected a PRNG key with uint32 data, got dtype {data.dtype}")
    return {"impl": impl, "shape": list(data.shape), "data": data.reshape(-1).tolist()}


def key_from_json(blob: Mapping[str, Any]) -> jax.Array:
    """Inverse of :func:`key_to_json`; bit-exact."""
    data = np.asarray(blob["data"], dtype=np.uint32).reshape(blob["shape"])
    if blob["impl"] is None:
        return jnp.asarray(data)
    return jax.random.wrap_key_data(data, impl=blob["impl"])


def numpy_rng_to_json(rng: np.random.Generator) -> dict[str, Any]:
    """A NumPy Generator's exact bit-generator state (JSON ints are arbitrary precision)."""
    return rng.bit_generator.state


def numpy_rng_from_json(state: Mapping[str, Any]) -> np.random.Generator:
    bit_generator = getattr(np.random, state["bit_generator"])()
    bit_generator.state = dict(state)
    return np.random.Generator(bit_generator)
