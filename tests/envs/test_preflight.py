"""The run's sandbox preflight (``envs.preflight``): each missing isolation layer is named
with how to provide it, and weak isolation needs an explicit flag. (The same check as a
non-root user, through the real command: ``tests/cli/test_sandbox_preflight.py``.)"""

from __future__ import annotations

import logging
import os

import pytest

from spade_jax.envs.isolation import IsolationLayer, IsolationReport
from spade_jax.envs.preflight import SandboxUnavailable, missing_layers, require_isolation


def _report(missing: set[str]) -> IsolationReport:
    names = ("process", "supervisor", "rlimits", "no_new_privs", "unprivileged_uid", "seccomp",
             "namespaces")
    return IsolationReport(tuple(IsolationLayer(n, n not in missing, "probe detail")
                                 for n in names) + (
        IsolationLayer("static_gate", False, "off", required=False),))


def test_a_complete_sandbox_passes():
    require_isolation(_report(set()), allow_weak=False)  # no error, nothing missing
    assert missing_layers(_report(set())) == []


def test_each_missing_layer_is_named_with_its_fix(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no bwrap on PATH
    with pytest.raises(SandboxUnavailable) as err:
        require_isolation(_report({"unprivileged_uid", "namespaces", "seccomp"}), allow_weak=False)
    text = str(err.value)
    assert "every program would be refused (weak_isolation)" in text
    assert "unprivileged_uid: the trainer must run as root" in text
    assert f"(it runs as uid {os.getuid()} now)" in text
    assert "namespaces: " in text and "sudo apt-get install -y bubblewrap" in text
    assert "seccomp: " in text and "pyseccomp" in text and "~/.local" in text
    assert "--allow_weak_sandbox" in text
    assert "static_gate" not in text  # not a required layer


def test_installed_bwrap_that_fails_gets_the_namespace_advice(monkeypatch, tmp_path):
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    [(name, fix)] = missing_layers(_report({"namespaces"}))
    assert name == "namespaces" and f"installed ({fake})" in fix and "user namespaces" in fix


def test_weak_isolation_runs_only_when_allowed_and_says_so(caplog):
    with caplog.at_level(logging.WARNING, logger="spade_jax.envs.preflight"):
        require_isolation(_report({"seccomp"}), allow_weak=True)
    assert "WITHOUT these isolation layers" in caplog.text and "seccomp" in caplog.text


def test_a_bwrap_that_cannot_build_the_sandbox_is_a_clear_error(tmp_path):
    """A host where bubblewrap is installed but fails (seen in a Firecracker VM: it could not
    remount its read-only binds) stops the pool with an error naming bwrap's complaint and
    the ways on, not a zygote traceback."""
    from spade_jax.envs import EnvPool, SandboxConfig

    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho \"bwrap: Can't remount readonly on /newroot/usr: "
                    "Invalid argument\" >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(SandboxUnavailable) as err:
        EnvPool(SandboxConfig(bwrap_path=str(fake)))
    message = str(err.value)
    assert str(fake) in message and "sandbox.use_namespaces=false" in message
    assert "--allow_weak_sandbox" in message and "Can't remount readonly" in message
