"""Run spade_jax on a Cloud TPU VM slice: create, install, run, tail, stop.

    python launch/tpu.py create  --name=spade30b --zone=us-east5-a --accelerator=v5p-64
    python launch/tpu.py install --name=spade30b --zone=us-east5-a
    python launch/tpu.py run     --name=spade30b --zone=us-east5-a -- \
        --experiment=qwen3_30b_a3b --hf_checkpoint=/ckpt/Qwen3-30B-A3B-Instruct-2507 \
        --workdir=gs://BUCKET/runs/spade_30b
    python launch/tpu.py tail    --name=spade30b --zone=us-east5-a
    python launch/tpu.py stop    --name=spade30b --zone=us-east5-a

Every subcommand takes ``--dry_run``: print the exact ``gcloud`` commands, run nothing.

* create: a queued resource (``--queued``, the default; waits for capacity, optional
  ``--spot``) or a plain TPU VM (``--no-queued``).
* install: copies this checkout (git-tracked files, as a tarball) to every worker with
  ``scp --worker=all`` and runs ``scripts/install.sh`` there.
* run: starts ``python -m spade_jax.train <args>`` on all workers at once, detached with
  ``nohup``, stdout/stderr to ``~/spade_jax.log`` on each worker. On a TPU VM
  ``jax.distributed.initialize()`` (``spade_jax.distributed.maybe_initialize``) finds the
  other hosts itself; only process 0 writes logs and metrics.
* tail: follows worker 0's log (``--worker=N`` for another host's).
* stop: kills the run on all workers, then (``--delete``) deletes the slice.

Only the Python standard library is used, so this runs on any workstation with gcloud.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import subprocess
import sys
from collections.abc import Sequence

REMOTE_DIR = "~/spade_jax"
REMOTE_LOG = "~/spade_jax.log"
TARBALL = "/tmp/spade_jax_src.tar.gz"
# TPU VM base images per generation (Cloud TPU docs, "TPU VM images").
RUNTIME_VERSIONS = {
    "v4": "tpu-ubuntu2204-base",
    "v5p": "v2-alpha-tpuv5",
    "v5litepod": "v2-alpha-tpuv5-lite",
    "v6e": "v2-alpha-tpuv6e",
}


@dataclasses.dataclass(frozen=True)
class SliceConfig:
    """Where the run lives.

    Attributes:
      name: TPU VM / queued-resource name.
      zone: GCP zone, e.g. us-east5-a.
      project: GCP project (empty = gcloud's default).
      accelerator: slice type as gcloud spells it, e.g. v5p-64, v4-32, v5litepod-16, v6e-8.
      runtime_version: TPU VM image (empty = the generation's default).
      queued: create through a queued resource (waits for capacity) instead of directly.
      spot: spot capacity (queued resources only).
    """

    name: str
    zone: str
    project: str = ""
    accelerator: str = "v5p-64"
    runtime_version: str = ""
    queued: bool = True
    spot: bool = False

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("-", "").isalnum() or self.name != self.name.lower():
            raise ValueError(f"name must be lowercase letters, digits and '-', got {self.name!r}")
        if not self.zone:
            raise ValueError("zone is required, e.g. --zone=us-east5-a")
        generation = self.accelerator.rsplit("-", 1)[0]
        if generation not in RUNTIME_VERSIONS or not self.accelerator.rsplit("-", 1)[-1].isdigit():
            raise ValueError(f"accelerator must be <generation>-<size> with generation in "
                             f"{sorted(RUNTIME_VERSIONS)}, got {self.accelerator!r}")
        if self.spot and not self.queued:
            raise ValueError("--spot needs a queued resource (drop --no-queued)")

    @property
    def image(self) -> str:
        return self.runtime_version or RUNTIME_VERSIONS[self.accelerator.rsplit("-", 1)[0]]


def _where(config: SliceConfig) -> list[str]:
    out = [f"--zone={config.zone}"]
    if config.project:
        out.append(f"--project={config.project}")
    return out


def _ssh(config: SliceConfig, command: str, worker: str = "all") -> list[str]:
    return ["gcloud", "compute", "tpus", "tpu-vm", "ssh", config.name, *_where(config),
            f"--worker={worker}", f"--command={command}"]


def create_commands(config: SliceConfig) -> list[list[str]]:
    if config.queued:
        command = ["gcloud", "compute", "tpus", "queued-resources", "create", config.name,
                   f"--node-id={config.name}", *_where(config),
                   f"--accelerator-type={config.accelerator}",
                   f"--runtime-version={config.image}"]
        if config.spot:
            command.append("--spot")
        return [command, ["gcloud", "compute", "tpus", "queued-resources", "describe",
                          config.name, *_where(config)]]
    return [["gcloud", "compute", "tpus", "tpu-vm", "create", config.name, *_where(config),
             f"--accelerator-type={config.accelerator}", f"--version={config.image}"]]


def install_commands(config: SliceConfig) -> list[list[str]]:
    unpack = (f"mkdir -p {REMOTE_DIR} && tar -xzf /tmp/spade_jax_src.tar.gz -C {REMOTE_DIR} "
              f"&& cd {REMOTE_DIR} && bash scripts/install.sh && pip install 'jax[tpu]==0.10.2'")
    return [
        ["git", "archive", "--format=tar.gz", f"--output={TARBALL}", "HEAD"],
        ["gcloud", "compute", "tpus", "tpu-vm", "scp", TARBALL, f"{config.name}:/tmp/",
         *_where(config), "--worker=all"],
        _ssh(config, unpack),
    ]


def run_commands(config: SliceConfig, train_args: Sequence[str]) -> list[list[str]]:
    if not train_args:
        raise ValueError("run needs the trainer's arguments after '--', "
                         "e.g. -- --experiment=qwen3_30b_a3b --workdir=gs://BUCKET/runs/x")
    train = " ".join(shlex.quote(a) for a in ["python", "-m", "spade_jax.train", *train_args])
    # Same command on every worker, detached so the ssh session can end.
    remote = f"cd {REMOTE_DIR} && nohup {train} > {REMOTE_LOG} 2>&1 < /dev/null &"
    return [_ssh(config, remote)]


def tail_commands(config: SliceConfig, worker: int = 0) -> list[list[str]]:
    if worker < 0:
        raise ValueError(f"worker must be >= 0, got {worker}")
    return [_ssh(config, f"tail -n 200 -F {REMOTE_LOG}", worker=str(worker))]


def stop_commands(config: SliceConfig, delete: bool = False) -> list[list[str]]:
    commands = [_ssh(config, "pkill -INT -f 'spade_jax.train' || true")]
    if delete:
        if config.queued:
            commands.append(["gcloud", "compute", "tpus", "queued-resources", "delete",
                             config.name, *_where(config), "--force", "--quiet"])
        else:
            commands.append(["gcloud", "compute", "tpus", "tpu-vm", "delete", config.name,
                             *_where(config), "--quiet"])
    return commands


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    for action in ("create", "install", "run", "tail", "stop"):
        p = sub.add_parser(action)
        p.add_argument("--name", required=True)
        p.add_argument("--zone", required=True)
        p.add_argument("--project", default="")
        p.add_argument("--accelerator", default="v5p-64")
        p.add_argument("--runtime_version", default="")
        p.add_argument("--queued", action=argparse.BooleanOptionalAction, default=True)
        p.add_argument("--spot", action="store_true")
        p.add_argument("--dry_run", action="store_true", help="print the gcloud commands only")
        if action == "tail":
            p.add_argument("--worker", type=int, default=0)
        if action == "stop":
            p.add_argument("--delete", action="store_true", help="also delete the slice")
        if action == "run":
            p.add_argument("train_args", nargs=argparse.REMAINDER,
                           help="after '--': arguments of python -m spade_jax.train")
    return parser


def commands_for(args: argparse.Namespace) -> list[list[str]]:
    config = SliceConfig(name=args.name, zone=args.zone, project=args.project,
                         accelerator=args.accelerator, runtime_version=args.runtime_version,
                         queued=args.queued, spot=args.spot)
    if args.action == "create":
        return create_commands(config)
    if args.action == "install":
        return install_commands(config)
    if args.action == "run":
        train_args = [a for a in args.train_args if a != "--"]
        return run_commands(config, train_args)
    if args.action == "tail":
        return tail_commands(config, args.worker)
    return stop_commands(config, args.delete)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        commands = commands_for(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for command in commands:
        print(shlex.join(command), flush=True)
        if not args.dry_run:
            subprocess.run(command, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
