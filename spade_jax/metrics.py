"""Run metrics: a JSONL log of every metric, TensorBoard event files, and a progress line.

``<run_dir>/metrics.jsonl`` holds one JSON object per :meth:`MetricsWriter.write` call::

    {"step": 12, "wall_time": 1717000000.5, "loss/pg_loss": 0.31, "reward/mean": "NaN"}

Non-finite floats are written as the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"``
(strict JSON has no literal for them) and read back as floats by :func:`read_metrics`.
A resumed run appends to the same file, so a step can appear twice; readers keep the
last value. TensorBoard events go to ``<run_dir>/tensorboard/``; every designer attempt (its
reply, verdict and stated level) to ``<run_dir>/designs.jsonl``. On a multi-host run only
process 0 writes or prints.

``run_dir`` may be remote (``gs://...``): both files are then written in a local mirror
(:class:`spade_jax.storage.MirroredDir`) and uploaded after every record, since an object
store cannot append; a resumed run downloads ``metrics.jsonl`` and ``designs.jsonl`` first and continues them.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

import jax
import numpy as np

from spade_jax import storage

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
# Every designer attempt of a run, one JSON object each (``MetricsWriter.write_designs``).
DESIGNS_FILE = "designs.jsonl"
TENSORBOARD_DIR = "tensorboard"
RESERVED_KEYS = ("step", "wall_time")
_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _scalar(name: str, value: Any) -> int | float:
    """A metric value as a Python int/float; a clear error for anything else."""
    if isinstance(value, bool | np.bool_):
        return int(value)
    if isinstance(value, int | float):
        return value
    array = np.asarray(value)
    if array.size != 1:
        raise ValueError(f"metric {name!r} has shape {array.shape}; only scalars are logged")
    if array.dtype.kind == "b":
        return int(array.reshape(()))
    if array.dtype.kind in "iu":
        return int(array.reshape(()))
    if array.dtype.kind == "f":
        return float(array.reshape(()))
    raise ValueError(f"metric {name!r} has dtype {array.dtype}; only numbers are logged")


def _json_value(value: int | float) -> int | float | str:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return value


@dataclasses.dataclass(frozen=True)
class MetricsConfig:
    """Settings of :class:`MetricsWriter`.

    Attributes:
      tensorboard: also write TensorBoard event files.
      tensorboard_flush_secs: how often the TensorBoard writer flushes to disk.
    """

    tensorboard: bool = True
    tensorboard_flush_secs: int = 10

    def __post_init__(self) -> None:
        if self.tensorboard_flush_secs < 1:
            raise ValueError(
                f"tensorboard_flush_secs must be >= 1, got {self.tensorboard_flush_secs}"
            )


class MetricsWriter:
    """Appends scalar metrics to ``metrics.jsonl`` and TensorBoard; no-op off process 0."""

    def __init__(self, run_dir: storage.PathLike, cfg: MetricsConfig = MetricsConfig()) -> None:
        self.run_dir = storage.as_path(run_dir)
        self.cfg = cfg
        self.active = jax.process_index() == 0
        self._jsonl: TextIO | None = None
        self._designs: TextIO | None = None
        self._tensorboard: Any = None
        self._mirror: storage.MirroredDir | None = None
        if not self.active:
            return
        self._mirror = storage.MirroredDir(self.run_dir, resume=(METRICS_FILE, DESIGNS_FILE))
        local = self._mirror.local
        self._jsonl = (local / METRICS_FILE).open("a", buffering=1)  # line-buffered
        self._designs = (local / DESIGNS_FILE).open("a", buffering=1)
        if cfg.tensorboard:
            from tensorboardX import SummaryWriter

            # A NaN is a value here (a step without games has no validity rate), not a
            # fault: tensorboardX would warn on every one of them.
            logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)
            self._tensorboard = SummaryWriter(
                str(local / TENSORBOARD_DIR), flush_secs=cfg.tensorboard_flush_secs
            )

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Logs one record of scalar metrics for ``step``. Non-finite values are kept."""
        if not self.active:
            return
        values: dict[str, int | float] = {}
        for name, value in metrics.items():
            if not isinstance(name, str):
                raise TypeError(f"metric names must be strings, got {name!r}")
            if name in RESERVED_KEYS:
                raise ValueError(f"metric name {name!r} is reserved for the record itself")
            values[name] = _scalar(name, value)
        record = {"step": int(step), "wall_time": time.time()}
        record.update({name: _json_value(value) for name, value in values.items()})
        assert self._jsonl is not None
        self._jsonl.write(json.dumps(record, allow_nan=False) + "\n")
        if self._tensorboard is not None:
            for name, value in values.items():
                self._tensorboard.add_scalar(name, value, int(step))
        if self._mirror is not None and self._mirror.remote:
            self.flush()  # one upload per record: a killed run loses no logged step

    def write_designs(self, step: int, attempts: Sequence[Mapping[str, Any]]) -> None:
        """Appends ``step``'s designer attempts (JSON objects: what the designer wrote and
        what became of it) to ``designs.jsonl``: the text behind the validity and
        difficulty curves. A resumed run re-logs the steps after its checkpoint. A remote
        ``run_dir`` gets them with the step's ``write`` (one upload per step: call this
        first) or at ``flush`` / ``close``."""
        if not self.active or not attempts:
            return
        assert self._designs is not None
        for attempt in attempts:
            self._designs.write(json.dumps({"step": int(step), **attempt}) + "\n")

    def flush(self) -> None:
        """Writes buffered records out (and uploads them when ``run_dir`` is remote)."""
        if self._jsonl is not None:
            self._jsonl.flush()
        if self._designs is not None:
            self._designs.flush()
        if self._tensorboard is not None:
            self._tensorboard.flush()
        if self._mirror is not None:
            self._mirror.sync()

    def close(self) -> None:
        for handle in (self._jsonl, self._designs):
            if handle is not None:
                handle.close()
        self._jsonl = self._designs = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._mirror is not None:
            self._mirror.close()
            self._mirror = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def read_metrics(path: storage.PathLike) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Reads a ``metrics.jsonl`` (file or run directory) into ``{name: (steps, values)}``,
    sorted by step. A repeated step keeps its last value (a resumed run re-logs the steps
    after its checkpoint); a torn last line (a killed writer) is skipped with a warning."""
    path = storage.as_path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.exists():
        raise FileNotFoundError(f"no metrics file at {path}")
    by_name: dict[str, dict[int, float]] = {}
    for line_number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            log.warning("%s:%d is not a complete JSON record; skipped", path, line_number)
            continue
        step = int(record["step"])
        for name, value in record.items():
            if name in RESERVED_KEYS:
                continue
            number = _NON_FINITE[value] if isinstance(value, str) else float(value)
            by_name.setdefault(name, {})[step] = number
    out = {}
    for name, points in by_name.items():
        steps = np.asarray(sorted(points), dtype=np.int64)
        out[name] = (steps, np.asarray([points[s] for s in steps], dtype=np.float64))
    return out


def _format_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    return str(datetime.timedelta(seconds=round(seconds)))


class Progress:
    """Prints ``step 120/400 (30.0%) | 2.31 steps/s | elapsed 0:00:52 | ETA 0:02:01 | ...``
    at most every ``every_seconds`` (and always at the last step), on process 0 only."""

    def __init__(
        self,
        total_steps: int,
        *,
        start_step: int = 0,
        every_seconds: float = 30.0,
        print_fn: Callable[[str], None] = print,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if total_steps < 1 or not 0 <= start_step <= total_steps:
            raise ValueError(f"need 0 <= start_step ({start_step}) <= total_steps ({total_steps})")
        self.total_steps = total_steps
        self.start_step = start_step
        self.every_seconds = every_seconds
        self._print = print_fn
        self._clock = clock
        self._start_time = clock()
        self._last_print: float | None = None
        self.active = jax.process_index() == 0

    def line(self, step: int, metrics: Mapping[str, Any] | None = None) -> str:
        elapsed = self._clock() - self._start_time
        done = step - self.start_step
        rate = done / elapsed if elapsed > 0 and done > 0 else math.nan
        eta = (self.total_steps - step) / rate if rate > 0 else math.nan
        # Model-scale steps take minutes: show seconds per step when under one step a second.
        speed = f"{1.0 / rate:.3g} s/step" if 0 < rate < 1 else f"{rate:.3g} steps/s"
        parts = [
            f"step {step}/{self.total_steps} ({100.0 * step / self.total_steps:.1f}%)",
            speed,
            f"elapsed {_format_duration(elapsed)}",
            f"ETA {_format_duration(eta)}",
        ]
        for name, value in (metrics or {}).items():
            parts.append(f"{name}={_scalar(name, value):.4g}")
        return " | ".join(parts)

    def update(self, step: int, metrics: Mapping[str, Any] | None = None) -> str | None:
        """Prints and returns the progress line when one is due, else returns None."""
        now = self._clock()
        due = (
            self._last_print is None
            or now - self._last_print >= self.every_seconds
            or step >= self.total_steps
        )
        if not (due and self.active):
            return None
        self._last_print = now
        text = self.line(step, metrics)
        self._print(text)
        return text
