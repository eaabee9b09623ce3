"""Run spade_jax on a Cloud TPU VM slice: create, install, run, tail, stop, resume.

    python launch/tpu.py create  --name=spade30b --zone=us-east5-a --accelerator=v5p-64 [--spot]
    python launch/tpu.py install --name=spade30b --zone=us-east5-a
    python launch/tpu.py run     --name=spade30b --zone=us-east5-a -- \\
        --experiment=qwen3_30b_a3b --hf_checkpoint=gs://BUCKET/ckpt/Qwen3-30B-A3B-Instruct-2507 \\
        --corpus=gs://BUCKET/corpus/*.parquet --workdir=gs://BUCKET/runs/spade_30b
    python launch/tpu.py tail    --name=spade30b --zone=us-east5-a
    python launch/tpu.py stop    --name=spade30b --zone=us-east5-a [--delete]
    python launch/tpu.py resume  --name=spade30b --zone=us-east5-a --accelerator=v5p-64 --spot -- \\
        --experiment=qwen3_30b_a3b ... --workdir=gs://BUCKET/runs/spade_30b

Every subcommand takes ``--dry_run``: print the exact commands, run nothing (a line ending
in ``# ...`` says how the launcher repeats or tolerates it).

* create: a queued resource (``--queued``, the default; waits in Google's queue for
  capacity; ``--spot`` for spot capacity) or a plain TPU VM (``--no-queued``), with the
  generation's TPU software version, ``--service_account`` and ``--scopes``; then polls until
  the queued resource is ACTIVE and the TPU VM READY (``--no-wait``: return at once).
* install: ships this checkout (``git archive HEAD``; refused when the working tree has
  uncommitted changes, which it would silently drop, unless ``--source=worktree`` ships the
  tracked and untracked, non-ignored files as they are on disk) to every worker with
  ``scp --worker=all`` and runs ``scripts/install.sh --tpu --venv ~/spade_jax/venv`` there:
  a Python 3.11+ virtual environment (the images ship 3.10), the project and ``jax[tpu]`` in
  one pip resolution pinned by ``scripts/constraints-tpu.txt``, bubblewrap (required).
* run: on every worker, ``scripts/tpu_worker.sh start``: refuses if a trainer is already
  running, kills stale processes holding the TPU devices and removes
  ``/tmp/libtpu_lockfile``, then starts ``python -m spade_jax.train <args>`` as root (the
  sandbox needs root to give each designer-program worker its own uid), detached, with
  ``SPADE_JAX_DISTRIBUTED=1`` (every worker joins one ``jax.distributed`` job; JAX reads
  the workers from the TPU VM metadata); output to ``~/spade_jax.log``.
* tail: follows worker 0's log (``--worker=N`` for another host's).
* stop: SIGTERM to the trainer on every worker (it saves a checkpoint at its next safe
  point and exits), waits for it to exit (``--stop_timeout_s``), then (``--delete``)
  deletes the slice.
* resume: a spot slice cannot be restarted after a preemption, only deleted and recreated:
  deletes the queued resource / VM (if any), creates and waits, installs, and runs the same
  command against the same ``gs://`` workdir, which resumes from its newest checkpoint.

Only the Python standard library is used, so this runs on any workstation with gcloud.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import subprocess
import sys
import tarfile
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REMOTE_ROOT = "~/spade_jax"
REMOTE_SRC = f"{REMOTE_ROOT}/src"
REMOTE_VENV = f"{REMOTE_ROOT}/venv"
REMOTE_LOG = "~/spade_jax.log"
TARBALL = "/tmp/spade_jax_src.tar.gz"
WORKER = f"bash {REMOTE_SRC}/scripts/tpu_worker.sh"
# TPU software versions for JAX per generation (Cloud TPU docs, "TPU software versions").
RUNTIME_VERSIONS = {
    "v4": "tpu-ubuntu2204-base",
    "v5p": "v2-alpha-tpuv5",
    "v5litepod": "v2-alpha-tpuv5-lite",
    "v6e": "v2-alpha-tpuv6e",
}
CLOUD_PLATFORM = "https://www.googleapis.com/auth/cloud-platform"
POLL_S = 30


@dataclasses.dataclass(frozen=True)
class SliceConfig:
    """Where the run lives.

    Attributes:
      name: TPU VM / queued-resource name.
      zone: GCP zone, e.g. us-east5-a.
      project: GCP project (empty = gcloud's default).
      accelerator: slice type as gcloud spells it, e.g. v5p-64, v4-32, v5litepod-16, v6e-8.
      runtime_version: TPU software version (empty = the generation's default).
      queued: create through a queued resource (waits for capacity) instead of directly.
      spot: spot capacity (preemptible at any time; cannot be restarted, only recreated).
      service_account: the VMs' service account (empty = the project's default compute
        service account); it needs the bucket roles in docs/scale_out.md.
      scopes: OAuth scopes of that account on the VMs (IAM roles then decide access).
    """

    name: str
    zone: str
    project: str = ""
    accelerator: str = "v5p-64"
    runtime_version: str = ""
    queued: bool = True
    spot: bool = False
    service_account: str = ""
    scopes: str = CLOUD_PLATFORM

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("-", "").isalnum() or self.name != self.name.lower():
            raise ValueError(f"name must be lowercase letters, digits and '-', got {self.name!r}")
        if not self.zone:
            raise ValueError("zone is required, e.g. --zone=us-east5-a")
        generation, _, size = self.accelerator.rpartition("-")
        if generation not in RUNTIME_VERSIONS or not size.isdigit():
            raise ValueError(f"accelerator must be <generation>-<size> with generation in "
                             f"{sorted(RUNTIME_VERSIONS)}, got {self.accelerator!r}")
        if self.service_account and "@" not in self.service_account:
            raise ValueError("service_account must be an email, e.g. "
                             f"spade@PROJECT.iam.gserviceaccount.com, got {self.service_account!r}")

    @property
    def image(self) -> str:
        return self.runtime_version or RUNTIME_VERSIONS[self.accelerator.rpartition("-")[0]]


@dataclasses.dataclass(frozen=True)
class Step:
    """One command. ``until``: repeat it every ``POLL_S`` seconds until its output is one of
    these (a state); ``fail_on``: states that end the wait with an error; ``may_fail``: a
    non-zero exit is fine (deleting what may already be gone); ``local``: a Python action
    (``argv`` describes it) instead of a command."""

    argv: tuple[str, ...]
    until: tuple[str, ...] = ()
    fail_on: tuple[str, ...] = ()
    may_fail: bool = False
    local: str = ""

    def shown(self) -> str:
        note = (f"  # every {POLL_S} s until {' or '.join(self.until)}" if self.until else
                "  # may fail: already gone" if self.may_fail else "")
        return ("# " if self.local else "") + shlex.join(self.argv) + note


def _where(config: SliceConfig) -> list[str]:
    return [f"--zone={config.zone}"] + ([f"--project={config.project}"] if config.project else [])


def _ssh(config: SliceConfig, command: str, worker: str = "all") -> Step:
    return Step(("gcloud", "compute", "tpus", "tpu-vm", "ssh", config.name, *_where(config),
                 f"--worker={worker}", f"--command={command}"))


def create_commands(config: SliceConfig, wait: bool = True) -> list[Step]:
    identity = ([f"--service-account={config.service_account}"] if config.service_account
                else []) + ([f"--scopes={config.scopes}"] if config.scopes else [])
    spot = ["--spot"] if config.spot else []
    tpu_vm = ("gcloud", "compute", "tpus", "tpu-vm")
    ready = Step((*tpu_vm, "describe", config.name, *_where(config), "--format=value(state)"),
                 until=("READY",), fail_on=("PREEMPTED", "TERMINATED", "STOPPED"))
    if not config.queued:
        steps = [Step((*tpu_vm, "create", config.name, *_where(config),
                       f"--accelerator-type={config.accelerator}", f"--version={config.image}",
                       *spot, *identity))]
        return steps + ([ready] if wait else [])
    queued = ("gcloud", "compute", "tpus", "queued-resources")
    steps = [Step((*queued, "create", config.name, f"--node-id={config.name}", *_where(config),
                   f"--accelerator-type={config.accelerator}",
                   f"--runtime-version={config.image}", *spot, *identity))]
    if wait:
        steps += [Step((*queued, "describe", config.name, *_where(config),
                        "--format=value(state.state)"),
                       until=("ACTIVE",), fail_on=("FAILED", "SUSPENDING", "SUSPENDED")), ready]
    return steps


def dirty_paths(repo: Path | None = None) -> list[str]:
    """Uncommitted changes (modified, staged, untracked and not ignored) in ``repo`` (this
    checkout by default)."""
    out = subprocess.run(["git", "-C", str(repo or REPO), "status", "--porcelain"], check=True,
                         capture_output=True, text=True).stdout
    return [line[3:] for line in out.splitlines() if line.strip()]


def install_commands(config: SliceConfig, source: str = "head") -> list[Step]:
    if source == "head":
        dirty = dirty_paths()
        if dirty:
            shown = ", ".join(dirty[:8]) + (f" and {len(dirty) - 8} more" if len(dirty) > 8 else "")
            raise ValueError(f"the working tree has uncommitted changes ({shown}); `git archive "
                             "HEAD` would leave them out. Commit them, or pass "
                             "--source=worktree to ship the working tree as it is on disk")
        pack = Step(("git", "archive", "--format=tar.gz", f"--output={TARBALL}", "HEAD"))
    elif source == "worktree":
        pack = Step(("tar", "-czf", TARBALL, "$(git ls-files --cached --others --exclude-standard)"),
                    local="worktree")
    else:
        raise ValueError(f"source must be 'head' or 'worktree', got {source!r}")
    unpack = (f"rm -rf {REMOTE_SRC} && mkdir -p {REMOTE_SRC} && tar -xzf {TARBALL} -C "
              f"{REMOTE_SRC} && cd {REMOTE_SRC} && bash scripts/install.sh --tpu --venv {REMOTE_VENV}")
    return [pack,
            Step(("gcloud", "compute", "tpus", "tpu-vm", "scp", TARBALL, f"{config.name}:/tmp/",
                  *_where(config), "--worker=all")),
            _ssh(config, unpack)]


def _train_flag(train_args: Sequence[str], flag: str) -> str | None:
    for i, arg in enumerate(train_args):
        if arg.startswith(f"{flag}="):
            return arg.split("=", 1)[1]
        if arg == flag and i + 1 < len(train_args):
            return train_args[i + 1]
    return None


def run_commands(config: SliceConfig, train_args: Sequence[str],
                 env: Sequence[str] = ()) -> list[Step]:
    if not train_args:
        raise ValueError("run needs the trainer's arguments after '--', "
                         "e.g. -- --experiment=qwen3_30b_a3b --workdir=gs://BUCKET/runs/x")
    for pair in env:
        if "=" not in pair or not pair.split("=", 1)[0].isidentifier():
            raise ValueError(f"--env takes KEY=VALUE, got {pair!r}")
    workdir = _train_flag(train_args, "--workdir")
    if workdir is None:
        raise ValueError("the trainer needs --workdir (gs://BUCKET/runs/NAME on a TPU slice)")
    if not workdir.startswith("gs://"):
        print(f"warning: --workdir={workdir} is on each worker's own disk: checkpoints of a "
              "multi-host slice need a shared gs:// directory, and it is lost with the slice",
              file=sys.stderr)
    checkpoint = _train_flag(train_args, "--hf_checkpoint")
    if checkpoint and not checkpoint.startswith("gs://"):
        print(f"warning: --hf_checkpoint={checkpoint} must exist on every worker; "
              "gs://BUCKET/path is read by every host", file=sys.stderr)
    start = shlex.join(["start", *env, "--", *train_args])
    return [_ssh(config, f"{WORKER} {start}")]


def tail_commands(config: SliceConfig, worker: int = 0) -> list[Step]:
    if worker < 0:
        raise ValueError(f"worker must be >= 0, got {worker}")
    return [_ssh(config, f"tail -n 200 -F {REMOTE_LOG}", worker=str(worker))]


def delete_commands(config: SliceConfig, may_fail: bool = False) -> list[Step]:
    if config.queued:  # --force deletes the queued resource's TPU VM too
        argv = ("gcloud", "compute", "tpus", "queued-resources", "delete", config.name,
                *_where(config), "--force", "--quiet")
    else:
        argv = ("gcloud", "compute", "tpus", "tpu-vm", "delete", config.name, *_where(config),
                "--quiet")
    return [Step(argv, may_fail=may_fail)]


def stop_commands(config: SliceConfig, delete: bool = False, timeout_s: int = 600) -> list[Step]:
    if timeout_s < 1:
        raise ValueError(f"stop_timeout_s must be >= 1, got {timeout_s}")
    steps = [_ssh(config, f"{WORKER} stop {timeout_s}")]
    return steps + (delete_commands(config) if delete else [])


def resume_commands(config: SliceConfig, train_args: Sequence[str], env: Sequence[str] = (),
                    source: str = "head") -> list[Step]:
    workdir = _train_flag(train_args, "--workdir") or ""
    if not workdir.startswith("gs://"):
        raise ValueError("resume reruns against the same run directory on a new slice: "
                         f"--workdir must be gs://..., got {workdir or 'none'}")
    return (delete_commands(config, may_fail=True) + create_commands(config)
            + install_commands(config, source) + run_commands(config, train_args, env))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    for action in ("create", "install", "run", "tail", "stop", "resume"):
        p = sub.add_parser(action)
        p.add_argument("--name", required=True)
        p.add_argument("--zone", required=True)
        p.add_argument("--project", default="")
        p.add_argument("--accelerator", default="v5p-64")
        p.add_argument("--runtime_version", default="")
        p.add_argument("--queued", action=argparse.BooleanOptionalAction, default=True)
        p.add_argument("--spot", action="store_true")
        p.add_argument("--service_account", default="")
        p.add_argument("--scopes", default=CLOUD_PLATFORM)
        p.add_argument("--dry_run", action="store_true", help="print the commands only")
        if action in ("create", "resume"):
            p.add_argument("--wait", action=argparse.BooleanOptionalAction, default=True)
        if action in ("install", "resume"):
            p.add_argument("--source", choices=("head", "worktree"), default="head")
        if action == "tail":
            p.add_argument("--worker", type=int, default=0)
        if action == "stop":
            p.add_argument("--delete", action="store_true", help="also delete the slice")
            p.add_argument("--stop_timeout_s", type=int, default=600)
        if action in ("run", "resume"):
            p.add_argument("--env", action="append", default=[],
                           help="KEY=VALUE for the trainer's environment (repeatable)")
            p.add_argument("train_args", nargs=argparse.REMAINDER,
                           help="after '--': arguments of python -m spade_jax.train")
    return parser


def commands_for(args: argparse.Namespace) -> list[Step]:
    config = SliceConfig(name=args.name, zone=args.zone, project=args.project,
                         accelerator=args.accelerator, runtime_version=args.runtime_version,
                         queued=args.queued, spot=args.spot,
                         service_account=args.service_account, scopes=args.scopes)
    train_args = [a for a in getattr(args, "train_args", []) if a != "--"]
    if args.action == "create":
        return create_commands(config, args.wait)
    if args.action == "install":
        return install_commands(config, args.source)
    if args.action == "run":
        return run_commands(config, train_args, args.env)
    if args.action == "tail":
        return tail_commands(config, args.worker)
    if args.action == "resume":
        return resume_commands(config, train_args, args.env, args.source)
    return stop_commands(config, args.delete, args.stop_timeout_s)


def _pack_worktree(out: str) -> None:
    """The tracked and untracked, non-ignored files as they are on disk, as a tarball."""
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], check=True, capture_output=True).stdout
    with tarfile.open(out, "w:gz") as tar:
        for name in sorted({n.decode() for n in listed.split(b"\0") if n}):
            if (REPO / name).is_file():  # a deleted tracked file is not shipped
                tar.add(REPO / name, arcname=name)


def _execute(step: Step) -> None:
    if step.local == "worktree":
        _pack_worktree(TARBALL)
        return
    if not step.until:
        result = subprocess.run(step.argv, cwd=REPO)  # git archive: this checkout
        if result.returncode and not step.may_fail:
            raise subprocess.CalledProcessError(result.returncode, step.argv)
        return
    while True:  # poll a state: the queued resource's, then the VM's
        state = subprocess.run(step.argv, check=True, capture_output=True,
                               text=True).stdout.strip()
        print(f"  state: {state or '(none yet)'}", flush=True)
        if state in step.until:
            return
        if state in step.fail_on:
            raise RuntimeError(f"{shlex.join(step.argv)} reports {state}: the slice is not "
                               "coming up (delete it and create again, or try another zone)")
        time.sleep(POLL_S)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        steps = commands_for(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for step in steps:
        print(step.shown(), flush=True)
        if not args.dry_run:
            _execute(step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
