"""launch/tpu.py as a user runs it: the --dry_run of every subcommand prints the exact gcloud
commands (checked against Google's documented forms in docs/scale_out.md); run for real
against a fake gcloud, create waits for the slice, resume deletes / recreates / installs /
reruns; install refuses a dirty tree; the worker script stops a trainer with SIGTERM and
waits for it."""

from __future__ import annotations

import importlib.util
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "launch" / "tpu.py"
WORKER_SCRIPT = ROOT / "scripts" / "tpu_worker.sh"
SLICE = ["--name=spade30b", "--zone=us-east5-a", "--accelerator=v5p-64", "--dry_run"]
TRAIN = ["--experiment=qwen3_30b_a3b", "--hf_checkpoint=gs://b/ckpt/q30b",
         "--workdir=gs://b/runs/x", "--set", "spade.rounds=5"]


def _module():
    spec = importlib.util.spec_from_file_location("launch_tpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


def dry_run(*args: str) -> list[list[str]]:
    out = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                         timeout=60, check=True)
    return [shlex.split(line, comments=True) for line in out.stdout.splitlines()
            if not line.startswith("#")]


def test_create_a_queued_resource_and_wait_until_active_and_ready():
    create, queued, ready = dry_run("create", *SLICE, "--spot",
                                    "--service_account=spade@p.iam.gserviceaccount.com")
    assert create[:5] == ["gcloud", "compute", "tpus", "queued-resources", "create"]
    assert {"--accelerator-type=v5p-64", "--node-id=spade30b", "--runtime-version=v2-alpha-tpuv5",
            "--spot", "--service-account=spade@p.iam.gserviceaccount.com",
            "--scopes=https://www.googleapis.com/auth/cloud-platform"} <= set(create)
    assert queued[3:5] == ["queued-resources", "describe"] and "--format=value(state.state)" in queued
    assert ready[3:5] == ["tpu-vm", "describe"] and "--format=value(state)" in ready
    direct, ready = dry_run("create", *SLICE, "--no-queued", "--accelerator=v6e-16")
    assert direct[3:5] == ["tpu-vm", "create"] and "--version=v2-alpha-tpuv6e" in direct
    assert ready[3:5] == ["tpu-vm", "describe"]
    (only,) = dry_run("create", *SLICE, "--no-wait")
    assert only[3:5] == ["queued-resources", "create"]


@pytest.mark.parametrize("accelerator, version", [
    ("v4-32", "tpu-ubuntu2204-base"), ("v5litepod-16", "v2-alpha-tpuv5-lite"),
    ("v5p-64", "v2-alpha-tpuv5"), ("v6e-8", "v2-alpha-tpuv6e")])
def test_each_generation_gets_its_tpu_software_version(accelerator, version):
    create = dry_run("create", *SLICE, f"--accelerator={accelerator}", "--no-wait")[0]
    assert f"--runtime-version={version}" in create


def test_install_ships_the_checkout_and_runs_the_tpu_install_on_every_worker():
    scp, ssh = dry_run("install", *SLICE, "--source=worktree")  # the tree as it is on disk
    assert scp[3:5] == ["tpu-vm", "scp"] and "--worker=all" in scp
    assert ssh[3:5] == ["tpu-vm", "ssh"] and "--worker=all" in ssh
    assert "bash scripts/install.sh --tpu --venv ~/spade_jax/venv" in ssh[-1]


def test_install_refuses_a_dirty_tree_unless_told_to_ship_it(tmp_path, monkeypatch):
    launch = _module()
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (repo / "a.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "a.py"], check=True)
    subprocess.run([*git, "commit", "-qm", "a"], check=True)
    monkeypatch.setattr(launch, "REPO", repo)
    config = launch.SliceConfig(name="s", zone="z")
    assert launch.install_commands(config)[0].argv[:2] == ("git", "archive")  # clean: HEAD
    (repo / "a.py").write_text("x = 2\n")  # an uncommitted edit
    (repo / "new.py").write_text("y = 1\n")  # an untracked file
    with pytest.raises(ValueError, match=r"uncommitted changes \(a.py, new.py\)"):
        launch.install_commands(config)
    assert launch.install_commands(config, "worktree")[0].local == "worktree"
    out = tmp_path / "src.tar.gz"
    launch._pack_worktree(str(out))  # noqa: SLF001 (what --source=worktree ships)
    import tarfile

    with tarfile.open(out) as tar:
        assert sorted(tar.getnames()) == ["a.py", "new.py"]
        assert tar.extractfile("a.py").read() == b"x = 2\n"


def test_run_starts_the_trainer_through_the_worker_script_on_all_workers():
    (ssh,) = dry_run("run", *SLICE, "--env", "HF_HUB_OFFLINE=1", "--", *TRAIN)
    assert ssh[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "spade30b"]
    assert "--worker=all" in ssh
    remote = shlex.split(ssh[-1].removeprefix("--command="))
    assert remote[:3] == ["bash", "~/spade_jax/src/scripts/tpu_worker.sh", "start"]
    assert remote[3:] == ["HF_HUB_OFFLINE=1", "--", *TRAIN]


def test_run_warns_about_paths_that_live_on_one_worker():
    out = subprocess.run([sys.executable, str(SCRIPT), "run", *SLICE, "--",
                          "--hf_checkpoint=/ckpt/q", "--workdir=runs/x"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    assert "--hf_checkpoint=/ckpt/q must exist on every worker" in out.stderr
    assert "--workdir=runs/x is on each worker's own disk" in out.stderr


def test_tail_and_stop():
    (tail,) = dry_run("tail", *SLICE, "--worker=3")
    assert "--worker=3" in tail and "tail" in tail[-1]
    stop, delete = dry_run("stop", *SLICE, "--delete", "--stop_timeout_s=900")
    assert "--worker=all" in stop and stop[-1].endswith("tpu_worker.sh stop 900")
    assert delete[3:5] == ["queued-resources", "delete"] and "--force" in delete


def test_resume_deletes_recreates_installs_and_reruns_against_the_same_bucket():
    steps = dry_run("resume", *SLICE, "--spot", "--source=worktree", "--", *TRAIN)
    verbs = [step[3:5] for step in steps]
    assert verbs == [["queued-resources", "delete"], ["queued-resources", "create"],
                     ["queued-resources", "describe"], ["tpu-vm", "describe"],
                     ["tpu-vm", "scp"], ["tpu-vm", "ssh"], ["tpu-vm", "ssh"]]
    assert "--spot" in steps[1] and steps[-1][-1].endswith(shlex.join(["--", *TRAIN]))


@pytest.mark.parametrize("args, message", [
    (["create", "--name=Bad_Name", "--zone=z", "--dry_run"], "name must be"),
    (["create", "--name=ok", "--zone=z", "--accelerator=v9x-8", "--dry_run"], "accelerator"),
    (["create", "--name=ok", "--zone=z", "--service_account=me", "--dry_run"], "an email"),
    (["run", "--name=ok", "--zone=z", "--dry_run"], "trainer's arguments"),
    (["run", "--name=ok", "--zone=z", "--dry_run", "--", "--experiment=x"], "needs --workdir"),
    (["run", "--name=ok", "--zone=z", "--env=1X=2", "--dry_run", "--", "--workdir=gs://b"],
     "KEY=VALUE"),
    (["resume", "--name=ok", "--zone=z", "--dry_run", "--", "--workdir=runs/x"],
     "--workdir must be gs://"),
    (["stop", "--name=ok", "--zone=z", "--stop_timeout_s=0", "--dry_run"], "stop_timeout_s"),
])
def test_bad_input_is_named(args, message):
    out = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and message in out.stderr


# ---- for real, against a fake gcloud ---------------------------------------------------------

FAKE_GCLOUD = """#!/bin/sh
echo "$*" >> {log}
case "$*" in
  *"queued-resources delete"*) echo "NOT_FOUND" >&2; exit 1 ;;
  *"queued-resources describe"*)
    n=$(grep -c "queued-resources describe" {log})
    [ "$n" -lt 3 ] && echo WAITING_FOR_RESOURCES || echo ACTIVE ;;
  *"tpu-vm describe"*)
    n=$(grep -c "tpu-vm describe" {log})
    [ "$n" -lt 2 ] && echo CREATING || echo READY ;;
esac
exit 0
"""


def test_resume_for_real_tolerates_a_missing_slice_and_waits_for_it(tmp_path, monkeypatch, capsys):
    launch = _module()
    log = tmp_path / "gcloud.log"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "gcloud").write_text(FAKE_GCLOUD.format(log=log))
    (bin_dir / "gcloud").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(launch, "POLL_S", 0)
    monkeypatch.setattr(launch, "TARBALL", str(tmp_path / "src.tar.gz"))
    args = ["resume", "--name=spade30b", "--zone=z", "--spot", "--source=worktree", "--", *TRAIN]
    assert launch.main(args) == 0
    calls = log.read_text().splitlines()
    assert calls[0].startswith("compute tpus queued-resources delete")  # failed: NOT_FOUND
    assert sum("queued-resources describe" in c for c in calls) == 3  # waited for ACTIVE
    assert sum("tpu-vm describe" in c for c in calls) == 2  # then for READY
    assert "tpu_worker.sh start" in calls[-1]
    assert (tmp_path / "src.tar.gz").stat().st_size > 0
    assert "state: WAITING_FOR_RESOURCES" in capsys.readouterr().out


# ---- the worker script, on this machine --------------------------------------------------------

# A stand-in trainer: `python -m spade_jax.train ...` that saves on SIGTERM (and not on
# SIGINT), taking a moment, then exits.
FAKE_TRAINER = """#!/bin/bash
trap 'echo "got SIGTERM, saving"; sleep 1; echo saved; exit 0' TERM
trap 'echo "got SIGINT"' INT
echo "args: $*"
echo "distributed: $SPADE_JAX_DISTRIBUTED extra: $EXTRA"
while true; do sleep 0.1; done
"""


@pytest.fixture
def worker(tmp_path):
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").write_text(FAKE_TRAINER)
    (venv / "python").chmod(0o755)
    marker = f"--workdir={tmp_path}/run"  # matches this test's trainer only
    env = {**os.environ, "SPADE_VENV": str(venv.parent), "SPADE_LOG": str(tmp_path / "log"),
           "SPADE_TPU_LOCKFILE": str(tmp_path / "libtpu_lockfile"),
           # This machine's processes hold no TPU; never let the test kill one that holds
           # some other VFIO device.
           "SPADE_TPU_DEVICE_REGEX": f"^{tmp_path}/no-such-device$",
           "SPADE_TRAINER_PATTERN": f"[s]pade_jax[.]train {marker}"}

    def call(*args: str, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(WORKER_SCRIPT), *args], capture_output=True,
                              text=True, env={**env, **extra}, timeout=120)

    yield call, marker, tmp_path
    call("stop", "5")


def test_worker_script_starts_once_and_stop_saves_with_sigterm(worker):
    call, marker, tmp_path = worker
    (tmp_path / "libtpu_lockfile").touch()  # a crashed run's lock
    started = call("start", "EXTRA=1", "--", marker, "--experiment=tiny")
    assert started.returncode == 0, started.stderr
    assert not (tmp_path / "libtpu_lockfile").exists()
    log = tmp_path / "log"
    deadline = time.monotonic() + 30
    while "distributed" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert f"args: -m spade_jax.train {marker} --experiment=tiny" in log.read_text()
    assert "distributed: 1 extra: 1" in log.read_text()
    assert "running on" in call("status").stdout
    again = call("start", "--", marker)
    assert again.returncode == 1 and "already running" in again.stderr
    stopped = call("stop", "60")
    assert stopped.returncode == 0 and "stopped" in stopped.stdout
    assert "got SIGTERM, saving\nsaved" in log.read_text() and "SIGINT" not in log.read_text()
    assert "not running" in call("status").stdout


def test_worker_stop_reports_a_trainer_that_does_not_exit(worker):
    call, marker, tmp_path = worker
    stubborn = subprocess.Popen(["bash", "-c", "trap '' TERM; while true; do sleep 0.1; done",
                                 "spade_jax.train", marker], start_new_session=True)
    try:
        time.sleep(0.2)
        out = call("stop", "2")
        assert out.returncode == 1 and "still running" in out.stderr
    finally:
        os.killpg(stubborn.pid, signal.SIGKILL)
        stubborn.wait()


def test_worker_clear_kills_a_stale_process_holding_the_chip(worker):
    call, _, tmp_path = worker
    chip = tmp_path / "vfio0"  # stands in for /dev/vfio/0
    chip.touch()
    holder = subprocess.Popen(["bash", "-c", f"exec 3<{chip}; while true; do sleep 0.1; done"])
    try:
        time.sleep(0.2)
        out = call("clear", SPADE_TPU_DEVICE_REGEX=f"^{chip}$")
        assert out.returncode == 0 and "stale TPU holders on" in out.stderr
        assert holder.wait(timeout=30) == -signal.SIGKILL
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
