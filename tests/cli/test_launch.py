"""launch/tpu.py: the --dry_run of every subcommand prints the exact gcloud commands."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "launch" / "tpu.py"
SLICE = ["--name=spade30b", "--zone=us-east5-a", "--accelerator=v5p-64", "--dry_run"]


def dry_run(*args: str) -> list[list[str]]:
    out = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                         timeout=60, check=True)
    return [shlex.split(line) for line in out.stdout.splitlines()]


def test_create_uses_a_queued_resource_of_the_slice():
    create, describe = dry_run("create", *SLICE)
    assert create[:5] == ["gcloud", "compute", "tpus", "queued-resources", "create"]
    assert "--accelerator-type=v5p-64" in create and "--node-id=spade30b" in create
    assert "--runtime-version=v2-alpha-tpuv5" in create
    assert describe[3:5] == ["queued-resources", "describe"]
    (direct,) = dry_run("create", *SLICE, "--no-queued")
    assert direct[3:5] == ["tpu-vm", "create"] and "--version=v2-alpha-tpuv5" in direct


def test_install_copies_to_and_installs_on_every_worker():
    archive, scp, ssh = dry_run("install", *SLICE)
    assert archive[:2] == ["git", "archive"]
    assert scp[3:5] == ["tpu-vm", "scp"] and "--worker=all" in scp
    assert ssh[3:5] == ["tpu-vm", "ssh"] and "--worker=all" in ssh
    assert "scripts/install.sh" in ssh[-1]


def test_run_starts_the_same_train_command_on_all_workers():
    args = ["--experiment=qwen3_30b_a3b", "--workdir=gs://b/runs/x", "--set", "spade.rounds=5"]
    (ssh,) = dry_run("run", *SLICE, "--", *args)
    assert ssh[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "spade30b"]
    assert "--worker=all" in ssh
    remote = ssh[-1].removeprefix("--command=")
    assert "nohup python -m spade_jax.train " + " ".join(args) in remote


def test_tail_and_stop():
    (tail,) = dry_run("tail", *SLICE, "--worker=3")
    assert "--worker=3" in tail and "tail" in tail[-1]
    kill, delete = dry_run("stop", *SLICE, "--delete")
    assert "--worker=all" in kill and "spade_jax.train" in kill[-1]
    assert delete[3:5] == ["queued-resources", "delete"]


@pytest.mark.parametrize("args, message", [
    (["create", "--name=Bad_Name", "--zone=z", "--dry_run"], "name must be"),
    (["create", "--name=ok", "--zone=z", "--accelerator=v9x-8", "--dry_run"], "accelerator"),
    (["run", "--name=ok", "--zone=z", "--dry_run"], "trainer's arguments"),
])
def test_bad_input_is_named(args, message):
    out = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and message in out.stderr
