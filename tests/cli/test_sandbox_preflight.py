"""`python -m spade_jax.train` started as a non-root user (uid 65534 through ``setpriv``),
the way the ssh user of a TPU VM would start it: the sandbox cannot give its workers their
own uids there, so the run refuses to start with an error naming each missing layer and
its fix; with bubblewrap off PATH as well, the namespaces layer is named too. With
``--allow_weak_sandbox`` it gets past the check (and says so in its log).

This machine's interpreter lives under /root (mode 700), which uid 65534 cannot enter, so
the command runs in a private mount namespace where /root is a world-readable directory
holding only a bind of the interpreter's tree: the paths stay the same, nothing changes
outside the namespace. Needs root, ``unshare`` and ``setpriv`` (skipped otherwise).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534

pytestmark = [
    pytest.mark.slow,  # a JAX subprocess
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare")
                       or not shutil.which("setpriv"),
                       reason="needs root, unshare and setpriv to run a command as uid 65534"),
]


def _as_nobody(command: list[str], tmp_path: Path, path_var: str) -> list[str]:
    """``command`` as uid/gid 65534 with no supplementary groups and ``PATH=path_var``; if
    the interpreter sits under /root, seen through a world-readable /root (see above)."""
    home = tmp_path / "home"
    home.mkdir(mode=0o777)
    home.chmod(0o777)
    env = ["env", "-i", f"HOME={home}", f"PATH={path_var}", f"PYTHONPATH={REPO}",
           "JAX_PLATFORMS=cpu", "XLA_FLAGS=", "LANG=C.UTF-8"]
    drop = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *env,
            *command]
    prefix = os.path.realpath(sys.prefix)
    if not prefix.startswith("/root/"):
        return drop
    top = prefix.split("/")[2]  # e.g. ".pyenv"
    view = tmp_path / "rootview"
    (view / top).mkdir(parents=True)
    view.chmod(0o755)
    script = (f"mount --bind /root/{top} {view}/{top} && mount --rbind {view} /root && "
              f"cd {REPO} && exec " + " ".join(f"'{a}'" for a in drop))
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]


@pytest.fixture
def open_tmp():
    """A directory uid 65534 can reach (pytest's tmp_path sits under a root-only one)."""
    path = Path(tempfile.mkdtemp(prefix="spade_nobody_", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _train_command(workdir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "spade_jax.train", "--experiment=tiny",
            f"--workdir={workdir}", *extra]


def _workdir(tmp_path: Path) -> Path:
    runs = tmp_path / "runs"
    runs.mkdir(mode=0o777)
    runs.chmod(0o777)
    return runs / "tiny"


def test_a_non_root_run_refuses_to_start_and_names_what_is_missing(open_tmp):
    tmp_path = open_tmp
    workdir = _workdir(tmp_path)
    bin_dir = os.path.dirname(shutil.which("bwrap") or "/usr/bin/bwrap")
    out = subprocess.run(_as_nobody(_train_command(workdir), tmp_path, "/nonexistent"),
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "the sandbox cannot isolate designer programs" in out.stderr
    assert f"(it runs as uid {NOBODY} now)" in out.stderr and "start it with sudo" in out.stderr
    assert "`bwrap` is not on PATH" in out.stderr  # PATH without bubblewrap
    assert "--allow_weak_sandbox" in out.stderr
    log = (workdir / "train.log").read_text()
    assert "the sandbox cannot isolate" in log and "step 0 started" not in log
    assert not (workdir / "checkpoints").exists()
    # bubblewrap on PATH: only the uid layer is missing (namespaces work unprivileged).
    second = tmp_path / "second"
    second.mkdir()
    again = subprocess.run(_as_nobody(_train_command(workdir), second, bin_dir),
                           capture_output=True, text=True, timeout=300, cwd=REPO)
    assert again.returncode == 2, again.stderr[-3000:]
    assert "unprivileged_uid:" in again.stderr and "not on PATH" not in again.stderr


def test_the_explicit_flag_lets_a_non_root_run_start(open_tmp):
    tmp_path = open_tmp
    workdir = _workdir(tmp_path)
    command = _as_nobody(_train_command(workdir, "--allow_weak_sandbox"), tmp_path,
                         "/nonexistent")
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, cwd=REPO, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        log = workdir / "train.log"
        # Past the preflight once the policy is built (the next step after the pool).
        while not (log.exists() and "policy: " in log.read_text()):
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the run did not get past the sandbox check"
            time.sleep(0.5)
        text = log.read_text()
        assert "WITHOUT these isolation layers" in text and "unprivileged_uid" in text
        assert "the sandbox cannot isolate" not in text
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
