"""Test-wide setup: 8 simulated CPU devices for the sharded tests.

The flag must be set before JAX initialises its backend, hence here and not in a fixture.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
