"""Multi-host set-up: one process per TPU VM worker, all running the same command.

    from spade_jax import distributed
    distributed.maybe_initialize()          # first thing in main(), before any jax array
    seed = distributed.host_seed(config.seed)  # this host's environment-worker pool seed
    docs = distributed.agree(docs_chosen_on_host_0)  # every host gets process 0's choice

What runs where on a pod slice:
  * every host runs the jitted programs over the global mesh (``jax.devices()``);
  * environments always run on the local host's CPUs, in each host's own sandbox pool
    (seeded with :func:`host_seed`); each host resets and steps only its share of a
    batch's episodes (``rollout.agent_loop.episode_owner``: contiguous blocks) and every
    turn's outcomes are all-gathered (:func:`all_gather_json`), so every host absorbs the
    owner's observation / reward / ending and the batch rows agree token for token;
  * decisions that must be identical everywhere (corpus documents drawn this round,
    environment-memory entries fed to the designer or replayed, which programs validated
    and loaded, episode returns, the trained tokenizer) are made on process 0 and
    broadcast with :func:`agree` / :func:`agree_json` / :func:`agree_bytes`, so hosts
    never diverge through a host-local corpus, RNG or wall-clock deadline; a host that
    cannot follow process 0 says so through :func:`failing_hosts`, and every host raises;
  * only process 0 writes logs, metrics and the report (``metrics.py`` and
    ``run.py`` gate on process 0); Orbax checkpoints are written by all hosts.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import glob
import json
import logging
import os
import sys
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

# Environment variables that mean "this process is one of several": an explicit cluster
# (CPU/GPU processes, the tests), GKE's TPU worker list, a Megascale (multislice) job.
_COORDINATOR_VARS = ("JAX_COORDINATOR_ADDRESS", "COORDINATOR_ADDRESS")
_GKE_WORKER_VARS = ("TPU_PROCESS_ADDRESSES", "TPU_WORKER_HOSTNAMES")
# The explicit switch `launch/tpu.py run` always sets: "1" = this is a TPU VM slice, call
# jax.distributed.initialize() and let JAX read the workers from the metadata server; "0" =
# never initialise. Unset = decide from the environment and, on a TPU host, the metadata.
OPT_IN_VAR = "SPADE_JAX_DISTRIBUTED"
# Seconds without a heartbeat after which JAX's coordination service declares a host dead
# and ends the job on every host (jax.distributed.initialize's heartbeat_timeout_seconds).
HEARTBEAT_VAR = "SPADE_JAX_HEARTBEAT_TIMEOUT_S"
DEFAULT_HEARTBEAT_TIMEOUT_S = 100
_YES, _NO = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
# Google's PCI vendor id and the device ids of TPU chips v4 / v5p / v5e / v6e (the ids
# jax's own hardware probe knows); a host without one is not a TPU VM.
_GOOGLE_PCI_VENDOR = "0x1ae0"
_TPU_PCI_DEVICES = frozenset({"0x005e", "0x0062", "0x0063", "0x006f", "0x0076"})
_METADATA_TIMEOUT_S = 5.0


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """How this process joins the job (all None = let jax detect it on a TPU VM).

    Attributes:
      coordinator_address: "host:port" of process 0.
      num_processes: hosts in the job.
      process_id: this host's index in [0, num_processes).
    """

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None

    def __post_init__(self) -> None:
        given = [self.coordinator_address, self.num_processes, self.process_id]
        if any(v is not None for v in given) and any(v is None for v in given):
            raise ValueError("coordinator_address, num_processes and process_id are set "
                             f"together or not at all, got {self}")
        if self.num_processes is not None and self.num_processes < 1:
            raise ValueError(f"num_processes must be >= 1, got {self.num_processes}")
        if self.process_id is not None and not 0 <= self.process_id < (self.num_processes or 0):
            raise ValueError(f"process_id must be in [0, {self.num_processes}), "
                             f"got {self.process_id}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> DistributedConfig:
        """Reads JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID (an explicit
        cluster); empty when they are unset (a TPU VM, where jax asks the runtime)."""
        env = os.environ if env is None else env
        address = next((env[k] for k in _COORDINATOR_VARS if env.get(k)), None)
        if address is None:
            return cls()
        try:
            return cls(address, int(env["JAX_NUM_PROCESSES"]), int(env["JAX_PROCESS_ID"]))
        except KeyError as e:
            raise ValueError(f"{_COORDINATOR_VARS[0]} is set, so {e.args[0]} must be too") from e


@dataclasses.dataclass(frozen=True)
class InitDecision:
    """Whether this process calls ``jax.distributed.initialize()``, and why.

    Attributes:
      source: what decided: "off" (SPADE_JAX_DISTRIBUTED=0), "explicit" (JAX_COORDINATOR_*),
        "gke" (TPU_PROCESS_ADDRESSES / TPU_WORKER_HOSTNAMES), "multislice"
        (MEGASCALE_COORDINATOR_ADDRESS), "launcher" (SPADE_JAX_DISTRIBUTED=1), "tpu_vm"
        (the metadata server's worker list), "single" (none of these).
      initialize: call ``jax.distributed.initialize()``.
      reason: one line for the log.
    """

    source: str
    initialize: bool
    reason: str


def tpu_chip_count(pci_devices: str = "/sys/bus/pci/devices") -> int:
    """TPU chips attached to this host through PCI (0 on anything but a TPU VM)."""
    count = 0
    for vendor in glob.glob(os.path.join(pci_devices, "*", "vendor")):
        try:
            if Path(vendor).read_text().strip() != _GOOGLE_PCI_VENDOR:
                continue
            device = (Path(vendor).parent / "device").read_text().strip()
        except OSError:
            continue
        count += device in _TPU_PCI_DEVICES
    return count


def tpu_metadata(key: str, env: Mapping[str, str] | None = None) -> str | None:
    """``instance/attributes/<key>`` from the GCE metadata server (the TPU VM's worker list
    and worker number live there), or None when it cannot be read. ``GCE_METADATA_IP``
    overrides the server's address, as it does for jax."""
    env = os.environ if env is None else env
    host = env.get("GCE_METADATA_IP") or "metadata.google.internal"
    request = urllib.request.Request(
        f"http://{host}/computeMetadata/v1/instance/attributes/{key}",
        headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(request, timeout=_METADATA_TIMEOUT_S) as response:
            return response.read().decode("utf-8").strip()
    except (OSError, ValueError) as e:  # URLError / HTTPError / timeouts are OSErrors
        log.warning("could not read TPU metadata %r from %s: %s", key, host, e)
        return None


def decide(env: Mapping[str, str] | None = None, *, tpu_chips: int | None = None,
           metadata: Callable[[str], str | None] | None = None) -> InitDecision:
    """Decides whether this process is one of several hosts (see :class:`InitDecision`).

    In order: ``SPADE_JAX_DISTRIBUTED=0`` turns it off; an explicit coordinator
    (``JAX_COORDINATOR_ADDRESS`` + ``JAX_NUM_PROCESSES`` + ``JAX_PROCESS_ID``) decides by
    its process count; GKE's worker list by its length; a Megascale coordinator always
    initialises; ``SPADE_JAX_DISTRIBUTED=1`` (set by ``launch/tpu.py run``) always does;
    otherwise, on a host with TPU chips, the metadata server's ``worker-network-endpoints``
    (the plain TPU VM case, where no environment variable names the other workers) decides
    by its length. ``tpu_chips`` / ``metadata`` replace the PCI probe and the metadata
    server (tests).
    """
    env = os.environ if env is None else env
    switch = env.get(OPT_IN_VAR, "").strip().lower()
    if switch and switch not in _YES + _NO:
        raise ValueError(f"{OPT_IN_VAR} must be 1 or 0 (or unset), got {env[OPT_IN_VAR]!r}")
    if switch in _NO:
        return InitDecision("off", False, f"{OPT_IN_VAR}={env[OPT_IN_VAR]}")
    if any(env.get(k) for k in _COORDINATOR_VARS):
        processes = int(env.get("JAX_NUM_PROCESSES", "2"))
        return InitDecision("explicit", processes > 1,
                            f"JAX_COORDINATOR_ADDRESS with {processes} processes")
    gke = next((env[k] for k in _GKE_WORKER_VARS if env.get(k)), None)
    if gke is not None:
        hosts = [h for h in gke.split(",") if h.strip()]
        return InitDecision("gke", len(hosts) > 1, f"GKE worker list of {len(hosts)} hosts")
    if env.get("MEGASCALE_COORDINATOR_ADDRESS"):
        return InitDecision("multislice", True, "MEGASCALE_COORDINATOR_ADDRESS is set")
    if switch in _YES:
        return InitDecision("launcher", True, f"{OPT_IN_VAR}={env[OPT_IN_VAR]}")
    chips = tpu_chip_count() if tpu_chips is None else tpu_chips
    if chips == 0:
        return InitDecision("single", False, "no coordinator and no TPU chips on this host")
    fetch = metadata if metadata is not None else (lambda key: tpu_metadata(key, env))
    workers = fetch("worker-network-endpoints")
    if workers is None:
        return InitDecision("single", False, f"{chips} TPU chips but no worker list in the "
                            f"metadata; set {OPT_IN_VAR}=1 on every host of a multi-host slice")
    hosts = [w for w in workers.split(",") if w.strip()]
    return InitDecision("tpu_vm", len(hosts) > 1,
                        f"TPU VM whose metadata lists {len(hosts)} workers")


def is_multihost(env: Mapping[str, str] | None = None) -> bool:
    """True when this process is one of several hosts (:func:`decide`)."""
    return decide(env).initialize


def heartbeat_timeout_s(env: Mapping[str, str] | None = None) -> int:
    """``SPADE_JAX_HEARTBEAT_TIMEOUT_S`` (default 100, JAX's): how long a host may be silent
    before the coordination service declares it dead and every host's job ends."""
    env = os.environ if env is None else env
    raw = env.get(HEARTBEAT_VAR, "")
    try:
        value = int(raw) if raw else DEFAULT_HEARTBEAT_TIMEOUT_S
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{HEARTBEAT_VAR} must be a positive number of seconds, got {raw!r}")
    return value


_initialized = False


def maybe_initialize(env: Mapping[str, str] | None = None) -> bool:
    """Calls ``jax.distributed.initialize()`` when :func:`decide` says this process is one
    of several hosts; a no-op on one host and on a second call.

    Must run before any JAX computation. Returns whether this call initialised.
    """
    global _initialized
    if _initialized:
        return False
    decision = decide(env)
    log.info("jax.distributed: %s (%s)", "initialising" if decision.initialize else "one host",
             decision.reason)
    if not decision.initialize:
        return False
    import jax

    config = DistributedConfig.from_env(env)
    timeout = heartbeat_timeout_s(env)
    if config.coordinator_address is None:
        # TPU VM / GKE / multislice: jax reads the workers from the runtime or the metadata.
        jax.distributed.initialize(heartbeat_timeout_seconds=timeout)
    else:
        jax.distributed.initialize(config.coordinator_address, config.num_processes,
                                   config.process_id, heartbeat_timeout_seconds=timeout)
    _initialized = True
    log.info("jax.distributed: process %d of %d, %d local / %d global devices",
             jax.process_index(), jax.process_count(), jax.local_device_count(),
             jax.device_count())
    return True


@contextlib.contextmanager
def fail_fast() -> Iterator[None]:
    """In a multi-host job, an exception that escapes the block ends this process at once
    (its traceback logged, exit status 1).

    Raising normally would run JAX's exit handler, which waits in a shutdown barrier (up to
    ``shutdown_timeout_seconds``, 5 minutes) for the other hosts, while they wait for this
    one in their next collective. Exiting at once closes this process's connections: the
    other hosts' collectives fail and the whole job stops. What is skipped is safe to skip:
    checkpoints are committed atomically, and sandbox workers die with their parent. One
    host: the exception propagates unchanged.
    """
    try:
        yield
    except (Exception, KeyboardInterrupt):
        import jax

        if jax.process_count() == 1:
            raise
        log.exception("process %d failed; exiting without the shutdown barrier",
                      jax.process_index())
        logging.shutdown()  # flush every handler (the run's train.log)
        sys.stderr.flush()
        os._exit(1)


def process_index() -> int:
    import jax

    return jax.process_index()


def is_primary() -> bool:
    """Process 0: the only host that writes logs, metrics and reports."""
    return process_index() == 0


def host_seed(seed: int, process: int | None = None) -> int:
    """A distinct, reproducible seed for one host's environment-worker pool: the same
    experiment seed gives each host its own stream, and host 0 keeps ``seed`` itself."""
    process = process_index() if process is None else process
    if process < 0:
        raise ValueError(f"process must be >= 0, got {process}")
    if process == 0:
        return int(seed)
    mixed = np.random.SeedSequence([int(seed) & 0xFFFFFFFF, process]).generate_state(1)[0]
    return int(mixed)


def agree(value: Any) -> Any:
    """Process 0's ``value`` on every host (a pytree of arrays / numbers / strings).

    Strings and lists of strings (corpus documents, memory entries) are sent as UTF-8
    bytes padded to one length; other leaves go through
    ``multihost_utils.broadcast_one_to_all``. One host: returns ``value`` unchanged.
    """
    import jax

    if jax.process_count() == 1:
        return value
    if isinstance(value, str):
        return _agree_strings([value])[0]
    if isinstance(value, list | tuple) and value and all(isinstance(v, str) for v in value):
        return type(value)(_agree_strings(list(value)))
    from jax.experimental import multihost_utils

    return multihost_utils.broadcast_one_to_all(value)


def agree_json(value: Any) -> Any:
    """Process 0's JSON-able ``value`` (nested dicts / lists / strings / numbers) on every
    host, sent as one UTF-8 string whatever its shape, so hosts whose local values differ
    in structure (one host's memory is empty, another's is not) still make the same
    collective calls. JSON turns tuples into lists. One host: ``value`` itself, untouched.
    """
    import jax

    if jax.process_count() == 1:
        return value
    return json.loads(agree(json.dumps(value)))


def agree_bytes(data: bytes) -> bytes:
    """Process 0's ``data`` on every host (a small file, e.g. a tokenizer model), sent as
    one base64 string. One host: ``data`` itself."""
    import jax

    if not isinstance(data, bytes | bytearray):
        raise TypeError(f"agree_bytes takes bytes, got {type(data).__name__}")
    if jax.process_count() == 1:
        return bytes(data)
    return base64.b64decode(agree(base64.b64encode(data).decode("ascii")))


def failing_hosts(failed: bool) -> list[int]:
    """The processes whose ``failed`` is True, known on every host (an all-gather).

    For a host that cannot follow process 0's decision: rather than raise alone and leave
    the others waiting in the next collective, every host calls this with its own flag
    and all raise together. A collective: every host calls it at the same point. One
    host: ``[0]`` or ``[]``, with no communication.
    """
    import jax

    if jax.process_count() == 1:
        return [0] if failed else []
    from jax.experimental import multihost_utils

    flags = np.asarray(multihost_utils.process_allgather(np.int32(bool(failed)))).reshape(-1)
    return [int(i) for i in np.flatnonzero(flags)]


def all_gather_json(value: Any) -> list[Any]:
    """Every process's JSON-able ``value``, in process order, on every host (one
    all-gather of UTF-8 bytes; e.g. each host's share of the episodes' env outcomes). A
    collective: every host calls it at the same point, each with its own value. One host:
    ``[value]``, untouched."""
    import jax

    if jax.process_count() == 1:
        return [value]
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(value).encode("utf-8"), np.uint8)
    lengths = np.asarray(multihost_utils.process_allgather(np.int64(len(data)))).reshape(-1)
    # Pad to a power of two so a run's messages reuse a few compiled gathers.
    width = max(64, 1 << (int(lengths.max()) - 1).bit_length())
    buffer = np.zeros((width,), np.uint8)
    buffer[:len(data)] = data
    rows = np.asarray(multihost_utils.process_allgather(buffer)).reshape(len(lengths), width)
    return [json.loads(bytes(row[:n]).decode("utf-8")) for row, n in zip(rows, lengths, strict=True)]


def _agree_strings(values: list[str]) -> list[str]:
    from jax.experimental import multihost_utils

    encoded = [v.encode("utf-8") for v in values]
    # Every host must call the collective with the same shape: agree on the sizes first.
    count = int(multihost_utils.broadcast_one_to_all(np.int64(len(encoded))))
    width = int(multihost_utils.broadcast_one_to_all(
        np.int64(max((len(e) for e in encoded), default=0))))
    # Each new buffer shape compiles a new broadcast (~0.2 s on CPU): pad the width to a
    # power of two so a run's per-round messages reuse a few compiled programs.
    width = max(64, 1 << (width - 1).bit_length())
    buffer = np.zeros((count, width), np.uint8)
    lengths = np.zeros((count,), np.int64)
    for i, e in enumerate(encoded[:count]):
        buffer[i, :len(e)] = np.frombuffer(e, np.uint8)[:width]
        lengths[i] = len(e)
    buffer, lengths = multihost_utils.broadcast_one_to_all((buffer, lengths))
    return [bytes(np.asarray(row[:n])).decode("utf-8") for row, n in zip(buffer, lengths, strict=True)]
