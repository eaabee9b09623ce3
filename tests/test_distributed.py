"""Whether a process joins a multi-host job (``distributed.decide``), on each kind of
machine it runs on: a plain TPU VM slice (no environment variable names the other workers;
the metadata server does), GKE (``TPU_WORKER_HOSTNAMES``), a CPU multi-process job
(``JAX_COORDINATOR_ADDRESS``...) and a single host. The PCI probe and the metadata server
are faked (a fake sysfs tree, a metadata server on loopback): nothing leaves this machine.
"""

from __future__ import annotations

import http.server
import threading
from pathlib import Path

import pytest

from spade_jax import distributed

V5P_WORKERS = "10.130.0.2,10.130.0.3,10.130.0.4,10.130.0.5"


def _metadata(values: dict[str, str]):
    asked: list[str] = []

    def fetch(key: str) -> str | None:
        asked.append(key)
        return values.get(key)

    return fetch, asked


def test_plain_tpu_vm_slice_initialises_from_the_metadata_worker_list():
    fetch, asked = _metadata({"worker-network-endpoints": V5P_WORKERS})
    decision = distributed.decide({}, tpu_chips=4, metadata=fetch)
    assert (decision.source, decision.initialize) == ("tpu_vm", True)
    assert "4 workers" in decision.reason and asked == ["worker-network-endpoints"]
    # A one-host slice (v5p-8) lists one worker: no distributed system to join.
    fetch, _ = _metadata({"worker-network-endpoints": "10.130.0.2"})
    assert distributed.decide({}, tpu_chips=4, metadata=fetch).initialize is False
    # Metadata unreadable on a TPU host: stays single and says how to force it.
    fetch, _ = _metadata({})
    decision = distributed.decide({}, tpu_chips=4, metadata=fetch)
    assert decision.initialize is False and "SPADE_JAX_DISTRIBUTED=1" in decision.reason


def test_the_launchers_switch_decides_without_the_metadata():
    fetch, asked = _metadata({"worker-network-endpoints": V5P_WORKERS})
    on = distributed.decide({"SPADE_JAX_DISTRIBUTED": "1"}, tpu_chips=0, metadata=fetch)
    assert (on.source, on.initialize) == ("launcher", True) and asked == []
    off = distributed.decide({"SPADE_JAX_DISTRIBUTED": "0", "TPU_WORKER_HOSTNAMES": "a,b"},
                             tpu_chips=4, metadata=fetch)
    assert (off.source, off.initialize) == ("off", False) and asked == []
    with pytest.raises(ValueError, match="SPADE_JAX_DISTRIBUTED must be 1 or 0"):
        distributed.decide({"SPADE_JAX_DISTRIBUTED": "maybe"})


def test_gke_worker_list():
    fetch, asked = _metadata({})
    two = distributed.decide({"TPU_WORKER_HOSTNAMES": "w-0.svc,w-1.svc"}, tpu_chips=4,
                             metadata=fetch)
    assert (two.source, two.initialize) == ("gke", True)
    one = distributed.decide({"TPU_WORKER_HOSTNAMES": "w-0.svc"}, tpu_chips=4, metadata=fetch)
    assert (one.source, one.initialize) == ("gke", False)
    newer = distributed.decide({"TPU_PROCESS_ADDRESSES": "a:8471,b:8471,c:8471"},
                               tpu_chips=4, metadata=fetch)
    assert newer.initialize and "3 hosts" in newer.reason
    assert asked == []  # the environment decided
    multislice = distributed.decide({"MEGASCALE_COORDINATOR_ADDRESS": "h0"}, tpu_chips=4,
                                    metadata=fetch)
    assert (multislice.source, multislice.initialize) == ("multislice", True)


def test_cpu_multi_process_job():
    explicit = {"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1234", "JAX_NUM_PROCESSES": "2",
                "JAX_PROCESS_ID": "1"}
    decision = distributed.decide(explicit, tpu_chips=0)
    assert (decision.source, decision.initialize) == ("explicit", True)
    assert distributed.DistributedConfig.from_env(explicit) == distributed.DistributedConfig(
        "127.0.0.1:1234", 2, 1)
    alone = distributed.decide({**explicit, "JAX_NUM_PROCESSES": "1", "JAX_PROCESS_ID": "0"},
                               tpu_chips=0)
    assert alone.initialize is False
    with pytest.raises(ValueError, match="JAX_PROCESS_ID"):
        distributed.DistributedConfig.from_env({"JAX_COORDINATOR_ADDRESS": "h:1",
                                                "JAX_NUM_PROCESSES": "2"})
    with pytest.raises(ValueError, match="process_id"):
        distributed.DistributedConfig("h:1", 2, 2)


def test_single_host_without_tpu_never_asks_the_metadata_server():
    fetch, asked = _metadata({"worker-network-endpoints": V5P_WORKERS})
    decision = distributed.decide({}, tpu_chips=0, metadata=fetch)
    assert (decision.source, decision.initialize) == ("single", False) and asked == []
    assert distributed.is_multihost({}) is False  # this machine: no TPU, no variables
    assert distributed.maybe_initialize({}) is False


def test_tpu_chips_are_counted_from_pci_vendor_and_device(tmp_path: Path):
    def device(name: str, vendor: str, dev: str) -> None:
        (tmp_path / name).mkdir()
        (tmp_path / name / "vendor").write_text(vendor + "\n")
        (tmp_path / name / "device").write_text(dev + "\n")

    for i in range(4):
        device(f"0000:00:0{i + 4}.0", "0x1ae0", "0x0062")  # v5p chips
    device("0000:00:01.0", "0x1ae0", "0x0001")  # another Google device (not a TPU)
    device("0000:00:02.0", "0x8086", "0x0062")  # another vendor
    assert distributed.tpu_chip_count(str(tmp_path)) == 4
    assert distributed.tpu_chip_count(str(tmp_path / "missing")) == 0


def test_metadata_is_read_with_googles_header_from_the_server(monkeypatch):
    seen: list[tuple[str, str | None]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the stdlib's name)
            seen.append((self.path, self.headers.get("Metadata-Flavor")))
            if self.headers.get("Metadata-Flavor") != "Google":
                self.send_error(403)
                return
            if not self.path.endswith("/worker-network-endpoints"):
                self.send_error(404)
                return
            body = V5P_WORKERS.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        env = {"GCE_METADATA_IP": f"127.0.0.1:{server.server_port}"}
        assert distributed.tpu_metadata("worker-network-endpoints", env) == V5P_WORKERS
        assert distributed.tpu_metadata("agent-worker-number", env) is None  # 404
        decision = distributed.decide(env, tpu_chips=4)
        assert (decision.source, decision.initialize) == ("tpu_vm", True)
    finally:
        server.shutdown()
        server.server_close()
    assert seen[0] == ("/computeMetadata/v1/instance/attributes/worker-network-endpoints",
                       "Google")


def test_heartbeat_timeout_is_read_and_checked():
    assert distributed.heartbeat_timeout_s({}) == 100
    assert distributed.heartbeat_timeout_s({"SPADE_JAX_HEARTBEAT_TIMEOUT_S": "20"}) == 20
    for bad in ("0", "-3", "soon"):
        with pytest.raises(ValueError, match="SPADE_JAX_HEARTBEAT_TIMEOUT_S"):
            distributed.heartbeat_timeout_s({"SPADE_JAX_HEARTBEAT_TIMEOUT_S": bad})
