"""Pieces shared by the ``read`` and ``identify`` commands: input errors, progress lines,
the run record that makes a re-run resume (or refuse), cached stage results and tables.

Everything here is plain Python / NumPy; matplotlib is imported inside the plot helpers.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any


class CommandError(ValueError):
    """Bad input to a command: reported as one ``error: ...`` line, exit status 2."""


def run_command(parser: argparse.ArgumentParser, argv: Sequence[str],
                body: Callable[[argparse.Namespace], None]) -> int:
    """Parses ``argv`` and runs ``body``; input errors become ``error: ...`` and status 2.

    argparse's own exits (``--help``: 0, a bad flag: 2) come back as the status rather than
    a ``SystemExit``, so ``spade_jax.steer.main`` can be called in-process.
    """
    try:
        args = parser.parse_args(list(argv))
    except SystemExit as exit_:
        return int(exit_.code or 0)
    try:
        body(args)
    except (ValueError, FileNotFoundError) as err:  # CommandError is a ValueError
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


class Progress:
    """One line per finished stage: ``[read] capture: 1,234 tokens in 3.2 s (385/s)``."""

    def __init__(self, command: str) -> None:
        self.command = command
        self._start = time.perf_counter()

    def start(self) -> None:
        self._start = time.perf_counter()

    def done(self, stage: str, count: int, unit: str, note: str = "") -> None:
        elapsed = time.perf_counter() - self._start
        rate = f"{count / elapsed:,.0f}/s" if elapsed > 0 else "-"
        extra = f"; {note}" if note else ""
        print(f"[{self.command}] {stage}: {count:,} {unit} in {elapsed:.1f} s ({rate}){extra}",
              flush=True)
        self._start = time.perf_counter()


def write_json(path: Path, obj: Any) -> None:
    """Atomic write (a crash leaves the old file or the new one, never half of one)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CommandError(f"{path}: invalid JSON ({err.msg}, line {err.lineno})") from None


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes: a resumed run must read the inputs the first run read."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_run_record(path: Path, settings: Mapping[str, Any], command: str) -> bool:
    """Refuses a re-run whose settings differ from the ones stored at ``path``; returns
    whether a record exists (:func:`save_run_record` writes one once the inputs passed).

    Why: every cached stage of an output directory was computed from these settings, so a
    re-run with other ones would mix two runs' results. The error names the argument.
    """
    if not path.exists():
        return False
    stored = read_json(path).get("settings", {})
    for key in sorted(set(stored) | set(settings)):
        if stored.get(key) != settings.get(key):
            raise CommandError(
                f"{path.parent} holds a different {command} run: --{key} was "
                f"{stored.get(key)!r}, now {settings.get(key)!r} (use a fresh --out)")
    return True


def save_run_record(path: Path, settings: Mapping[str, Any], command: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, {"command": command, "settings": dict(settings)})


def cached(path: Path, compute: Callable[[], Any]) -> tuple[Any, bool]:
    """The JSON result stored at ``path``, else ``compute()`` stored there; and whether it
    was reused."""
    if path.exists():
        return read_json(path), True
    value = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, value)
    return value, False


def trace_records(path: Path) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """``(where, trace_id, object)`` for every non-blank line of a traces JSONL file (the
    ``read`` and ``rewind`` inputs); refuses invalid JSON, a line without a ``trace_id`` and
    a repeated one, naming the file and line."""
    first_line: dict[str, int] = {}
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {line_no}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise CommandError(f"{where}: invalid JSON ({err.msg})") from None
            if not isinstance(obj, dict) or "trace_id" not in obj:
                raise CommandError(f"{where}: expected an object with a 'trace_id'")
            trace_id = str(obj["trace_id"])
            if trace_id in first_line:
                raise CommandError(f"{where}: duplicate trace_id {trace_id!r} (first on line "
                                   f"{first_line[trace_id]})")
            first_line[trace_id] = line_no
            yield where, trace_id, obj


def trace_content(where: str, trace_id: str, obj: Mapping[str, Any]
                  ) -> tuple[str | None, tuple[int, ...] | None]:
    """A trace's ``(text, None)`` or ``(None, token_ids)``; refuses a line with neither."""
    text, ids = obj.get("text"), obj.get("token_ids")
    if isinstance(text, str) and text:
        return text, None
    if isinstance(ids, list) and ids and all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        return None, tuple(ids)
    raise CommandError(f"{where}: trace {trace_id!r} needs a non-empty 'text' or "
                       f"'token_ids' (a list of ints >= 0)")


def safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "x"


def parse_int_list(text: str, flag: str) -> tuple[int, ...]:
    """``"0,3,5"`` -> (0, 3, 5); a clear error for anything else (empty: ())."""
    values = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            values.append(int(part))
        except ValueError:
            raise CommandError(f"{flag}: expected a comma list of integers, got {text!r}") from None
    if len(set(values)) != len(values) or any(v < 0 for v in values):
        raise CommandError(f"{flag}: values must be distinct and >= 0, got {text!r}")
    return tuple(values)


def format_cell(value: Any) -> str:
    if isinstance(value, float):
        return "nan" if value != value else f"{value:.3f}"
    return str(value)


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(format_cell(row.get(c, "")) for c in columns) + " |")
    return "\n".join(lines) + "\n"


def write_csv(path: Path, rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def new_figure(width: float, height: float, legend_right: float = 0.0):
    """A figure with fixed margins in inches (no ``tight_layout``: it measures every tick
    label, and these plots are re-drawn on every run); ``legend_right`` inches are kept
    free on the right for a legend outside the axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(width, height))
    fig.subplots_adjust(left=0.7 / width, right=1 - (0.2 + legend_right) / width,
                        bottom=0.55 / height, top=1 - 0.4 / height)
    return plt, fig, ax
