"""Benchmark files (JSONL) -> typed problems; every bad line raises `DataError` naming it.

Formats (one JSON object per line; `id` optional everywhere, default "<file stem>-<line>"):
  math             {"problem": str, "answer": str}                       (AIME-style)
  multiple_choice  {"question": str, "choices": [str, ...], "answer": "B" | 1}  (GPQA-style)
  code             {"question": str, "tests": [{"input": str, "output": str}, ...],
                    "fn_name": str (optional: call-based tests, input = JSON list of args,
                    output = JSON value), "starter_code": str (optional),
                    "time_limit_s": float (optional)}                   (LiveCodeBench-style)
  tool             see `spade_jax.evaluation.tool_tasks`
"""

from __future__ import annotations

import dataclasses
import json
import string
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class DataError(ValueError):
    """A benchmark or task file is malformed; the message names file, line and field."""


@dataclasses.dataclass(frozen=True)
class Where:
    """Position of a record, for error messages."""

    path: str
    line: int

    def error(self, message: str) -> DataError:
        return DataError(f"{self.path}:{self.line}: {message}")

    def default_id(self) -> str:
        return f"{Path(self.path).stem}-{self.line}"


def read_jsonl(path: str | Path) -> Iterator[tuple[Where, dict[str, Any]]]:
    """(position, record) per non-blank line; malformed JSON or non-objects raise DataError."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            where = Where(str(path), number)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise where.error(f"not UTF-8 text (byte 0x{raw[err.start]:02x} at column "
                                  f"{err.start + 1})") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise where.error(f"malformed JSON ({err.msg} at column {err.colno})") from None
            if not isinstance(record, dict):
                raise where.error(f"expected a JSON object, got {type(record).__name__}")
            yield where, record


def field(record: dict[str, Any], name: str, kind: type | tuple[type, ...], where: Where,
          *, required: bool = True, default: Any = None) -> Any:
    """record[name] checked against `kind`; a missing or mistyped field raises DataError."""
    if name not in record:
        if required:
            raise where.error(f"missing field '{name}'")
        return default
    value = record[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        expected = " or ".join(k.__name__ for k in kinds)
        raise where.error(f"field '{name}' must be {expected}, got {type(value).__name__}")
    if isinstance(value, str) and str in kinds and required and not value.strip():
        raise where.error(f"field '{name}' is empty")
    return value


def record_id(record: dict[str, Any], where: Where) -> str:
    value = field(record, "id", (str, int), where, required=False)
    return where.default_id() if value is None else str(value)


def check_unique_ids(items: list[Any], path: str | Path) -> None:
    seen: set[str] = set()
    for item in items:
        if item.id in seen:
            raise DataError(f"{path}: duplicate id {item.id!r}")
        seen.add(item.id)


@dataclasses.dataclass(frozen=True)
class MathProblem:
    id: str
    problem: str
    answer: str


@dataclasses.dataclass(frozen=True)
class ChoiceProblem:
    id: str
    question: str
    choices: tuple[str, ...]
    answer: str  # the correct letter


@dataclasses.dataclass(frozen=True)
class CodeTest:
    input: str
    output: str


@dataclasses.dataclass(frozen=True)
class CodeProblem:
    id: str
    question: str
    tests: tuple[CodeTest, ...]
    fn_name: str | None = None
    starter_code: str = ""
    time_limit_s: float | None = None


def load_math(path: str | Path) -> list[MathProblem]:
    items = []
    for where, record in read_jsonl(path):
        answer = field(record, "answer", (str, int, float), where)
        items.append(MathProblem(record_id(record, where), field(record, "problem", str, where),
                                 str(answer)))
    check_unique_ids(items, path)
    return items


def load_multiple_choice(path: str | Path) -> list[ChoiceProblem]:
    items = []
    for where, record in read_jsonl(path):
        choices = field(record, "choices", list, where)
        if not 2 <= len(choices) <= 26 or not all(isinstance(c, str) for c in choices):
            raise where.error("field 'choices' must be a list of 2 to 26 strings")
        letters = string.ascii_uppercase[: len(choices)]
        answer = field(record, "answer", (str, int), where)
        if isinstance(answer, int):
            if not 0 <= answer < len(choices):
                raise where.error(f"field 'answer' index {answer} is outside the {len(choices)} choices")
            answer = letters[answer]
        answer = answer.strip().upper()
        if answer not in letters or len(answer) != 1:
            raise where.error(f"field 'answer' must be one of {list(letters)}, got {answer!r}")
        items.append(ChoiceProblem(record_id(record, where),
                                   field(record, "question", str, where), tuple(choices), answer))
    check_unique_ids(items, path)
    return items


def load_code(path: str | Path) -> list[CodeProblem]:
    items = []
    for where, record in read_jsonl(path):
        fn_name = field(record, "fn_name", str, where, required=False)
        raw_tests = field(record, "tests", list, where)
        if not raw_tests:
            raise where.error("field 'tests' is empty")
        tests = []
        for k, test in enumerate(raw_tests):
            if not isinstance(test, dict):
                raise where.error(f"field 'tests[{k}]' must be an object")
            for key in ("input", "output"):
                if not isinstance(test.get(key), str):
                    raise where.error(f"field 'tests[{k}].{key}' must be a string")
            if fn_name is not None:
                for key in ("input", "output"):
                    try:
                        value = json.loads(test[key])
                    except json.JSONDecodeError:
                        raise where.error(
                            f"field 'tests[{k}].{key}' must be JSON for call-based tests") from None
                    if key == "input" and not isinstance(value, list):
                        raise where.error(f"field 'tests[{k}].input' must be a JSON list of args")
            tests.append(CodeTest(test["input"], test["output"]))
        limit = field(record, "time_limit_s", (int, float), where, required=False)
        if limit is not None and not limit > 0:
            raise where.error(f"field 'time_limit_s' must be > 0, got {limit}")
        items.append(CodeProblem(
            record_id(record, where), field(record, "question", str, where), tuple(tests),
            fn_name, field(record, "starter_code", str, where, required=False, default=""),
            None if limit is None else float(limit)))
    check_unique_ids(items, path)
    return items
