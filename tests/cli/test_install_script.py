"""`scripts/install.sh` on a machine whose default Python is too old (the TPU images'
Ubuntu 22.04: python3 is 3.10, no `python`), run against fake interpreters and tools on a
PATH of its own (no network, nothing installed): it picks a 3.11+ interpreter, makes the
virtual environment with it (or with uv when there is none), installs the project and
jax[tpu] in one pip call pinned by the constraints file, and stops when bubblewrap is
missing. The constraints file pins what pyproject asks for."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "install.sh"
TOOLS = ("dirname", "id", "mkdir", "cat", "chmod", "cp")  # what the script and fakes use

# A fake interpreter: answers the script's version / venv probes from its own name's
# version, makes a venv (a copy of itself renamed), and logs pip and import calls.
FAKE_PYTHON = """#!/bin/sh
VERSION={version}
LOG={log}
case "$*" in
  *version_info*) [ "$VERSION" -ge 311 ] && exit 0 || exit 1 ;;
  *ensurepip*) [ -z "{no_venv}" ] && exit 0 || exit 1 ;;
  "-m venv "*) mkdir -p "$3/bin"; cp "$0" "$3/bin/python"; echo "venv $0 $3" >> "$LOG"; exit 0 ;;
  "-m pip "*) echo "pip $0 $*" >> "$LOG"; exit 0 ;;
  *"import pyseccomp"*) echo "check $0" >> "$LOG"; exit 0 ;;
  *"sys.version"*) echo "3.${{VERSION#3}}.0"; exit 0 ;;
esac
echo "unexpected call: $0 $*" >> "$LOG"; exit 3
"""
FAKE_UV = """#!/bin/sh
echo "uv $*" >> {log}
dir=$(for a in "$@"; do :; done; echo "$a")
mkdir -p "$dir/bin"; cp {venv_python} "$dir/bin/python"
"""


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


@pytest.fixture
def machine(tmp_path):
    """A bin dir holding only the basic tools; tests add fake interpreters to it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in TOOLS:
        os.symlink(shutil.which(tool), bin_dir / tool)
    _executable(bin_dir / "bwrap", "#!/bin/sh\nexit 0\n")
    log = tmp_path / "calls.log"
    log.touch()

    def add_python(name: str, version: int, no_venv: bool = False) -> Path:
        path = bin_dir / name
        _executable(path, FAKE_PYTHON.format(version=version, log=log,
                                             no_venv="1" if no_venv else ""))
        return path

    def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(["/bin/bash", str(SCRIPT), *args], capture_output=True, text=True,
                              env={"PATH": str(bin_dir), **(env or {})}, timeout=60)

    return bin_dir, log, add_python, run


def test_the_default_python3_is_used_when_it_is_new_enough(machine):
    _, _, add_python, run = machine
    default = add_python("python3", 312)
    add_python("python3.11", 311)
    out = run("--print-python")
    assert out.returncode == 0 and out.stdout.strip() == str(default)


def test_a_310_default_makes_it_choose_a_versioned_311_plus(machine):
    _, _, add_python, run = machine
    add_python("python3", 310)  # the v5p / v6e image's interpreter, and no `python`
    newer = add_python("python3.12", 312)
    out = run("--print-python")
    assert out.returncode == 0 and out.stdout.strip() == str(newer), out.stderr
    # Only a 3.10 on PATH: nothing to choose.
    (newer).unlink()
    out = run("--print-python")
    assert out.returncode == 1 and "no Python 3.11+" in out.stderr


def test_a_311_without_venv_support_is_skipped_for_a_venv(machine):
    _, _, add_python, run = machine
    add_python("python3", 310)
    add_python("python3.11", 311, no_venv=True)  # Debian's python3.11 without python3.11-venv
    good = add_python("python3.12", 312)
    out = run("--print-python", "--venv", "/tmp/unused")
    assert out.stdout.strip() == str(good) and "cannot make a virtual environment" in out.stderr


def test_tpu_install_makes_the_venv_and_installs_in_one_pinned_resolution(machine, tmp_path):
    _, log, add_python, run = machine
    add_python("python3", 310)
    chosen = add_python("python3.11", 311)
    venv = tmp_path / "venv"
    out = run("--tpu", "--venv", str(venv))
    assert out.returncode == 0, out.stderr
    calls = log.read_text().splitlines()
    assert calls[0] == f"venv {chosen} {venv}"
    pips = [c for c in calls if c.startswith("pip ")]
    assert all(c.startswith(f"pip {venv}/bin/python ") for c in pips)
    install = [c for c in pips if "-e" in c.split()]
    assert len(install) == 1  # the project and jax[tpu]: one resolution
    assert install[0].endswith("-c scripts/constraints-tpu.txt -e .[tpu]")
    assert calls[-1] == f"check {venv}/bin/python"  # pyseccomp importable from the venv


def test_no_311_anywhere_falls_back_to_uv(machine, tmp_path):
    bin_dir, log, add_python, run = machine
    add_python("python3", 310)
    template = add_python("venv-python", 311)  # what uv's venv holds
    _executable(bin_dir / "uv", FAKE_UV.format(log=log, venv_python=template))
    venv = tmp_path / "venv"
    out = run("--tpu", "--venv", str(venv))  # no apt-get on this PATH
    assert out.returncode == 0, out.stderr
    calls = log.read_text().splitlines()
    assert calls[0] == f"uv venv --seed --python 3.11 {venv}"
    assert any(c.startswith(f"pip {venv}/bin/python ") and c.endswith("-e .[tpu]") for c in calls)


def test_no_311_and_no_way_to_get_one_is_an_error_naming_the_ways(machine, tmp_path):
    _, _, add_python, run = machine
    add_python("python3", 310)
    out = run("--tpu", "--venv", str(tmp_path / "venv"))
    assert out.returncode == 1
    assert "no Python 3.11+ found" in out.stderr and "python3.11-venv" in out.stderr
    assert "uv venv --python 3.11" in out.stderr and "SPADE_PYTHON" in out.stderr


def test_missing_bubblewrap_is_an_error_not_a_warning(machine, tmp_path):
    bin_dir, log, add_python, run = machine
    (bin_dir / "bwrap").unlink()  # and no apt-get to install it
    add_python("python3", 311)
    out = run("--tpu", "--venv", str(tmp_path / "venv"))
    assert out.returncode == 1 and "error: bubblewrap (bwrap) is not installed" in out.stderr
    assert log.read_text() == ""  # stopped before making anything
    out = run("--tpu", "--venv", str(tmp_path / "venv"), "--without-bwrap")
    assert out.returncode == 0 and "runs need --allow_weak_sandbox" in out.stderr


def test_the_constraints_pin_every_dependency_and_the_tpu_runtime():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = dict(line.split("==") for line in
                (REPO / "scripts" / "constraints-tpu.txt").read_text().splitlines()
                if line and not line.startswith("#"))

    def key(requirement: str) -> str:
        name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1)
        return re.sub(r"[-_.]+", "-", name).lower()

    assert project["optional-dependencies"]["tpu"] == ["jax[tpu]==0.10.2"]
    assert pins["jax"] == pins["jaxlib"] == "0.10.2"
    # The libtpu jax[tpu] 0.10.2 pins is the one the aot extra compiles with.
    assert project["optional-dependencies"]["aot"] == [f"libtpu=={pins['libtpu']}"]
    assert {key(r) for r in project["dependencies"]} <= set(pins)
