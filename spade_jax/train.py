"""The main command: a SPADE self-play run.

    python -m spade_jax.train --experiment=tiny --workdir=runs/tiny
    python -m spade_jax.train --experiment=qwen3_30b_a3b --hf_checkpoint=/ckpt/Qwen3-30B-A3B \
        --workdir=gs://bucket/runs/spade_30b --set spade.rounds=400

Builds the tokenizer, policy, sandbox pool, trainer and SPADE loop from the experiment
file, resumes from the newest intact checkpoint in ``workdir`` if there is one, runs the
rounds, and writes ``metrics.jsonl``, TensorBoard events, checkpoints and ``report.md``.
``--workdir`` may be a local directory or a URL such as ``gs://bucket/run`` (every file of
the run goes there through ``etils.epath``; see docs/scale_out.md).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("experiment", "tiny", "Experiment name (experiments/<name>.py) or path.")
flags.DEFINE_string("workdir", None, "Run directory (local or gs://): checkpoints, metrics, report.")
flags.DEFINE_multi_string("set", [], "Config override section.field=value (repeatable).")
flags.DEFINE_string("hf_checkpoint", None, "Shortcut for --set model.hf_checkpoint=DIR: a local "
                    "directory present on every host, or gs://BUCKET/path (read by every host).")
flags.DEFINE_list("corpus", [], "Shortcut for corpus.paths: the designer's grounding corpus, "
                  "JSONL or parquet shards with a 'text' field (paths or globs, local or "
                  "gs://, comma-separated). The recipe experiments refuse to run without it.")
flags.DEFINE_bool("dry_run", False, "Print the resolved config and exit.")
flags.DEFINE_bool("allow_weak_sandbox", False,
                  "Run designer programs even when the sandbox lacks isolation layers (no "
                  "root, no bubblewrap, no seccomp); shortcut for --set "
                  "sandbox.allow_weak_isolation=True. Without it such a run refuses to start.")

log = logging.getLogger("spade_jax.train")


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from spade_jax.experiment import json_value, load_experiment
    from spade_jax.overrides import OverrideError

    overrides = list(FLAGS.set)
    if FLAGS.hf_checkpoint:
        overrides.append(f"model.hf_checkpoint={FLAGS.hf_checkpoint!r}")
    if FLAGS.corpus:
        overrides.append(f"corpus.paths={tuple(FLAGS.corpus)!r}")
    if FLAGS.allow_weak_sandbox:
        overrides.append("sandbox.allow_weak_isolation=True")
    try:
        config = load_experiment(FLAGS.experiment, overrides)
    # ValueError: an experiment's get_config refusing its variant (``toy:nope``) or a config
    # class refusing a value the experiment file set
    except (FileNotFoundError, OverrideError, AttributeError, TypeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    problem = _workdir_problem(FLAGS.workdir) if FLAGS.workdir else None
    if problem:  # checked in --dry_run too: a run would fail there only after startup
        print(f"error: {problem}", file=sys.stderr)
        return 2
    from spade_jax.experiment import (
        CorpusMissing,
        check_supervised_replay,
        check_warm_start,
        require_corpus,
    )

    try:
        check_warm_start(config)
        check_supervised_replay(config)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    try:  # a dry run reads no storage: the corpus files are checked by a real run only
        require_corpus(config, check_paths=not FLAGS.dry_run)
    except CorpusMissing as e:
        if not FLAGS.dry_run:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"note: a run would stop here: {e}", file=sys.stderr)
    if FLAGS.dry_run:
        print(json.dumps(dataclasses.asdict(config), indent=2, default=json_value))
        return 0
    if config.model.batch_invariant:  # XLA reads its flags when the backend starts: now
        from spade_jax.models import numerics

        numerics.request_exact_cpu_math()
    from spade_jax import distributed

    distributed.maybe_initialize()  # multi-host TPU VM: join the job before JAX runs anything
    if not FLAGS.workdir:
        raise app.UsageError("--workdir is required")
    from spade_jax import storage

    workdir = storage.absolute(FLAGS.workdir)  # a gs:// URL stays one (never ./gs:/...)
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"error: cannot create --workdir {FLAGS.workdir}: {e.strerror}", file=sys.stderr)
        return 2
    log_file = _setup_logging(workdir)
    from spade_jax.envs.preflight import SandboxUnavailable
    from spade_jax.experiment import ConfigProblemAtStart
    from spade_jax.run import run_experiment

    start = time.time()
    try:
        with distributed.fail_fast():  # one host failing stops the job, not a 5-min hang
            try:
                run_experiment(config, workdir)
            except (SandboxUnavailable, ConfigProblemAtStart) as e:  # every host checks
                log.error("error: %s", e)  # its own: all stop here (stderr and train.log)
                return 2
        log.info("done in %.1f min; report: %s", (time.time() - start) / 60,
                 workdir / "report.md")
    finally:
        if log_file is not None:  # uploads a remote train.log a last time
            logging.getLogger().removeHandler(log_file)
            log_file.close()
    return 0


def _workdir_problem(workdir: str) -> str | None:
    """Why a local --workdir cannot hold a run (a file, under a file, not writable), or
    None. Remote paths (gs://...) are left to the storage layer."""
    if "://" in workdir:
        return None
    path = Path(workdir)
    if path.exists() and not path.is_dir():
        return f"--workdir {workdir} is a file, not a directory"
    ancestor = path
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"--workdir {workdir} lies under {ancestor}, which is a file"
    try:  # a real write: permission bits say nothing for root or a read-only mount
        with tempfile.TemporaryFile(dir=ancestor):
            pass
    except OSError as e:
        return f"--workdir {workdir}: cannot write in {ancestor} ({e.strerror})"
    return None


class _MirroredLogFile(logging.FileHandler):
    """``train.log`` in the run directory. A remote one is written locally and uploaded
    (whole: object stores cannot append) at most every ``sync_every_s`` and on close; a
    resumed run downloads it first and appends."""

    def __init__(self, workdir, sync_every_s: float = 30.0) -> None:
        from spade_jax import storage

        self.mirror = storage.MirroredDir(workdir, resume=("train.log",))
        self.sync_every_s = sync_every_s
        self._last_sync = time.monotonic()
        super().__init__(self.mirror.local / "train.log")

    def emit(self, record: logging.LogRecord) -> None:
        super().emit(record)
        if self.mirror.remote and time.monotonic() - self._last_sync >= self.sync_every_s:
            self._last_sync = time.monotonic()
            self.flush()
            self.mirror.sync()

    def close(self) -> None:
        super().close()
        self.mirror.close()


def _setup_logging(workdir) -> logging.Handler | None:
    """INFO to stderr and ``workdir/train.log`` on process 0. Other hosts of a multi-host
    job print WARNING and above to their own stderr only: N copies of every progress line
    would bury process 0's, and their appends would interleave in a shared train.log.
    Returns the train.log handler (to close at the end), None off process 0."""
    from absl import logging as absl_logging

    from spade_jax import distributed

    root = logging.getLogger()
    if not distributed.is_primary():
        root.setLevel(logging.WARNING)
        absl_logging.set_verbosity(absl_logging.WARNING)
        return None
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    root.setLevel(logging.INFO)
    handler = _MirroredLogFile(workdir)  # absl already logs to stderr
    handler.setFormatter(fmt)
    root.addHandler(handler)
    for noisy in ("absl", "jax._src", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return handler


if __name__ == "__main__":
    app.run(main)
