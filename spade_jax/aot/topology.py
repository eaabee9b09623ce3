"""TPU slices by name (``v5p-64``, ``v5e-16``): chips, grid, per-chip HBM / FLOP/s /
bandwidths, and libtpu's abstract devices of the slice (compiling needs no chip)."""

from __future__ import annotations

import dataclasses
import math
import os

GIB = 1 << 30



@dataclasses.dataclass(frozen=True)
class ChipSpec:
    """One TPU generation: HBM per chip, peak bf16 FLOP/s and HBM bytes/s per chip, how the slice name counts
    (TensorCores for v4/v5p, chips for v5e/v6e), and libtpu's name for its topologies."""

    hbm_bytes: int
    peak_flops: float
    hbm_bandwidth: float
    cores_per_chip: int
    libtpu_name: str
    three_d: bool
    ici_bandwidth: float  # bytes/s per chip, all links (Cloud TPU's published Gbps / 8)


CHIPS: dict[str, ChipSpec] = {
    "v4": ChipSpec(32 * GIB, 275e12, 1.23e12, 2, "v4", True, 2400e9 / 8),
    "v5p": ChipSpec(95 * GIB, 459e12, 2.77e12, 2, "v5", True, 4800e9 / 8),
    "v5e": ChipSpec(16 * GIB, 197e12, 0.82e12, 1, "v5e", False, 1600e9 / 8),
    "v6e": ChipSpec(32 * GIB, 918e12, 1.64e12, 1, "v6e", False, 3584e9 / 8),
}


@dataclasses.dataclass(frozen=True)
class Topology:
    """A named slice such as ``v5p-64`` (64 TensorCores = 32 chips)."""

    name: str
    generation: str
    chips: int
    shape: tuple[int, ...]

    @property
    def chip(self) -> ChipSpec:
        return CHIPS[self.generation]

    @property
    def libtpu_topology(self) -> str:
        return f"{self.chip.libtpu_name}:{'x'.join(map(str, self.shape))}"


def _grid(chips: int, three_d: bool) -> tuple[int, ...]:
    """Chip grid of a slice: 2D for v5e/v6e (2x4, 4x4, 4x8, ...), 3D for v4/v5p (2x2x1, 2x2x2,
    2x2x4, 2x4x4, 4x4x4, ...), doubling the smallest axis first as Cloud TPU does."""
    if three_d:
        if chips < 4:
            raise ValueError(f"a v4/v5p slice has at least 4 chips, got {chips}")
        dims = [2, 2, 1]
        while math.prod(dims) < chips:
            dims[dims.index(min(dims))] *= 2
        dims = sorted(dims[:2]) + [dims[2]] if dims[2] == 1 else sorted(dims)
    else:
        if chips < 1:
            raise ValueError(f"a slice has at least 1 chip, got {chips}")
        dims = [1, 1]
        while math.prod(dims) < chips:
            dims[dims.index(min(dims))] *= 2
        dims = sorted(dims)
    if math.prod(dims) != chips:
        raise ValueError(f"topology of {chips} chips: not a power-of-two slice")
    return tuple(dims)


def parse_topology(name: str) -> Topology:
    """``"v5p-64"`` -> Topology(generation="v5p", chips=32, shape=(2, 4, 4))."""
    generation, sep, count = name.partition("-")
    if not sep or generation not in CHIPS or not count.isdigit():
        raise ValueError(
            f"topology must look like <generation>-<size> with generation in {sorted(CHIPS)}, "
            f"e.g. v5p-64 or v5e-16; got {name!r}"
        )
    chip = CHIPS[generation]
    cores = int(count)
    if cores % chip.cores_per_chip:
        raise ValueError(f"topology {name}: {generation} sizes count TensorCores (2 per chip), "
                         f"{cores} is odd")
    chips = cores // chip.cores_per_chip
    return Topology(name, generation, chips, _grid(chips, chip.three_d))


def topology_devices(topology: Topology) -> list:
    """Abstract devices of the slice from libtpu (raises ImportError naming the fix)."""
    try:
        import libtpu  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "spade_jax.aot needs libtpu for the TPU compiler: pip install libtpu==0.0.42.1"
        ) from e
    # libtpu probes the GCE metadata server for a real TPU VM; on a CPU host, say so up front.
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    # Any other jax process on this host (one run without JAX_PLATFORMS=cpu) holds libtpu's
    # lockfile; compiling needs no chip, so share it.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    desc = topologies.get_topology_desc(
        topology_name=topology.libtpu_topology,
        platform="tpu",
        chip_config_name="megacore" if topology.chip.cores_per_chip == 2 else "default",
        chips_per_host_bounds=(2, 2, 1),
        num_slices=1,
    )
    devices = list(desc.devices)
    if len(devices) != topology.chips:
        raise RuntimeError(f"libtpu gave {len(devices)} devices for {topology.name}, "
                           f"expected {topology.chips} chips")
    return devices
