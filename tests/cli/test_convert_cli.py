"""`python -m spade_jax.convert` round trip HF -> Orbax -> HF, and its errors, as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import tiny_hf
from xla_test_flags import jax_flags

from spade_jax.models.safetensors_io import TensorIndex

# Each test starts JAX subprocesses (~30-40 s loaded).
pytestmark = pytest.mark.slow


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": jax_flags()}
    return subprocess.run([sys.executable, "-m", "spade_jax.convert", *args],
                          capture_output=True, text=True, env=env, timeout=300)


def test_convert_cli_round_trip(tmp_path):
    hf_dir, orbax_dir, back = tmp_path / "hf", tmp_path / "orbax", tmp_path / "back"
    tiny_hf.make_hf_model("moe", hf_dir, num_hidden_layers=3, mlp_only_layers=[1])
    r = _run(f"--hf_dir={hf_dir}", f"--out_dir={orbax_dir}")
    assert r.returncode == 0, r.stderr
    assert (orbax_dir / "config.json").exists() and (orbax_dir / "params").is_dir()
    r = _run("--to_hf", f"--orbax_dir={orbax_dir}", f"--out_dir={back}")
    assert r.returncode == 0, r.stderr
    a, b = TensorIndex(hf_dir), TensorIndex(back)
    assert a.names() == b.names()
    for name in a.names():
        assert np.array_equal(a.get(name), b.get(name)), name


def test_convert_cli_errors_are_clear(tmp_path):
    r = _run(f"--hf_dir={tmp_path / 'missing'}", f"--out_dir={tmp_path / 'o'}")
    assert r.returncode == 1 and "does not exist" in r.stderr
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{not json")
    r = _run(f"--hf_dir={tmp_path / 'empty'}", f"--out_dir={tmp_path / 'o'}")
    assert r.returncode == 1 and "config.json" in r.stderr
    r = _run("--to_hf", f"--orbax_dir={tmp_path / 'empty'}", f"--out_dir={tmp_path / 'o2'}")
    assert r.returncode == 1 and "not an Orbax model checkpoint" in r.stderr
    r = _run("--to_hf", f"--out_dir={tmp_path / 'o3'}")
    assert r.returncode != 0 and "--orbax_dir" in r.stderr
